"""Biases + SwiGLU, the epilogue of Qwen2.5-VL's vision MLP after its two bias-less GEMMs:
``torch.ops.qvl.bias_swiglu``.

transformers' ``Qwen2_5_VLMLP(config, bias=True)`` computes
``down_proj(silu(gate_proj(x)) * up_proj(x))`` (``hidden_act="silu"``). qvl runs ``gate_proj`` and
``up_proj`` as bias-less GEMMs (or one GEMM over the stacked weights) and this kernel does the rest before
``down_proj``: it reads the two GEMM outputs and the two biases once and writes the product once, computing
in fp32 and rounding once on the store. It is the bias + GELU epilogue's sibling and shares its tiling
(:func:`qvl.kernels.tiles.row_tiles`) and sigmoid (:func:`qvl.kernels.tiles.times_sigmoid`).

Why two ``(N, F)`` arguments rather than one ``(N, 2F)``: both take free row strides, so a caller that runs
one GEMM over ``[W_gate; W_up]`` passes the two column halves of its ``(N, 2F)`` output as views (row
stride 2F) without a copy, and a caller that runs two GEMMs (or shards gate and up separately across
tensor-parallel ranks) passes two tensors. A single ``(N, 2F)`` argument would impose the stacked layout on
every caller.

Backward (``torch.ops.qvl.bias_swiglu_backward``, the op's autograd formula): one kernel recomputes
``g = gate + gate_bias`` and ``u = up + up_bias`` from the saved inputs (the output is not saved: it is not
part of the derivative), writes ``d_gate = dy * u * silu'(g)`` and ``d_up = dy * silu(g)`` and sums both over
each program's rows into fp32 partial rows, which a second launch adds in a fixed order into the two bias
gradients (:mod:`qvl.kernels.tiles`: no atomics, deterministic).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

from .autocast import follow_autocast, in_autocast_dtype
from .common import (
    FLOAT_DTYPES,
    KernelLaunch,
    cdiv,
    check_same_device,
    check_tensor,
    device_target,
    run_launches,
    runs_torch,
)
from .tiles import (
    aligned_view,
    epilogue_backward_config,
    last_dim_contiguous,
    round_to,
    row_tiles,
    row_vector,
    sum_partials_launch,
    times_sigmoid,
    vector_multiple,
)

__all__ = [
    "bias_swiglu",
    "bias_swiglu_backward",
    "bias_swiglu_backward_launches",
    "bias_swiglu_backward_reference",
    "bias_swiglu_launches",
    "bias_swiglu_reference",
    "launch_config",
]


@triton.jit(do_not_specialize=["num_rows"])
def _bias_swiglu_kernel(
    # pointers
    Gate,
    Up,
    GateBias,
    UpBias,
    Y,
    # sizes
    num_rows,
    num_cols,
    # strides (rows); the last dim is contiguous
    stride_gm,
    stride_um,
    stride_ym,
    # meta-parameters: VEC elements divide num_cols and the row strides (row_vector); the four inputs start
    # SHIFT_* elements past the pointers passed (aligned_view: see _shifted_inputs)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    VEC: tl.constexpr,
    SHIFT_GATE: tl.constexpr,
    SHIFT_UP: tl.constexpr,
    SHIFT_GATE_BIAS: tl.constexpr,
    SHIFT_UP_BIAS: tl.constexpr,
):
    Gate, Up = Gate + SHIFT_GATE, Up + SHIFT_UP
    GateBias, UpBias = GateBias + SHIFT_GATE_BIAS, UpBias + SHIFT_UP_BIAS
    num_cols = vector_multiple(num_cols, VEC)
    stride_gm, stride_um = vector_multiple(stride_gm, VEC), vector_multiple(stride_um, VEC)
    stride_ym = vector_multiple(stride_ym, VEC)
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = cols < num_cols
    mask = (rows < num_rows)[:, None] & mask_n[None, :]

    gate = tl.load(Gate + rows[:, None] * stride_gm + cols[None, :], mask=mask, other=0.0)
    up = tl.load(Up + rows[:, None] * stride_um + cols[None, :], mask=mask, other=0.0)
    gate_bias = tl.load(GateBias + cols, mask=mask_n, other=0.0)
    up_bias = tl.load(UpBias + cols, mask=mask_n, other=0.0)
    g = gate.to(tl.float32) + gate_bias.to(tl.float32)[None, :]
    u = up.to(tl.float32) + up_bias.to(tl.float32)[None, :]
    y = times_sigmoid(g, g) * u
    tl.store(Y + rows[:, None] * stride_ym + cols[None, :], round_to(y, Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_rows", "blocks_per_program"])
def _bias_swiglu_backward_kernel(
    # pointers
    Gate,
    Up,
    GateBias,
    UpBias,
    DY,
    DGate,
    DUp,
    Partials,
    # sizes
    num_rows,
    num_cols,
    blocks_per_program,
    # strides (rows; the partials' K dim); the last dims are contiguous
    stride_gm,
    stride_um,
    stride_dym,
    stride_dgm,
    stride_dum,
    stride_pk,
    # meta-parameters: as the forward's
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    VEC: tl.constexpr,
    SHIFT_GATE: tl.constexpr,
    SHIFT_UP: tl.constexpr,
    SHIFT_GATE_BIAS: tl.constexpr,
    SHIFT_UP_BIAS: tl.constexpr,
):
    Gate, Up = Gate + SHIFT_GATE, Up + SHIFT_UP
    GateBias, UpBias = GateBias + SHIFT_GATE_BIAS, UpBias + SHIFT_UP_BIAS
    num_cols = vector_multiple(num_cols, VEC)
    stride_gm, stride_um = vector_multiple(stride_gm, VEC), vector_multiple(stride_um, VEC)
    stride_dym, stride_dgm = vector_multiple(stride_dym, VEC), vector_multiple(stride_dgm, VEC)
    stride_dum = vector_multiple(stride_dum, VEC)
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = cols < num_cols
    gate_bias = tl.load(GateBias + cols, mask=mask_n, other=0.0).to(tl.float32)
    up_bias = tl.load(UpBias + cols, mask=mask_n, other=0.0).to(tl.float32)
    d_gate_bias = tl.zeros((BLOCK_N,), dtype=tl.float32)
    d_up_bias = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for block in range(0, blocks_per_program):
        rows = (pid * blocks_per_program + block).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (rows < num_rows)[:, None] & mask_n[None, :]
        gate = tl.load(Gate + rows[:, None] * stride_gm + cols[None, :], mask=mask, other=0.0)
        up = tl.load(Up + rows[:, None] * stride_um + cols[None, :], mask=mask, other=0.0)
        dy = tl.load(DY + rows[:, None] * stride_dym + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        g = gate.to(tl.float32) + gate_bias[None, :]
        u = up.to(tl.float32) + up_bias[None, :]
        # silu(g) = g s, s = sigmoid(g); silu'(g) = s + g s (1 - s), with 1 - s = sigmoid(-g) (no cancellation).
        s = times_sigmoid(1.0, g)
        d_up = dy * g * s
        d_gate = dy * u * (s + g * s * times_sigmoid(1.0, -g))
        tl.store(
            DGate + rows[:, None] * stride_dgm + cols[None, :], round_to(d_gate, DGate.dtype.element_ty), mask=mask
        )
        tl.store(DUp + rows[:, None] * stride_dum + cols[None, :], round_to(d_up, DUp.dtype.element_ty), mask=mask)
        # Masked elements have dy = 0, so they add nothing to the bias gradients.
        d_gate_bias += tl.sum(d_gate, axis=0)
        d_up_bias += tl.sum(d_up, axis=0)
    partial = Partials + pid.to(tl.int64) * num_cols + cols
    tl.store(partial, d_gate_bias, mask=mask_n)
    tl.store(partial + stride_pk, d_up_bias, mask=mask_n)


def _shifted_inputs(gate, up, gate_bias, up_bias, config: dict) -> dict:
    """The kernels' four input pointers, each an :func:`~qvl.kernels.tiles.aligned_view` of its tensor, and their
    shifts into ``config`` (``SHIFT_GATE``, ...): a stacked GEMM output's halves and a stacked bias's halves (vLLM's
    ``gate_up_proj``) start 8 bytes off a 16-byte boundary at F = 3,420 in 16-bit dtypes."""
    pointers = {}
    for name, shift_name, x in (
        ("Gate", "SHIFT_GATE", gate),
        ("Up", "SHIFT_UP", up),
        ("GateBias", "SHIFT_GATE_BIAS", gate_bias),
        ("UpBias", "SHIFT_UP_BIAS", up_bias),
    ):
        pointers[name], config[shift_name] = aligned_view(x)
    return pointers


def launch_config(num_cols: int, target: GPUTarget) -> dict:
    """Everything the SwiGLU launch passes besides tensors and scalars, for rows of ``num_cols`` on
    ``target``: the elementwise epilogues' :func:`~qvl.kernels.tiles.row_tiles`. Every target gets the same
    values (the interpreter ignores warps and options)."""
    return row_tiles(num_cols)


def bias_swiglu_launches(gate, up, gate_bias, up_bias, y, target: GPUTarget) -> list[KernelLaunch]:
    """The launch writing ``silu(gate + gate_bias) * (up + up_bias)`` into ``y`` for checked arguments;
    empty when gate is. Reads shapes and strides only (no device sync)."""
    num_rows, num_cols = gate.shape
    if gate.numel() == 0:
        return []
    config = launch_config(num_cols, target)
    # Row blocks on grid axis 0 (up to 2**31 - 1); axis 1 (column blocks) is capped at 65535.
    grid = (cdiv(num_rows, config["BLOCK_M"]), cdiv(num_cols, config["BLOCK_N"]))
    args = dict(
        # pointers
        **_shifted_inputs(gate, up, gate_bias, up_bias, config),
        Y=y,
        # sizes
        num_rows=num_rows,
        num_cols=num_cols,
        # strides
        stride_gm=gate.stride(0),
        stride_um=up.stride(0),
        stride_ym=y.stride(0),
    )
    config["VEC"] = row_vector(num_cols, (gate.stride(0), up.stride(0), y.stride(0)), gate.element_size())
    return [KernelLaunch(_bias_swiglu_kernel, grid, args, config)]


def bias_swiglu_backward_launches(
    grad_y, gate, up, gate_bias, up_bias, d_gate, d_up, partials, d_gate_bias, d_up_bias
) -> list[KernelLaunch]:
    """The launches of bias_swiglu's backward for checked arguments: ``d_gate``, ``d_up`` (gate's shape and
    dtype) and their fp32 per-program column sums into ``partials`` ``(2, programs, F)``
    (:func:`~qvl.kernels.tiles.epilogue_backward_config`), then their reduction into ``d_gate_bias`` and
    ``d_up_bias``. Mutates the four gradients and partials; empty when gate is. Reads shapes and strides only
    (no device sync)."""
    num_rows, num_cols = gate.shape
    if gate.numel() == 0:
        return []
    config = epilogue_backward_config(num_rows, num_cols)
    grid = (config.pop("programs"), cdiv(num_cols, config["BLOCK_N"]))
    args = dict(
        # pointers
        **_shifted_inputs(gate, up, gate_bias, up_bias, config),
        DY=grad_y,
        DGate=d_gate,
        DUp=d_up,
        Partials=partials,
        # sizes
        num_rows=num_rows,
        num_cols=num_cols,
        blocks_per_program=config.pop("blocks_per_program"),
        # strides
        stride_gm=gate.stride(0),
        stride_um=up.stride(0),
        stride_dym=grad_y.stride(0),
        stride_dgm=d_gate.stride(0),
        stride_dum=d_up.stride(0),
        stride_pk=partials.stride(0),
    )
    row_strides = [x.stride(0) for x in (gate, up, grad_y, d_gate, d_up)]
    config["VEC"] = row_vector(num_cols, row_strides, gate.element_size())
    return [
        KernelLaunch(_bias_swiglu_backward_kernel, grid, args, config),
        sum_partials_launch(partials, (d_gate_bias, d_up_bias)),
    ]


def bias_swiglu_reference(
    gate: torch.Tensor, up: torch.Tensor, gate_bias: torch.Tensor, up_bias: torch.Tensor
) -> torch.Tensor:
    """Pure-torch ``silu(gate + gate_bias) * (up + up_bias)`` in fp32 (float64 stays float64), one rounding
    to gate's dtype, returned contiguous."""
    compute = torch.float64 if gate.dtype == torch.float64 else torch.float32
    g = gate.to(compute) + gate_bias.to(compute)
    u = up.to(compute) + up_bias.to(compute)
    return (F.silu(g) * u).to(gate.dtype).contiguous()


