"""What torch.ao's eager-mode quantization does to guarded layers, said once.

``quantize_dynamic``, ``prepare``/``convert``, ``prepare_qat``: each swaps modules by their exact
type (``type(m) in mapping``), and the quantized Linear's ``from_float`` refuses any other type.
A SafeLinear is an ``nn.Linear`` subclass, so it is left as it is: float, guarded, and silently
not quantized. The warning names the layers left and the way out (guarded_linear/
ao_quantization.py raises it when such a pass sets a qconfig on a guarded layer).
"""

from __future__ import annotations

QUANTIZATION_LEFT = (
    "torch.ao.quantization matches nn.Linear by its exact type, so it left {count} guarded "
    "layer(s) unquantized, in float: {names}. To quantize them, swap them back first: "
    "model = cublas_guard_ext.restore_linear(model), then quantize (the quantized layers run "
    "int8 kernels, not cuBLAS GEMMs: the guard has nothing to check there). To keep them "
    "guarded and float, leave them out of the qconfig (or ignore this warning)."
)


def quantization_left_message(names: list[str]) -> str:
    """The warning's text for the guarded layers ``names`` (the first 6 written out)."""
    shown = ", ".join(f"'{n}'" for n in names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    return QUANTIZATION_LEFT.format(count=len(names), names=shown or "(none named)")
