// The stable core's C entry for SafeLinear's hot call: PyObjects in, the linear
// op's kernel called directly, a torch.Tensor out. It is the core's twin of the
// locked library's fast eager entry (locked/python_module.cpp) and exists only
// where torch has the stable ABI's Python interop shims (torch >= 2.14:
// torch_tensor_from_pyobject / torch_tensor_to_pyobject). The core is built to
// load beside every torch from its floor (2.10) on, so it cannot link them:
// they are declared here weak, with their published signatures, and are null
// where libtorch lacks them; Python then keeps its twin
// (core_twins/stable_core.py's fast_linear), which takes the same decisions.
//
// Why a direct call: through the dispatcher the op would reach its Autograd
// kernel, which under the core is Python's (about 9 us of a 16x16 call), and
// the stable ABI has no way to step below autograd. So this entry takes only
// the calls where skipping the dispatcher changes nothing: plain tensors (no
// subclass, no Python key) whose memory holds their values (no lazy negation,
// ZeroTensor, nested or quantized tensor), no torch function or dispatch mode,
// no tracer, no autocast, and no gradient to record; everything else returns None (the
// torch.ops path decides) or, for a call that records a gradient, goes to
// Python's autograd node (the `grad_path` hook). The caller,
// guarded_linear/ops.py, has ruled out torch.compile and torch.func. That node
// calls the gradient ops' kernels through this file too (grad_input,
// grad_weight, guard_values: NotImplemented where the dispatcher must decide),
// and its forward calls fast_linear, which autograd runs with gradients off.
//
// Python hands the entry what it must ask (Hooks, below) once, through the
// exported function cublas_guard_core_python_entry (ctypes), so the core
// imports no Python module and works from a JIT build as from the wheel.
// Built against the limited C API (abi3), as the core's module is.
#ifdef CUBLAS_GUARD_STABLE
#include "linear/linear_op.h"

#include <Python.h>

#include <atomic>
#include <exception>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>

extern "C" {
// torch/csrc/stable/c/shim.h (torch >= 2.14), "Python interop shims". The GIL must be held.
__attribute__((weak, visibility("default"))) AOTITorchError torch_tensor_from_pyobject(void* py_obj,
                                                                                       AtenTensorHandle* ret);
__attribute__((weak, visibility("default"))) AOTITorchError torch_tensor_to_pyobject(AtenTensorHandle ath,
                                                                                     void* py_type,
                                                                                     void** ret);
}

