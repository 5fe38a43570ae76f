// Raising the typed Python exception straight from native code.
//
// An error a guarded op raises may cross code no Python wrapper can wrap: the
// autograd engine's worker threads (backward GEMMs), compiled graphs. So the
// native side builds the exception itself: it asks cublas_guard_ext._native_callbacks
// (typed_error: errors.parse formats every message) for the typed exception of the
// report, sets it as the Python error and throws torch's python_error, which
// the engine carries across threads and the Python bindings restore as is.
// Without an interpreter (or if anything here fails) the plain c10 error with
// the payload line is thrown instead.
//
// With the message go the tensors of the failing call (report/call_scope.h):
// the report's attached GEMM buffers and the operands of this thread's guarded
// call, so that the failure capsule (cublas_guard_ext.capsule) can be written
// in Python even for a backward GEMM, whose operands Python never sees. They
// are alive for the whole call: Python copies what it keeps before returning.
#include <Python.h>

#include "linear/linear_op.h"
#include "report/call_scope.h"

#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

namespace cublas_guard {

namespace {

// Adds `tensor` to `dict` under `name` (an undefined tensor is left out).
// Returns false if Python failed.
bool put_tensor(PyObject* dict, const char* name, const at::Tensor& tensor) {
  if (!tensor.defined()) return true;
  PyObject* value = THPVariable_Wrap(tensor);
  if (value == nullptr) return false;
  const int rc = PyDict_SetItemString(dict, name, value);
  Py_DECREF(value);
  return rc == 0;
}

bool put_string(PyObject* dict, const char* name, const char* text) {
  PyObject* value = PyUnicode_FromString(text);
  if (value == nullptr) return false;
  const int rc = PyDict_SetItemString(dict, name, value);
  Py_DECREF(value);
  return rc == 0;
}

// {"buffers": {name: tensor}, "phase": str, "call_number": int, "operands": {name: tensor}}
// (a new reference), or nullptr with a Python error set.
PyObject* native_context(const ErrorReport* report) {
  PyObject* context = PyDict_New();
  PyObject* buffers = PyDict_New();
  PyObject* operands = PyDict_New();
  bool ok = context != nullptr && buffers != nullptr && operands != nullptr;
  if (ok && report != nullptr) {
    for (const auto& entry : report->attached()) {
      ok = ok && put_tensor(buffers, entry.first.c_str(), entry.second);
    }
  }
  const GuardedCall* call = current_guarded_call();
  if (ok && call != nullptr) {
    for (int i = 0; i < 3 && ok; ++i) {
      if (call->names[i] != nullptr && call->tensors[i] != nullptr) {
        ok = put_tensor(operands, call->names[i], *call->tensors[i]);
      }
    }
    ok = ok && put_string(context, "phase", call->phase);
    PyObject* number = ok ? PyLong_FromLongLong(call->number) : nullptr;
    ok = number != nullptr && PyDict_SetItemString(context, "call_number", number) == 0;
    Py_XDECREF(number);
  }
  ok = ok && PyDict_SetItemString(context, "buffers", buffers) == 0 &&
       PyDict_SetItemString(context, "operands", operands) == 0;
  Py_XDECREF(buffers);
  Py_XDECREF(operands);
  if (!ok) {
    Py_XDECREF(context);
    return nullptr;
  }
  return context;
}

}  // namespace

void throw_python_error_if_possible(const std::string& message, const ErrorReport* report) {
  if (!Py_IsInitialized()) return;
  const PyGILState_STATE gil = PyGILState_Ensure();
  // The capsule reads the operands with torch ops: watch (whose dispatch key
  // may be on in this thread) must not observe them as the model's ops.
  const c10::impl::ExcludeDispatchKeyGuard no_watch(c10::DispatchKey::TESTING_ONLY_GenericMode);
  PyObject* module = PyImport_ImportModule("cublas_guard_ext._native_callbacks");
  PyObject* context = module != nullptr ? native_context(report) : nullptr;
  PyObject* exc = context != nullptr
                      ? PyObject_CallMethod(module, "typed_error", "sO", message.c_str(), context)
                      : nullptr;
  Py_XDECREF(context);
  Py_XDECREF(module);
  if (exc == nullptr || !PyExceptionInstance_Check(exc)) {
    Py_XDECREF(exc);
    PyErr_Clear();
    PyGILState_Release(gil);
    return;
  }
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc)), exc);
  Py_DECREF(exc);
  python_error error;
  error.persist();  // takes the error out of this thread's indicator, with its message
  PyGILState_Release(gil);
  throw error;
}

}  // namespace cublas_guard
