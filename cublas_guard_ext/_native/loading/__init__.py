"""Which native library serves this process, and the one seam the rest of the package reads.

* ``loader``: the version-locked ``_C``, else the stable core, else a JIT build
  (``CUBLAS_GUARD_EXT_NATIVE`` picks), and ``info()``, how it was loaded;
* ``seam``: what callers ask of the loaded library (its fast eager entry, whether it has
  watch, how its errors become typed), so no caller branches on which library loaded;
* ``codes``: the integer codes the ops take, shared by Python and C++;
* ``compatibility``: which builds can load beside this torch, known by names alone (the
  core's torch floor, the JIT cache's names), so loading needs nothing of ``building/``.
"""
