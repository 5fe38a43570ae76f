// The stable core's Python module, cublas_guard_ext._core: empty. Importing it
// loads the library, whose static registrations (STABLE_TORCH_LIBRARY) define
// and implement the ops; Python reaches them as torch.ops.cublas_guard.*.
// Built against the limited C API (abi3): one binary for every CPython >= 3.10.
#ifdef CUBLAS_GUARD_STABLE
#include <Python.h>

extern "C" {
PyMODINIT_FUNC PyInit__core(void) {
  static struct PyModuleDef module = {
      PyModuleDef_HEAD_INIT, "_core", nullptr, -1, nullptr, nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module);
}
}
#endif  // CUBLAS_GUARD_STABLE
