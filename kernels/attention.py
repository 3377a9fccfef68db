"""Variable-length, non-causal attention over packed image patches: ``torch.ops.qvl.vision_attn``.

One launch covers every image/frame of a batch. The grid comes from shapes alone,
``(T // BLOCK_M + B, H)`` programs for T tokens in B segments: segment b owns the program range
``[cu[b] // BLOCK_M + b, cu[b+1] // BLOCK_M + b + 1)``, which holds at least ``ceil(S_b / BLOCK_M)``
programs, and each program finds its segment by a binary search over ``cu_seqlens`` on the device.
No ``max_seqlen`` is needed and nothing is read back to the host, so the op behaves the same under
CUDA graphs and torch.compile whatever the image sizes.

``max_seqlen``, a host int the caller's metadata already holds (the longest image, or the window length of
Qwen2.5-VL's window attention), is a tile hint: when every segment is at most :data:`SHORT_SEGMENT_MAX`
tokens, 16-bit head dims up to 128 take 64-row query tiles instead of 128-row ones, so a 64-token window is
one tile rather than half of one (:func:`launch_work` counts the matmul work a launch executes). The program
mapping is the same for every tile, so a hint smaller than a real segment is still correct, only slower.

Head dims that are not a power of two are tiled as a power-of-two main part plus a narrow tail
(72 = 64 + 16-wide tail holding 8 live columns), so the dot products do 80/72 of the needed work
where padding to 128 would do 128/72.

Softmax runs online in fp32 with exp2 (log2(e) folded into the scale).

When every row of q, k, v and the output starts on a 16-byte boundary (checked on the host from strides
and data pointers: true of the views of a packed qkv projection for every Qwen3-VL head dim), the kernel
re-derives its strides in a form the compiler can prove 16-byte aligned (:func:`qvl.kernels.tiles.aligned_stride`),
so K and V tiles are fetched with 16-byte asynchronous copies pipelined over ``num_stages``; a head stride
such as 72 elements otherwise proves nothing and rows are loaded element by element. Other layouts take
the unproven path.

With ``positions`` the 2D rotary embedding is applied (see :mod:`qvl.kernels.rotary`): each program
rotates its q tile as it loads it, once, and k is rotated once per call, by the rotary kernel into a
scratch tensor, before the attention launch. Rotating k inside the key loop instead redoes its sin/cos
(inlined libdevice polynomials with range reduction) for every q block and head, S / BLOCK_M * H times per
key, which makes the key loop several times longer and spills it to local memory; rotating q once per
program leaves the loop as it is without rope (``python -m bench.sass_attention`` prints both).

Training: the op is differentiable in q, k and v. A call with grad mode on and one of them requiring grad
runs :func:`vision_attn_with_lse` instead (routed by the op's autograd keys): the same kernel, which then
also stores each row's log-sum-exp, so inference stores nothing more than the output. Its backward,
:func:`vision_attn_backward`, rebuilds the probabilities from that log-sum-exp tile by tile in a dK/dV
kernel and a dQ kernel (no ``(S x S)`` tensor, no atomics, the forward's grid formula, segment search and
head-dim tiling; see the comment above the backward kernels). With ``positions`` it rotates q and k again
with the rotary kernel and rotates dq and dk back with its inverse.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.tools.tensor_descriptor import TensorDescriptor

from .common import (
    FLOAT_DTYPES,
    FMA_CONTRACTION,
    KernelLaunch,
    backend_for,
    check_cu_seqlens,
    check_same_device,
    check_tensor,
    device_target,
    rows_16_byte_aligned,
    run_launches,
    shared_memory_per_block,
)
from .rotary import check_positions, check_rope_head_dim, check_rope_theta, rotary_2d_reference, rotary_launches
from .tiles import aligned_stride, last_dim_contiguous, rope_apply, rope_cos_sin, rope_dim_tables, route_autograd

__all__ = [
    "MAX_HEAD_DIM",
    "SHORT_SEGMENT_MAX",
    "AttentionWork",
    "backward_launch_config",
    "head_dim_tiles",
    "launch_config",
    "launch_work",
    "vision_attn",
    "vision_attn_backward",
    "vision_attn_backward_launches",
    "vision_attn_backward_reference",
    "vision_attn_launches",
    "vision_attn_reference",
    "vision_attn_with_lse",
]

MAX_HEAD_DIM = 256
# ln(2) and log2(e) for the kernels (Triton reads globals only as constexprs).
LN2 = tl.constexpr(math.log(2.0))
LOG2E = tl.constexpr(math.log2(math.e))
# A ``max_seqlen`` hint at most this long selects the short-segment tiles (see launch_config).
SHORT_SEGMENT_MAX = 64


def head_dim_tiles(head_dim: int) -> tuple[int, int]:
    """(main, tail) tile widths for ``head_dim``: main is the largest power of two <= head_dim (at least
    16, the smallest dot dimension GPUs accept for 16-bit types), tail the next power of two >= the rest
    (0 when nothing is left)."""
    main = max(16, 1 << (head_dim.bit_length() - 1))
    rest = head_dim - main
    tail = 0 if rest <= 0 else max(16, triton.next_power_of_2(rest))
    return main, tail


@triton.jit
def _load_rows(base, rows, stride_t, offs_d, row_mask, HEAD_DIM: tl.constexpr, MASK_ROWS: tl.constexpr,
               MASK_COLS: tl.constexpr = True):  # fmt: skip
    """Load a ``(len(rows), len(offs_d))`` tile, zeros outside the masks; rows are token indices. ``MASK_COLS``
    False: the caller knows every column is below HEAD_DIM (a main tile), so a full block loads unmasked."""
    ptrs = base + rows[:, None] * stride_t + offs_d[None, :]
    if MASK_ROWS and MASK_COLS:
        return tl.load(ptrs, mask=row_mask[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    if MASK_ROWS:
        return tl.load(ptrs, mask=row_mask[:, None], other=0.0)
    if MASK_COLS:
        return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return tl.load(ptrs)


@triton.jit
def _load_kv(X, XTail, rows, stride_t, offs_d, kv_mask, desc_row, head,
             HEAD_DIM: tl.constexpr, MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr, TAIL: tl.constexpr,
             DESCRIPTORS: tl.constexpr, BLOCK_N: tl.constexpr, D_MAIN: tl.constexpr, WIDTH: tl.constexpr):  # fmt: skip
    """A ``(BLOCK_N, WIDTH)`` key or value tile: the main columns, or with ``TAIL`` the tail ones. Pointer path:
    ``X`` points at the segment's first token of this head. ``DESCRIPTORS``: ``X`` / ``XTail`` are TMA
    descriptors of the whole ``(T, H, D)`` tensor, read at token ``desc_row``; the hardware zero-fills the
    columns past D and the rows past T, and rows of the next segment are zeroed here (their logits are -inf
    already, but a value that is not finite would still turn 0 * x into NaN)."""
    if not DESCRIPTORS:
        x = _load_rows(X, rows, stride_t, offs_d, kv_mask, HEAD_DIM, MASK_ROWS, MASK_COLS)
    elif TAIL:
        x = XTail.load([desc_row, head, D_MAIN]).reshape(BLOCK_N, WIDTH)
    else:
        x = X.load([desc_row, head, 0]).reshape(BLOCK_N, WIDTH)
    if DESCRIPTORS and MASK_ROWS:
        x = tl.where(kv_mask[:, None], x, 0.0)
    return x


@triton.jit
def _store_rows(base, rows, stride_t, offs_d, row_mask, x, HEAD_DIM: tl.constexpr):
    """Store the fp32 tile ``x`` into rows (token indices, masked by ``row_mask``), rounded to base's dtype."""
    mask = row_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    tl.store(base + rows[:, None] * stride_t + offs_d[None, :], x.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _load_rotated(base, rows, stride_t, offs_d, row_mask, row_pos, col_pos, inv_freq, from_col, partner, sign,
                  HEAD_DIM: tl.constexpr, ROTATE: tl.constexpr):  # fmt: skip
    """Load a tile of rows (masked by ``row_mask``) and, with ROTATE, rotate it and round it back to the
    input dtype (as the standalone rotary op would store it)."""
    x = _load_rows(base, rows, stride_t, offs_d, row_mask, HEAD_DIM, True)
    if ROTATE:
        x_partner = _load_rows(base, rows, stride_t, partner, row_mask, HEAD_DIM, True)
        cos, sin = rope_cos_sin(row_pos, col_pos, inv_freq, from_col)
        x = rope_apply(x, x_partner, cos, sin, sign)
        # Padding columns past HEAD_DIM hold x_partner * sin: zero them so they add nothing to q.k.
        x = tl.where(offs_d[None, :] < HEAD_DIM, x, 0.0).to(base.dtype.element_ty)
    return x


@triton.jit
def _program_tile(CuSeqlens, pid, num_segments, search_steps, BLOCK: tl.constexpr):
    """The tile program ``pid`` of a ``(T // BLOCK + B, H)`` grid owns: (first token of its segment, the
    segment's length, the tile's first row inside the segment). The row may lie past the segment's end:
    such a program has nothing to do.

    Segment b starts at program ``cu[b] // BLOCK + b``, strictly increasing in b, so a binary search over
    ``cu_seqlens`` (``search_steps`` = ceil(log2(B)) steps, on the device) finds the last segment starting
    at or before pid."""
    lo = pid * 0
    hi = lo + num_segments
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        mid_start = tl.load(CuSeqlens + mid) // BLOCK + mid
        before = mid_start <= pid
        lo = tl.where(before, mid, lo)
        hi = tl.where(before, hi, mid)
    seq_start = tl.load(CuSeqlens + lo)
    seqlen = tl.load(CuSeqlens + lo + 1) - seq_start
    return seq_start, seqlen, (pid - (seq_start // BLOCK + lo)) * BLOCK


@triton.jit
def _attn_kv_block(
    acc_main, acc_tail, m_i, l_i, q_main, q_tail,
    K, V, KTail, VTail, kv_start, desc_start, head, seqlen, stride_kt, stride_vt, qk_scale, offs_dm, offs_dt,
    HEAD_DIM: tl.constexpr, HAS_TAIL: tl.constexpr, BLOCK_N: tl.constexpr, D_MAIN: tl.constexpr,
    D_TAIL_TILE: tl.constexpr, MASK_MAIN_COLS: tl.constexpr, MASK_TAIL_COLS: tl.constexpr,
    MASK_KV: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDE_OFFSETS: tl.constexpr, DESCRIPTORS: tl.constexpr,
):  # fmt: skip
    """One step of the online softmax over keys ``[kv_start, kv_start + BLOCK_N)`` of the segment (see
    :func:`_load_kv` for K and V; ``desc_start`` is the segment's first token in the batch)."""
    offs_n = kv_start + tl.arange(0, BLOCK_N)
    kv_mask = offs_n < seqlen
    rows = offs_n.to(tl.int64) if WIDE_OFFSETS else offs_n
    desc_row = desc_start + kv_start

    k_main = _load_kv(K, KTail, rows, stride_kt, offs_dm, kv_mask, desc_row, head,
                      HEAD_DIM, MASK_KV, MASK_MAIN_COLS, False, DESCRIPTORS, BLOCK_N, D_MAIN, D_MAIN)  # fmt: skip
    qk = tl.dot(q_main, tl.trans(k_main), input_precision=DOT_PRECISION)
    if HAS_TAIL:
        k_tail = _load_kv(K, KTail, rows, stride_kt, offs_dt, kv_mask, desc_row, head, HEAD_DIM, MASK_KV,
                          MASK_TAIL_COLS, True, DESCRIPTORS, BLOCK_N, D_MAIN, D_TAIL_TILE)  # fmt: skip
        qk = tl.dot(q_tail, tl.trans(k_tail), qk, input_precision=DOT_PRECISION)
    if MASK_KV:
        qk = tl.where(kv_mask[None, :], qk, float("-inf"))

    # The row max of the raw logits, scaled once per row (qk_scale > 0 keeps the order and rounding keeps it
    # exact), so that scaling each logit and subtracting the max below is one FMA.
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(q_main.dtype)

    v_main = _load_kv(V, VTail, rows, stride_vt, offs_dm, kv_mask, desc_row, head,
                      HEAD_DIM, MASK_KV, MASK_MAIN_COLS, False, DESCRIPTORS, BLOCK_N, D_MAIN, D_MAIN)  # fmt: skip
    acc_main = tl.dot(p, v_main, acc_main * alpha[:, None], input_precision=DOT_PRECISION)
    if HAS_TAIL:
        v_tail = _load_kv(V, VTail, rows, stride_vt, offs_dt, kv_mask, desc_row, head, HEAD_DIM, MASK_KV,
                          MASK_TAIL_COLS, True, DESCRIPTORS, BLOCK_N, D_MAIN, D_TAIL_TILE)  # fmt: skip
        acc_tail = tl.dot(p, v_tail, acc_tail * alpha[:, None], input_precision=DOT_PRECISION)
    return acc_main, acc_tail, m_new, l_i


@triton.jit(do_not_specialize=["num_segments", "search_steps"])
def _vision_attn_kernel(
    # pointers (Positions is read only with ROTATE_Q, Lse written only with STORE_LSE). With DESCRIPTORS, K and V
    # are TMA descriptors of the (T, H, D) tensors with (BLOCK_N, 1, D_MAIN) boxes, KTail and VTail with
    # (BLOCK_N, 1, D_TAIL) boxes; without, K and V are pointers and KTail, VTail unused.
    Q, K, V, KTail, VTail, Out, CuSeqlens, Positions, Lse,
    # sizes
    num_segments, search_steps,
    # scalars
    qk_scale, log2_theta,
    # strides (tokens, heads); the last dim is contiguous. Lse is flat (H * T,): stride_lh = T.
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_pt, stride_lh,
    # meta-parameters
    HEAD_DIM: tl.constexpr, D_MAIN: tl.constexpr, D_TAIL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ROTATE_Q: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDE_OFFSETS: tl.constexpr, STRIDES_ALIGNED: tl.constexpr,
    STORE_LSE: tl.constexpr, DESCRIPTORS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    head = tl.program_id(1)
    if STRIDES_ALIGNED:
        # Multiples of 16 bytes on the host; proven so here, every K/V tile row moves in 16-byte async copies.
        stride_qt, stride_qh = aligned_stride(stride_qt, Q), aligned_stride(stride_qh, Q)
        if not DESCRIPTORS:
            stride_kt, stride_kh = aligned_stride(stride_kt, K), aligned_stride(stride_kh, K)
            stride_vt, stride_vh = aligned_stride(stride_vt, V), aligned_stride(stride_vh, V)
        stride_ot, stride_oh = aligned_stride(stride_ot, Out), aligned_stride(stride_oh, Out)

    seq_start, seqlen, m_start = _program_tile(CuSeqlens, pid, num_segments, search_steps, BLOCK_M)

    if m_start < seqlen:
        HAS_TAIL: tl.constexpr = D_TAIL > 0
        D_TAIL_TILE: tl.constexpr = D_TAIL if D_TAIL > 0 else 16
        # Main tiles lie inside the head unless the head is narrower than the smallest dot tile (16).
        MASK_MAIN_COLS: tl.constexpr = D_MAIN > HEAD_DIM
        MASK_TAIL_COLS: tl.constexpr = D_MAIN + D_TAIL_TILE > HEAD_DIM
        # The segment's first token in 64-bit scalar arithmetic; offsets inside the batch stay 32-bit
        # (vector address math in 64 bits costs registers and spills) unless T * stride can pass 2**31.
        first = seq_start.to(tl.int64)
        Q += first * stride_qt + head.to(tl.int64) * stride_qh
        if not DESCRIPTORS:
            K += first * stride_kt + head.to(tl.int64) * stride_kh
            V += first * stride_vt + head.to(tl.int64) * stride_vh
        Out += first * stride_ot + head.to(tl.int64) * stride_oh

        offs_m = m_start + tl.arange(0, BLOCK_M)
        q_mask = offs_m < seqlen
        q_rows = offs_m.to(tl.int64) if WIDE_OFFSETS else offs_m
        offs_dm = tl.arange(0, D_MAIN)
        offs_dt = D_MAIN + tl.arange(0, D_TAIL_TILE)

        # Placeholders, replaced when ROTATE_Q (Triton needs every name bound on both paths).
        row_pos, col_pos = offs_m, offs_m
        inv_freq_m, from_col_m, partner_m, sign_m = offs_dm, offs_dm, offs_dm, offs_dm
        inv_freq_t, from_col_t, partner_t, sign_t = offs_dt, offs_dt, offs_dt, offs_dt
        if ROTATE_Q:
            Positions += first * stride_pt
            inv_freq_m, from_col_m, partner_m, sign_m = rope_dim_tables(offs_dm, HEAD_DIM, log2_theta)
            inv_freq_t, from_col_t, partner_t, sign_t = rope_dim_tables(offs_dt, HEAD_DIM, log2_theta)
            row_pos = tl.load(Positions + q_rows * stride_pt, mask=q_mask, other=0)
            col_pos = tl.load(Positions + q_rows * stride_pt + 1, mask=q_mask, other=0)

        q_main = _load_rotated(Q, q_rows, stride_qt, offs_dm, q_mask, row_pos, col_pos, inv_freq_m, from_col_m,
                               partner_m, sign_m, HEAD_DIM, ROTATE_Q)  # fmt: skip
        q_tail = q_main
        acc_tail = tl.zeros([BLOCK_M, D_TAIL_TILE], dtype=tl.float32)
        if HAS_TAIL:
            q_tail = _load_rotated(Q, q_rows, stride_qt, offs_dt, q_mask, row_pos, col_pos, inv_freq_t, from_col_t,
                                   partner_t, sign_t, HEAD_DIM, ROTATE_Q)  # fmt: skip

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc_main = tl.zeros([BLOCK_M, D_MAIN], dtype=tl.float32)

        # Full key blocks need no row mask; the ragged last block is handled apart.
        full_end = (seqlen // BLOCK_N) * BLOCK_N
        for kv_start in range(0, full_end, BLOCK_N):
            acc_main, acc_tail, m_i, l_i = _attn_kv_block(
                acc_main, acc_tail, m_i, l_i, q_main, q_tail,
                K, V, KTail, VTail, kv_start, seq_start, head, seqlen, stride_kt, stride_vt, qk_scale,
                offs_dm, offs_dt, HEAD_DIM, HAS_TAIL, BLOCK_N, D_MAIN, D_TAIL_TILE, MASK_MAIN_COLS, MASK_TAIL_COLS,
                False, DOT_PRECISION, WIDE_OFFSETS, DESCRIPTORS,
            )  # fmt: skip
        if full_end < seqlen:
            acc_main, acc_tail, m_i, l_i = _attn_kv_block(
                acc_main, acc_tail, m_i, l_i, q_main, q_tail,
                K, V, KTail, VTail, full_end, seq_start, head, seqlen, stride_kt, stride_vt, qk_scale,
                offs_dm, offs_dt, HEAD_DIM, HAS_TAIL, BLOCK_N, D_MAIN, D_TAIL_TILE, MASK_MAIN_COLS, MASK_TAIL_COLS,
                True, DOT_PRECISION, WIDE_OFFSETS, DESCRIPTORS,
            )  # fmt: skip

        inv_l = 1.0 / l_i
        out_rows = Out + q_rows[:, None] * stride_ot
        tl.store(
            out_rows + offs_dm[None, :],
            (acc_main * inv_l[:, None]).to(Out.dtype.element_ty),
            mask=q_mask[:, None] & (offs_dm[None, :] < HEAD_DIM),
        )
        if HAS_TAIL:
            tl.store(
                out_rows + offs_dt[None, :],
                (acc_tail * inv_l[:, None]).to(Out.dtype.element_ty),
                mask=q_mask[:, None] & (offs_dt[None, :] < HEAD_DIM),
            )
        if STORE_LSE:
            # What the backward needs to rebuild each probability from one logit: the row's log-sum-exp of
            # the scaled logits, natural log (m_i and log2(l_i) are in base 2).
            lse = (m_i + tl.log2(l_i)) * LN2
            tl.store(Lse + (head.to(tl.int64) * stride_lh + first) + offs_m, lse, mask=q_mask)


# ----------------------------------------------------------------------------------------------------
# Backward, flash-attention style: no (S x S) tensor; each probability is rebuilt from its logit and the
# row's log-sum-exp saved by the forward, P = exp(s - lse), s = q.k * scale. With dO the output's
# gradient and delta = rowsum(dO * O) (= rowsum(P * dP)):
#   dV = P^T dO,   dP = dO V^T,   dS = P * (dP - delta),   dQ = dS K * scale,   dK = dS^T Q * scale.
# Two kernels share the work without atomics (so results are deterministic): one program per key block
# accumulates dK and dV over the query blocks of its segment, one per query block accumulates dQ over the
# key blocks. Both use the forward's grid formula and segment search, and its head-dim tiling.
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _attn_bwd_delta_kernel(
    Out, DOut, Delta, num_tokens,
    stride_ot, stride_oh, stride_dot, stride_doh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    """delta[h, t] = sum_d dO[t, h, d] * O[t, h, d] in fp32, one ``BLOCK_T``-token tile of one head."""
    head = tl.program_id(1)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < num_tokens
    tokens = offs_t.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask = mask_t[:, None] & (offs_d[None, :] < HEAD_DIM)
    o = tl.load(Out + tokens[:, None] * stride_ot + head * stride_oh + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DOut + tokens[:, None] * stride_dot + head * stride_doh + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + head.to(tl.int64) * num_tokens + offs_t, delta, mask=mask_t)


@triton.jit
def _attn_bwd_dkdv_q_block(
    dk_main, dk_tail, dv_main, dv_tail, k_main, k_tail, v_main, v_tail,
    Q, DO, Lse, Delta, m_start, seqlen, stride_qt, stride_dot, qk_scale, offs_dm, offs_dt,
    HEAD_DIM: tl.constexpr, HAS_TAIL: tl.constexpr, BLOCK_M: tl.constexpr,
    MASK_Q: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDE_OFFSETS: tl.constexpr,
):  # fmt: skip
    """Add the queries ``[m_start, m_start + BLOCK_M)`` of the segment to one key block's dK and dV (Q, DO,
    Lse and Delta point at the segment's first token). Works on transposed tiles, keys x queries, so that
    P^T and dS^T come out of the dots in the orientation dV and dK take them."""
    offs_m = m_start + tl.arange(0, BLOCK_M)
    q_mask = offs_m < seqlen
    rows = offs_m.to(tl.int64) if WIDE_OFFSETS else offs_m
    q_main = _load_rows(Q, rows, stride_qt, offs_dm, q_mask, HEAD_DIM, MASK_Q)
    s_t = tl.dot(k_main, tl.trans(q_main), input_precision=DOT_PRECISION)
    q_tail = q_main
    if HAS_TAIL:
        q_tail = _load_rows(Q, rows, stride_qt, offs_dt, q_mask, HEAD_DIM, MASK_Q)
        s_t = tl.dot(k_tail, tl.trans(q_tail), s_t, input_precision=DOT_PRECISION)
    if MASK_Q:
        # Rows past the segment get lse = +inf: probability 0, so they add nothing.
        lse = tl.load(Lse + offs_m, mask=q_mask, other=float("inf"))
        delta = tl.load(Delta + offs_m, mask=q_mask, other=0.0)
    else:
        lse = tl.load(Lse + offs_m)
        delta = tl.load(Delta + offs_m)
    p_t = tl.exp2(s_t * qk_scale - (lse * LOG2E)[None, :])
    p_low = p_t.to(Q.dtype.element_ty)

    do_main = _load_rows(DO, rows, stride_dot, offs_dm, q_mask, HEAD_DIM, MASK_Q)
    dv_main = tl.dot(p_low, do_main, dv_main, input_precision=DOT_PRECISION)
    dp_t = tl.dot(v_main, tl.trans(do_main), input_precision=DOT_PRECISION)
    if HAS_TAIL:
        do_tail = _load_rows(DO, rows, stride_dot, offs_dt, q_mask, HEAD_DIM, MASK_Q)
        dv_tail = tl.dot(p_low, do_tail, dv_tail, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v_tail, tl.trans(do_tail), dp_t, input_precision=DOT_PRECISION)
    ds_t = (p_t * (dp_t - delta[None, :])).to(Q.dtype.element_ty)
    dk_main = tl.dot(ds_t, q_main, dk_main, input_precision=DOT_PRECISION)
    if HAS_TAIL:
        dk_tail = tl.dot(ds_t, q_tail, dk_tail, input_precision=DOT_PRECISION)
    return dk_main, dk_tail, dv_main, dv_tail


@triton.jit
def _bwd_input_strides(Q, K, V, DO, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot,
                       stride_doh, STRIDES_ALIGNED: tl.constexpr):  # fmt: skip
    """The backward's input strides, in the provably 16-byte aligned form when the host found them so."""
    if STRIDES_ALIGNED:
        stride_qt, stride_qh = aligned_stride(stride_qt, Q), aligned_stride(stride_qh, Q)
        stride_kt, stride_kh = aligned_stride(stride_kt, K), aligned_stride(stride_kh, K)
        stride_vt, stride_vh = aligned_stride(stride_vt, V), aligned_stride(stride_vh, V)
        stride_dot, stride_doh = aligned_stride(stride_dot, DO), aligned_stride(stride_doh, DO)
    return stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh


@triton.jit
def _bwd_input_bases(Q, K, V, DO, Lse, Delta, first, head_64, num_tokens, stride_qt, stride_qh, stride_kt, stride_kh,
                     stride_vt, stride_vh, stride_dot, stride_doh):  # fmt: skip
    """The backward's input pointers moved to the segment's first token (``first``, int64) of head ``head_64``:
    64-bit scalar base offsets, so in-batch offsets can stay 32-bit (as in the forward)."""
    return (
        Q + first * stride_qt + head_64 * stride_qh,
        K + first * stride_kt + head_64 * stride_kh,
        V + first * stride_vt + head_64 * stride_vh,
        DO + first * stride_dot + head_64 * stride_doh,
        Lse + head_64 * num_tokens + first,
        Delta + head_64 * num_tokens + first,
    )


@triton.jit
def _load_row_pair(A, B, rows, stride_at, stride_bt, offs_dm, offs_dt, row_mask, HEAD_DIM: tl.constexpr,
                   HAS_TAIL: tl.constexpr):  # fmt: skip
    """The same rows of two tensors, zeros outside ``row_mask``: ``(a_main, b_main, a_tail, b_tail)``; without a
    tail the tail names hold the main tiles again, unused (Triton binds names on both paths)."""
    a_main = _load_rows(A, rows, stride_at, offs_dm, row_mask, HEAD_DIM, True)
    b_main = _load_rows(B, rows, stride_bt, offs_dm, row_mask, HEAD_DIM, True)
    a_tail, b_tail = a_main, b_main
    if HAS_TAIL:
        a_tail = _load_rows(A, rows, stride_at, offs_dt, row_mask, HEAD_DIM, True)
        b_tail = _load_rows(B, rows, stride_bt, offs_dt, row_mask, HEAD_DIM, True)
    return a_main, b_main, a_tail, b_tail


@triton.jit(do_not_specialize=["num_segments", "search_steps"])
def _attn_bwd_dkdv_kernel(
    # pointers; Lse and Delta are fp32, head h's tokens at h * T
    Q, K, V, DO, DK, DV, Lse, Delta, CuSeqlens,
    # sizes
    num_segments, search_steps, num_tokens,
    # scalars: qk_scale = softmax_scale * log2(e)
    qk_scale, softmax_scale,
    # strides (tokens, heads); the last dim is contiguous
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    # meta-parameters
    HEAD_DIM: tl.constexpr, D_MAIN: tl.constexpr, D_TAIL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WIDE_OFFSETS: tl.constexpr, STRIDES_ALIGNED: tl.constexpr,
):  # fmt: skip
    """dK and dV of one ``BLOCK_N``-key block of one head: its K and V stay in registers while the
    program walks the query blocks of its segment."""
    pid = tl.program_id(0)
    head = tl.program_id(1)
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh = _bwd_input_strides(
        Q, K, V, DO, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
        STRIDES_ALIGNED,
    )  # fmt: skip
    if STRIDES_ALIGNED:
        stride_dkt, stride_dkh = aligned_stride(stride_dkt, DK), aligned_stride(stride_dkh, DK)
        stride_dvt, stride_dvh = aligned_stride(stride_dvt, DV), aligned_stride(stride_dvh, DV)
    seq_start, seqlen, n_start = _program_tile(CuSeqlens, pid, num_segments, search_steps, BLOCK_N)

    if n_start < seqlen:
        HAS_TAIL: tl.constexpr = D_TAIL > 0
        D_TAIL_TILE: tl.constexpr = D_TAIL if D_TAIL > 0 else 16
        first = seq_start.to(tl.int64)
        head_64 = head.to(tl.int64)
        Q, K, V, DO, Lse, Delta = _bwd_input_bases(
            Q, K, V, DO, Lse, Delta, first, head_64, num_tokens,
            stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
        )  # fmt: skip
        DK += first * stride_dkt + head_64 * stride_dkh
        DV += first * stride_dvt + head_64 * stride_dvh

        offs_n = n_start + tl.arange(0, BLOCK_N)
        kv_mask = offs_n < seqlen
        kv_rows = offs_n.to(tl.int64) if WIDE_OFFSETS else offs_n
        offs_dm = tl.arange(0, D_MAIN)
        offs_dt = D_MAIN + tl.arange(0, D_TAIL_TILE)
        # Keys past the segment load as zeros; their dK and dV rows are never stored.
        k_main, v_main, k_tail, v_tail = _load_row_pair(
            K, V, kv_rows, stride_kt, stride_vt, offs_dm, offs_dt, kv_mask, HEAD_DIM, HAS_TAIL
        )
        dk_main = tl.zeros([BLOCK_N, D_MAIN], dtype=tl.float32)
        dv_main = tl.zeros([BLOCK_N, D_MAIN], dtype=tl.float32)
        dk_tail = tl.zeros([BLOCK_N, D_TAIL_TILE], dtype=tl.float32)
        dv_tail = tl.zeros([BLOCK_N, D_TAIL_TILE], dtype=tl.float32)

        full_end = (seqlen // BLOCK_M) * BLOCK_M
        for m_start in range(0, full_end, BLOCK_M):
            dk_main, dk_tail, dv_main, dv_tail = _attn_bwd_dkdv_q_block(
                dk_main, dk_tail, dv_main, dv_tail, k_main, k_tail, v_main, v_tail,
                Q, DO, Lse, Delta, m_start, seqlen, stride_qt, stride_dot, qk_scale, offs_dm, offs_dt,
                HEAD_DIM, HAS_TAIL, BLOCK_M, False, DOT_PRECISION, WIDE_OFFSETS,
            )  # fmt: skip
        if full_end < seqlen:
            dk_main, dk_tail, dv_main, dv_tail = _attn_bwd_dkdv_q_block(
                dk_main, dk_tail, dv_main, dv_tail, k_main, k_tail, v_main, v_tail,
                Q, DO, Lse, Delta, full_end, seqlen, stride_qt, stride_dot, qk_scale, offs_dm, offs_dt,
                HEAD_DIM, HAS_TAIL, BLOCK_M, True, DOT_PRECISION, WIDE_OFFSETS,
            )  # fmt: skip

        _store_rows(DK, kv_rows, stride_dkt, offs_dm, kv_mask, dk_main * softmax_scale, HEAD_DIM)
        _store_rows(DV, kv_rows, stride_dvt, offs_dm, kv_mask, dv_main, HEAD_DIM)
        if HAS_TAIL:
            _store_rows(DK, kv_rows, stride_dkt, offs_dt, kv_mask, dk_tail * softmax_scale, HEAD_DIM)
            _store_rows(DV, kv_rows, stride_dvt, offs_dt, kv_mask, dv_tail, HEAD_DIM)


@triton.jit
def _attn_bwd_dq_kv_block(
    dq_main, dq_tail, q_main, q_tail, do_main, do_tail, lse2, delta,
    K, V, kv_start, seqlen, stride_kt, stride_vt, qk_scale, offs_dm, offs_dt,
    HEAD_DIM: tl.constexpr, HAS_TAIL: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_KV: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDE_OFFSETS: tl.constexpr,
):  # fmt: skip
    """Add the keys ``[kv_start, kv_start + BLOCK_N)`` of the segment to one query block's dQ (K and V
    point at the segment's first token; ``lse2`` is the rows' log-sum-exp in base 2)."""
    offs_n = kv_start + tl.arange(0, BLOCK_N)
    kv_mask = offs_n < seqlen
    rows = offs_n.to(tl.int64) if WIDE_OFFSETS else offs_n
    k_main = _load_rows(K, rows, stride_kt, offs_dm, kv_mask, HEAD_DIM, MASK_KV)
    s = tl.dot(q_main, tl.trans(k_main), input_precision=DOT_PRECISION)
    k_tail = k_main
    if HAS_TAIL:
        k_tail = _load_rows(K, rows, stride_kt, offs_dt, kv_mask, HEAD_DIM, MASK_KV)
        s = tl.dot(q_tail, tl.trans(k_tail), s, input_precision=DOT_PRECISION)
    p = tl.exp2(s * qk_scale - lse2[:, None])
    if MASK_KV:
        p = tl.where(kv_mask[None, :], p, 0.0)

    v_main = _load_rows(V, rows, stride_vt, offs_dm, kv_mask, HEAD_DIM, MASK_KV)
    dp = tl.dot(do_main, tl.trans(v_main), input_precision=DOT_PRECISION)
    if HAS_TAIL:
        v_tail = _load_rows(V, rows, stride_vt, offs_dt, kv_mask, HEAD_DIM, MASK_KV)
        dp = tl.dot(do_tail, tl.trans(v_tail), dp, input_precision=DOT_PRECISION)
    ds = (p * (dp - delta[:, None])).to(K.dtype.element_ty)
    dq_main = tl.dot(ds, k_main, dq_main, input_precision=DOT_PRECISION)
    if HAS_TAIL:
        dq_tail = tl.dot(ds, k_tail, dq_tail, input_precision=DOT_PRECISION)
    return dq_main, dq_tail


@triton.jit(do_not_specialize=["num_segments", "search_steps"])
def _attn_bwd_dq_kernel(
    # pointers; Lse and Delta are fp32, head h's tokens at h * T
    Q, K, V, DO, DQ, Lse, Delta, CuSeqlens,
    # sizes
    num_segments, search_steps, num_tokens,
    # scalars: qk_scale = softmax_scale * log2(e)
    qk_scale, softmax_scale,
    # strides (tokens, heads); the last dim is contiguous
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_dqt, stride_dqh,
    # meta-parameters
    HEAD_DIM: tl.constexpr, D_MAIN: tl.constexpr, D_TAIL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WIDE_OFFSETS: tl.constexpr, STRIDES_ALIGNED: tl.constexpr,
):  # fmt: skip
    """dQ of one ``BLOCK_M``-query block of one head: its q and dO stay in registers while the program
    walks the key blocks of its segment, as the forward does."""
    pid = tl.program_id(0)
    head = tl.program_id(1)
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh = _bwd_input_strides(
        Q, K, V, DO, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
        STRIDES_ALIGNED,
    )  # fmt: skip
    if STRIDES_ALIGNED:
        stride_dqt, stride_dqh = aligned_stride(stride_dqt, DQ), aligned_stride(stride_dqh, DQ)
    seq_start, seqlen, m_start = _program_tile(CuSeqlens, pid, num_segments, search_steps, BLOCK_M)

    if m_start < seqlen:
        HAS_TAIL: tl.constexpr = D_TAIL > 0
        D_TAIL_TILE: tl.constexpr = D_TAIL if D_TAIL > 0 else 16
        first = seq_start.to(tl.int64)
        head_64 = head.to(tl.int64)
        Q, K, V, DO, Lse, Delta = _bwd_input_bases(
            Q, K, V, DO, Lse, Delta, first, head_64, num_tokens,
            stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
        )  # fmt: skip
        DQ += first * stride_dqt + head_64 * stride_dqh

        offs_m = m_start + tl.arange(0, BLOCK_M)
        q_mask = offs_m < seqlen
        q_rows = offs_m.to(tl.int64) if WIDE_OFFSETS else offs_m
        offs_dm = tl.arange(0, D_MAIN)
        offs_dt = D_MAIN + tl.arange(0, D_TAIL_TILE)
        # Rows past the segment load as zeros (lse 0 keeps their probabilities finite); never stored.
        q_main, do_main, q_tail, do_tail = _load_row_pair(
            Q, DO, q_rows, stride_qt, stride_dot, offs_dm, offs_dt, q_mask, HEAD_DIM, HAS_TAIL
        )
        lse2 = tl.load(Lse + offs_m, mask=q_mask, other=0.0) * LOG2E
        delta = tl.load(Delta + offs_m, mask=q_mask, other=0.0)
        dq_main = tl.zeros([BLOCK_M, D_MAIN], dtype=tl.float32)
        dq_tail = tl.zeros([BLOCK_M, D_TAIL_TILE], dtype=tl.float32)

        full_end = (seqlen // BLOCK_N) * BLOCK_N
        for kv_start in range(0, full_end, BLOCK_N):
            dq_main, dq_tail = _attn_bwd_dq_kv_block(
                dq_main, dq_tail, q_main, q_tail, do_main, do_tail, lse2, delta,
                K, V, kv_start, seqlen, stride_kt, stride_vt, qk_scale, offs_dm, offs_dt,
                HEAD_DIM, HAS_TAIL, BLOCK_N, False, DOT_PRECISION, WIDE_OFFSETS,
            )  # fmt: skip
        if full_end < seqlen:
            dq_main, dq_tail = _attn_bwd_dq_kv_block(
                dq_main, dq_tail, q_main, q_tail, do_main, do_tail, lse2, delta,
                K, V, full_end, seqlen, stride_kt, stride_vt, qk_scale, offs_dm, offs_dt,
                HEAD_DIM, HAS_TAIL, BLOCK_N, True, DOT_PRECISION, WIDE_OFFSETS,
            )  # fmt: skip

        _store_rows(DQ, q_rows, stride_dqt, offs_dm, q_mask, dq_main * softmax_scale, HEAD_DIM)
        if HAS_TAIL:
            _store_rows(DQ, q_rows, stride_dqt, offs_dt, q_mask, dq_tail * softmax_scale, HEAD_DIM)


# Tiles measured on devices by bench/tune_attention.py, read by launch_config (see tile_table).
TILE_TABLE_PATH = Path(__file__).with_name("attention_tiles.json")
# The meta-parameters a tile-table entry sets: tile shape, pipelining, and whether K and V load through TMA.
TILE_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "DESCRIPTORS")


@functools.cache
def tile_table() -> dict[str, dict]:
    """The packaged tile table: ``{tile_key(...): {BLOCK_M, BLOCK_N, num_warps, num_stages, DESCRIPTORS, ...}}``
    (extra fields record what was measured). Read once; empty when no device run has written it."""
    return json.loads(TILE_TABLE_PATH.read_text())["tiles"]


def segment_class(max_seqlen: int | None) -> str:
    """The tile hint's class: ``"short"`` for a ``max_seqlen`` of at most :data:`SHORT_SEGMENT_MAX`, else
    ``"long"`` (also when no hint is given)."""
    return "short" if max_seqlen is not None and max_seqlen <= SHORT_SEGMENT_MAX else "long"


def tile_key(target: GPUTarget, head_dim: int, dtype: torch.dtype, max_seqlen: int | None) -> str:
    """The tile table's key for a launch: ``"cuda:90/bfloat16/D72/long"``."""
    dtype_name = str(dtype).removeprefix("torch.")
    return f"{target.backend}:{target.arch}/{dtype_name}/D{head_dim}/{segment_class(max_seqlen)}"


def tma_capable(target: GPUTarget) -> bool:
    """Whether K and V may load through tensor descriptors on ``target``: Hopper and later NVIDIA GPUs (TMA
    hardware), and the interpreter, which emulates them (so the tests run the descriptor path on CPU)."""
    return (target.backend == "cuda" and target.arch >= 90) or target.backend == "interpreter"


def _head_dim_config(head_dim: int, dtype: torch.dtype) -> dict:
    """What every attention kernel's launch takes besides its tiles: the head-dim tiling
    (:func:`head_dim_tiles`), the dot precision (fp32 exact, 16-bit on tensor cores) and the FMA option."""
    main, tail = head_dim_tiles(head_dim)
    precision = "ieee" if dtype == torch.float32 else "tf32"
    return dict(HEAD_DIM=head_dim, D_MAIN=main, D_TAIL=tail, DOT_PRECISION=precision, **FMA_CONTRACTION)


def launch_config(head_dim: int, dtype: torch.dtype, target: GPUTarget, max_seqlen: int | None = None) -> dict:
    """Everything the attention launch passes besides tensors, scalars and per-call flags (rope on q,
    64-bit offsets, aligned strides): head-dim tiling, tile sizes, pipelining, whether K and V may load
    through TMA descriptors, and compile options for ``head_dim`` in ``dtype`` on ``target`` (see
    :func:`qvl.kernels.common.device_target`), given the caller's ``max_seqlen`` hint (a host int or None; only
    its class matters: :func:`segment_class`).

    A tile-table entry for the launch (:func:`tile_table`, keyed by :func:`tile_key`: what a device measured)
    sets the tiles; without one, the heuristic below does, with pointer loads. A descriptor entry is only
    followed where the tensors allow it (see :func:`vision_attn_launches`).

    fp32 tiles, and 16-bit ones wider than 128, are halved so their staged copies fit the 227 KiB of shared
    memory a Hopper block may use; fp32 tiles wider than 128 (136 KiB at 64 x 32) are quartered again where
    a block may use less (99 KiB on sm_86, sm_89, sm_12x). tests/kernels/test_cuda_compile.py compiles them
    for sm_90 and sm_89 and checks. The interpreter ignores warps, stages and options.

    Short segments (a hint of at most 64: Qwen2.5-VL's 112-pixel windows are 8 x 8 patches) take 64 x 64
    tiles with one warpgroup in 16-bit dtypes up to D 128 (the others are 64 rows already): a 64-token
    window is then exactly one query tile and one key block, where 128-row tiles execute twice the useful
    matmul work. Longer segments keep 128-row tiles, which load each key/value block once per 128 queries;
    from 65 tokens up 64-row tiles save little work anyway (none up to 128 tokens: both cover
    ``ceil(S / 64) * 64`` keys for 128 query rows).
    """
    main, tail = head_dim_tiles(head_dim)
    tuned = tile_table().get(tile_key(target, head_dim, dtype, max_seqlen))
    if tuned is not None:
        tiles = {key: tuned[key] for key in TILE_KEYS}
    elif dtype == torch.float32 or main + tail > 128:
        tiles = dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2, DESCRIPTORS=False)
        budget = shared_memory_per_block(target)
        if dtype == torch.float32 and main + tail > 128 and budget is not None and budget < 136 * 1024:
            tiles = dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=2, DESCRIPTORS=False)
    elif segment_class(max_seqlen) == "short":
        tiles = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2, DESCRIPTORS=False)
    else:
        tiles = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, DESCRIPTORS=False)
    return {**_head_dim_config(head_dim, dtype), **tiles}


def backward_launch_config(head_dim: int, dtype: torch.dtype, max_seqlen: int | None = None) -> dict[str, dict]:
    """The backward's counterpart of :func:`launch_config`: ``{"dkdv": ..., "dq": ...}``, the meta-parameters
    and compile options of the dK/dV and the dQ kernels (same head-dim tiling and precision as the forward).

    The dK/dV program keeps a key block's K, V and two fp32 accumulators resident and streams narrow query
    blocks past them; the dQ program is the forward's shape, a wide query block streaming narrow key
    blocks. In 16-bit dtypes up to D 128, 128 resident rows with 32-row blocks streaming compile without
    spills on sm_90 (up to 245 registers at D 128, 8 warps); a short-segment hint (at most
    :data:`SHORT_SEGMENT_MAX`) takes 64 resident rows and one warpgroup, so a 64-token window is one
    program; wider 16-bit heads take 64 resident rows and 8 warps (a 240-byte stack remains at D 256). fp32
    dots run on FMA units, not tensor cores, and hold far more in registers: fp32 takes 32 x 16 tiles,
    which still spill (a few KiB of stack, as the forward's fp32 tiles do), a correctness path rather than a
    fast one. Every target gets the same tiles: the widest (fp32 at D 256) fit the 99 KiB of shared memory
    of sm_86, sm_89 and sm_12x; tests/kernels/compile_sm90.py compiles them for sm_90 and sm_89. The
    interpreter ignores warps, stages and options.
    """
    main, tail = head_dim_tiles(head_dim)
    if dtype == torch.float32:
        dkdv = dict(BLOCK_M=16, BLOCK_N=32, num_warps=8, num_stages=2)
        dq = dict(BLOCK_M=32, BLOCK_N=16, num_warps=8, num_stages=2)
    elif main + tail > 128:
        dkdv = dict(BLOCK_M=32, BLOCK_N=64, num_warps=8, num_stages=2)
        dq = dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=2)
    elif segment_class(max_seqlen) == "short":
        dkdv = dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=2)
        dq = dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
    else:
        dkdv = dict(BLOCK_M=32, BLOCK_N=128, num_warps=8, num_stages=3)
        dq = dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=3)
    common = _head_dim_config(head_dim, dtype)
    return {"dkdv": {**common, **dkdv}, "dq": {**common, **dq}}


