// An op inside a watch block failed with a cuBLAS or CUDA error: re-raise it
// as the project's typed error (CublasError, CublasOutOfMemoryError,
// PendingCudaError) naming the op, the module and the inputs, with the
// original as __cause__ (cublas_guard_ext._native_callbacks.watch_op_failure builds it).
#include "locked/watch/watch.h"

#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/Exceptions.h>

namespace cublas_guard {
namespace watch {

bool mentions_cuda_failure(const std::string& m) {
  return m.find("CUBLAS_STATUS_") != std::string::npos || m.find("CUDA error") != std::string::npos ||
         m.find("cudaError") != std::string::npos;
}

// An op failed with a cuBLAS/CUDA error: re-raise it typed, naming the module
// and op, the original as __cause__ (cublas_guard_ext._native_callbacks.watch_op_failure builds it).
[[noreturn]] void reraise_typed(Session& s, const c10::OperatorHandle& op, const OpInfo& info,
                                const std::vector<c10::IValue>& args, PyObject* original,
                                const std::string& original_message) {
  c10::impl::ExcludeDispatchKeyGuard no_watch(kWatchKey);
  ErrorReport r("watch_op_failure");
  r.add("op", op_display_name(op.schema()));
  {
    SessionLock lock(*s.mu);
    add_where(r, s, where_now(s));
  }
  describe_inputs(r, op.schema(), args, info);
  const std::string payload = r.json();
  PyObject* module = PyImport_ImportModule("cublas_guard_ext._native_callbacks");
  PyObject* exc = nullptr;
  if (module != nullptr) {
    exc = PyObject_CallMethod(module, "watch_op_failure", "sOs", payload.c_str(),
                              original != nullptr ? original : Py_None, original_message.c_str());
  }
  Py_XDECREF(module);
  if (exc == nullptr || !PyExceptionInstance_Check(exc)) {
    Py_XDECREF(exc);
    PyErr_Clear();
    throw;  // NOLINT: rethrows the exception being handled by the caller
  }
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc)), exc);
  Py_DECREF(exc);
  python_error error;
  error.persist();
  throw error;
}

bool is_guard_error(PyObject* value) {
  PyObject* errors = PyImport_ImportModule("cublas_guard_ext._native_callbacks");
  if (errors == nullptr) {
    PyErr_Clear();
    return false;
  }
  PyObject* base = PyObject_GetAttrString(errors, "GuardError");
  Py_DECREF(errors);
  if (base == nullptr) {
    PyErr_Clear();
    return false;
  }
  const int r = PyObject_IsInstance(value, base);
  Py_DECREF(base);
  if (r < 0) PyErr_Clear();
  return r == 1;
}

std::string py_str(PyObject* value) {
  std::string out;
  PyObject* str = value != nullptr ? PyObject_Str(value) : nullptr;
  const char* utf8 = str != nullptr ? PyUnicode_AsUTF8(str) : nullptr;
  if (utf8 != nullptr) out = utf8;
  Py_XDECREF(str);
  PyErr_Clear();
  return out;
}

}  // namespace watch
}  // namespace cublas_guard
