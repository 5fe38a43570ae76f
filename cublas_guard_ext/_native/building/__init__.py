"""Compiling the native libraries: the source lists (``sources``), the flags (``build``,
``cxx_flags``), the CUDA toolkit (``toolkit``), ninja and its progress (``ninja_build``), the
unity build (``unity_build``) and the stable core's plan (``core_build``).

One folder because it is one job with one rule: setup.py loads these files by path, before
the package exists, so they import nothing of the package (``build._sibling`` finds the
others) and run no compiler at import. The loader imports them only to JIT-build or to load
a JIT build; importing ``cublas_guard_ext`` never does (tests/building/test_native_layout.py).
"""