def bias_swiglu_backward_reference(
    grad_y: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, gate_bias: torch.Tensor, up_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pure-torch bias_swiglu backward in fp32 (float64 stays float64): ``(d_gate, d_up, d_gate_bias,
    d_up_bias)`` in gate's dtype, the first two contiguous."""
    compute = torch.float64 if gate.dtype == torch.float64 else torch.float32
    g = gate.to(compute) + gate_bias.to(compute)
    u = up.to(compute) + up_bias.to(compute)
    dy = grad_y.to(compute)
    s = torch.sigmoid(g)
    d_gate = dy * u * (s + g * s * torch.sigmoid(-g))
    d_up = dy * g * s
    dtype = gate.dtype
    return d_gate.to(dtype).contiguous(), d_up.to(dtype).contiguous(), d_gate.sum(0).to(dtype), d_up.sum(0).to(dtype)


def _check_bias_swiglu_args(op: str, gate, up, gate_bias, up_bias) -> None:
    check_tensor(op, "gate", gate, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    check_tensor(op, "up", up, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    if up.shape != gate.shape:
        raise ValueError(f"{op}: up must have gate's shape {tuple(gate.shape)}, got {tuple(up.shape)}")
    if up.dtype != gate.dtype:
        raise TypeError(f"{op}: up must have gate's dtype {gate.dtype}, got {up.dtype}")
    num_cols = gate.shape[1]
    for name, bias in (("gate_bias", gate_bias), ("up_bias", up_bias)):
        check_tensor(op, name, bias, ndim=1, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
        if bias.shape[0] != num_cols:
            raise ValueError(f"{op}: {name} must have shape (F,) = ({num_cols},), got {tuple(bias.shape)}")
        if bias.dtype != gate.dtype:
            raise TypeError(f"{op}: {name} must have gate's dtype {gate.dtype}, got {bias.dtype}")
    check_same_device(op, {"gate": gate, "up": up, "gate_bias": gate_bias, "up_bias": up_bias})


@torch.library.custom_op("qvl::bias_swiglu", mutates_args=(), device_types=("cpu", "cuda"))
def bias_swiglu(gate: torch.Tensor, up: torch.Tensor, gate_bias: torch.Tensor, up_bias: torch.Tensor) -> torch.Tensor:
    """``silu(gate + gate_bias) * (up + up_bias)``: the epilogue of bias-less ``gate = h @ W_gate^T`` and
    ``up = h @ W_up^T`` in Qwen2.5-VL's vision MLP.

    Args:
        gate, up: ``(N, F)`` of one dtype (fp16/bf16/fp32) and device, last dim contiguous, row strides free
            (e.g. the two column halves of one ``(N, 2F)`` GEMM output). N may be 0.
        gate_bias, up_bias: contiguous ``(F,)`` in gate's dtype, on gate's device.

    Returns a new contiguous ``(N, F)`` tensor in gate's dtype. The bias adds, the SiLU and the product are
    computed in fp32 and rounded once. Compared with eager
    ``F.silu(F.linear(h, W_gate, b_gate)) * F.linear(h, W_up, b_up)``: the caller's bias-less GEMMs round
    ``h @ W^T`` before the bias where eager rounds ``h @ W^T + b``, so each factor's input differs by at most
    one rounding of the dtype (in fp32, within fp32 rounding); eager in a 16-bit dtype then also rounds the
    SiLU and the product, which qvl does not (one rounding on the output instead of three). Nothing is
    mutated. Differentiable in all four inputs (:func:`bias_swiglu_backward`; saves the four inputs).
    """
    _check_bias_swiglu_args("bias_swiglu", gate, up, gate_bias, up_bias)
    if runs_torch(gate.device):
        return bias_swiglu_reference(gate, up, gate_bias, up_bias)
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    launches = bias_swiglu_launches(gate, up, gate_bias, up_bias, y, device_target(gate.device))
    run_launches(launches, gate.device)
    return y


@bias_swiglu.register_fake
def _(gate, up, gate_bias, up_bias):
    _check_bias_swiglu_args("bias_swiglu", gate, up, gate_bias, up_bias)
    return torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)


@torch.library.custom_op("qvl::bias_swiglu_backward", mutates_args=(), device_types=("cpu", "cuda"))
def bias_swiglu_backward(
    grad_y: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, gate_bias: torch.Tensor, up_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`bias_swiglu`.

    Args:
        grad_y: ``(N, F)`` gradient of the output, gate's dtype, last dim contiguous (row stride free).
        gate, up, gate_bias, up_bias: the forward's inputs, checked as :func:`bias_swiglu` checks them.

    Returns new ``(d_gate (N, F), d_up (N, F), d_gate_bias (F,), d_up_bias (F,))`` in gate's dtype, the first
    two contiguous: with ``g = gate + gate_bias``, ``u = up + up_bias``, ``d_gate = grad_y * u * silu'(g)``
    and ``d_up = grad_y * silu(g)`` in fp32, rounded once; the bias gradients their column sums in fp32
    (per-program partial sums added in a fixed order: deterministic), rounded once. Nothing is mutated.
    """
    _check_bias_swiglu_backward_args(grad_y, gate, up, gate_bias, up_bias)
    if runs_torch(gate.device):
        return bias_swiglu_backward_reference(grad_y, gate, up, gate_bias, up_bias)
    d_gate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    d_up = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    # With no rows nothing is launched and the bias gradients are zeros.
    new_bias = torch.empty_like if gate.shape[0] else torch.zeros_like
    d_gate_bias, d_up_bias = new_bias(gate_bias), new_bias(up_bias)
    programs = epilogue_backward_config(gate.shape[0], gate.shape[1])["programs"]
    partials = torch.empty((2, programs, gate.shape[1]), dtype=torch.float32, device=gate.device)
    launches = bias_swiglu_backward_launches(
        grad_y, gate, up, gate_bias, up_bias, d_gate, d_up, partials, d_gate_bias, d_up_bias
    )
    run_launches(launches, gate.device)
    return d_gate, d_up, d_gate_bias, d_up_bias


def _check_bias_swiglu_backward_args(grad_y, gate, up, gate_bias, up_bias) -> None:
    op = "bias_swiglu_backward"
    _check_bias_swiglu_args(op, gate, up, gate_bias, up_bias)
    check_tensor(op, "grad_y", grad_y, ndim=2, dtypes=(gate.dtype,), last_dim_contiguous=True)
    if grad_y.shape != gate.shape:
        raise ValueError(f"{op}: grad_y must have gate's shape {tuple(gate.shape)}, got {tuple(grad_y.shape)}")
    check_same_device(op, {"gate": gate, "grad_y": grad_y})


@bias_swiglu_backward.register_fake
def _(grad_y, gate, up, gate_bias, up_bias):
    _check_bias_swiglu_backward_args(grad_y, gate, up, gate_bias, up_bias)
    grads = (torch.empty(gate.shape, dtype=gate.dtype, device=gate.device) for _ in range(2))
    return *grads, torch.empty_like(gate_bias), torch.empty_like(up_bias)


def _bias_swiglu_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _bias_swiglu_backward(ctx, grad_y):
    return bias_swiglu_backward(last_dim_contiguous(grad_y), *ctx.saved_tensors)


bias_swiglu.register_autograd(_bias_swiglu_backward, setup_context=_bias_swiglu_setup_context)
# The biases and activation of two linear layers' outputs: in the autocast dtype, as the linears' biases.
follow_autocast("bias_swiglu", in_autocast_dtype(0, 1, 2, 3))
follow_autocast("bias_swiglu_backward")
