"""Biases + SwiGLU, the epilogue of Qwen2.5-VL's vision MLP after its two bias-less GEMMs:
``torch.ops.qvl.bias_swiglu``.

transformers' ``Qwen2_5_VLMLP(config, bias=True)`` computes
``down_proj(silu(gate_proj(x)) * up_proj(x))`` (``hidden_act="silu"``). qvl runs ``gate_proj`` and
``up_proj`` as bias-less GEMMs (or one GEMM over the stacked weights) and this kernel does the rest before
``down_proj``: it reads the two GEMM outputs and the two biases once and writes the product once, computing
in fp32 and rounding once on the store. It is the bias + GELU epilogue's sibling and shares its tiling
(:func:`qvl.kernels.gelu.row_tiles`) and sigmoid (:func:`qvl.kernels.gelu.times_sigmoid`).

Why two ``(N, F)`` arguments rather than one ``(N, 2F)``: both take free row strides, so a caller that runs
one GEMM over ``[W_gate; W_up]`` passes the two column halves of its ``(N, 2F)`` output as views (row
stride 2F) without a copy, and a caller that runs two GEMMs (or shards gate and up separately across
tensor-parallel ranks) passes two tensors. A single ``(N, 2F)`` argument would impose the stacked layout on
every caller.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

from .common import (
    FLOAT_DTYPES,
    KernelLaunch,
    backend_for,
    check_same_device,
    check_tensor,
    device_target,
    run_launches,
)
from .gelu import row_tiles, times_sigmoid

__all__ = ["bias_swiglu", "bias_swiglu_launches", "bias_swiglu_reference", "launch_config"]


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
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
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
    tl.store(Y + rows[:, None] * stride_ym + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


def launch_config(num_cols: int, target: GPUTarget) -> dict:
    """Everything the SwiGLU launch passes besides tensors and scalars, for rows of ``num_cols`` on
    ``target``: the elementwise epilogues' :func:`~qvl.kernels.gelu.row_tiles`. Every target gets the same
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
    grid = (triton.cdiv(num_rows, config["BLOCK_M"]), triton.cdiv(num_cols, config["BLOCK_N"]))
    args = (gate, up, gate_bias, up_bias, y, num_rows, num_cols, gate.stride(0), up.stride(0), y.stride(0))
    return [KernelLaunch(_bias_swiglu_kernel, grid, args, config)]


def bias_swiglu_reference(
    gate: torch.Tensor, up: torch.Tensor, gate_bias: torch.Tensor, up_bias: torch.Tensor
) -> torch.Tensor:
    """Pure-torch ``silu(gate + gate_bias) * (up + up_bias)`` in fp32 (float64 stays float64), one rounding
    to gate's dtype, returned contiguous."""
    compute = torch.float64 if gate.dtype == torch.float64 else torch.float32
    g = gate.to(compute) + gate_bias.to(compute)
    u = up.to(compute) + up_bias.to(compute)
    return (F.silu(g) * u).to(gate.dtype).contiguous()


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
    mutated. Forward only.
    """
    _check_bias_swiglu_args("bias_swiglu", gate, up, gate_bias, up_bias)
    if backend_for(gate.device) == "torch":
        return bias_swiglu_reference(gate, up, gate_bias, up_bias)
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    launches = bias_swiglu_launches(gate, up, gate_bias, up_bias, y, device_target(gate.device))
    run_launches(launches, gate.device)
    return y


@bias_swiglu.register_fake
def _(gate, up, gate_bias, up_bias):
    _check_bias_swiglu_args("bias_swiglu", gate, up, gate_bias, up_bias)
    return torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
