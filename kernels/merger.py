"""LayerNorm and bias + GELU for the vision blocks and patch mergers.

Ops: ``torch.ops.qvl.layer_norm``, ``torch.ops.qvl.add_layer_norm`` (residual add fused with the next
norm), ``torch.ops.qvl.bias_gelu`` and its in-place twin ``torch.ops.qvl.bias_gelu_`` (the epilogue
of a bias-less fc1 GEMM). Plain-Python helpers :func:`patch_merger` and :func:`vision_mlp` compose them
with torch's matmuls into transformers' ``Qwen3VLVisionPatchMerger`` and ``Qwen3VLVisionMLP`` forwards,
with an ``all_reduce`` hook for fc1-column / fc2-row tensor parallelism.

All kernels are memory bound: each reads its inputs once and writes its outputs once, computing in fp32
and rounding once on the store. A LayerNorm program holds whole rows (``BLOCK_C = next_pow2(C)``), so
mean and variance come from one read of the row, with the variance taken over centered values (no
``E[x^2] - E[x]^2`` cancellation).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .common import FLOAT_DTYPES, FMA_CONTRACTION, backend_for, check_same_device, check_tensor, device_guard

__all__ = [
    "GELU_APPROXIMATIONS",
    "MAX_NORM_DIM",
    "add_layer_norm",
    "add_layer_norm_reference",
    "bias_gelu",
    "bias_gelu_",
    "bias_gelu_reference",
    "layer_norm",
    "layer_norm_reference",
    "patch_merger",
    "row_parallel_linear",
    "vision_mlp",
]

# A norm program keeps next_pow2(C) fp32 values per row in registers: 16384 over 16 warps is 32 per
# thread, the most that stays out of local memory. Qwen3-VL needs at most 4 * 1152 = 4608.
MAX_NORM_DIM = 16384
GELU_APPROXIMATIONS = ("none", "tanh")

_SQRT1_2 = tl.constexpr(0.7071067811865476)
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_GELU_KAPPA = tl.constexpr(0.044715)
_LOG2_E = tl.constexpr(1.4426950408889634)


# ----------------------------------------------------------------------------------------------------
# LayerNorm, optionally fed by a residual add.
# ----------------------------------------------------------------------------------------------------
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

    x = tl.load(X + rows[:, None] * stride_xm + offs_c[None, :], mask=mask, other=0.0)
    if HAS_DELTA:
        delta = tl.load(Delta + rows[:, None] * stride_dm + offs_c[None, :], mask=mask, other=0.0)
        # Round the sum to the residual dtype before normalizing, so the norm sees exactly the residual
        # that is stored (eager ``h = x + delta; norm(h)``), not a more precise sum.
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(Sum.dtype.element_ty)
        tl.store(Sum + rows[:, None] * stride_sm + offs_c[None, :], x, mask=mask)
    x = x.to(tl.float32)

    mean = tl.sum(x, axis=1) / num_cols
    # Padding columns would contribute mean^2 each to the variance: zero them.
    centered = tl.where(mask_c[None, :], x - mean[:, None], 0.0)
    var = tl.sum(centered * centered, axis=1) / num_cols
    rstd = tl.rsqrt(var + eps)

    weight = tl.load(Weight + offs_c, mask=mask_c, other=0.0).to(tl.float32)
    bias = tl.load(Bias + offs_c, mask=mask_c, other=0.0).to(tl.float32)
    y = centered * rstd[:, None] * weight[None, :] + bias[None, :]
    tl.store(Y + rows[:, None] * stride_ym + offs_c[None, :], y.to(Y.dtype.element_ty), mask=mask)


def _launch_layer_norm(x, delta, h, weight, bias, y, eps: float) -> None:
    """Normalize ``x`` (or ``h = x + delta``, stored, when ``delta`` is given) into ``y``."""
    num_rows, num_cols = x.shape
    if num_rows == 0:
        return
    block_c = triton.next_power_of_2(num_cols)
    # At least 4096 values per program, so narrow rows still give each thread enough loads in flight;
    # warps grow with wider rows to keep about 32 fp32 values per thread (MAX_NORM_DIM over 16 warps).
    block_m = max(1, 4096 // block_c)
    num_warps = min(16, max(4, block_m * block_c // 1024))
    has_delta = delta is not None
    grid = (triton.cdiv(num_rows, block_m),)
    with device_guard(x.device):
        _layer_norm_kernel[grid](
            x, delta if has_delta else x, h if has_delta else x, weight, bias, y,
            num_rows, num_cols,
            eps,
            x.stride(0), delta.stride(0) if has_delta else 0, h.stride(0) if has_delta else 0, y.stride(0),
            BLOCK_M=block_m, BLOCK_C=block_c, HAS_DELTA=has_delta,
            num_warps=num_warps,
            **FMA_CONTRACTION,
        )  # fmt: skip


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


def _check_norm_args(op: str, x, weight, bias, eps, delta=None) -> None:
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
    _check_norm_args("layer_norm", x, weight, bias, eps)
    if backend_for(x.device) == "torch":
        return layer_norm_reference(x, weight, bias, eps)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_layer_norm(x, None, None, weight, bias, y, eps)
    return y


@layer_norm.register_fake
def _(x, weight, bias, eps=1e-6):
    _check_norm_args("layer_norm", x, weight, bias, eps)
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
    _check_norm_args("add_layer_norm", x, weight, bias, eps, delta)
    if backend_for(x.device) == "torch":
        return add_layer_norm_reference(x, delta, weight, bias, eps)
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_layer_norm(x, delta, h, weight, bias, y, eps)
    return h, y


@add_layer_norm.register_fake
def _(x, delta, weight, bias, eps=1e-6):
    _check_norm_args("add_layer_norm", x, weight, bias, eps, delta)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty(x.shape, dtype=x.dtype, device=x.device)


# ----------------------------------------------------------------------------------------------------
# Bias + GELU: the epilogue of a bias-less GEMM.
# ----------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["num_rows"])
def _bias_gelu_kernel(
    # pointers
    X,
    Bias,
    Y,
    # sizes
    num_rows,
    num_cols,
    # strides (rows); the last dim is contiguous
    stride_xm,
    stride_ym,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    APPROXIMATE_TANH: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = cols < num_cols
    mask = (rows < num_rows)[:, None] & mask_n[None, :]

    x = tl.load(X + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
    bias = tl.load(Bias + cols, mask=mask_n, other=0.0)
    v = x.to(tl.float32) + bias.to(tl.float32)[None, :]
    if APPROXIMATE_TANH:
        # v * (1 + tanh(u)) / 2 == v * sigmoid(2u): one exp2 and no tanh (which the interpreter lacks),
        # and no cancellation in 1 + tanh(u) for u << 0. Overflow is benign: exp2 -> inf gives -0.
        u = v * (_SQRT_2_OVER_PI + (_SQRT_2_OVER_PI * _GELU_KAPPA) * v * v)
        y = v / (1.0 + tl.exp2(u * (-2.0 * _LOG2_E)))
    else:
        y = 0.5 * v * (1.0 + tl.math.erf(v * _SQRT1_2))
    tl.store(Y + rows[:, None] * stride_ym + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


def _launch_bias_gelu(x, bias, y, approximate: str) -> None:
    num_rows, num_cols = x.shape
    if x.numel() == 0:
        return
    block_n = min(1024, triton.next_power_of_2(num_cols))
    block_m = max(1, 4096 // block_n)
    # Row blocks on grid axis 0 (up to 2**31 - 1); axis 1 (column blocks) is capped at 65535.
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(num_cols, block_n))
    with device_guard(x.device):
        _bias_gelu_kernel[grid](
            x, bias, y,
            num_rows, num_cols,
            x.stride(0), y.stride(0),
            BLOCK_M=block_m, BLOCK_N=block_n, APPROXIMATE_TANH=approximate == "tanh",
            num_warps=4,
            **FMA_CONTRACTION,
        )  # fmt: skip


def bias_gelu_reference(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """Pure-torch ``gelu(x + bias)`` in fp32 (float64 stays float64), one rounding to x's dtype,
    returned contiguous."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = F.gelu(x.to(compute) + bias.to(compute), approximate=approximate)
    return y.to(x.dtype).contiguous()


