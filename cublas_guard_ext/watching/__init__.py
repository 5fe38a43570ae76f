"""``watch``: which op and module first produced a NaN/Inf. session.py holds the public
``watch`` class and the findings it raises from the native side (csrc/locked/watch/);
global_patches.py the process-wide patches a block needs (``Tensor.backward``,
``torch.autograd.grad``, CUDA graph capture).

Not named ``watch/``: the public ``cublas_guard_ext.watch`` (the class) would hide it.
"""
