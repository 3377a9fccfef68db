"""RMSNorm for Qwen2.5-VL's vision blocks (``norm1``, ``norm2``) and patch merger (``ln_q``):
``torch.ops.qvl.rms_norm`` and ``torch.ops.qvl.add_rms_norm`` (a block's residual add fused with the next
norm).

transformers' ``Qwen2RMSNorm`` (``Qwen2_5_VLRMSNorm``, eps 1e-6 in the vision tower) computes::

    h = x.to(float32)
    h = h * rsqrt(h.pow(2).mean(-1) + eps)
    y = weight * h.to(x.dtype)

so the normalized row is rounded to x's dtype *before* the weight multiplies it, and the product is rounded
again. The kernel reproduces both roundings (in fp32 both are exact no-ops): it reads each row once,
computes the mean square in fp32, rounds ``x * rstd`` to the dtype, multiplies by the weight in fp32 and
rounds the product on the store, which is exactly how eager torch evaluates ``weight * h`` for two tensors
of one 16-bit dtype.

The kernel is LayerNorm's, run without centering (:func:`~qvl.kernels.layer_norm.norm_launches` with the
weight alone): memory bound, a program holding whole rows, the residual add fused into the row load; the
argument checks and the backward kernel and its launch (:func:`~qvl.kernels.layer_norm.norm_backward`) are
shared the same way.

Backward (``torch.ops.qvl.rms_norm_backward``, both ops' autograd formula) as LayerNorm's: ``dx`` per row in
fp32 in one kernel, ``dweight`` as per-program fp32 partial sums added in a fixed order afterwards
(deterministic), rstd recomputed from the row the backward reads anyway instead of saved by the forward
(see :mod:`qvl.kernels.layer_norm`). The weight multiplies the *rounded* normalized row, so ``dweight`` sums
``grad_y`` times that rounded row, the exact derivative of what the forward computes; ``dx`` treats the
rounding as the identity, as autograd does with transformers' ``.to(x.dtype)``.
"""

from __future__ import annotations

import torch
from triton.backends.compiler import GPUTarget

from .autocast import add_then_norm, follow_autocast, in_fp32
from .common import KernelLaunch, device_target, run_launches, runs_torch
from .layer_norm import MAX_NORM_DIM, check_norm_args, check_norm_backward_args, norm_backward, norm_launches
from .tiles import last_dim_contiguous

__all__ = [
    "MAX_NORM_DIM",
    "add_rms_norm",
    "add_rms_norm_reference",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_backward_reference",
    "rms_norm_launches",
    "rms_norm_reference",
]


def rms_norm_launches(x, delta, h, weight, y, eps: float, target: GPUTarget) -> list[KernelLaunch]:
    """:func:`~qvl.kernels.layer_norm.norm_launches` for RMSNorm: the launch RMS-normalizing ``x`` (or ``h = x +
    delta``, stored into ``h``, when ``delta`` is given) into ``y``."""
    return norm_launches(x, delta, h, (weight,), y, eps, target)


