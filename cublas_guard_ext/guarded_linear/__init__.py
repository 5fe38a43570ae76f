"""The guarded linear: SafeLinear and SafeConv1D (nn.py), the typed wrappers over
``torch.ops.cublas_guard`` with ``check()`` (ops.py), the guard modes and ``guard()``
(modes.py), and the path of the op under ``torch.func`` transforms (_transforms.py).

Not named ``linear/``: the package exports the function ``cublas_guard_ext.linear``, which
would hide a subpackage of that name.
"""