def _check_bias_gelu_args(op: str, x, bias, approximate) -> None:
    check_tensor(op, "x", x, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    check_tensor(op, "bias", bias, ndim=1, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    if bias.shape[0] != x.shape[1]:
        raise ValueError(f"{op}: bias must have shape (F,) = ({x.shape[1]},), got {tuple(bias.shape)}")
    if bias.dtype != x.dtype:
        raise TypeError(f"{op}: bias must have x's dtype {x.dtype}, got {bias.dtype}")
    check_same_device(op, {"x": x, "bias": bias})
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"{op}: approximate must be one of {GELU_APPROXIMATIONS}, got {approximate!r}")


@torch.library.custom_op("qvl::bias_gelu", mutates_args=(), device_types=("cpu", "cuda"))
def bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``gelu(x + bias)``: the epilogue of a bias-less ``x = h @ W^T``.

    Args:
        x: ``(N, F)`` fp16/bf16/fp32, last dim contiguous (row stride free).
        bias: contiguous ``(F,)`` in x's dtype, on x's device.
        approximate: ``"none"`` (exact erf GELU, the patch mergers' ``nn.GELU()``) or ``"tanh"``
            (``gelu_pytorch_tanh``, the blocks' MLP).

    Returns a new contiguous ``(N, F)`` tensor in x's dtype. ``x + bias`` and the GELU are computed in
    fp32 and rounded once. Compared with eager ``F.gelu(F.linear(h, W, b))``, which rounds
    ``h @ W^T + b`` to the dtype before the GELU, the caller's bias-less GEMM rounds ``h @ W^T`` before
    the bias instead: results agree within one rounding of the dtype at the GELU's input (in fp32, within
    fp32 rounding). Nothing is mutated. Forward only.
    """
    _check_bias_gelu_args("bias_gelu", x, bias, approximate)
    if backend_for(x.device) == "torch":
        return bias_gelu_reference(x, bias, approximate)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_bias_gelu(x, bias, y, approximate)
    return y


@bias_gelu.register_fake
def _(x, bias, approximate="none"):
    _check_bias_gelu_args("bias_gelu", x, bias, approximate)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("qvl::bias_gelu_", mutates_args=("x",), device_types=("cpu", "cuda"))
def bias_gelu_(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> None:
    """In-place :func:`bias_gelu`: overwrites ``x`` with ``gelu(x + bias)`` where it lies (row-strided
    views included; ``bias`` must not overlap ``x``). Returns nothing."""
    _check_bias_gelu_args("bias_gelu_", x, bias, approximate)
    if backend_for(x.device) == "torch":
        x.copy_(bias_gelu_reference(x, bias, approximate))
        return
    _launch_bias_gelu(x, bias, x, approximate)


@bias_gelu_.register_fake
def _(x, bias, approximate="none"):
    _check_bias_gelu_args("bias_gelu_", x, bias, approximate)


# ----------------------------------------------------------------------------------------------------
# Module forwards (plain functions: torch.compile sees through them to the ops and matmuls).
# ----------------------------------------------------------------------------------------------------
AllReduce = Callable[[torch.Tensor], torch.Tensor]


def row_parallel_linear(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, all_reduce: AllReduce | None
) -> torch.Tensor:
    """``F.linear(h, weight, bias)``; with ``all_reduce``, ``weight`` holds this rank's input-feature
    columns, and the partial products are summed over ranks before the bias is added once."""
    if all_reduce is None:
        return F.linear(h, weight, bias)
    # Each rank holds a slice of the input features, so its product is a partial sum: reduce first,
    # then add the bias once.
    return all_reduce(F.linear(h, weight)) + bias


def patch_merger(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc1_bias: torch.Tensor,
    fc2_weight: torch.Tensor,
    fc2_bias: torch.Tensor,
    spatial_merge_size: int = 2,
    postshuffle_norm: bool = False,
    eps: float = 1e-6,
    all_reduce: AllReduce | None = None,
) -> torch.Tensor:
    """transformers' ``Qwen3VLVisionPatchMerger`` forward on qvl ops.

    Args:
        x: ``(N, C)`` hidden states in merge-block order (every ``m * m`` consecutive tokens form one
            block, ``m = spatial_merge_size``); N divisible by ``m * m``; viewable as ``(N / m^2, m^2 C)``.
        norm_weight, norm_bias: ``(C,)`` for the main merger (norm per token, then merge), or
            ``(m^2 C,)`` with ``postshuffle_norm=True`` (the deepstack mergers: merge, then norm).
        fc1_weight, fc1_bias: ``(F, m^2 C)`` and ``(F,)``; fc2_weight ``(out, F)``, fc2_bias ``(out,)``.
        all_reduce: for tensor parallelism, fc1 split by output features (each rank passes its rows of
            fc1_weight and fc1_bias, F = its slice) and fc2 by input features (its columns of
            fc2_weight); ``all_reduce`` maps the rank's partial fc2 product to the sum over ranks (e.g.
            ``lambda t: torch.distributed._functional_collectives.all_reduce(t, "sum", group)``), and the
            full fc2_bias is added once after it. None: no parallelism.

    Returns ``(N / m^2, out)`` in x's dtype: ``fc2(gelu(fc1(merge(norm(x)))))`` with exact-erf GELU.
    fc1 runs as a bias-less ``torch.mm`` followed by the in-place :func:`bias_gelu_` (see its rounding note).
    """
    group = spatial_merge_size * spatial_merge_size
    check_tensor("patch_merger", "x", x, ndim=2)
    if x.shape[0] % group != 0:
        raise ValueError(
            f"patch_merger: x's token count {x.shape[0]} must be divisible by spatial_merge_size**2 = {group}"
        )
    merged_width = x.shape[1] * group
    if postshuffle_norm:
        h = torch.ops.qvl.layer_norm(x.view(-1, merged_width), norm_weight, norm_bias, eps)
    else:
        h = torch.ops.qvl.layer_norm(x, norm_weight, norm_bias, eps).view(-1, merged_width)
    h = torch.mm(h, fc1_weight.t())
    torch.ops.qvl.bias_gelu_(h, fc1_bias, "none")
    return row_parallel_linear(h, fc2_weight, fc2_bias, all_reduce)


def vision_mlp(
    x: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc1_bias: torch.Tensor,
    fc2_weight: torch.Tensor,
    fc2_bias: torch.Tensor,
    all_reduce: AllReduce | None = None,
) -> torch.Tensor:
    """transformers' ``Qwen3VLVisionMLP`` forward on qvl ops: ``fc2(gelu_tanh(fc1(x)))``.

    Args:
        x: ``(N, C)``. fc1_weight ``(F, C)``, fc1_bias ``(F,)``, fc2_weight ``(C_out, F)``, fc2_bias
            ``(C_out,)``, all in x's dtype.
        all_reduce: tensor parallelism as in :func:`patch_merger` (fc1 column-, fc2 row-parallel; the
            partial fc2 product is reduced, then fc2_bias added once).

    Returns ``(N, C_out)`` in x's dtype. fc1 runs as a bias-less ``torch.mm`` followed by the in-place
    :func:`bias_gelu_` with ``approximate="tanh"``.
    """
    check_tensor("vision_mlp", "x", x, ndim=2)
    h = torch.mm(x, fc1_weight.t())
    torch.ops.qvl.bias_gelu_(h, fc1_bias, "tanh")
    return row_parallel_linear(h, fc2_weight, fc2_bias, all_reduce)