namespace cublas_guard {
namespace {

// What the entry asks Python, set once by cublas_guard_core_python_entry (strong references,
// kept for the process's life).
struct Hooks {
  PyObject* tensor_type = nullptr;     // torch.Tensor
  PyObject* parameter_type = nullptr;  // torch.nn.Parameter
  PyObject* function_mode_on = nullptr;  // () -> bool
  PyObject* tracing = nullptr;           // () -> bool
  PyObject* dispatch_modes = nullptr;    // () -> int: how many TorchDispatchModes are on
  PyObject* any_autocast = nullptr;      // () -> bool
  PyObject* grad_path = nullptr;         // (x, weight, bias, layer, code, scan_grad) -> Tensor
  PyObject* error_from_core = nullptr;   // (message) -> the exception to raise
  PyObject* hand_over_cuda = nullptr;    // () -> None: torch's half-precision cuBLAS settings
  PyObject* requires_grad = nullptr;     // "requires_grad"
  PyObject* is_neg = nullptr;            // "is_neg"
  PyObject* is_nested = nullptr;         // "is_nested"
};
Hooks python_hooks;
std::atomic<uint64_t> cuda_devices_seen{0};  // bit i: cuda:i had its first-use diagnostics

PyObject* none() { Py_RETURN_NONE; }

// A hook's answer as a truth value; -1 with a Python error set when it raised.
int ask(PyObject* hook) {
  PyObject* answer = PyObject_CallNoArgs(hook);
  if (answer == nullptr) return -1;
  const int truth = PyObject_IsTrue(answer);
  Py_DECREF(answer);
  return truth;
}

bool plain_tensor(PyObject* obj) {
  const auto* type = reinterpret_cast<PyObject*>(Py_TYPE(obj));
  return type == python_hooks.tensor_type || type == python_hooks.parameter_type;
}

// 1 when obj.<name> (an attribute, or with call, a method called with no arguments) is True,
// 0 when not, -1 with a Python error set.
int answers_true(PyObject* obj, PyObject* name, bool call) {
  PyObject* answer = call ? PyObject_CallMethodObjArgs(obj, name, nullptr) : PyObject_GetAttr(obj, name);
  if (answer == nullptr) return -1;
  const int truth = answer == Py_True;
  Py_DECREF(answer);
  return truth;
}

int requires_grad(PyObject* obj) {
  return obj == Py_None ? 0 : answers_true(obj, python_hooks.requires_grad, /*call=*/false);
}

// Whether a plain tensor's memory holds its values as they are, as far as Python sees:
// not nested, no lazy negation (a _neg_view, as `x.conj().imag` makes). The dispatcher's
// keys for those refuse or materialize the tensor before any kernel runs; a direct call would
// read the memory as it is. (A ZeroTensor, which has no memory, kernels_for sees.)
// 1 yes, 0 no, -1 with a Python error set.
int data_as_stored(PyObject* obj) {
  if (obj == Py_None) return 1;
  for (const auto& [name, call] :
       {std::pair{python_hooks.is_nested, false}, std::pair{python_hooks.is_neg, true}}) {
    const int on = answers_true(obj, name, call);
    if (on != 0) return on < 0 ? -1 : 0;
  }
  return 1;
}

// Every tensor of a call as stored (data_as_stored), 1; 0 when one is not; -1 on an error.
int all_as_stored(std::initializer_list<PyObject*> objs) {
  for (PyObject* obj : objs) {
    const int stored = data_as_stored(obj);
    if (stored != 1) return stored;
  }
  return 1;
}

Tensor from_python(PyObject* obj) {
  AtenTensorHandle handle = nullptr;
  CG_SHIM(torch_tensor_from_pyobject(obj, &handle));
  return Tensor(handle);
}

// The exception Python makes of the core's message (the typed one where it is ours), set.
PyObject* raise_from_core(const char* message) {
  PyObject* exc = PyObject_CallFunction(python_hooks.error_from_core, "s", message);
  if (exc != nullptr) {
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc)), exc);
    Py_DECREF(exc);
  }
  return nullptr;
}

// Whether a call may skip the dispatcher now: nothing that would see the op through it (a
// torch function or dispatch mode, the JIT tracer; autocast for the ops it has a rule for).
// 1 yes, 0 no, -1 with a Python error set.
int dispatcher_skippable(bool with_autocast) {
  for (PyObject* hook : {python_hooks.function_mode_on, python_hooks.tracing, python_hooks.dispatch_modes}) {
    const int on = ask(hook);
    if (on != 0) return on < 0 ? -1 : 0;
  }
  if (!with_autocast) return 1;
  const int on = ask(python_hooks.any_autocast);
  return on < 0 ? -1 : on == 0;
}

