// The op schema (one namespace, cublas_guard), the Meta kernels that
// torch.compile / FakeTensor use, the device-independent ops, and a minimal
// Python module init so the prebuilt library imports as cublas_guard_ext._C.
#include <Python.h>

#include "guard.h"
#include "op_handles.h"

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/TracerMode.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

namespace cublas_guard {
namespace {

// Sizes as SymInts: under torch.compile(dynamic=...) and torch.export a batch
// dim is symbolic and must stay so (no sizes(), no guard on it).
c10::SymDimVector linear_output_shape(const at::Tensor& x, const c10::SymInt& out_features) {
  c10::SymDimVector shape(x.sym_sizes().begin(), x.sym_sizes().end());
  shape.back() = out_features;
  return shape;
}

// Meta kernels run the same rule functions as the real ones, so a traced or
// compiled model refuses the same inputs with the same errors.
at::Tensor scan_meta(const at::Tensor& x) {
  check_scannable(x);
  return at::empty({kScanFields}, x.options().dtype(at::kLong));
}

at::Tensor linear_meta(const at::Tensor& x, const at::Tensor& weight,
                       const c10::optional<at::Tensor>& bias, c10::string_view layer,
                       int64_t mode, bool /*scan_grad*/) {
  parse_mode(mode);
  check_linear_args(x, weight, bias, std::string(layer));
  return at::empty_symint(linear_output_shape(x, weight.sym_size(0)), weight.options());
}

at::Tensor grad_input_meta(const at::Tensor& grad_output, const at::Tensor& weight,
                           c10::string_view layer) {
  check_grad_args(grad_output, weight, weight.sym_size(0), "weight", std::string(layer));
  return at::empty_symint(linear_output_shape(grad_output, weight.sym_size(1)), weight.options());
}

at::Tensor grad_weight_meta(const at::Tensor& grad_output, const at::Tensor& x,
                            c10::string_view layer) {
  check_grad_args(grad_output, x, grad_output.sym_size(-1), "input", std::string(layer));
  return at::empty_symint({grad_output.sym_size(-1), x.sym_size(-1)}, x.options());
}

void check_features_meta(const at::Tensor& x, int64_t in_features, c10::string_view layer) {
  check_input(x, in_features, std::string(layer));
}

void guard_values_meta(const at::Tensor& /*t*/, c10::string_view /*layer*/, int64_t /*role*/,
                       int64_t mode) {
  parse_mode(mode);
}

void async_check_op(bool synchronize) { raise_if_async_recorded(synchronize); }

void set_fault_op(c10::string_view site, int64_t code, int64_t times) {
  set_fault_for_testing(std::string(site), code, times);
}

int64_t set_size_limit_op(int64_t limit, bool allow_64bit) {
  return set_size_limit_for_testing(limit, allow_64bit);
}

std::string build_info_op() { return build_info_json(); }

std::string (*&cuda_build_info_provider())() {
  static std::string (*provider)() = nullptr;
  return provider;
}

#define CUBLAS_GUARD_STRINGIFY2(...) #__VA_ARGS__
#define CUBLAS_GUARD_STRINGIFY(...) CUBLAS_GUARD_STRINGIFY2(__VA_ARGS__)

}  // namespace

void set_cuda_build_info(std::string (*provider)()) { cuda_build_info_provider() = provider; }

std::string build_info_json() {
  std::string out = "{\"built_with_torch\": \"";
#ifdef CUBLAS_GUARD_TORCH_VERSION
  out += CUBLAS_GUARD_STRINGIFY(CUBLAS_GUARD_TORCH_VERSION);
#else
  out += "unknown";
#endif
  out += "\", \"cuda_compiled\": ";
  const auto provider = cuda_build_info_provider();
  out += provider != nullptr ? "true, " + provider() : std::string("false");
  return out + "}";
}

}  // namespace cublas_guard

TORCH_LIBRARY(cublas_guard, m) {
  using namespace cublas_guard;
  m.def("scan(Tensor x) -> Tensor");
  m.def(
      "linear(Tensor x, Tensor weight, Tensor? bias, str layer=\"\", int mode=1, "
      "bool scan_grad=False) -> Tensor");
  m.def("linear_grad_input(Tensor grad_output, Tensor weight, str layer=\"\") -> Tensor");
  m.def("linear_grad_weight(Tensor grad_output, Tensor x, str layer=\"\") -> Tensor");
  m.def("check_features(Tensor x, int in_features, str layer=\"\") -> ()");
  m.def("guard_values(Tensor t, str layer, int role, int mode) -> ()");
  m.def("async_check(bool synchronize=True) -> ()", &async_check_op);
  m.def("_set_fault(str site, int code, int times) -> ()", &set_fault_op);
  m.def("_set_size_limit(int limit, bool allow_64bit=True) -> int", &set_size_limit_op);
  m.def("build_info() -> str", &build_info_op);
}

TORCH_LIBRARY_IMPL(cublas_guard, Meta, m) {
  using namespace cublas_guard;
  m.impl("scan", &scan_meta);
  m.impl("linear", &linear_meta);
  m.impl("linear_grad_input", &grad_input_meta);
  m.impl("linear_grad_weight", &grad_weight_meta);
  m.impl("check_features", &check_features_meta);
  m.impl("guard_values", &guard_values_meta);
}

