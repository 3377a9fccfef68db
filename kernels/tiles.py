"""Triton device functions that more than one kernel family uses.

Strides the host found to be multiples of 16 bytes are re-derived in the kernel with
:func:`aligned_stride`, so that the compiler can prove every row of a tile starts on a 16-byte boundary.

Qwen3-VL's 2D rotary embedding on a ``(tokens, head dims)`` tile: the standalone rotary kernel
(:mod:`qvl.kernels.rotary`) and the attention kernel, which rotates q as it loads it
(:mod:`qvl.kernels.attention`), compute cos/sin in fp32 from int32 (row, col) positions with these, so
both round exactly alike.
"""

import triton
import triton.language as tl

__all__ = ["aligned_stride", "rope_apply", "rope_cos_sin", "rope_dim_tables"]


@triton.jit
def aligned_stride(stride, base):
    """``stride`` (in elements of pointer ``base``), which the host checked to be a multiple of 16 bytes,
    rounded down to that multiple: the same value, in a form the compiler can prove divisible by it.

    Triton only knows an integer argument divisible by 16 elements (or not at all), so a head stride of 72
    leaves every row address of a tile unproven, and each row is then loaded element by element, without
    asynchronous copies. ``tl.multiple_of`` on the argument does not carry the fact through; rounding does.
    """
    elements: tl.constexpr = 128 // base.dtype.element_ty.primitive_bitwidth
    return stride // elements * elements


@triton.jit
def rope_dim_tables(offs_d, HEAD_DIM: tl.constexpr, log2_theta):
    """Per-dimension rotary constants for the dims ``offs_d`` of a head of width ``HEAD_DIM``.

    Returns (inv_freq fp32, from_col bool, partner dim, sign fp32): dim d pairs with
    ``partner = (d + D/2) % D`` and is rotated as ``x[d] * cos + sign * x[partner] * sin``.
    """
    half: tl.constexpr = HEAD_DIM // 2
    quarter: tl.constexpr = HEAD_DIM // 4
    in_half = offs_d % half
    from_col = in_half >= quarter
    freq_index = tl.where(from_col, in_half - quarter, in_half)
    inv_freq = tl.exp2(freq_index.to(tl.float32) * (-4.0 / HEAD_DIM) * log2_theta)
    partner = (offs_d + half) % HEAD_DIM
    sign = tl.where(offs_d < half, -1.0, 1.0)
    return inv_freq, from_col, partner, sign


@triton.jit
def rope_cos_sin(row_pos, col_pos, inv_freq, from_col):
    """cos/sin ``(BLOCK_T, BLOCK_D)`` in fp32 for tokens at ``(row_pos, col_pos)`` (int32 ``(BLOCK_T,)``)."""
    pos = tl.where(from_col[None, :], col_pos[:, None], row_pos[:, None]).to(tl.float32)
    angle = pos * inv_freq[None, :]
    return tl.cos(angle), tl.sin(angle)


@triton.jit
def rope_apply(x, x_partner, cos, sin, sign):
    """Rotate one tile in fp32: ``x * cos + sign * x_partner * sin``."""
    return x.to(tl.float32) * cos + sign[None, :] * x_partner.to(tl.float32) * sin
