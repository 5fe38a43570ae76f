"""The guarded ops under ``torch.func`` transforms and forward-mode AD.

The native ops differentiate through C++ autograd nodes (csrc/locked/linear/autograd.cpp),
the fast path for eager training. PyTorch refuses C++ autograd functions while
a functorch transform (``grad``, ``vjp``, ``jacrev``, ``jvp``, ``hessian``,
``vmap``) is active, and they have no forward-mode formula. In those cases
only, :mod:`cublas_guard_ext.ops` routes through the ``torch.autograd.Function``
classes below: the same native ops (the same checks, scans and typed errors),
with backward, jvp and a vmap rule written in Python. The vmap rules registered
for the native ops fold the vmapped dim into the op's own batch (or feature)
dims, so a vmapped call is one guarded GEMM wherever the math allows; a GEMM
whose both operands carry the vmapped dim (per-sample weight gradients) runs
once per sample.
"""

from __future__ import annotations

import threading

import torch
from torch.autograd import forward_ad as _forward_ad

from .._native.loading import codes as _codes

_ops = torch.ops.cublas_guard

_MODE_OFF = _codes.MODE_OFF
_ROLE_GRAD_OUTPUT = _codes.ROLE_GRAD_OUTPUT

_functorch_active = torch._C._are_functorch_transforms_active


def active() -> bool:
    """Whether a torch.func transform or a forward-AD dual level is active now."""
    return _functorch_active() or _forward_ad._current_level >= 0


class _ForwardDepth(threading.local):
    depth = 0


# Inside the forward of the Functions below, the only transform levels left are
# the vmap levels that generate_vmap_rule replays the forward under (grad and jvp
# levels are handled by the Function itself). The native ops' vmap rules then
# must call the native ops again, not the Functions: a Function applied there
# (hessian: two vmap levels in one forward) has no kernel for those levels.
_forward = _ForwardDepth()


def _differentiable() -> bool:
    return _forward.depth == 0 and active()


def _native_forward(op, *args):
    _forward.depth += 1
    try:
        return op(*args)
    finally:
        _forward.depth -= 1


# ---------------------------------------------------------------------------
# Entry points: the Python autograd path while transforms are active, the native
# (C++ autograd) op otherwise. Backward, jvp and the vmap rules call these, so
# every level of a nested transform sees a differentiable, batchable op.
# ---------------------------------------------------------------------------
def linear(x, weight, bias, layer: str, mode: int, scan_grad: bool) -> torch.Tensor:
    if _differentiable():
        return _Linear.apply(x, weight, bias, layer, mode, scan_grad)
    return _ops.linear.default(x, weight, bias, layer, mode, scan_grad)


def grad_input(grad_output, weight, layer: str) -> torch.Tensor:
    if _differentiable():
        return _GradInput.apply(grad_output, weight, layer)
    return _ops.linear_grad_input.default(grad_output, weight, layer)


def grad_weight(grad_output, x, layer: str) -> torch.Tensor:
    if _differentiable():
        return _GradWeight.apply(grad_output, x, layer)
    return _ops.linear_grad_weight.default(grad_output, x, layer)


def _add(total, term):
    if term is None:
        return total
    return term if total is None else total + term


def _bias_grad(grad: torch.Tensor) -> torch.Tensor:
    return grad.sum(tuple(range(grad.dim() - 1))) if grad.dim() > 1 else grad.clone()