// Where a call's tensors are: their device's kernels, or null (declined: a layout other than
// strided, a device other than the CPU or a CUDA device past its first-use diagnostics, or
// tensors on different kinds of device, whose error the dispatcher's choice of kernel words).
// *failed is set when a Python hook raised. Shim failures throw.
const LinearKernels* kernels_for(std::initializer_list<const Tensor*> tensors, bool* failed) {
  *failed = false;
  const Tensor& first = **tensors.begin();
  const bool cuda = first.is_cuda();
  if (!cuda && !first.is_cpu()) return nullptr;
  for (const Tensor* t : tensors) {
    int32_t layout = 0;
    CG_SHIM(aoti_torch_get_layout(t->get(), &layout));
    if (layout != aoti_torch_layout_strided() || t->is_cuda() != cuda || (!cuda && !t->is_cpu())) {
      return nullptr;
    }
    // A ZeroTensor (the dispatcher's ZeroTensor key materializes it): values and no memory.
    void* data = nullptr;
    int64_t numel = 0;
    CG_SHIM(aoti_torch_get_data_ptr(t->get(), &data));
    CG_SHIM(aoti_torch_get_numel(t->get(), &numel));
    if (data == nullptr && numel > 0) return nullptr;
    // Quantized tensors: the dispatcher's Quantized keys refuse them (and the stable Tensor's
    // scalar_type() has no word for their dtypes): read the dtype's raw code.
    int32_t dtype = 0;
    CG_SHIM(aoti_torch_get_dtype(t->get(), &dtype));
    for (const ScalarType quantized : {ScalarType::QInt8, ScalarType::QUInt8, ScalarType::QInt32,
                                       ScalarType::QUInt4x2, ScalarType::QUInt2x4}) {
      if (dtype == static_cast<int32_t>(quantized)) return nullptr;
    }
  }
  if (!cuda) return &cpu_linear_kernels();
#ifdef CUBLAS_GUARD_WITH_CUDA
  const int index = device_index(first);
  if (index < 0 || index >= 64 ||
      (cuda_devices_seen.load(std::memory_order_relaxed) & (uint64_t{1} << index)) == 0) {
    return nullptr;
  }
  const ScalarType dtype = first.scalar_type();
  if (dtype == kHalf || dtype == kBFloat16) {  // torch's half-precision cuBLAS settings, handed over
    PyObject* done = PyObject_CallNoArgs(python_hooks.hand_over_cuda);
    if (done == nullptr) {
      *failed = true;
      return nullptr;
    }
    Py_DECREF(done);
  }
  return &cuda_linear_kernels();
#else
  return nullptr;  // a CPU-only core: the dispatcher says there is no CUDA kernel
#endif
}

// fn() with the GIL released (as torch.ops runs a kernel: other Python threads go on).
template <typename Fn>
auto without_gil(Fn&& fn) {
  PyThreadState* const saved = PyEval_SaveThread();
  struct Restore {
    PyThreadState* state;
    ~Restore() { PyEval_RestoreThread(state); }
  } restore{saved};
  return fn();
}

PyObject* to_python(const Tensor& t) {
  void* result = nullptr;
  CG_SHIM(torch_tensor_to_pyobject(t.get(), nullptr, &result));
  return static_cast<PyObject*>(result);
}

bool exact_str(PyObject* obj) { return PyUnicode_CheckExact(obj); }

// An exact int in [0, 2^63) into *out; false (no error set) for anything else.
bool code_arg(PyObject* obj, long long* out) {
  if (!PyLong_CheckExact(obj)) return false;
  int overflow = 0;
  *out = PyLong_AsLongLongAndOverflow(obj, &overflow);
  if (overflow != 0 || *out < 0) {  // the ops refuse other codes themselves, with their ValueError
    PyErr_Clear();
    return false;
  }
  return true;
}

// A str argument's text; nullopt (no error set) where it has none as UTF-8.
std::optional<std::string> text_arg(PyObject* obj) {
  Py_ssize_t length = 0;
  const char* text = PyUnicode_AsUTF8AndSize(obj, &length);
  if (text == nullptr) {
    PyErr_Clear();
    return std::nullopt;
  }
  return std::string(text, static_cast<size_t>(length));
}

