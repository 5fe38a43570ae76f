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
// subclass, no Python key), no torch function or dispatch mode, no tracer, no
// autocast, and no gradient to record; everything else returns None (the
// torch.ops path decides) or, for a call that records a gradient, goes to
// Python's autograd node (the `grad_path` hook). The caller,
// guarded_linear/ops.py, has ruled out torch.compile and torch.func.
//
// Python hands the entry what it must ask (python_hooks, below) once, through the
// exported function cublas_guard_core_python_entry (ctypes), so the core
// imports no Python module and works from a JIT build as from the wheel.
// Built against the limited C API (abi3), as the core's module is.
#ifdef CUBLAS_GUARD_STABLE
#include "linear/linear_op.h"

#include <Python.h>

#include <atomic>
#include <exception>
#include <optional>
#include <string>

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

// 1 when obj.requires_grad, 0 when not, -1 with a Python error set.
int requires_grad(PyObject* obj) {
  if (obj == Py_None) return 0;
  PyObject* flag = PyObject_GetAttr(obj, python_hooks.requires_grad);
  if (flag == nullptr) return -1;
  const int truth = flag == Py_True;
  Py_DECREF(flag);
  return truth;
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

// The kernel of the op on x's device, with the GIL released while it runs (as torch.ops does).
Tensor run_kernel(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias, std::string layer,
                  int64_t mode, bool scan_grad) {
  PyThreadState* const saved = PyEval_SaveThread();
  struct Restore {
    PyThreadState* state;
    ~Restore() { PyEval_RestoreThread(state); }
  } restore{saved};
#ifdef CUBLAS_GUARD_WITH_CUDA
  if (x.is_cuda()) return linear_cuda_kernel(x, weight, bias, std::move(layer), mode, scan_grad);
#endif
  return linear_cpu_kernel(x, weight, bias, std::move(layer), mode, scan_grad);
}

// fast_linear(x, weight, bias, layer: str, code: int, scan_grad: bool) -> Tensor | None, as
// core_twins/stable_core.py's fast_linear (None: the torch.ops path decides).
PyObject* fast_linear(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 6) return none();
  PyObject* const px = args[0];
  PyObject* const pw = args[1];
  PyObject* const pb = args[2];
  if (!plain_tensor(px) || !plain_tensor(pw) || (pb != Py_None && !plain_tensor(pb)) ||
      !PyUnicode_CheckExact(args[3]) || !PyLong_CheckExact(args[4]) ||
      (args[5] != Py_True && args[5] != Py_False)) {
    return none();
  }
  int overflow = 0;
  const long long code = PyLong_AsLongLongAndOverflow(args[4], &overflow);
  if (overflow != 0 || code < 0) {  // the op refuses other codes itself, with their ValueError
    PyErr_Clear();
    return none();
  }
  for (PyObject* hook : {python_hooks.function_mode_on, python_hooks.tracing, python_hooks.dispatch_modes,
                         python_hooks.any_autocast}) {
    const int on = ask(hook);
    if (on != 0) return on < 0 ? nullptr : none();
  }
  try {
    Tensor x = from_python(px);
    int32_t layout = 0;
    CG_SHIM(aoti_torch_get_layout(x.get(), &layout));
    if (layout != aoti_torch_layout_strided()) return none();
    const bool cuda = x.is_cuda();
    if (!cuda && !x.is_cpu()) return none();
    if (cuda) {
      const int index = device_index(x);
      if (index < 0 || index >= 64 ||
          (cuda_devices_seen.load(std::memory_order_relaxed) & (uint64_t{1} << index)) == 0) {
        return none();
      }
      const ScalarType dtype = x.scalar_type();
      if (dtype == kHalf || dtype == kBFloat16) {
        PyObject* done = PyObject_CallNoArgs(python_hooks.hand_over_cuda);
        if (done == nullptr) return nullptr;
        Py_DECREF(done);
      }
    }
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
    Py_ssize_t length = 0;
    const char* layer = PyUnicode_AsUTF8AndSize(args[3], &length);
    if (layer == nullptr) {
      PyErr_Clear();
      return none();
    }
    const Tensor weight = from_python(pw);
    std::optional<Tensor> bias;
    if (pb != Py_None) bias = from_python(pb);
    const Tensor out = run_kernel(x, weight, bias, std::string(layer, static_cast<size_t>(length)), code,
                                  args[5] == Py_True);
    void* result = nullptr;
    CG_SHIM(torch_tensor_to_pyobject(out.get(), nullptr, &result));
    return static_cast<PyObject*>(result);
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

PyMethodDef fast_linear_def = {
    "fast_linear", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fast_linear)), METH_FASTCALL,
    "The core's guarded linear from C, or None (python_entry_stable.cpp)."};
PyMethodDef cuda_first_use_done_def = {"cuda_first_use_done", &cuda_first_use_done, METH_O,
                                       "Marks cuda:index as having had its first-use diagnostics."};

}  // namespace
}  // namespace cublas_guard

// entry(python_hooks: tuple) -> (fast_linear, cuda_first_use_done), or None where torch lacks the
// Python interop shims (before 2.14). python_hooks: (torch.Tensor, torch.nn.Parameter,
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
    PyErr_SetString(PyExc_TypeError, "cublas_guard_core_python_entry: expected a tuple of 9 python_hooks");
    return nullptr;
  }
  if (python_hooks.requires_grad == nullptr) {  // first call: later ones return the same entry
    for (Py_ssize_t i = 0; i < n; ++i) {
      *slots[i] = PyTuple_GetItem(given, i);
      Py_INCREF(*slots[i]);
    }
    python_hooks.requires_grad = PyUnicode_InternFromString("requires_grad");
  }
  PyObject* linear = PyCFunction_New(&cublas_guard::fast_linear_def, nullptr);
  PyObject* first_use = PyCFunction_New(&cublas_guard::cuda_first_use_done_def, nullptr);
  if (linear == nullptr || first_use == nullptr) {
    Py_XDECREF(linear);
    Py_XDECREF(first_use);
    return nullptr;
  }
  PyObject* pair = PyTuple_Pack(2, linear, first_use);
  Py_DECREF(linear);
  Py_DECREF(first_use);
  return pair;
}
#endif  // CUBLAS_GUARD_STABLE