def _launch_rms_norm(x, delta, h, weight, y, eps: float) -> None:
    run_launches(rms_norm_launches(x, delta, h, weight, y, eps, device_target(x.device)), x.device)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Pure-torch ``Qwen2RMSNorm`` over the last dim: statistics and normalization in fp32 (float64 stays
    float64, the tests' ground truth), rounded to x's dtype, then ``weight *`` in x's dtype; returned
    contiguous. For a weight in x's dtype this is transformers' forward op for op."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = x.to(compute)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h.to(x.dtype)).contiguous()


def rms_norm_backward_reference(
    grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, grad_h: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch RMSNorm backward in fp32 (float64 stays float64): ``(dx (+ grad_h), dweight)`` in x's dtype,
    contiguous, by the formulas the kernel computes."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    h, dy = x.to(compute), grad_y.to(compute)
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    x_hat = h * rstd
    g = dy * weight.to(compute)
    dx = (g - x_hat * (g * x_hat).mean(-1, keepdim=True)) * rstd
    if grad_h is not None:
        dx = dx + grad_h.to(compute)
    dweight = (dy * x_hat.to(x.dtype).to(compute)).sum(0)
    return dx.to(x.dtype).contiguous(), dweight.to(x.dtype)


def add_rms_norm_reference(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch ``h = x + delta`` (rounded to x's dtype, as eager torch does) and ``rms_norm(h)``."""
    h = (x + delta).contiguous()
    return h, rms_norm_reference(h, weight, eps)


@torch.library.custom_op("qvl::rms_norm", mutates_args=(), device_types=("cpu", "cuda"))
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm of each row of ``x`` as transformers' ``Qwen2RMSNorm``:
    ``weight * (x / sqrt(mean(x^2) + eps)).to(x.dtype)``.

    Args:
        x: ``(N, C)`` fp16/bf16/fp32, last dim contiguous (row stride free). ``1 <= C <= MAX_NORM_DIM``;
            N may be 0.
        weight: contiguous ``(C,)`` in x's dtype (a checkpoint's parameters in the tower's dtype), on x's
            device. (transformers with an fp32 weight over 16-bit activations would return fp32: not
            supported; cast the weight.)
        eps: finite, > 0 (Qwen2.5-VL's vision tower uses 1e-6, transformers' default).

    Returns a new contiguous ``(N, C)`` tensor in x's dtype. The mean square and ``x * rstd`` in fp32,
    rounded to x's dtype, then the weight's product rounded again: the two roundings transformers makes
    (see the module docstring). Nothing is mutated. Differentiable in x and weight
    (:func:`rms_norm_backward`; saves x and weight).
    """
    check_norm_args("rms_norm", x, weight, None, eps)
    if runs_torch(x.device):
        return rms_norm_reference(x, weight, eps)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_rms_norm(x, None, None, weight, y, eps)
    return y


@rms_norm.register_fake
def _(x, weight, eps=1e-6):
    check_norm_args("rms_norm", x, weight, None, eps)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("qvl::add_rms_norm", mutates_args=(), device_types=("cpu", "cuda"))
def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add fused with the following RMSNorm: returns ``(h, rms_norm(h))`` with ``h = x + delta``.

    Args:
        x, delta: ``(N, C)`` of one dtype (fp16/bf16/fp32) and device, last dim contiguous (row strides
            free). ``1 <= C <= MAX_NORM_DIM``.
        weight, eps: as for :func:`rms_norm`.

    ``h`` is rounded to x's dtype exactly as eager ``x + delta`` rounds it (fp32 add, one rounding) and
    the norm is computed from that rounded ``h``, so the pair equals eager ``h = x + delta; norm(h)``
    within the norm's own rounding. Returns two new contiguous ``(N, C)`` tensors; nothing is mutated.
    One kernel reads x and delta once and writes h and the norm once. Differentiable in x, delta and weight
    (:func:`rms_norm_backward` with ``grad_h``; saves h and weight; x and delta get the same gradient).
    """
    check_norm_args("add_rms_norm", x, weight, None, eps, delta)
    if runs_torch(x.device):
        return add_rms_norm_reference(x, delta, weight, eps)
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_rms_norm(x, delta, h, weight, y, eps)
    return h, y


@add_rms_norm.register_fake
def _(x, delta, weight, eps=1e-6):
    check_norm_args("add_rms_norm", x, weight, None, eps, delta)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("qvl::rms_norm_backward", mutates_args=(), device_types=("cpu", "cuda"))
def rms_norm_backward(
    grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, grad_h: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward of :func:`rms_norm` (and, with ``grad_h``, of :func:`add_rms_norm`).

    Args:
        grad_y: ``(N, C)`` gradient of the norm's output, x's dtype, last dim contiguous (row stride free).
        x: the normalized ``(N, C)`` input (add_rms_norm's ``h``), checked as :func:`rms_norm` checks it.
        weight: ``(C,)`` in x's dtype. eps: the forward's.
        grad_h: None, or add_rms_norm's ``(N, C)`` gradient of ``h``, added to ``dx``.

    Returns new contiguous ``(dx (N, C), dweight (C,))`` in x's dtype, each rounded once from fp32: rstd
    recomputed from x as the forward computes it, ``dx = rstd * (g - x_hat * mean(g * x_hat)) (+ grad_h)``
    with ``g = grad_y * weight``, ``dweight = sum_rows grad_y * round(x_hat)`` (per-program fp32 partial sums
    added in a fixed order: deterministic). Nothing is mutated.
    """
    check_norm_backward_args("rms_norm_backward", grad_y, x, weight, eps, grad_h)
    if runs_torch(x.device):
        return rms_norm_backward_reference(grad_y, x, weight, eps, grad_h)
    return norm_backward(grad_y, x, weight, eps, grad_h, 1)


@rms_norm_backward.register_fake
def _(grad_y, x, weight, eps, grad_h=None):
    check_norm_backward_args("rms_norm_backward", grad_y, x, weight, eps, grad_h)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty_like(weight)


def _rms_norm_setup_context(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _rms_norm_backward(ctx, grad_y):
    x, weight = ctx.saved_tensors
    dx, dweight = rms_norm_backward(last_dim_contiguous(grad_y), x, weight, ctx.eps)
    return dx, dweight, None


rms_norm.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup_context)


def _add_rms_norm_setup_context(ctx, inputs, output):
    weight, eps = inputs[2], inputs[3]
    # The norm's input is the stored, rounded sum h: saved instead of x and delta.
    ctx.save_for_backward(output[0], weight)
    ctx.eps = eps


def _add_rms_norm_backward(ctx, grad_h, grad_y):
    h, weight = ctx.saved_tensors
    dh, dweight = rms_norm_backward(last_dim_contiguous(grad_y), h, weight, ctx.eps, last_dim_contiguous(grad_h))
    # d(x + delta)/dx = d(x + delta)/ddelta = 1: one tensor serves both (autograd copies before accumulating).
    return dh, dh, dweight, None


add_rms_norm.register_autograd(_add_rms_norm_backward, setup_context=_add_rms_norm_setup_context)
follow_autocast("rms_norm", in_fp32)
follow_autocast("add_rms_norm", add_then_norm(torch.ops.qvl.rms_norm.default))
follow_autocast("rms_norm_backward")