// fast_linear(x, weight, bias, layer: str, code: int, scan_grad: bool) -> Tensor | None, as
// core_twins/stable_core.py's fast_linear (None: the torch.ops path decides).
PyObject* fast_linear(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 6) return none();
  PyObject* const px = args[0];
  PyObject* const pw = args[1];
  PyObject* const pb = args[2];
  long long code = 0;
  if (!plain_tensor(px) || !plain_tensor(pw) || (pb != Py_None && !plain_tensor(pb)) || !exact_str(args[3]) ||
      !code_arg(args[4], &code) || (args[5] != Py_True && args[5] != Py_False)) {
    return none();
  }
  const int skippable = dispatcher_skippable(/*with_autocast=*/true);
  if (skippable <= 0) return skippable < 0 ? nullptr : none();
  const int stored = all_as_stored({px, pw, pb});
  if (stored <= 0) return stored < 0 ? nullptr : none();
  try {
    const Tensor x = from_python(px);
    const Tensor weight = from_python(pw);
    std::optional<Tensor> bias;
    if (pb != Py_None) bias = from_python(pb);
    bool failed = false;
    const LinearKernels* kernels =
        bias ? kernels_for({&x, &weight, &*bias}, &failed) : kernels_for({&x, &weight}, &failed);
    if (kernels == nullptr) return failed ? nullptr : none();
    if (aoti_torch_grad_mode_is_enabled()) {
      for (PyObject* t : {px, pw, pb}) {
        const int needs = requires_grad(t);
        if (needs < 0) return nullptr;
        if (needs == 1) {  // a gradient to record: Python's autograd node
          PyObject* call_args = PyTuple_New(6);
          if (call_args == nullptr) return nullptr;
          for (Py_ssize_t i = 0; i < 6; ++i) {
            Py_INCREF(args[i]);
            PyTuple_SetItem(call_args, i, args[i]);
          }
          PyObject* out = PyObject_Call(python_hooks.grad_path, call_args, nullptr);
          Py_DECREF(call_args);
          return out;
        }
      }
    }
    std::optional<std::string> layer = text_arg(args[3]);
    if (!layer) return none();
    const bool scan_grad = args[5] == Py_True;
    return to_python(
        without_gil([&] { return kernels->linear(x, weight, bias, std::move(*layer), code, scan_grad); }));
  } catch (const std::exception& e) {
    return raise_from_core(e.what());
  }
}

PyObject* not_implemented() { Py_RETURN_NOTIMPLEMENTED; }

// The gradient ops' entries, for the core's Python autograd node (stable_core.py's _call), which
// calls them where it would call the op below autograd (no gradient of theirs to record):
// grad_input(grad_output, weight, layer), grad_weight(grad_output, x, layer) -> Tensor, and
// guard_values(t, layer, role, mode) -> None; NotImplemented where the dispatcher must decide.
PyObject* grad_gemm(PyObject* const* args, Py_ssize_t nargs, bool input) {
  if (nargs != 3 || !plain_tensor(args[0]) || !plain_tensor(args[1]) || !exact_str(args[2])) {
    return not_implemented();
  }
  const int skippable = dispatcher_skippable(/*with_autocast=*/false);
  if (skippable <= 0) return skippable < 0 ? nullptr : not_implemented();
  if (aoti_torch_grad_mode_is_enabled()) return not_implemented();  // a gradient of it may be recorded
  const int stored = all_as_stored({args[0], args[1]});
  if (stored <= 0) return stored < 0 ? nullptr : not_implemented();
  try {
    const Tensor grad_output = from_python(args[0]);
    const Tensor other = from_python(args[1]);
    bool failed = false;
    const LinearKernels* kernels = kernels_for({&grad_output, &other}, &failed);
    if (kernels == nullptr) return failed ? nullptr : not_implemented();
    std::optional<std::string> layer = text_arg(args[2]);
    if (!layer) return not_implemented();
    const auto kernel = input ? kernels->grad_input : kernels->grad_weight;
    return to_python(without_gil([&] { return kernel(grad_output, other, std::move(*layer)); }));
  } catch (const std::exception& e) {
    return raise_from_core(e.what());
  }
}

PyObject* grad_input(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  return grad_gemm(args, nargs, /*input=*/true);
}

PyObject* grad_weight(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  return grad_gemm(args, nargs, /*input=*/false);
}

PyObject* guard_values(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  long long role = 0, mode = 0;
  if (nargs != 4 || !plain_tensor(args[0]) || !exact_str(args[1]) || !code_arg(args[2], &role) ||
      !code_arg(args[3], &mode)) {
    return not_implemented();
  }
  const int skippable = dispatcher_skippable(/*with_autocast=*/false);
  if (skippable <= 0) return skippable < 0 ? nullptr : not_implemented();
  if (aoti_torch_grad_mode_is_enabled()) return not_implemented();
  const int stored = data_as_stored(args[0]);
  if (stored <= 0) return stored < 0 ? nullptr : not_implemented();
  try {
    const Tensor t = from_python(args[0]);
    bool failed = false;
    const LinearKernels* kernels = kernels_for({&t}, &failed);
    if (kernels == nullptr) return failed ? nullptr : not_implemented();
    std::optional<std::string> layer = text_arg(args[1]);
    if (!layer) return not_implemented();
    without_gil([&] {
      kernels->guard_values(t, std::move(*layer), role, mode);
      return 0;
    });
    return none();
  } catch (const std::exception& e) {
    return raise_from_core(e.what());
  }
}

