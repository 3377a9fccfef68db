"""LayerNorm for the vision blocks and patch mergers: ``torch.ops.qvl.layer_norm`` and
``torch.ops.qvl.add_layer_norm`` (a block's residual add fused with the next norm).

The kernel is memory bound: it reads its inputs once and writes its outputs once, computing in fp32 and
rounding once on the store. A program holds whole rows (``BLOCK_C = next_pow2(C)``), so mean and
variance come from one read of the row, with the variance taken over centered values (no
``E[x^2] - E[x]^2`` cancellation).

The row blocking (:func:`launch_config`), the row load with the fused residual add (:func:`load_norm_rows`)
and the argument checks (:func:`check_norm_args`) are shared with RMSNorm (:mod:`qvl.kernels.rms_norm`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

from .common import (
    FLOAT_DTYPES,
    FMA_CONTRACTION,
    KernelLaunch,
    backend_for,
    check_same_device,
    check_tensor,
    device_target,
    run_launches,
)

__all__ = [
    "MAX_NORM_DIM",
    "add_layer_norm",
    "add_layer_norm_reference",
    "launch_config",
    "layer_norm",
    "layer_norm_launches",
    "layer_norm_reference",
]

# A norm program keeps next_pow2(C) fp32 values per row in registers: 16384 over 16 warps is 32 per
# thread, and wider rows would spill to local memory. Qwen3-VL needs at most 4 * 1152 = 4608.
MAX_NORM_DIM = 16384


@triton.jit
def load_norm_rows(X, Delta, Sum, rows, offs_c, mask, stride_xm, stride_dm, stride_sm, HAS_DELTA: tl.constexpr):
    """The ``(rows, offs_c)`` tile a norm normalizes, in fp32 (0 where ``mask`` is off): x's, or with
    ``HAS_DELTA`` the residual sum ``h = x + delta``, added in fp32, rounded to Sum's dtype and stored
    into Sum. The norm kernels (LayerNorm here, RMSNorm in :mod:`qvl.kernels.rms_norm`) share it."""
    x = tl.load(X + rows[:, None] * stride_xm + offs_c[None, :], mask=mask, other=0.0)
    if HAS_DELTA:
        delta = tl.load(Delta + rows[:, None] * stride_dm + offs_c[None, :], mask=mask, other=0.0)
        # Round the sum to the residual dtype before normalizing, so the norm sees exactly the residual
        # that is stored (eager ``h = x + delta; norm(h)``), not a more precise sum.
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(Sum.dtype.element_ty)
        tl.store(Sum + rows[:, None] * stride_sm + offs_c[None, :], x, mask=mask)
    return x.to(tl.float32)


@triton.jit(do_not_specialize=["num_rows"])
def _layer_norm_kernel(
    # pointers
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
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    mask_m = rows < num_rows
    offs_c = tl.arange(0, BLOCK_C)
    mask_c = offs_c < num_cols
    mask = mask_m[:, None] & mask_c[None, :]

    x = load_norm_rows(X, Delta, Sum, rows, offs_c, mask, stride_xm, stride_dm, stride_sm, HAS_DELTA)

    mean = tl.sum(x, axis=1) / num_cols
    # Padding columns would contribute mean^2 each to the variance: zero them.
    centered = tl.where(mask_c[None, :], x - mean[:, None], 0.0)
    var = tl.sum(centered * centered, axis=1) / num_cols
    rstd = tl.rsqrt(var + eps)

    weight = tl.load(Weight + offs_c, mask=mask_c, other=0.0).to(tl.float32)
    bias = tl.load(Bias + offs_c, mask=mask_c, other=0.0).to(tl.float32)
    y = centered * rstd[:, None] * weight[None, :] + bias[None, :]
    tl.store(Y + rows[:, None] * stride_ym + offs_c[None, :], y.to(Y.dtype.element_ty), mask=mask)


def launch_config(num_cols: int, has_delta: bool, target: GPUTarget) -> dict:
    """Everything the norm launch passes besides tensors and scalars, for rows of ``num_cols`` (with the
    residual add when ``has_delta``) on ``target``. Every target gets the same values (the interpreter
    ignores warps and options). RMSNorm (:mod:`qvl.kernels.rms_norm`) launches with the same values: its
    programs hold the same whole fp32 rows."""
    block_c = triton.next_power_of_2(num_cols)
    # At least 4096 values per program, so narrow rows still give each thread enough loads in flight;
    # warps grow with wider rows to keep about 32 fp32 values per thread (MAX_NORM_DIM over 16 warps).
    block_m = max(1, 4096 // block_c)
    num_warps = min(16, max(4, block_m * block_c // 1024))
    return dict(BLOCK_M=block_m, BLOCK_C=block_c, HAS_DELTA=has_delta, num_warps=num_warps, **FMA_CONTRACTION)


def layer_norm_launches(x, delta, h, weight, bias, y, eps: float, target: GPUTarget) -> list[KernelLaunch]:
    """The launch normalizing ``x`` (or ``h = x + delta``, stored into ``h``, when ``delta`` is given) into
    ``y``, for checked arguments; empty when x has no rows. Reads shapes and strides only (no device sync)."""
    num_rows, num_cols = x.shape
    if num_rows == 0:
        return []
    has_delta = delta is not None
    config = launch_config(num_cols, has_delta, target)
    grid = (triton.cdiv(num_rows, config["BLOCK_M"]),)
    args = (
        x, delta if has_delta else x, h if has_delta else x, weight, bias, y,
        num_rows, num_cols,
        eps,
        x.stride(0), delta.stride(0) if has_delta else 0, h.stride(0) if has_delta else 0, y.stride(0),
    )  # fmt: skip
    return [KernelLaunch(_layer_norm_kernel, grid, args, config)]


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
    Forward only (no autograd).
    """
    check_norm_args("layer_norm", x, weight, bias, eps)
    if backend_for(x.device) == "torch":
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
    One kernel reads x and delta once and writes h and the norm once. Forward only.
    """
    check_norm_args("add_layer_norm", x, weight, bias, eps, delta)
    if backend_for(x.device) == "torch":
        return add_layer_norm_reference(x, delta, weight, bias, eps)
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_layer_norm(x, delta, h, weight, bias, y, eps)
    return h, y


@add_layer_norm.register_fake
def _(x, delta, weight, bias, eps=1e-6):
    check_norm_args("add_layer_norm", x, weight, bias, eps, delta)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty(x.shape, dtype=x.dtype, device=x.device)