// ---------------------------------------------------------------------------
// The fast eager entry (issue 12). `torch.ops.cublas_guard.linear.default(...)`
// parses its arguments against the schema into a boxed stack on every call
// (several microseconds); this calls the same op through the dispatcher with a
// typed handle, so every dispatch key (Autograd, Autocast, Python modes, the
// backends) runs exactly as it does for torch.ops. It returns None, and the
// caller takes the torch.ops path, whenever that path could behave otherwise:
// an argument that is not a plain Tensor/Parameter (subclasses with
// __torch_function__), an active torch function mode, the JIT tracer, a
// non-strided input, a CUDA device whose first-use diagnostics have not run,
// an unreadable default mode. Python calls it only outside torch.compile and
// torch.func transforms (cublas_guard_ext.ops).
// ---------------------------------------------------------------------------
namespace cublas_guard {
namespace {

std::atomic<uint64_t> cuda_devices_checked{0};  // bit i: cuda:i had its first-use diagnostics

// The CUBLAS_GUARD_MODE default as a mode code, read at every call (the
// variable may change at run time: os.environ writes go through putenv), in
// the cases that need no rule: unset, or exactly a mode's name. -1
// for anything else: cublas_guard_ext.modes owns the rule (normalizing case
// and blanks, refusing the rest) and the Python path applies it.
int64_t env_mode_code() {
  const char* raw = std::getenv("CUBLAS_GUARD_MODE");
  if (raw == nullptr || std::strcmp(raw, "sync") == 0) return static_cast<int64_t>(GuardMode::kSync);
  if (std::strcmp(raw, "async") == 0) return static_cast<int64_t>(GuardMode::kAsync);
  if (std::strcmp(raw, "off") == 0) return static_cast<int64_t>(GuardMode::kOff);
  return -1;
}

bool plain_tensor(PyObject* obj) { return THPVariable_CheckExact(obj); }

PyObject* none() { Py_RETURN_NONE; }

// _fast_linear(x, weight, bias, layer: str, mode: int, scan_grad: bool) -> Tensor | None
// mode: 0 off, 1 sync, 2 async, or -1 for the environment default (CUBLAS_GUARD_MODE).
PyObject* fast_linear(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 6) return none();
  PyObject* const px = args[0];
  PyObject* const pw = args[1];
  PyObject* const pb = args[2];
  if (!plain_tensor(px) || !plain_tensor(pw) || (pb != Py_None && !plain_tensor(pb)) ||
      !PyUnicode_Check(args[3]) || !PyLong_Check(args[4]) || !PyBool_Check(args[5])) {
    return none();
  }
  if (at::impl::torch_function_mode_enabled() || at::tracer::impl::is_dispatch_enabled()) {
    return none();
  }
  const at::Tensor& x = THPVariable_Unpack(px);
  if (x.layout() != c10::kStrided) return none();
  if (x.is_cuda()) {
    const int index = x.device().index();
    if (index < 0 || index >= 64 ||
        (cuda_devices_checked.load(std::memory_order_relaxed) & (uint64_t{1} << index)) == 0) {
      return none();
    }
  }
  int overflow = 0;
  int64_t mode = PyLong_AsLongLongAndOverflow(args[4], &overflow);
  if (overflow != 0 || (mode == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    return none();
  }
  if (mode == -1) {
    mode = env_mode_code();
    if (mode < 0) return none();
  }
  Py_ssize_t length = 0;
  const char* layer = PyUnicode_AsUTF8AndSize(args[3], &length);
  if (layer == nullptr) {
    PyErr_Clear();
    return none();
  }
  const at::Tensor& weight = THPVariable_Unpack(pw);
  c10::optional<at::Tensor> bias;
  if (pb != Py_None) bias = THPVariable_Unpack(pb);
  const bool scan_grad = args[5] == Py_True;
  const auto& op = linear_handle();
  at::Tensor out;
  {
    // As torch.ops does: other Python threads run while the op does.
    PyThreadState* const saved = PyEval_SaveThread();
    struct Restore {
      PyThreadState* state;
      ~Restore() { PyEval_RestoreThread(state); }
    } restore{saved};
    out = op.call(x, weight, bias, c10::string_view(layer, static_cast<size_t>(length)), mode,
                  scan_grad);
  }
  return THPVariable_Wrap(std::move(out));
  END_HANDLE_TH_ERRORS
}

// _cuda_first_use_done(index): cuda:index had its first-use diagnostics (Python).
PyObject* cuda_first_use_done(PyObject* /*self*/, PyObject* arg) {
  const long index = PyLong_AsLong(arg);
  if (index == -1 && PyErr_Occurred()) return nullptr;
  if (index >= 0 && index < 64) cuda_devices_checked.fetch_or(uint64_t{1} << index);
  Py_RETURN_NONE;
}

PyMethodDef module_methods[] = {
    {"_fast_linear", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fast_linear)),
     METH_FASTCALL, "The guarded linear through a typed dispatcher handle, or None (see bindings.cpp)."},
    {"_cuda_first_use_done", &cuda_first_use_done, METH_O,
     "Marks cuda:index as having had its first-use diagnostics."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace
}  // namespace cublas_guard

extern "C" {
// Importing cublas_guard_ext._C loads the library, whose static initializers
// register the ops above; the module has the fast eager entry only.
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1,
                                          cublas_guard::module_methods};
  return PyModule_Create(&module_def);
}
}