// cuda_first_use_done(index): cuda:index had its first-use diagnostics (Python).
PyObject* cuda_first_use_done(PyObject* /*self*/, PyObject* arg) {
  const long index = PyLong_AsLong(arg);
  if (index == -1 && PyErr_Occurred()) return nullptr;
  if (index >= 0 && index < 64) cuda_devices_seen.fetch_or(uint64_t{1} << index);
  Py_RETURN_NONE;
}

PyCFunction fastcall(PyObject* (*fn)(PyObject*, PyObject* const*, Py_ssize_t)) {
  return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fn));
}

PyMethodDef entry_defs[] = {
    {"fast_linear", fastcall(&fast_linear), METH_FASTCALL,
     "The core's guarded linear from C, or None (python_entry_stable.cpp)."},
    {"cuda_first_use_done", &cuda_first_use_done, METH_O,
     "Marks cuda:index as having had its first-use diagnostics."},
    {"grad_input", fastcall(&grad_input), METH_FASTCALL,
     "linear_grad_input's kernel from C, or NotImplemented."},
    {"grad_weight", fastcall(&grad_weight), METH_FASTCALL,
     "linear_grad_weight's kernel from C, or NotImplemented."},
    {"guard_values", fastcall(&guard_values), METH_FASTCALL,
     "guard_values' kernel from C, or NotImplemented."},
};

}  // namespace
}  // namespace cublas_guard

// entry(hooks: tuple) -> (fast_linear, cuda_first_use_done, grad_input, grad_weight,
// guard_values), or None where torch lacks the Python interop shims (before 2.14).
// hooks: (torch.Tensor, torch.nn.Parameter,
// function_mode_on, tracing, dispatch_modes, any_autocast, grad_path, error_from_core,
// hand_over_cuda), as Hooks says. Called once, with the GIL held (ctypes.PyDLL).
extern "C" __attribute__((visibility("default"))) PyObject* cublas_guard_core_python_entry(PyObject* given) {
  using cublas_guard::python_hooks;
  if (torch_tensor_from_pyobject == nullptr || torch_tensor_to_pyobject == nullptr) Py_RETURN_NONE;
  PyObject** slots[] = {
      &python_hooks.tensor_type, &python_hooks.parameter_type,  &python_hooks.function_mode_on,
      &python_hooks.tracing,     &python_hooks.dispatch_modes,  &python_hooks.any_autocast,
      &python_hooks.grad_path,   &python_hooks.error_from_core, &python_hooks.hand_over_cuda};
  constexpr Py_ssize_t n = sizeof(slots) / sizeof(slots[0]);
  if (!PyTuple_Check(given) || PyTuple_Size(given) != n) {
    PyErr_SetString(PyExc_TypeError, "cublas_guard_core_python_entry: expected a tuple of 9 hooks");
    return nullptr;
  }
  if (python_hooks.requires_grad == nullptr) {  // first call: later ones return the same entry
    for (Py_ssize_t i = 0; i < n; ++i) {
      *slots[i] = PyTuple_GetItem(given, i);
      Py_INCREF(*slots[i]);
    }
    python_hooks.requires_grad = PyUnicode_InternFromString("requires_grad");
    python_hooks.is_neg = PyUnicode_InternFromString("is_neg");
    python_hooks.is_nested = PyUnicode_InternFromString("is_nested");
  }
  constexpr Py_ssize_t count = sizeof(cublas_guard::entry_defs) / sizeof(cublas_guard::entry_defs[0]);
  PyObject* entries = PyTuple_New(count);
  if (entries == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* fn = PyCFunction_New(&cublas_guard::entry_defs[i], nullptr);
    if (fn == nullptr) {
      Py_DECREF(entries);
      return nullptr;
    }
    PyTuple_SetItem(entries, i, fn);
  }
  return entries;
}
#endif  // CUBLAS_GUARD_STABLE
