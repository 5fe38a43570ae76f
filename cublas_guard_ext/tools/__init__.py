"""The top layer: the command-line tools built on the public API.

``doctor`` (the environment checklist), ``demo``, ``bench``, and ``_minilm``
(the real model the demo and the watch benchmark use). Run them as
``python -m cublas_guard_ext doctor|demo|bench``; nothing below imports them.
"""