class AttentionWork(NamedTuple):
    """The matmul work of one attention launch per head (see :func:`launch_work`), in flops."""

    executed: int  # what the programs' tl.dot calls multiply, padding included
    useful: int  # 4 * S**2 * D summed over segments: q.k and p.v of the real rows, keys and columns
    programs: int  # programs per head in the grid
    busy_programs: int  # those that own a query tile (the others return after finding their segment)

    @property
    def ratio(self) -> float:
        """executed / useful (1.0 for a launch with no work)."""
        return self.executed / self.useful if self.useful else 1.0


def launch_work(cu_seqlens: np.ndarray, config: dict) -> AttentionWork:
    """The matmul work the attention kernel executes per head for ``cu_seqlens`` (host ints, any sequence)
    with ``config`` (:func:`launch_config`), against the useful work. A pure function of host data, as the
    kernel runs it: a segment of S tokens has ``ceil(S / BLOCK_M)`` busy programs, each multiplying a
    ``BLOCK_M``-row q tile with ``ceil(S / BLOCK_N)`` key blocks of ``BLOCK_N`` keys, over ``D_MAIN + D_TAIL``
    columns, twice (q.k and p.v)."""
    bounds = np.asarray(cu_seqlens, dtype=np.int64).reshape(-1)
    lengths = np.diff(bounds)
    block_m, block_n = config["BLOCK_M"], config["BLOCK_N"]
    width = config["D_MAIN"] + config["D_TAIL"]
    tiles = -(-lengths // block_m)
    keys = -(-lengths // block_n) * block_n
    return AttentionWork(
        executed=int((tiles * block_m * keys).sum()) * width * 4,
        useful=int((lengths * lengths).sum()) * config["HEAD_DIM"] * 4,
        programs=int(bounds[-1]) // block_m + lengths.size if lengths.size else 0,
        busy_programs=int(tiles.sum()),
    )


def _search_steps(num_segments: int) -> int:
    """Binary-search steps that find a program's segment among ``num_segments`` (see _program_tile)."""
    return max(1, (num_segments - 1).bit_length())


def _needs_wide_offsets(num_tokens: int, *tensors: torch.Tensor | None) -> bool:
    """Whether a token offset inside the batch (at most T * token stride) can pass int32."""
    return any(t is not None and num_tokens * t.stride(0) >= 2**31 for t in tensors)


def vision_attn_launches(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens: torch.Tensor,
    softmax_scale: float | None,
    positions: torch.Tensor | None,
    rope_theta: float,
    target: GPUTarget,
    max_seqlen: int | None = None,
    lse: torch.Tensor | None = None,
    tiles: dict | None = None,
) -> list[KernelLaunch]:
    """The launches :func:`vision_attn` runs, in order, for checked arguments and its output ``out``
    (contiguous ``(T, H, D)``, written by the last launch): with ``positions``, the rotary kernel rotating
    k into a scratch tensor allocated here, then the attention kernel, tiled for the ``max_seqlen`` hint.
    Given ``lse`` (fp32 flat ``(H * T,)``, head-major, what the backward needs), the attention kernel also writes
    each row's log-sum-exp of the scaled logits into it (natural log); without it, nothing more than the
    output is written. Empty when there is nothing to do. Reads shapes, strides, data pointers and the
    host int ``max_seqlen`` only (no device sync).

    ``tiles`` (the tuner's and the tests' handle) overrides :func:`launch_config`'s choice of any of
    :data:`TILE_KEYS`. K and V load through TMA descriptors (built here, on the host, passed by value: CUDA-graph
    safe) when the configuration asks for it, the target has TMA (:func:`tma_capable`) and every row of K and
    V starts on a 16-byte boundary (TMA's alignment rule); otherwise through pointers."""
    num_tokens, num_heads, head_dim = q.shape
    num_segments = cu_seqlens.shape[0] - 1
    if num_tokens == 0 or num_heads == 0 or num_segments == 0:
        return []
    launches = []
    apply_rope = positions is not None
    if apply_rope:
        # k is rotated once here; q, tile by tile, in the kernel (see the module docstring for why).
        k_rotated = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        launches += rotary_launches(None, k, None, k_rotated, positions, rope_theta, target)
        k = k_rotated
    config = {**launch_config(head_dim, q.dtype, target, max_seqlen), **(tiles or {})}
    kv_aligned = rows_16_byte_aligned(k, v)
    config["DESCRIPTORS"] = bool(config["DESCRIPTORS"]) and tma_capable(target) and kv_aligned
    flags = dict(
        ROTATE_Q=apply_rope,
        WIDE_OFFSETS=_needs_wide_offsets(num_tokens, q, k, v, out, positions),
        STRIDES_ALIGNED=kv_aligned and rows_16_byte_aligned(q, out),
        STORE_LSE=lse is not None,
    )
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    grid = (num_tokens // config["BLOCK_M"] + num_segments, num_heads)
    kv_strides = (k.stride(0), k.stride(1), v.stride(0), v.stride(1))
    k_tail = v_tail = cu_seqlens  # Pointers a variant does not read get cu_seqlens as a placeholder.
    if config["DESCRIPTORS"]:
        k, k_tail = _kv_descriptors(k, config)
        v, v_tail = _kv_descriptors(v, config)
    args = (
        q, k, v, k_tail, v_tail, out, cu_seqlens, positions if apply_rope else cu_seqlens,
        cu_seqlens if lse is None else lse,
        num_segments, _search_steps(num_segments),
        scale * math.log2(math.e), math.log2(rope_theta),
        q.stride(0), q.stride(1), *kv_strides,
        out.stride(0), out.stride(1), positions.stride(0) if apply_rope else 0, 0 if lse is None else q.shape[0],
    )  # fmt: skip
    launches.append(KernelLaunch(_vision_attn_kernel, grid, args, {**config, **flags}))
    return launches


def _kv_descriptors(x: torch.Tensor, config: dict) -> tuple[TensorDescriptor, TensorDescriptor]:
    """TMA descriptors of a ``(T, H, D)`` key or value tensor: main boxes ``(BLOCK_N, 1, D_MAIN)`` and tail
    boxes ``(BLOCK_N, 1, D_TAIL)`` (the main box again where there is no tail, unread then). Out-of-bounds
    rows and columns read as zeros."""
    main, tail = config["D_MAIN"], config["D_TAIL"] or config["D_MAIN"]
    shape, strides = list(x.shape), list(x.stride())
    return (
        TensorDescriptor(x, shape, strides, [config["BLOCK_N"], 1, main]),
        TensorDescriptor(x, shape, strides, [config["BLOCK_N"], 1, tail]),
    )


def vision_attn_backward_launches(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    softmax_scale: float | None,
    positions: torch.Tensor | None,
    rope_theta: float,
    target: GPUTarget,
    max_seqlen: int | None = None,
) -> list[KernelLaunch]:
    """The launches :func:`vision_attn_backward` runs, in order, writing the gradients ``dq``, ``dk``,
    ``dv`` (new ``(T, H, D)`` tensors in q's dtype, last dim contiguous) from the forward's arguments, its
    output ``out``, the output's gradient ``grad_out`` (``(T, H, D)``, last dim contiguous) and the
    forward's ``lse`` (fp32 flat ``(H * T,)``, see :func:`vision_attn_launches`), all unchanged:

    1. with ``positions``: the rotary kernel rotates q and k into scratch tensors allocated here (what the
       forward multiplied, rounded to the dtype as it rounded them);
    2. delta = rowsum(grad_out * out), fp32 ``(H, T)`` scratch;
    3. the dK/dV kernel, a program per key block and head (grid ``(T // BLOCK_N + B, H)``);
    4. the dQ kernel, a program per query block and head (grid ``(T // BLOCK_M + B, H)``);
    5. with ``positions``: the inverse rotation of dq and dk, in place (the rotation is orthogonal, so its
       backward is its inverse).

    Only dq, dk, dv and the scratch tensors are written. Empty when there is nothing to do. Reads shapes,
    strides, data pointers and the host int ``max_seqlen`` only (no device sync)."""
    num_tokens, num_heads, head_dim = q.shape
    num_segments = cu_seqlens.shape[0] - 1
    if num_tokens == 0 or num_heads == 0 or num_segments == 0:
        return []
    launches = []
    if positions is not None:
        q_rotated = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        k_rotated = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        launches += rotary_launches(q, k, q_rotated, k_rotated, positions, rope_theta, target)
        q, k = q_rotated, k_rotated

    delta = torch.empty((num_heads, num_tokens), dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(head_dim)
    block_t = max(1, min(64, 4096 // block_d))
    launches.append(
        KernelLaunch(
            _attn_bwd_delta_kernel,
            (triton.cdiv(num_tokens, block_t), num_heads),
            (out, grad_out, delta, num_tokens, out.stride(0), out.stride(1), grad_out.stride(0), grad_out.stride(1)),
            dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_T=block_t, num_warps=4, **FMA_CONTRACTION),
        )
    )

    configs = backward_launch_config(head_dim, q.dtype, max_seqlen)
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    sizes = (num_segments, _search_steps(num_segments), num_tokens, scale * math.log2(math.e), scale)
    wide = _needs_wide_offsets(num_tokens, q, k, v, grad_out, dq, dk, dv)
    launches.append(
        KernelLaunch(
            _attn_bwd_dkdv_kernel,
            (num_tokens // configs["dkdv"]["BLOCK_N"] + num_segments, num_heads),
            (
                q,
                k,
                v,
                grad_out,
                dk,
                dv,
                lse,
                delta,
                cu_seqlens,
                *sizes,
                q.stride(0),
                q.stride(1),
                k.stride(0),
                k.stride(1),
                v.stride(0),
                v.stride(1),
                grad_out.stride(0),
                grad_out.stride(1),
                dk.stride(0),
                dk.stride(1),
                dv.stride(0),
                dv.stride(1),
            ),  # fmt: skip
            dict(configs["dkdv"], WIDE_OFFSETS=wide, STRIDES_ALIGNED=rows_16_byte_aligned(q, k, v, grad_out, dk, dv)),
        )
    )
    launches.append(
        KernelLaunch(
            _attn_bwd_dq_kernel,
            (num_tokens // configs["dq"]["BLOCK_M"] + num_segments, num_heads),
            (
                q,
                k,
                v,
                grad_out,
                dq,
                lse,
                delta,
                cu_seqlens,
                *sizes,
                q.stride(0),
                q.stride(1),
                k.stride(0),
                k.stride(1),
                v.stride(0),
                v.stride(1),
                grad_out.stride(0),
                grad_out.stride(1),
                dq.stride(0),
                dq.stride(1),
            ),  # fmt: skip
            dict(configs["dq"], WIDE_OFFSETS=wide, STRIDES_ALIGNED=rows_16_byte_aligned(q, k, v, grad_out, dq)),
        )
    )
    if positions is not None:
        launches += rotary_launches(dq, dk, dq, dk, positions, rope_theta, target, inverse=True)
    return launches


def vision_attn_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    softmax_scale: float | None = None,
    positions: torch.Tensor | None = None,
    rope_theta: float = 10000.0,
) -> torch.Tensor:
    """Pure-torch varlen attention with the op's semantics; returns a contiguous tensor in q's dtype.

    Computes in fp32 (float64 inputs in float64, the tests' ground truth). Reads ``cu_seqlens`` on the
    host: this is the CPU path and the tests' oracle, not a GPU path. Differentiable with torch's autograd.
    """
    return _attention_reference(q, k, v, cu_seqlens, softmax_scale, positions, rope_theta, with_lse=False)[0]


def _attention_reference(
    q, k, v, cu_seqlens, softmax_scale, positions, rope_theta, with_lse: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`vision_attn_reference`'s output and, with ``with_lse``, the rows' log-sum-exp of the scaled
    logits as the kernel stores it (fp32 flat ``(H * T,)``, head-major)."""
    head_dim = q.shape[-1]
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    if positions is not None:
        q, k = rotary_2d_reference(q, k, positions, rope_theta)
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = _empty_lse(q) if with_lse else None
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        qs, ks, vs = (x[start:end].to(compute).transpose(0, 1) for x in (q, k, v))
        logits = (qs @ ks.transpose(1, 2)) * scale
        out[start:end] = (torch.softmax(logits, dim=-1) @ vs).transpose(0, 1).to(q.dtype)
        if lse is not None:
            lse.view(q.shape[1], q.shape[0])[:, start:end] = torch.logsumexp(logits, dim=-1)
    return out, lse


def vision_attn_backward_reference(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens: torch.Tensor,
    softmax_scale: float | None = None,
    positions: torch.Tensor | None = None,
    rope_theta: float = 10000.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pure-torch :func:`vision_attn_backward`, segment by segment, with the kernels' formulas (probabilities
    from the saved ``lse``, delta = rowsum(grad_out * out)) in fp32; returns contiguous ``(dq, dk, dv)`` in
    q's dtype. Rounds where the kernels round: rotated q, k and the rotated gradients to q's dtype."""
    head_dim = q.shape[-1]
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    if positions is not None:
        q, k = rotary_2d_reference(q, k, positions, rope_theta)
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    # Every token lies in exactly one segment (cu_seqlens starts at 0 and ends at T), so all rows get written.
    dq, dk, dv = (torch.empty(q.shape, dtype=q.dtype, device=q.device) for _ in range(3))
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        qs, ks, vs, dos, os = (x[start:end].to(compute).transpose(0, 1) for x in (q, k, v, grad_out, out))
        p = torch.exp((qs @ ks.transpose(1, 2)) * scale - lse.view(q.shape[1], -1)[:, start:end, None].to(compute))
        dp = dos @ vs.transpose(1, 2)
        ds = p * (dp - (dos * os).sum(-1, keepdim=True))
        dq[start:end] = (ds @ ks * scale).transpose(0, 1).to(q.dtype)
        dk[start:end] = (ds.transpose(1, 2) @ qs * scale).transpose(0, 1).to(q.dtype)
        dv[start:end] = (p.transpose(1, 2) @ dos).transpose(0, 1).to(q.dtype)
    if positions is not None:
        dq, dk = rotary_2d_reference(dq, dk, positions, rope_theta, inverse=True)
    return dq, dk, dv


def _check_attn_args(
    q, k, v, cu_seqlens, max_seqlen, softmax_scale, positions, rope_theta, read_values: bool = True
) -> None:
    op = "vision_attn"
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(op, name, x, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    for name, x in (("k", k), ("v", v)):
        if x.shape != q.shape:
            raise ValueError(f"{op}: {name} must have q's shape {tuple(q.shape)}, got {tuple(x.shape)}")
        if x.dtype != q.dtype:
            raise TypeError(f"{op}: {name} must have q's dtype {q.dtype}, got {x.dtype}")
    check_same_device(op, {"q": q, "k": k, "v": v})
    head_dim = q.shape[-1]
    if not 0 < head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"{op}: head dim D = q.shape[-1] must be in 1..{MAX_HEAD_DIM}, got {head_dim}")
    if (
        max_seqlen is not None
        and not isinstance(max_seqlen, torch.SymInt)
        and (not isinstance(max_seqlen, int) or max_seqlen < 0)
    ):
        raise ValueError(f"{op}: max_seqlen must be None or a non-negative int, got {max_seqlen!r}")
    if softmax_scale is not None and not (softmax_scale > 0 and math.isfinite(softmax_scale)):
        raise ValueError(f"{op}: softmax_scale must be None or a finite number > 0, got {softmax_scale}")
    check_cu_seqlens(op, cu_seqlens, q.shape[0], q.device, read_values)
    if positions is not None:
        check_rope_head_dim(op, head_dim)
        check_rope_theta(op, rope_theta)
        check_positions(op, positions, q.shape[0], q.device, read_values)


@torch.library.custom_op("qvl::vision_attn", mutates_args=(), device_types=("cpu", "cuda"))
def vision_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None = None,
    softmax_scale: float | None = None,
    positions: torch.Tensor | None = None,
    rope_theta: float = 10000.0,
) -> torch.Tensor:
    """Non-causal attention of each token over the tokens of its own segment.

    Args:
        q, k, v: ``(T, H, D)``, fp16/bf16/fp32, one dtype and device, last dim contiguous (token and
            head strides free: ``qkv.view(T, 3, H, D).unbind(1)`` views work without copies). D <= 256.
        cu_seqlens: int32 ``(B + 1,)`` on q's device: 0, non-decreasing, ends at T. Zero-length
            segments and T = 0 are fine.
        max_seqlen: optional tile hint: a host int bounding the segment lengths, e.g. the metadata's
            ``max_seqlen`` or the window length of window attention (None: no bound). At most 64 picks
            64-row query tiles in 16-bit dtypes (see :func:`launch_config`); nothing else depends on it.
            It is never checked against ``cu_seqlens`` (that would need the values): a hint smaller than a
            real segment still gives correct results, that segment just runs on more, smaller tiles. The
            result may differ with the hint only by rounding order (the key-block size of the online
            softmax).
        softmax_scale: defaults to ``D ** -0.5``.
        positions: optional int32 ``(T, 2)`` (row, col) per token: apply Qwen3-VL's 2D rotary embedding
            (same result as :func:`rotary_2d` first). q is rotated as the kernel loads it; k once, into a
            scratch ``(T, H, D)`` tensor freed on return. Needs D % 4 == 0.
        rope_theta: rotary base, used with ``positions``.

    Returns a new contiguous ``(T, H, D)`` tensor in q's dtype; softmax and accumulation in fp32.
    Nothing is mutated. Any layout is accepted; one whose rows all start on 16-byte boundaries (packed qkv
    views, contiguous tensors with D * itemsize a multiple of 16) loads faster. No device-to-host sync on
    CUDA.

    Differentiable in q, k and v (with ``positions`` too: the gradients reach the unrotated q and k). With
    grad mode on and one of them requiring grad, the call runs :func:`vision_attn_with_lse`, which also
    saves each row's log-sum-exp for the backward (:func:`vision_attn_backward`); otherwise this op writes
    the output alone.
    """
    return _forward(q, k, v, cu_seqlens, max_seqlen, softmax_scale, positions, rope_theta, with_lse=False)[0]


@vision_attn.register_fake
def _(q, k, v, cu_seqlens, max_seqlen=None, softmax_scale=None, positions=None, rope_theta=10000.0):
    _check_attn_args(q, k, v, cu_seqlens, max_seqlen, softmax_scale, positions, rope_theta, read_values=False)
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def _forward(
    q, k, v, cu_seqlens, max_seqlen, softmax_scale, positions, rope_theta, with_lse: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output and, ``with_lse``, the log-sum-exp (else None), on the inputs' path."""
    _check_attn_args(q, k, v, cu_seqlens, max_seqlen, softmax_scale, positions, rope_theta)
    if backend_for(q.device) == "torch":
        return _attention_reference(q, k, v, cu_seqlens, softmax_scale, positions, rope_theta, with_lse)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = _empty_lse(q) if with_lse else None
    hint = None if max_seqlen is None else int(max_seqlen)
    launches = vision_attn_launches(
        q, k, v, out, cu_seqlens, softmax_scale, positions, rope_theta, device_target(q.device), hint, lse
    )
    run_launches(launches, q.device)
    return out, lse


def _empty_lse(q: torch.Tensor) -> torch.Tensor:
    """The log-sum-exp of every (head, token) row: fp32, flat ``(H * T,)``, head ``h``'s tokens at ``h * T``. Flat,
    so that its one stride is 1 whatever T is: a compiled training graph saves it for the backward, and a stride
    of T there would be fixed at the first batch's value."""
    return torch.empty(q.shape[1] * q.shape[0], dtype=torch.float32, device=q.device)


@torch.library.custom_op("qvl::vision_attn_with_lse", mutates_args=(), device_types=("cpu", "cuda"))
def vision_attn_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None,
    softmax_scale: float | None,
    positions: torch.Tensor | None,
    rope_theta: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`vision_attn`'s forward for training: ``(out, lse)``, ``out`` computed as :func:`vision_attn`
    computes it and ``lse`` each row's log-sum-exp of the scaled logits (natural log, fp32 contiguous
    ``(H * T,)``, head ``h``'s tokens at ``h * T``; non-differentiable), which the same kernel writes with
    STORE_LSE. Arguments as :func:`vision_attn`; nothing is mutated. Its autograd formula runs
    :func:`vision_attn_backward`."""
    return _forward(q, k, v, cu_seqlens, max_seqlen, softmax_scale, positions, rope_theta, with_lse=True)


@vision_attn_with_lse.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, softmax_scale, positions, rope_theta):
    _check_attn_args(q, k, v, cu_seqlens, max_seqlen, softmax_scale, positions, rope_theta, read_values=False)
    return torch.empty(q.shape, dtype=q.dtype, device=q.device), _empty_lse(q)


def _with_lse_setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_seqlens, max_seqlen, softmax_scale, positions, rope_theta = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, positions)
    ctx.max_seqlen, ctx.softmax_scale, ctx.rope_theta = max_seqlen, softmax_scale, rope_theta


def _with_lse_backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, cu_seqlens, positions = ctx.saved_tensors
    dq, dk, dv = torch.ops.qvl.vision_attn_backward(
        last_dim_contiguous(grad_out), q, k, v, out, lse, cu_seqlens,
        ctx.max_seqlen, ctx.softmax_scale, positions, ctx.rope_theta,
    )  # fmt: skip
    return dq, dk, dv, None, None, None, None, None


vision_attn_with_lse.register_autograd(_with_lse_backward, setup_context=_with_lse_setup_context)


# vision_attn takes the training forward when autograd records the call, so the forward writes the log-sum-exp
# only then (the custom op's own Autograd registration would run vision_attn itself, which has no LSE to save).
def _training_forward(q, k, v, cu_seqlens, max_seqlen=None, softmax_scale=None, positions=None, rope_theta=10000.0):
    return torch.ops.qvl.vision_attn_with_lse(q, k, v, cu_seqlens, max_seqlen, softmax_scale, positions, rope_theta)[0]


route_autograd("vision_attn", _training_forward)


@torch.library.custom_op("qvl::vision_attn_backward", mutates_args=(), device_types=("cpu", "cuda"))
def vision_attn_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None,
    softmax_scale: float | None,
    positions: torch.Tensor | None,
    rope_theta: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients ``(dq, dk, dv)`` of :func:`vision_attn` for the output gradient ``grad_out``.

    Args:
        grad_out: ``(T, H, D)`` in q's dtype, last dim contiguous.
        q, k, v, cu_seqlens, max_seqlen, softmax_scale, positions, rope_theta: the forward's arguments
            (q and k unrotated: with ``positions`` the backward rotates them again, as the forward did).
        out: the forward's output; lse: the forward's log-sum-exp, fp32 contiguous flat ``(H * T,)``
            (:func:`vision_attn_with_lse`).

    Returns new contiguous ``(T, H, D)`` tensors in q's dtype, the gradients with respect to the unrotated
    q and k and to v; math in fp32 (see :func:`vision_attn_backward_launches`). Nothing is mutated; no
    device-to-host sync on CUDA; ``max_seqlen`` is a tile hint as in the forward.
    """
    _check_backward_args(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, softmax_scale, positions, rope_theta)
    if backend_for(q.device) == "torch":
        return vision_attn_backward_reference(
            grad_out, q, k, v, out, lse, cu_seqlens, softmax_scale, positions, rope_theta
        )
    dq, dk, dv = (torch.empty(q.shape, dtype=q.dtype, device=q.device) for _ in range(3))
    hint = None if max_seqlen is None else int(max_seqlen)
    launches = vision_attn_backward_launches(
        grad_out, q, k, v, out, lse, dq, dk, dv, cu_seqlens, softmax_scale, positions, rope_theta,
        device_target(q.device), hint,
    )  # fmt: skip
    run_launches(launches, q.device)
    return dq, dk, dv


@vision_attn_backward.register_fake
def _(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, softmax_scale, positions, rope_theta):
    _check_backward_args(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, softmax_scale, positions, rope_theta)
    return tuple(torch.empty(q.shape, dtype=q.dtype, device=q.device) for _ in range(3))


def _check_backward_args(
    grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, softmax_scale, positions, rope_theta
) -> None:
    """The forward's checks (values were read when the forward ran, so not again) and the backward's own."""
    _check_attn_args(q, k, v, cu_seqlens, max_seqlen, softmax_scale, positions, rope_theta, read_values=False)
    op = "vision_attn_backward"
    for name, x in (("grad_out", grad_out), ("out", out)):
        check_tensor(op, name, x, ndim=3, dtypes=(q.dtype,), last_dim_contiguous=True)
        if x.shape != q.shape:
            raise ValueError(f"{op}: {name} must have q's shape {tuple(q.shape)}, got {tuple(x.shape)}")
    check_tensor(op, "lse", lse, ndim=1, dtypes=(torch.float32,))
    if lse.shape[0] != q.shape[1] * q.shape[0] or not lse.is_contiguous():
        raise ValueError(
            f"{op}: lse must be a contiguous (H * T,) = ({q.shape[1] * q.shape[0]},) tensor, got shape"
            f" {tuple(lse.shape)}, strides {lse.stride()} (as vision_attn_with_lse writes it)"
        )
    check_same_device(op, {"q": q, "grad_out": grad_out, "out": out, "lse": lse})
