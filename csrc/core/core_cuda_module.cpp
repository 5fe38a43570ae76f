// The stable core's CUDA Python module, cublas_guard_ext._core_cuda: empty.
// Importing it loads the library, whose static registrations
// (STABLE_TORCH_LIBRARY_IMPL for the CUDA key: cuda/linear.cu,
// replay/replay_cuda.cu) implement the core's ops on CUDA tensors; the ops
// themselves are defined by the CPU core (_core, core/core_module.cpp).
// Built against the limited C API (abi3): one binary for every CPython >= 3.10.
#ifdef CUBLAS_GUARD_STABLE
#include <Python.h>

extern "C" {
PyMODINIT_FUNC PyInit__core_cuda(void) {
  static struct PyModuleDef module = {
      PyModuleDef_HEAD_INIT, "_core_cuda", nullptr, -1, nullptr, nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module);
}
}
#endif  // CUBLAS_GUARD_STABLE
