// The Python module cublas_guard_ext._C: importing it loads this library,
// whose static initializers register the ops (ops.cpp and the kernels'
// files); the module holds the fast eager entry below and watch's methods
// (locked/watch/watch_python.cpp). A JIT build is not a Python module: the op
// cublas_guard_internal::python_module_install puts the same module into
// sys.modules there.
#include <Python.h>

#include "linear/linear_op.h"
#include "locked/op_handles.h"
#include "locked/watch/watch.h"

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/TracerMode.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <vector>

// ---------------------------------------------------------------------------
// The fast eager entry. `torch.ops.cublas_guard.linear.default(...)`
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
    out = op.call(x, weight, bias, c10::string_view(layer, static_cast<size_t>(length)), mode, scan_grad);
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
    {"_fast_linear", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fast_linear)), METH_FASTCALL,
     "The guarded linear through a typed dispatcher handle, or None (see python_module.cpp)."},
    {"_cuda_first_use_done", &cuda_first_use_done, METH_O,
     "Marks cuda:index as having had its first-use diagnostics."},
    {nullptr, nullptr, 0, nullptr}};

// The module's methods: the entries above, then watch's.
PyMethodDef* all_methods() {
  static std::vector<PyMethodDef> methods = [] {
    std::vector<PyMethodDef> t;
    for (PyMethodDef* m = module_methods; m->ml_name != nullptr; ++m) t.push_back(*m);
    for (PyMethodDef* m = watch::python_methods(); m->ml_name != nullptr; ++m) t.push_back(*m);
    t.push_back({nullptr, nullptr, 0, nullptr});
    return t;
  }();
  return methods.data();
}

// Every member named (no slots, no GC hooks): -Wextra checks this file in CI's nvcc check.
PyModuleDef module_def = {PyModuleDef_HEAD_INIT,
                          "cublas_guard_ext._C",
                          nullptr,
                          -1,
                          all_methods(),
                          nullptr,
                          nullptr,
                          nullptr,
                          nullptr};

// A JIT build: the same module, put into sys.modules (no fast entry is used
// from it: cublas_guard_ext.ops takes that only from a prebuilt _C).
void install_python_module() {
  if (!Py_IsInitialized()) return;
  const PyGILState_STATE gil = PyGILState_Ensure();
  PyObject* modules = PyImport_GetModuleDict();
  if (PyDict_GetItemString(modules, "cublas_guard_ext._C") == nullptr) {
    PyObject* m = PyModule_Create(&module_def);
    if (m != nullptr) {
      PyDict_SetItemString(modules, "cublas_guard_ext._C", m);
      Py_DECREF(m);
    }
  }
  PyErr_Clear();
  PyGILState_Release(gil);
}

}  // namespace
}  // namespace cublas_guard

TORCH_LIBRARY_FRAGMENT(cublas_guard_internal, m) {
  m.def("python_module_install() -> ()", &cublas_guard::install_python_module);
}

extern "C" {
// Importing cublas_guard_ext._C loads the library, whose static initializers
// register the ops above.
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&cublas_guard::module_def); }
}
