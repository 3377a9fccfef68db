"""LayerNorm for the vision blocks and patch mergers: ``torch.ops.qvl.layer_norm`` and
``torch.ops.qvl.add_layer_norm`` (a block's residual add fused with the next norm).

The kernel is memory bound: it reads its inputs once and writes its outputs once, computing in fp32 and
rounding once on the store. A program holds whole rows (``BLOCK_C = next_pow2(C)``), so mean and
variance come from one read of the row, with the variance taken over centered values (no
``E[x^2] - E[x]^2`` cancellation).

RMSNorm (:mod:`qvl.kernels.rms_norm`) runs the same kernels: the forward (:func:`norm_launches`) and the
backward (:func:`norm_backward`) each have a ``CENTERED`` switch choosing LayerNorm's formulas or RMSNorm's,
and the row blocking (:func:`launch_config`), the row load with the fused residual add (:func:`load_norm_rows`)
and the argument checks (:func:`check_norm_args`) are shared too.

Backward (``torch.ops.qvl.layer_norm_backward``, registered as both ops' autograd formula): one kernel
computes ``dx`` per row in fp32 and sums ``dweight``/``dbias`` over each program's rows into fp32 partial
rows, which a second launch adds in a fixed order (:mod:`qvl.kernels.tiles`): no atomics, the same bits on
every run. The forward outputs no mean or rstd; the backward recomputes them from the row it has to read
anyway (``x``, or ``add_layer_norm``'s stored ``h``) with the forward's own arithmetic, which costs no memory
traffic, whereas saving them would make the inference forward write (and the op return) tensors that only
training reads.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

from .autocast import add_then_norm, follow_autocast, in_fp32
from .common import (
    FLOAT_DTYPES,
    FMA_CONTRACTION,
    KernelLaunch,
    backend_for,
    cached_config,
    cdiv,
    check_same_device,
    check_tensor,
    device_target,
    next_power_of_2,
    run_launches,
    runs_torch,
)
from .tiles import last_dim_contiguous, round_to, row_split, sum_partials_launch

__all__ = [
    "MAX_NORM_DIM",
    "add_layer_norm",
    "add_layer_norm_reference",
    "add_layer_norm_torch",
    "backward_launch_config",
    "check_norm_backward_args",
    "launch_config",
    "norm_backward",
    "norm_backward_launches",
    "norm_partials",
    "layer_norm",
    "layer_norm_backward",
    "layer_norm_backward_reference",
    "layer_norm_launches",
    "norm_launches",
    "layer_norm_reference",
    "layer_norm_torch",
]

# A norm program keeps next_pow2(C) fp32 values per row in registers: 16384 over 16 warps is 32 per
# thread, and wider rows would spill to local memory. Qwen3-VL needs at most 4 * 1152 = 4608.
MAX_NORM_DIM = 16384


@triton.jit
def load_norm_rows(X, Delta, Sum, rows, offs_c, mask, stride_xm, stride_dm, stride_sm, HAS_DELTA: tl.constexpr):
    """The ``(rows, offs_c)`` tile a norm normalizes, in fp32 (0 where ``mask`` is off): x's, or with
    ``HAS_DELTA`` the residual sum ``h = x + delta``, added in fp32, rounded to Sum's dtype and stored
    into Sum."""
    x = tl.load(X + rows[:, None] * stride_xm + offs_c[None, :], mask=mask, other=0.0)
    if HAS_DELTA:
        delta = tl.load(Delta + rows[:, None] * stride_dm + offs_c[None, :], mask=mask, other=0.0)
        # Round the sum to the residual dtype before normalizing, so the norm sees exactly the residual
        # that is stored (eager ``h = x + delta; norm(h)``), not a more precise sum.
        x = round_to(x.to(tl.float32) + delta.to(tl.float32), Sum.dtype.element_ty)
        tl.store(Sum + rows[:, None] * stride_sm + offs_c[None, :], x, mask=mask)
    return x.to(tl.float32)


@triton.jit(do_not_specialize=["num_rows"])
def _norm_kernel(
    # pointers (Bias is read only when CENTERED)
    X,
    Delta,
    Sum,
    Weight,
    Bias,
    Y,
    # sizes
    num_rows,
    num_cols,
    # scalars
    eps,
    # strides (rows); the last dim is contiguous
    stride_xm,
    stride_dm,
    stride_sm,
    stride_ym,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    CENTERED: tl.constexpr,
):
    """LayerNorm (``CENTERED``: mean and variance, ``* weight + bias``, one rounding) or transformers' RMSNorm
    (root mean square, the normalized row rounded to Y's dtype, then ``weight *``) of a block of rows."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    mask_m = rows < num_rows
    offs_c = tl.arange(0, BLOCK_C)
    mask_c = offs_c < num_cols
    mask = mask_m[:, None] & mask_c[None, :]

    # Padding columns load as 0: they add nothing to the sums below.
    x = load_norm_rows(X, Delta, Sum, rows, offs_c, mask, stride_xm, stride_dm, stride_sm, HAS_DELTA)
    weight = tl.load(Weight + offs_c, mask=mask_c, other=0.0).to(tl.float32)
    if CENTERED:
        mean = tl.sum(x, axis=1) / num_cols
        # Padding columns would contribute mean^2 each to the variance: zero them.
        centered = tl.where(mask_c[None, :], x - mean[:, None], 0.0)
        var = tl.sum(centered * centered, axis=1) / num_cols
        rstd = tl.rsqrt(var + eps)
        bias = tl.load(Bias + offs_c, mask=mask_c, other=0.0).to(tl.float32)
        y = centered * rstd[:, None] * weight[None, :] + bias[None, :]
    else:
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / num_cols + eps)
        # transformers rounds the normalized row to the input dtype, then multiplies by the weight.
        normed = round_to(x * rstd[:, None], Y.dtype.element_ty).to(tl.float32)
        y = weight[None, :] * normed
    tl.store(Y + rows[:, None] * stride_ym + offs_c[None, :], round_to(y, Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_rows", "blocks_per_program"])
def _norm_backward_kernel(
    # pointers
    X,
    Weight,
    DY,
    DH,
    DX,
    Partials,
    # sizes
    num_rows,
    num_cols,
    blocks_per_program,
    # scalars
    eps,
    # strides (rows; the partials' K dim); the last dims are contiguous
    stride_xm,
    stride_dym,
    stride_dhm,
    stride_dxm,
    stride_pk,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    CENTERED: tl.constexpr,
):
    """LayerNorm's backward when ``CENTERED`` (partial rows of dweight and dbias), else RMSNorm's (dweight only,
    summed over the rounded normalized row its forward multiplies by the weight)."""
    pid = tl.program_id(0)
    offs_c = tl.arange(0, BLOCK_C)
    mask_c = offs_c < num_cols
    weight = tl.load(Weight + offs_c, mask=mask_c, other=0.0).to(tl.float32)
    dweight = tl.zeros((BLOCK_C,), dtype=tl.float32)
    dbias = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for block in range(0, blocks_per_program):
        rows = (pid * blocks_per_program + block).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (rows < num_rows)[:, None] & mask_c[None, :]
        # The forward's statistics, recomputed exactly as the forward kernels compute them.
        x = tl.load(X + rows[:, None] * stride_xm + offs_c[None, :], mask=mask, other=0.0).to(tl.float32)
        if CENTERED:
            mean = tl.sum(x, axis=1) / num_cols
            x = tl.where(mask_c[None, :], x - mean[:, None], 0.0)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / num_cols + eps)
        x_hat = x * rstd[:, None]
        dy = tl.load(DY + rows[:, None] * stride_dym + offs_c[None, :], mask=mask, other=0.0).to(tl.float32)
        # dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat)), g = dy * weight (0 in padding and masked rows);
        # RMSNorm's has no mean(g) term (its forward subtracts no mean).
        g = dy * weight[None, :]
        dx = g
        if CENTERED:
            dx -= (tl.sum(g, axis=1) / num_cols)[:, None]
        dx = (dx - x_hat * (tl.sum(g * x_hat, axis=1) / num_cols)[:, None]) * rstd[:, None]
        if HAS_DELTA:
            # add_*_norm's backward: h = x + delta also reaches the loss directly, through grad_h.
            dx += tl.load(DH + rows[:, None] * stride_dhm + offs_c[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + rows[:, None] * stride_dxm + offs_c[None, :], round_to(dx, DX.dtype.element_ty), mask=mask)
        if CENTERED:
            dweight += tl.sum(dy * x_hat, axis=0)
            dbias += tl.sum(dy, axis=0)
        else:
            dweight += tl.sum(dy * round_to(x_hat, DX.dtype.element_ty).to(tl.float32), axis=0)
    partial = Partials + pid.to(tl.int64) * num_cols + offs_c
    tl.store(partial, dweight, mask=mask_c)
    if CENTERED:
        tl.store(partial + stride_pk, dbias, mask=mask_c)


@cached_config
def launch_config(num_cols: int, has_delta: bool, target: GPUTarget) -> dict:
    """Everything the norm launch passes besides tensors and scalars, for rows of ``num_cols`` (with the
    residual add when ``has_delta``) on ``target``. Every target gets the same values (the interpreter
    ignores warps and options). RMSNorm (:mod:`qvl.kernels.rms_norm`) launches with the same values: its
    programs hold the same whole fp32 rows."""
    block_c = next_power_of_2(num_cols)
    # At least 4096 values per program, so narrow rows still give each thread enough loads in flight;
    # warps grow with wider rows to keep about 32 fp32 values per thread (MAX_NORM_DIM over 16 warps).
    block_m = max(1, 4096 // block_c)
    num_warps = min(16, max(4, block_m * block_c // 1024))
    return dict(BLOCK_M=block_m, BLOCK_C=block_c, HAS_DELTA=has_delta, num_warps=num_warps, **FMA_CONTRACTION)


def norm_launches(
    x, delta, h, params: tuple[torch.Tensor, ...], y, eps: float, target: GPUTarget
) -> list[KernelLaunch]:
    """The launch normalizing ``x`` (or ``h = x + delta``, stored into ``h``, when ``delta`` is given) into ``y``
    for checked arguments: LayerNorm when ``params`` is ``(weight, bias)``, RMSNorm when it is ``(weight,)``.
    Empty when x has no rows. Reads shapes and strides only (no device sync)."""
    num_rows, num_cols = x.shape
    if num_rows == 0:
        return []
    has_delta = delta is not None
    config = launch_config(num_cols, has_delta, target)
    grid = (cdiv(num_rows, config["BLOCK_M"]),)
    args = dict(
        # pointers (Delta and Sum are x where there is no residual add; Bias is the weight for RMSNorm)
        X=x,
        Delta=delta if has_delta else x,
        Sum=h if has_delta else x,
        Weight=params[0],
        Bias=params[-1],
        Y=y,
        # sizes
        num_rows=num_rows,
        num_cols=num_cols,
        # scalars
        eps=eps,
        # strides
        stride_xm=x.stride(0),
        stride_dm=delta.stride(0) if has_delta else 0,
        stride_sm=h.stride(0) if has_delta else 0,
        stride_ym=y.stride(0),
    )
    return [KernelLaunch(_norm_kernel, grid, args, dict(config, CENTERED=len(params) == 2))]


def layer_norm_launches(x, delta, h, weight, bias, y, eps: float, target: GPUTarget) -> list[KernelLaunch]:
    """:func:`norm_launches` for LayerNorm."""
    return norm_launches(x, delta, h, (weight, bias), y, eps, target)


def backward_launch_config(num_rows: int, num_cols: int, has_delta: bool, target: GPUTarget) -> dict:
    """Everything the norm backward launch passes besides tensors and scalars (``blocks_per_program``
    included), and ``programs``, the grid's size: the forward's row blocking (:func:`launch_config`) split over
    programs by :func:`~qvl.kernels.tiles.row_split`. The backward holds about five fp32 tiles of the block
    where the forward holds two, so it gets twice the forward's warps (up to 16) to keep them in registers.
    RMSNorm's backward launches with the same values."""
    config = launch_config(num_cols, has_delta, target)
    programs, blocks_per_program = row_split(num_rows, config["BLOCK_M"])
    config["num_warps"] = min(16, 2 * config["num_warps"])
    return dict(config, programs=programs, blocks_per_program=blocks_per_program)


def norm_partials(x: torch.Tensor, num_params: int) -> torch.Tensor:
    """The fp32 ``(num_params, programs, C)`` partial-sum rows a norm backward over ``x`` writes (uninitialized:
    every program writes its whole row)."""
    config = backward_launch_config(x.shape[0], x.shape[1], False, device_target(x.device))
    return torch.empty((num_params, config["programs"], x.shape[1]), dtype=torch.float32, device=x.device)


def norm_backward_launches(
    grad_y, x, weight, grad_h, dx, partials, param_grads: tuple[torch.Tensor, ...], eps: float, target: GPUTarget
) -> list[KernelLaunch]:
    """The launches of a norm's backward for checked arguments: LayerNorm's when ``param_grads`` is
    ``(dweight, dbias)``, RMSNorm's when it is ``(dweight,)``. One kernel writes ``dx`` (x's shape and dtype)
    and the fp32 ``partials`` (:func:`norm_partials` with ``len(param_grads)`` rows), a second reduces them into
    ``param_grads``. ``x`` is the normalized input (add_*_norm's stored ``h``); ``grad_h`` (or None) is added to
    ``dx``. Mutates dx, partials and param_grads; empty when x has no rows. Reads shapes and strides only (no
    device sync)."""
    num_rows, num_cols = x.shape
    if num_rows == 0:
        return []
    has_delta = grad_h is not None
    config = backward_launch_config(num_rows, num_cols, has_delta, target)
    grid = (config.pop("programs"),)
    args = dict(
        # pointers (DH is grad_y where there is no residual add)
        X=x,
        Weight=weight,
        DY=grad_y,
        DH=grad_h if has_delta else grad_y,
        DX=dx,
        Partials=partials,
        # sizes
        num_rows=num_rows,
        num_cols=num_cols,
        blocks_per_program=config.pop("blocks_per_program"),
        # scalars
        eps=eps,
        # strides
        stride_xm=x.stride(0),
        stride_dym=grad_y.stride(0),
        stride_dhm=grad_h.stride(0) if has_delta else 0,
        stride_dxm=dx.stride(0),
        stride_pk=partials.stride(0),
    )
    kernel = KernelLaunch(_norm_backward_kernel, grid, args, dict(config, CENTERED=len(param_grads) == 2))
    return [kernel, sum_partials_launch(partials, param_grads)]


def norm_backward(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    grad_h: torch.Tensor | None,
    num_params: int,
) -> tuple[torch.Tensor, ...]:
    """The kernels' ``(dx, *param_grads)`` of a norm over checked arguments, new tensors in x's dtype: LayerNorm's
    (``dweight, dbias``) with ``num_params`` 2, RMSNorm's (``dweight``) with 1 (:func:`norm_backward_launches`)."""
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    # With no rows nothing is launched and the parameter gradients are zeros.
    new_param = torch.empty_like if x.shape[0] else torch.zeros_like
    param_grads = tuple(new_param(weight) for _ in range(num_params))
    partials = norm_partials(x, num_params)
    launches = norm_backward_launches(
        grad_y, x, weight, grad_h, dx, partials, param_grads, eps, device_target(x.device)
    )
    run_launches(launches, x.device)
    return dx, *param_grads


def _launch_layer_norm(x, delta, h, weight, bias, y, eps: float) -> None:
    target = device_target(x.device)
    run_launches(layer_norm_launches(x, delta, h, weight, bias, y, eps, target), x.device)


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Pure-torch LayerNorm over the last dim in fp32 (float64 stays float64, the tests' ground truth),
    returned contiguous in x's dtype."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = F.layer_norm(x.to(compute), (x.shape[-1],), weight.to(compute), bias.to(compute), eps)
    return y.to(x.dtype).contiguous()


def add_layer_norm_reference(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch ``h = x + delta`` (rounded to x's dtype, as eager torch does) and ``layer_norm(h)``."""
    h = (x + delta).contiguous()
    return h, layer_norm_reference(h, weight, bias, eps)


def layer_norm_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """LayerNorm on the ops' torch path: torch's own ``F.layer_norm`` in x's dtype, as ``nn.LayerNorm`` runs. For
    16-bit x torch takes the statistics in fp32 without an fp32 copy of x, and may round ``x_hat * weight`` before
    adding the bias (one more rounding than :func:`layer_norm_reference`, the one transformers' towers make too).
    Returns a new contiguous tensor."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def add_layer_norm_torch(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`add_layer_norm` on the ops' torch path: ``h = x + delta`` as eager torch rounds it, and
    :func:`layer_norm_torch` of it."""
    h = (x + delta).contiguous()
    return h, layer_norm_torch(h, weight, bias, eps)


def layer_norm_backward_reference(
    grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, grad_h: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pure-torch LayerNorm backward in fp32 (float64 stays float64): ``(dx (+ grad_h), dweight, dbias)`` in
    x's dtype, contiguous, by the formulas the kernel computes."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    h, dy = x.to(compute), grad_y.to(compute)
    centered = h - h.mean(-1, keepdim=True)
    rstd = torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + eps)
    x_hat = centered * rstd
    g = dy * weight.to(compute)
    dx = (g - g.mean(-1, keepdim=True) - x_hat * (g * x_hat).mean(-1, keepdim=True)) * rstd
    if grad_h is not None:
        dx = dx + grad_h.to(compute)
    return dx.to(x.dtype).contiguous(), (dy * x_hat).sum(0).to(x.dtype), dy.sum(0).to(x.dtype)


def _check_eps(op: str, eps: object) -> None:
    if not isinstance(eps, (int, float)) or isinstance(eps, bool):
        raise TypeError(f"{op}: eps must be a float, got {type(eps).__name__}")
    if not (eps > 0 and math.isfinite(eps)):
        raise ValueError(f"{op}: eps must be a finite number > 0, got {eps}")


def check_norm_args(op: str, x, weight, bias, eps, delta=None) -> None:
    """The norm ops' argument checks (LayerNorm's and RMSNorm's, which passes ``bias=None``): x and delta
    ``(N, C)`` of one float dtype, last dim contiguous, ``1 <= C <= MAX_NORM_DIM``; weight (and bias)
    contiguous ``(C,)`` in x's dtype; all on x's device; eps finite and > 0."""
    check_tensor(op, "x", x, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    named = {"x": x}
    if delta is not None:
        check_tensor(op, "delta", delta, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
        if delta.shape != x.shape:
            raise ValueError(f"{op}: delta must have x's shape {tuple(x.shape)}, got {tuple(delta.shape)}")
        if delta.dtype != x.dtype:
            raise TypeError(f"{op}: delta must have x's dtype {x.dtype}, got {delta.dtype}")
        named["delta"] = delta
    num_cols = x.shape[1]
    if not 0 < num_cols <= MAX_NORM_DIM:
        raise ValueError(f"{op}: x's normalized dim C = x.shape[1] must be in 1..{MAX_NORM_DIM}, got {num_cols}")
    for name, param in (("weight", weight), ("bias", bias)):
        if param is None and name == "bias":
            continue
        check_tensor(op, name, param, ndim=1, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
        if param.shape[0] != num_cols:
            raise ValueError(f"{op}: {name} must have shape (C,) = ({num_cols},), got {tuple(param.shape)}")
        if param.dtype != x.dtype:
            raise TypeError(f"{op}: {name} must have x's dtype {x.dtype}, got {param.dtype}")
        named[name] = param
    check_same_device(op, named)
    _check_eps(op, eps)


def check_norm_backward_args(op: str, grad_y, x, weight, eps, grad_h=None) -> None:
    """The norm backward ops' argument checks: x, weight and eps as the forward checks them; grad_y (and
    grad_h) of x's shape and dtype on x's device, last dim contiguous (row strides free)."""
    check_norm_args(op, x, weight, None, eps)
    named = {"x": x}
    for name, grad in (("grad_y", grad_y), ("grad_h", grad_h)):
        if grad is None and name == "grad_h":
            continue
        check_tensor(op, name, grad, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
        if grad.shape != x.shape:
            raise ValueError(f"{op}: {name} must have x's shape {tuple(x.shape)}, got {tuple(grad.shape)}")
        if grad.dtype != x.dtype:
            raise TypeError(f"{op}: {name} must have x's dtype {x.dtype}, got {grad.dtype}")
        named[name] = grad
    check_same_device(op, named)


@torch.library.custom_op("qvl::layer_norm", mutates_args=(), device_types=("cpu", "cuda"))
def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """LayerNorm of each row of ``x``: ``(x - mean) / sqrt(var + eps) * weight + bias`` (biased variance).

    Args:
        x: ``(N, C)`` fp16/bf16/fp32, last dim contiguous (row stride free). ``1 <= C <= MAX_NORM_DIM``;
            N may be 0.
        weight, bias: contiguous ``(C,)`` in x's dtype, on x's device.
        eps: finite, > 0 (Qwen3-VL uses 1e-6).

    Returns a new contiguous ``(N, C)`` tensor in x's dtype. Mean and variance (of the centered values)
    in fp32, as ``torch.nn.LayerNorm`` computes them; one rounding on the output. Nothing is mutated.
    Differentiable in x, weight and bias (:func:`layer_norm_backward`; saves x and weight).
    """
    check_norm_args("layer_norm", x, weight, bias, eps)
    backend = backend_for(x.device)
    if backend == "torch":
        return layer_norm_torch(x, weight, bias, eps)
    if backend == "reference":
        return layer_norm_reference(x, weight, bias, eps)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_layer_norm(x, None, None, weight, bias, y, eps)
    return y


@layer_norm.register_fake
def _(x, weight, bias, eps=1e-6):
    check_norm_args("layer_norm", x, weight, bias, eps)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("qvl::add_layer_norm", mutates_args=(), device_types=("cpu", "cuda"))
def add_layer_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add fused with the following LayerNorm: returns ``(h, layer_norm(h))`` with ``h = x + delta``.

    Args:
        x, delta: ``(N, C)`` of one dtype (fp16/bf16/fp32) and device, last dim contiguous (row strides
            free). ``1 <= C <= MAX_NORM_DIM``.
        weight, bias, eps: as for :func:`layer_norm`.

    ``h`` is rounded to x's dtype exactly as eager ``x + delta`` rounds it (fp32 add, one rounding) and
    the norm is computed from that rounded ``h``, so the pair equals eager ``h = x + delta; norm(h)``
    within the norm's own rounding. Returns two new contiguous ``(N, C)`` tensors; nothing is mutated.
    One kernel reads x and delta once and writes h and the norm once. Differentiable in x, delta, weight and
    bias (:func:`layer_norm_backward` with ``grad_h``; saves h and weight; x and delta get the same gradient).
    """
    check_norm_args("add_layer_norm", x, weight, bias, eps, delta)
    backend = backend_for(x.device)
    if backend == "torch":
        return add_layer_norm_torch(x, delta, weight, bias, eps)
    if backend == "reference":
        return add_layer_norm_reference(x, delta, weight, bias, eps)
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_layer_norm(x, delta, h, weight, bias, y, eps)
    return h, y


@add_layer_norm.register_fake
def _(x, delta, weight, bias, eps=1e-6):
    check_norm_args("add_layer_norm", x, weight, bias, eps, delta)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("qvl::layer_norm_backward", mutates_args=(), device_types=("cpu", "cuda"))
def layer_norm_backward(
    grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, grad_h: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`layer_norm` (and, with ``grad_h``, of :func:`add_layer_norm`).

    Args:
        grad_y: ``(N, C)`` gradient of the norm's output, x's dtype, last dim contiguous (row stride free).
        x: the normalized ``(N, C)`` input (add_layer_norm's ``h``), checked as :func:`layer_norm` checks it.
        weight: ``(C,)`` in x's dtype. eps: the forward's.
        grad_h: None, or add_layer_norm's ``(N, C)`` gradient of ``h``, added to ``dx``.

    Returns new contiguous ``(dx (N, C), dweight (C,), dbias (C,))`` in x's dtype, each rounded once from fp32:
    mean and rstd recomputed from x as the forward computes them,
    ``dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat)) (+ grad_h)`` with ``g = grad_y * weight``,
    ``dweight = sum_rows grad_y * x_hat``, ``dbias = sum_rows grad_y`` (per-program fp32 partial sums added in
    a fixed order: deterministic). Nothing is mutated.
    """
    check_norm_backward_args("layer_norm_backward", grad_y, x, weight, eps, grad_h)
    if runs_torch(x.device):
        return layer_norm_backward_reference(grad_y, x, weight, eps, grad_h)
    return norm_backward(grad_y, x, weight, eps, grad_h, 2)


@layer_norm_backward.register_fake
def _(grad_y, x, weight, eps, grad_h=None):
    check_norm_backward_args("layer_norm_backward", grad_y, x, weight, eps, grad_h)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty_like(weight), torch.empty_like(weight)


def _layer_norm_setup_context(ctx, inputs, output):
    x, weight, _, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _layer_norm_backward(ctx, grad_y):
    x, weight = ctx.saved_tensors
    dx, dweight, dbias = layer_norm_backward(last_dim_contiguous(grad_y), x, weight, ctx.eps)
    return dx, dweight, dbias, None


layer_norm.register_autograd(_layer_norm_backward, setup_context=_layer_norm_setup_context)


def _add_layer_norm_setup_context(ctx, inputs, output):
    weight, eps = inputs[2], inputs[4]
    # The norm's input is the stored, rounded sum h: saved instead of x and delta.
    ctx.save_for_backward(output[0], weight)
    ctx.eps = eps


def _add_layer_norm_backward(ctx, grad_h, grad_y):
    h, weight = ctx.saved_tensors
    grad_h, grad_y = last_dim_contiguous(grad_h), last_dim_contiguous(grad_y)
    dh, dweight, dbias = layer_norm_backward(grad_y, h, weight, ctx.eps, grad_h)
    # d(x + delta)/dx = d(x + delta)/ddelta = 1: one tensor serves both (autograd copies before accumulating).
    return dh, dh, dweight, dbias, None


add_layer_norm.register_autograd(_add_layer_norm_backward, setup_context=_add_layer_norm_setup_context)
follow_autocast("layer_norm", in_fp32)
follow_autocast("add_layer_norm", add_then_norm(torch.ops.qvl.layer_norm.default))
follow_autocast("layer_norm_backward")
