"""The bottom layer: the native libraries, one job per folder.

* ``building/``: compiling them (the source lists, flags, the CUDA toolkit, ninja, the unity
  build, the stable core's plan); setup.py loads it by path, the loader only to JIT-build;
* ``loading/``: which library serves this process and the one seam every caller reads
  (``loading.seam``), the op codes both sides share, and which builds can load here;
* ``core_twins/``: what the stable core registers in Python because its C ABI cannot
  (autograd, autocast, fake kernels, the fast eager entry);
* ``machine/``: facts about this machine (torch/CUDA/cuBLAS versions, the mapped libraries,
  known-bad builds) for the doctor, the capsule and the error messages.

Nothing here imports a module above it at import time (docs/architecture.md), and importing
the package imports nothing of ``building/``. The old flat paths (``_native.loader``...) are
aliases of the moved modules (cublas_guard_ext/_module_aliases.py).
"""
