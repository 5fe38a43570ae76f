"""The bottom layer: building and loading the native library, and facts about the environment.

* ``build``: the source list, flags and CUDA decision (``setup.py`` loads it by path);
* ``toolkit``: the CUDA toolkit and torch's CUDA wheels (nvcc's version vs torch's, the
  cuBLAS headers, the CPU-only fallback), used by ``build``;
* ``loader``: a prebuilt ``_C`` or a JIT build of the same sources;
* ``facts``: torch/CUDA/cuBLAS versions, libraries, GPUs, arch support, the
  environment block of cuBLAS errors and the first-CUDA-use warning.

Nothing here imports a module above it at import time (docs/architecture.md).
"""
