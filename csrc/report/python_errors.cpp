// Raising the typed Python exception straight from native code.
//
// An error a guarded op raises may cross code no Python wrapper can wrap: the
// autograd engine's worker threads (backward GEMMs), compiled graphs. So the
// native side builds the exception itself: it asks cublas_guard_ext.errors
// (the one place messages are formatted) for the typed exception of the
// report, sets it as the Python error and throws torch's python_error, which
// the engine carries across threads and the Python bindings restore as is.
// Without an interpreter (or if anything here fails) the plain c10 error with
// the payload line is thrown instead.
#include <Python.h>

#include "guard.h"

#include <torch/csrc/Exceptions.h>

namespace cublas_guard {

void throw_python_error_if_possible(const std::string& message) {
  if (!Py_IsInitialized()) return;
  const PyGILState_STATE gil = PyGILState_Ensure();
  PyObject* module = PyImport_ImportModule("cublas_guard_ext.errors");
  PyObject* exc = module != nullptr
                      ? PyObject_CallMethod(module, "_typed_from_native_message", "s", message.c_str())
                      : nullptr;
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