class _Linear(torch.autograd.Function):
    """y = x W^T + b through the native op; backward and jvp through the native GEMM ops."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, weight, bias, layer, mode, scan_grad):
        return _native_forward(_ops.linear.default, x, weight, bias, layer, mode, scan_grad)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, layer, mode, scan_grad = inputs
        # Like nn.Linear (and the C++ node): dW reads x, dx reads W.
        ctx.save_for_backward(
            x if ctx.needs_input_grad[1] else None, weight if ctx.needs_input_grad[0] else None
        )
        ctx.save_for_forward(x, weight)
        ctx.layer = layer
        ctx.has_bias = bias is not None
        ctx.grad_mode = mode if scan_grad else _MODE_OFF

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        if ctx.grad_mode != _MODE_OFF:
            _ops.guard_values.default(grad, ctx.layer, _ROLE_GRAD_OUTPUT, ctx.grad_mode)
        grad_x = grad_input(grad, weight, ctx.layer) if ctx.needs_input_grad[0] else None
        grad_w = grad_weight(grad, x, ctx.layer) if ctx.needs_input_grad[1] else None
        grad_b = _bias_grad(grad) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None, None

    @staticmethod
    def jvp(ctx, x_t, weight_t, bias_t, *_):
        # d(x W^T + b) = dx W^T + x dW^T + db; tangents are not value-scanned
        # (as the gradients of double backward are not).
        x, weight = ctx.saved_tensors
        out = None
        if x_t is not None:
            out = linear(x_t, weight, None, ctx.layer, _MODE_OFF, False)
        if weight_t is not None:
            out = _add(out, linear(x, weight_t, None, ctx.layer, _MODE_OFF, False))
        if bias_t is not None:
            out = _add(out, bias_t.expand(*x.shape[:-1], weight.shape[0]))
        return out


def _bilinear_function(name: str, doc: str, op_name: str, product, grad_first, grad_second):
    """An autograd.Function for a native product p(a, b) that is linear in each operand.

    Both gradient ops are such products: gi = g W and gw = g^T x. Their backward formulas
    differ (``grad_first``/``grad_second`` take (a, b, dp, layer)); what they save, and their
    jvp, p(da, b) + p(a, db), do not.
    """

    def forward(a, b, layer):
        return _native_forward(getattr(_ops, op_name).default, a, b, layer)

    def setup_context(ctx, inputs, output):
        a, b, layer = inputs
        # The gradient of each operand reads only the other one.
        ctx.save_for_backward(a if ctx.needs_input_grad[1] else None, b if ctx.needs_input_grad[0] else None)
        ctx.save_for_forward(a, b)
        ctx.layer = layer

    def backward(ctx, dp):
        a, b = ctx.saved_tensors
        da = grad_first(a, b, dp, ctx.layer) if ctx.needs_input_grad[0] else None
        db = grad_second(a, b, dp, ctx.layer) if ctx.needs_input_grad[1] else None
        return da, db, None

    def jvp(ctx, a_t, b_t, _):
        a, b = ctx.saved_tensors
        out = product(a_t, b, ctx.layer) if a_t is not None else None
        if b_t is not None:
            out = _add(out, product(a, b_t, ctx.layer))
        return out

    members = {"forward": forward, "setup_context": setup_context, "backward": backward, "jvp": jvp}
    namespace = {name: staticmethod(fn) for name, fn in members.items()}
    return type(name, (torch.autograd.Function,), {"__doc__": doc, "generate_vmap_rule": True, **namespace})


# gi = g W:   dg = dgi W^T = linear(dgi, W);   dW = g^T dgi = grad_weight(g, dgi)
_GradInput = _bilinear_function(
    "_GradInput",
    "gi = g W (the input gradient), itself differentiable (double backward, hessian).",
    "linear_grad_input",
    lambda g, w, layer: grad_input(g, w, layer),
    grad_first=lambda g, w, dgi, layer: linear(dgi, w, None, layer, _MODE_OFF, False),
    grad_second=lambda g, w, dgi, layer: grad_weight(g, dgi, layer),
)
# gw = g^T x:   dg = x dgw^T = linear(x, dgw);   dx = g dgw = grad_input(g, dgw)
_GradWeight = _bilinear_function(
    "_GradWeight",
    "gw = g^T x (the weight gradient), itself differentiable.",
    "linear_grad_weight",
    lambda g, x, layer: grad_weight(g, x, layer),
    grad_first=lambda g, x, dgw, layer: linear(x, dgw, None, layer, _MODE_OFF, False),
    grad_second=lambda g, x, dgw, layer: grad_input(g, dgw, layer),
)


# ---------------------------------------------------------------------------
# vmap rules of the native ops. `info.batch_size` is B; a None in_dim means the
# operand is shared by every sample.
# ---------------------------------------------------------------------------
def _lowered(rule):
    """Run a vmap rule below its vmap level, so the calls in it see the outer levels only."""

    def run(info, in_dims, *args, **kwargs):
        from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter

        if _forward.depth:
            # In a Function's forward, replayed under vmap levels only: the calls
            # are native and torch's own lowering (FuncTorchBatched excluded) suffices.
            return rule(info, in_dims, *args, **kwargs)

        with retrieve_current_functorch_interpreter().lower():
            return rule(info, in_dims, *args, **kwargs)

    return run


def _front(t, dim):
    return t if dim is None or dim == 0 else t.movedim(dim, 0)


def _per_sample(info, fn, operands, in_dims):
    """fn once per sample (both GEMM operands are vmapped), stacked on dim 0."""
    outs = []
    for i in range(info.batch_size):
        args = [t if d is None or t is None else t.select(d, i) for t, d in zip(operands, in_dims)]
        outs.append(fn(*args))
    return torch.stack(outs), 0


def _linear_vmap(info, in_dims, x, weight, bias, layer="", mode=1, scan_grad=False):
    x_d, w_d, b_d = in_dims[0], in_dims[1], in_dims[2]
    if w_d is None and b_d is None:
        # The vmapped dim becomes one more batch dim of the input: one GEMM.
        return linear(_front(x, x_d), weight, bias, layer, mode, scan_grad), 0
    # Per-sample weights or bias (ensembles): one guarded GEMM per sample.
    return _per_sample(
        info,
        lambda xi, wi, bi: linear(xi, wi, bi, layer, mode, scan_grad),
        (x, weight, bias),
        (x_d, w_d, b_d),
    )


def _grad_input_vmap(info, in_dims, grad_output, weight, layer=""):
    g_d, w_d = in_dims[0], in_dims[1]
    if w_d is None:
        return grad_input(_front(grad_output, g_d), weight, layer), 0
    if g_d is None:
        # [B, out, in] -> [out, B*in]: one GEMM, its columns unflattened.
        n = info.batch_size
        w = _front(weight, w_d)
        in_f = w.shape[2]
        out = grad_input(grad_output, w.transpose(0, 1).reshape(w.shape[1], n * in_f), layer)
        out = out.unflatten(-1, (n, in_f))
        return out, out.dim() - 2
    return _per_sample(info, lambda gi, wi: grad_input(gi, wi, layer), (grad_output, weight), (g_d, w_d))


def _grad_weight_vmap(info, in_dims, grad_output, x, layer=""):
    g_d, x_d = in_dims[0], in_dims[1]
    n = info.batch_size
    if x_d is None:
        # The sample dim joins out_features: [..., B*out]^T x = [B*out, in].
        g = grad_output.movedim(g_d, -2).flatten(-2)
        return grad_weight(g, x, layer).unflatten(0, (n, -1)), 0
    if g_d is None:
        # The sample dim joins in_features: g^T [..., B*in] = [out, B*in].
        xs = x.movedim(x_d, -2).flatten(-2)
        return grad_weight(grad_output, xs, layer).unflatten(1, (n, -1)), 1
    # Per-sample weight gradients (vmap over grad): one GEMM per sample.
    return _per_sample(info, lambda gi, xi: grad_weight(gi, xi, layer), (grad_output, x), (g_d, x_d))


def _guard_values_vmap(info, in_dims, t, layer, role, mode):
    # Every sample is scanned: the whole batched tensor in one pass.
    _ops.guard_values.default(t, layer, role, mode)
    return None, None


def _check_features_vmap(info, in_dims, x, in_features, layer=""):
    (x_d,) = in_dims[:1]
    _ops.check_features.default(_front(x, x_d), in_features, layer)
    return None, None


torch.library.register_vmap("cublas_guard::linear", _lowered(_linear_vmap))
torch.library.register_vmap("cublas_guard::linear_grad_input", _lowered(_grad_input_vmap))
torch.library.register_vmap("cublas_guard::linear_grad_weight", _lowered(_grad_weight_vmap))
torch.library.register_vmap("cublas_guard::guard_values", _lowered(_guard_values_vmap))
torch.library.register_vmap("cublas_guard::check_features", _lowered(_check_features_vmap))
