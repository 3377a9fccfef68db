"""The attention backward: its Triton kernels, the launches of ``torch.ops.qvl.vision_attn_backward``, its op
registration and pure-torch reference, and the autograd wiring of the forward ops (``vision_attn_with_lse``'s
formula, and :func:`~qvl.kernels.common.route_autograd` sending ``vision_attn`` calls that autograd records to
``vision_attn_with_lse``, so the forward stores the log-sum-exp only then). The kernels reuse the forward's
segment search and row loads (:mod:`.forward`) and the launch configuration of :mod:`.config`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

from ..autocast import follow_autocast, in_autocast_dtype
from ..common import (
    FMA_CONTRACTION,
    KernelLaunch,
    cdiv,
    check_same_device,
    check_tensor,
    device_target,
    next_power_of_2,
    route_autograd,
    rows_16_byte_aligned,
    run_launches,
    runs_torch,
)
from ..rotary import rotary_2d_reference, rotary_launches
from ..tiles import LOG2E, aligned_stride, last_dim_contiguous, round_to, row_vector, vector_multiple
from .config import backward_launch_config, needs_wide_offsets, segment_search_steps
from .forward import (
    check_attn_args,
    head_dim_columns,
    load_rows,
    mma,
    program_tile,
    store_rows,
    vision_attn_with_lse,
    zero_shared_columns,
)

__all__ = [
    "vision_attn_backward",
    "vision_attn_backward_launches",
    "vision_attn_backward_reference",
]


# ----------------------------------------------------------------------------------------------------
# Backward, flash-attention style: no (S x S) tensor; each probability is rebuilt from its logit and the
# row's log-sum-exp saved by the forward, P = exp(s - lse), s = q.k * scale. With dO the output's
# gradient and delta = rowsum(dO * O) (= rowsum(P * dP)):
#   dV = P^T dO,   dP = dO V^T,   dS = P * (dP - delta),   dQ = dS K * scale,   dK = dS^T Q * scale.
# Two kernels share the work without atomics (so results are deterministic): one program per key block
# accumulates dK and dV over the query blocks of its segment, one per query block accumulates dQ over the
# key blocks. Both use the forward's grid formula and segment search, and its head-dim tile.
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _attn_bwd_delta_kernel(
    # pointers
    Out,
    DOut,
    Delta,
    # sizes
    num_tokens,
    # strides (tokens, heads); the last dim is contiguous
    stride_ot,
    stride_oh,
    stride_dot,
    stride_doh,
    # meta-parameters: VEC elements divide HEAD_DIM and the four strides (row_vector)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    VEC: tl.constexpr,
):
    """delta[h, t] = sum_d dO[t, h, d] * O[t, h, d] in fp32, one ``BLOCK_T``-token tile of one head."""
    # A head stride of 72 elements proves nothing to the compiler: rows would load element by element.
    stride_ot, stride_oh = vector_multiple(stride_ot, VEC), vector_multiple(stride_oh, VEC)
    stride_dot, stride_doh = vector_multiple(stride_dot, VEC), vector_multiple(stride_doh, VEC)
    head = tl.program_id(1).to(tl.int64)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < num_tokens
    tokens = offs_t.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask = mask_t[:, None] & (offs_d[None, :] < HEAD_DIM)
    o = tl.load(Out + tokens[:, None] * stride_ot + head * stride_oh + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DOut + tokens[:, None] * stride_dot + head * stride_doh + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + head * num_tokens + offs_t, delta, mask=mask_t)


@triton.jit
def _load_pair(
    base,
    rows,
    stride_t,
    cols,
    row_mask,
    HEAD_DIM: tl.constexpr,
    D_MAIN: tl.constexpr,
    D_TAIL: tl.constexpr,
    MASK_ROWS: tl.constexpr,
):
    """A row tile over the (main, tail) head-dim tiles (:func:`~.config.head_dim_tiles`; ``cols`` as
    :func:`~.forward.head_dim_columns` returns them): ``(main, tail)``, the tail the main tile again without one."""
    main_cols, tail_cols = cols
    main = load_rows(base, rows, stride_t, main_cols, row_mask, HEAD_DIM, MASK_ROWS, D_MAIN > HEAD_DIM)
    tail = main
    if D_TAIL > 0:
        tail = load_rows(base, rows, stride_t, tail_cols, row_mask, HEAD_DIM, MASK_ROWS, False)
    return main, tail


@triton.jit
def _dot_over_head_dim(a, b_t, DOT_PRECISION: tl.constexpr, D_TAIL: tl.constexpr):
    """``a @ b_t`` summed over the head dim, for (main, tail) pairs of tiles whose head dim is the last: ``a``'s
    tail has the shared columns zeroed (:func:`~.forward.zero_shared_columns`)."""
    a_main, a_tail = a
    b_main, b_tail = b_t
    out = mma(a_main, tl.trans(b_main), None, DOT_PRECISION)
    if D_TAIL > 0:
        out = mma(a_tail, tl.trans(b_tail), out, DOT_PRECISION)
    return out


@triton.jit
def _dot_into_head_dim(x, b, acc, DOT_PRECISION: tl.constexpr, D_TAIL: tl.constexpr):
    """``acc + x @ b`` for a (main, tail) pair ``b`` of row tiles and a (main, tail) pair of accumulators."""
    b_main, b_tail = b
    acc_main, acc_tail = acc
    acc_main = mma(x, b_main, acc_main, DOT_PRECISION)
    if D_TAIL > 0:
        acc_tail = mma(x, b_tail, acc_tail, DOT_PRECISION)
    return acc_main, acc_tail


@triton.jit
def _store_pair(
    base, rows, stride_t, cols, row_mask, x, scale, HEAD_DIM: tl.constexpr, D_MAIN: tl.constexpr, D_TAIL: tl.constexpr
):
    """Store the fp32 (main, tail) pair ``x`` times ``scale``, rounded to base's dtype (see
    :func:`~.forward.store_rows`)."""
    main_cols, tail_cols = cols
    x_main, x_tail = x
    store_rows(base, rows, stride_t, main_cols, row_mask, x_main * scale, 0, HEAD_DIM)
    if D_TAIL > 0:
        store_rows(base, rows, stride_t, tail_cols, row_mask, x_tail * scale, D_MAIN, HEAD_DIM)


@triton.jit
def _zeros_pair(ROWS: tl.constexpr, D_MAIN: tl.constexpr, D_TAIL: tl.constexpr):
    """fp32 zero accumulators for the (main, tail) head-dim tiles."""
    tail_width: tl.constexpr = D_TAIL if D_TAIL > 0 else 16
    return tl.zeros([ROWS, D_MAIN], dtype=tl.float32), tl.zeros([ROWS, tail_width], dtype=tl.float32)


@triton.jit
def _attn_bwd_dkdv_q_block(
    # the key block's running (main, tail) gradients
    dk,
    dv,
    # the query block's first query in the segment
    m_start,
    # what the query loop reads (see the dK/dV kernel): the key block's resident (k, v) pairs of tiles (their
    # tails with the shared columns zeroed), (Q, DO, Lse, Delta, stride_qt, stride_dot) at the segment's first
    # token, the segment's length, the head-dim columns and the logits' scale
    kv,
    queries,
    seqlen,
    cols,
    qk_scale,
    # meta-parameters
    HEAD_DIM: tl.constexpr,
    D_MAIN: tl.constexpr,
    D_TAIL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WIDE_OFFSETS: tl.constexpr,
    MASK_Q: tl.constexpr,
):
    """Add the queries ``[m_start, m_start + BLOCK_M)`` of the segment to one key block's dK and dV; ``MASK_Q`` for
    the ragged last block. Works on transposed tiles, keys x queries, so that P^T and dS^T come out of the dots in
    the orientation dV and dK take them."""
    k, v = kv
    Q, DO, Lse, Delta, stride_qt, stride_dot = queries
    offs_m = m_start + tl.arange(0, BLOCK_M)
    q_mask = offs_m < seqlen
    rows = offs_m.to(tl.int64) if WIDE_OFFSETS else offs_m
    q = _load_pair(Q, rows, stride_qt, cols, q_mask, HEAD_DIM, D_MAIN, D_TAIL, MASK_Q)
    s_t = _dot_over_head_dim(k, q, DOT_PRECISION, D_TAIL)
    if MASK_Q:
        # Rows past the segment get lse = +inf: probability 0, so they add nothing.
        lse = tl.load(Lse + offs_m, mask=q_mask, other=float("inf"))
        delta = tl.load(Delta + offs_m, mask=q_mask, other=0.0)
    else:
        lse = tl.load(Lse + offs_m)
        delta = tl.load(Delta + offs_m)
    p_t = tl.exp2(s_t * qk_scale - (lse * LOG2E)[None, :])
    p_low = round_to(p_t, Q.dtype.element_ty)

    do = _load_pair(DO, rows, stride_dot, cols, q_mask, HEAD_DIM, D_MAIN, D_TAIL, MASK_Q)
    dv = _dot_into_head_dim(p_low, do, dv, DOT_PRECISION, D_TAIL)
    dp_t = _dot_over_head_dim(v, do, DOT_PRECISION, D_TAIL)
    ds_t = round_to(p_t * (dp_t - delta[None, :]), Q.dtype.element_ty)
    dk = _dot_into_head_dim(ds_t, q, dk, DOT_PRECISION, D_TAIL)
    return dk, dv


@triton.jit
def _bwd_input_strides(Q, K, V, DO, strides, STRIDES_ALIGNED: tl.constexpr):
    """The backward's input strides ``(stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_dot, stride_doh)``, in the provably 16-byte aligned form when the host found them so."""
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh = strides
    if STRIDES_ALIGNED:
        stride_qt, stride_qh = aligned_stride(stride_qt, Q), aligned_stride(stride_qh, Q)
        stride_kt, stride_kh = aligned_stride(stride_kt, K), aligned_stride(stride_kh, K)
        stride_vt, stride_vh = aligned_stride(stride_vt, V), aligned_stride(stride_vh, V)
        stride_dot, stride_doh = aligned_stride(stride_dot, DO), aligned_stride(stride_doh, DO)
    return stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh


@triton.jit
def _bwd_input_bases(Q, K, V, DO, Lse, Delta, first, head_64, num_tokens, strides):
    """The backward's input pointers moved to the segment's first token (``first``, int64) of head ``head_64``
    (``strides`` as :func:`_bwd_input_strides` returns them): 64-bit scalar base offsets, so in-batch offsets
    can stay 32-bit (as in the forward)."""
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh = strides
    return (
        Q + first * stride_qt + head_64 * stride_qh,
        K + first * stride_kt + head_64 * stride_kh,
        V + first * stride_vt + head_64 * stride_vh,
        DO + first * stride_dot + head_64 * stride_doh,
        Lse + head_64 * num_tokens + first,
        Delta + head_64 * num_tokens + first,
    )


@triton.jit(do_not_specialize=["num_segments", "search_steps"])
def _attn_bwd_dkdv_kernel(
    # pointers; Lse and Delta are fp32, head h's tokens at h * T
    Q,
    K,
    V,
    DO,
    DK,
    DV,
    Lse,
    Delta,
    CuSeqlens,
    # sizes
    num_segments,
    search_steps,
    num_tokens,
    # scalars: qk_scale = softmax_scale * log2(e)
    qk_scale,
    softmax_scale,
    # strides (tokens, heads); the last dim is contiguous
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_dot,
    stride_doh,
    stride_dkt,
    stride_dkh,
    stride_dvt,
    stride_dvh,
    # meta-parameters
    HEAD_DIM: tl.constexpr,
    D_MAIN: tl.constexpr,
    D_TAIL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WIDE_OFFSETS: tl.constexpr,
    STRIDES_ALIGNED: tl.constexpr,
):
    """dK and dV of one ``BLOCK_N``-key block of one head: its K and V stay in registers while the
    program walks the query blocks of its segment."""
    pid = tl.program_id(0)
    head = tl.program_id(1)
    strides = (stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh)
    strides = _bwd_input_strides(Q, K, V, DO, strides, STRIDES_ALIGNED)
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh = strides
    if STRIDES_ALIGNED:
        stride_dkt, stride_dkh = aligned_stride(stride_dkt, DK), aligned_stride(stride_dkh, DK)
        stride_dvt, stride_dvh = aligned_stride(stride_dvt, DV), aligned_stride(stride_dvh, DV)
    seq_start, seqlen, n_start = program_tile(CuSeqlens, pid, num_segments, search_steps, BLOCK_N)

    if n_start < seqlen:
        first = seq_start.to(tl.int64)
        head_64 = head.to(tl.int64)
        Q, K, V, DO, Lse, Delta = _bwd_input_bases(Q, K, V, DO, Lse, Delta, first, head_64, num_tokens, strides)
        DK += first * stride_dkt + head_64 * stride_dkh
        DV += first * stride_dvt + head_64 * stride_dvh

        offs_n = n_start + tl.arange(0, BLOCK_N)
        kv_mask = offs_n < seqlen
        kv_rows = offs_n.to(tl.int64) if WIDE_OFFSETS else offs_n
        cols = head_dim_columns(HEAD_DIM, D_MAIN, D_TAIL)
        # Keys past the segment load as zeros; their dK and dV rows are never stored. k and v are the resident
        # operands of the dots that sum over the head dim: their tails count the shared columns once.
        k_main, k_tail = _load_pair(K, kv_rows, stride_kt, cols, kv_mask, HEAD_DIM, D_MAIN, D_TAIL, True)
        v_main, v_tail = _load_pair(V, kv_rows, stride_vt, cols, kv_mask, HEAD_DIM, D_MAIN, D_TAIL, True)
        k_tail = zero_shared_columns(k_tail, cols[1], D_MAIN, HEAD_DIM, D_TAIL)
        v_tail = zero_shared_columns(v_tail, cols[1], D_MAIN, HEAD_DIM, D_TAIL)
        dk = _zeros_pair(BLOCK_N, D_MAIN, D_TAIL)
        dv = _zeros_pair(BLOCK_N, D_MAIN, D_TAIL)

        # What every query block reads (see _attn_bwd_dkdv_q_block).
        kv = ((k_main, k_tail), (v_main, v_tail))
        queries = (Q, DO, Lse, Delta, stride_qt, stride_dot)
        full_end = (seqlen // BLOCK_M) * BLOCK_M
        for m_start in range(0, full_end, BLOCK_M):
            dk, dv = _attn_bwd_dkdv_q_block(
                dk,
                dv,
                m_start,
                kv,
                queries,
                seqlen,
                cols,
                qk_scale,
                HEAD_DIM,
                D_MAIN,
                D_TAIL,
                BLOCK_M,
                DOT_PRECISION,
                WIDE_OFFSETS,
                MASK_Q=False,
            )
        if full_end < seqlen:
            dk, dv = _attn_bwd_dkdv_q_block(
                dk,
                dv,
                full_end,
                kv,
                queries,
                seqlen,
                cols,
                qk_scale,
                HEAD_DIM,
                D_MAIN,
                D_TAIL,
                BLOCK_M,
                DOT_PRECISION,
                WIDE_OFFSETS,
                MASK_Q=True,
            )

        _store_pair(DK, kv_rows, stride_dkt, cols, kv_mask, dk, softmax_scale, HEAD_DIM, D_MAIN, D_TAIL)
        _store_pair(DV, kv_rows, stride_dvt, cols, kv_mask, dv, 1.0, HEAD_DIM, D_MAIN, D_TAIL)


@triton.jit
def _attn_bwd_dq_kv_block(
    # the query block's running (main, tail) gradient
    dq,
    # the key block's first key in the segment
    kv_start,
    # what the key loop reads (see the dQ kernel): the query block's resident (q, do, lse2, delta), q and do as
    # (main, tail) pairs with the shared columns of their tails zeroed and lse2 the rows' log-sum-exp in base 2,
    # (K, V, stride_kt, stride_vt) at the segment's first token, the segment's length, the head-dim columns and
    # the logits' scale
    queries,
    kv,
    seqlen,
    cols,
    qk_scale,
    # meta-parameters
    HEAD_DIM: tl.constexpr,
    D_MAIN: tl.constexpr,
    D_TAIL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WIDE_OFFSETS: tl.constexpr,
    MASK_KV: tl.constexpr,
):
    """Add the keys ``[kv_start, kv_start + BLOCK_N)`` of the segment to one query block's dQ; ``MASK_KV`` for the
    ragged last block."""
    q, do, lse2, delta = queries
    K, V, stride_kt, stride_vt = kv
    offs_n = kv_start + tl.arange(0, BLOCK_N)
    kv_mask = offs_n < seqlen
    rows = offs_n.to(tl.int64) if WIDE_OFFSETS else offs_n
    k = _load_pair(K, rows, stride_kt, cols, kv_mask, HEAD_DIM, D_MAIN, D_TAIL, MASK_KV)
    s = _dot_over_head_dim(q, k, DOT_PRECISION, D_TAIL)
    p = tl.exp2(s * qk_scale - lse2[:, None])
    if MASK_KV:
        p = tl.where(kv_mask[None, :], p, 0.0)

    v = _load_pair(V, rows, stride_vt, cols, kv_mask, HEAD_DIM, D_MAIN, D_TAIL, MASK_KV)
    dp = _dot_over_head_dim(do, v, DOT_PRECISION, D_TAIL)
    ds = round_to(p * (dp - delta[:, None]), K.dtype.element_ty)
    return _dot_into_head_dim(ds, k, dq, DOT_PRECISION, D_TAIL)


@triton.jit(do_not_specialize=["num_segments", "search_steps"])
def _attn_bwd_dq_kernel(
    # pointers; Lse and Delta are fp32, head h's tokens at h * T
    Q,
    K,
    V,
    DO,
    DQ,
    Lse,
    Delta,
    CuSeqlens,
    # sizes
    num_segments,
    search_steps,
    num_tokens,
    # scalars: qk_scale = softmax_scale * log2(e)
    qk_scale,
    softmax_scale,
    # strides (tokens, heads); the last dim is contiguous
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_dot,
    stride_doh,
    stride_dqt,
    stride_dqh,
    # meta-parameters
    HEAD_DIM: tl.constexpr,
    D_MAIN: tl.constexpr,
    D_TAIL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WIDE_OFFSETS: tl.constexpr,
    STRIDES_ALIGNED: tl.constexpr,
):
    """dQ of one ``BLOCK_M``-query block of one head: its q and dO stay in registers while the program
    walks the key blocks of its segment, as the forward does."""
    pid = tl.program_id(0)
    head = tl.program_id(1)
    strides = (stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh)
    strides = _bwd_input_strides(Q, K, V, DO, strides, STRIDES_ALIGNED)
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh = strides
    if STRIDES_ALIGNED:
        stride_dqt, stride_dqh = aligned_stride(stride_dqt, DQ), aligned_stride(stride_dqh, DQ)
    seq_start, seqlen, m_start = program_tile(CuSeqlens, pid, num_segments, search_steps, BLOCK_M)

    if m_start < seqlen:
        first = seq_start.to(tl.int64)
        head_64 = head.to(tl.int64)
        Q, K, V, DO, Lse, Delta = _bwd_input_bases(Q, K, V, DO, Lse, Delta, first, head_64, num_tokens, strides)
        DQ += first * stride_dqt + head_64 * stride_dqh

        offs_m = m_start + tl.arange(0, BLOCK_M)
        q_mask = offs_m < seqlen
        q_rows = offs_m.to(tl.int64) if WIDE_OFFSETS else offs_m
        cols = head_dim_columns(HEAD_DIM, D_MAIN, D_TAIL)
        # Rows past the segment load as zeros (lse 0 keeps their probabilities finite); never stored. q and do are
        # the resident operands of the dots that sum over the head dim: their tails count the shared columns once.
        q_main, q_tail = _load_pair(Q, q_rows, stride_qt, cols, q_mask, HEAD_DIM, D_MAIN, D_TAIL, True)
        do_main, do_tail = _load_pair(DO, q_rows, stride_dot, cols, q_mask, HEAD_DIM, D_MAIN, D_TAIL, True)
        q_tail = zero_shared_columns(q_tail, cols[1], D_MAIN, HEAD_DIM, D_TAIL)
        do_tail = zero_shared_columns(do_tail, cols[1], D_MAIN, HEAD_DIM, D_TAIL)
        lse2 = tl.load(Lse + offs_m, mask=q_mask, other=0.0) * LOG2E
        delta = tl.load(Delta + offs_m, mask=q_mask, other=0.0)
        dq = _zeros_pair(BLOCK_M, D_MAIN, D_TAIL)

        # What every key block reads (see _attn_bwd_dq_kv_block).
        queries = ((q_main, q_tail), (do_main, do_tail), lse2, delta)
        kv = (K, V, stride_kt, stride_vt)
        full_end = (seqlen // BLOCK_N) * BLOCK_N
        for kv_start in range(0, full_end, BLOCK_N):
            dq = _attn_bwd_dq_kv_block(
                dq,
                kv_start,
                queries,
                kv,
                seqlen,
                cols,
                qk_scale,
                HEAD_DIM,
                D_MAIN,
                D_TAIL,
                BLOCK_N,
                DOT_PRECISION,
                WIDE_OFFSETS,
                MASK_KV=False,
            )
        if full_end < seqlen:
            dq = _attn_bwd_dq_kv_block(
                dq,
                full_end,
                queries,
                kv,
                seqlen,
                cols,
                qk_scale,
                HEAD_DIM,
                D_MAIN,
                D_TAIL,
                BLOCK_N,
                DOT_PRECISION,
                WIDE_OFFSETS,
                MASK_KV=True,
            )

        _store_pair(DQ, q_rows, stride_dqt, cols, q_mask, dq, softmax_scale, HEAD_DIM, D_MAIN, D_TAIL)


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
    block_d = next_power_of_2(head_dim)
    block_t = max(1, min(64, 4096 // block_d))
    delta_args = dict(
        Out=out,
        DOut=grad_out,
        Delta=delta,
        num_tokens=num_tokens,
        stride_ot=out.stride(0),
        stride_oh=out.stride(1),
        stride_dot=grad_out.stride(0),
        stride_doh=grad_out.stride(1),
    )
    vec = row_vector(head_dim, [*out.stride()[:2], *grad_out.stride()[:2]], out.element_size())
    delta_config = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_T=block_t, VEC=vec, num_warps=4, **FMA_CONTRACTION)
    launches.append(
        KernelLaunch(_attn_bwd_delta_kernel, (cdiv(num_tokens, block_t), num_heads), delta_args, delta_config)
    )

    configs = backward_launch_config(head_dim, q.dtype, target, max_seqlen)
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    wide = needs_wide_offsets(num_tokens, q, k, v, grad_out, dq, dk, dv)
    # What both kernels read; each adds its outputs.
    inputs = dict(
        # pointers
        Q=q,
        K=k,
        V=v,
        DO=grad_out,
        Lse=lse,
        Delta=delta,
        CuSeqlens=cu_seqlens,
        # sizes
        num_segments=num_segments,
        search_steps=segment_search_steps(num_segments),
        num_tokens=num_tokens,
        # scalars
        qk_scale=scale * math.log2(math.e),
        softmax_scale=scale,
        # strides
        stride_qt=q.stride(0),
        stride_qh=q.stride(1),
        stride_kt=k.stride(0),
        stride_kh=k.stride(1),
        stride_vt=v.stride(0),
        stride_vh=v.stride(1),
        stride_dot=grad_out.stride(0),
        stride_doh=grad_out.stride(1),
    )
    dkdv_args = dict(
        inputs,
        DK=dk,
        DV=dv,
        stride_dkt=dk.stride(0),
        stride_dkh=dk.stride(1),
        stride_dvt=dv.stride(0),
        stride_dvh=dv.stride(1),
    )
    dkdv_flags = dict(WIDE_OFFSETS=wide, STRIDES_ALIGNED=rows_16_byte_aligned(q, k, v, grad_out, dk, dv))
    dkdv_grid = (num_tokens // configs["dkdv"]["BLOCK_N"] + num_segments, num_heads)
    launches.append(KernelLaunch(_attn_bwd_dkdv_kernel, dkdv_grid, dkdv_args, {**configs["dkdv"], **dkdv_flags}))
    dq_args = dict(inputs, DQ=dq, stride_dqt=dq.stride(0), stride_dqh=dq.stride(1))
    dq_flags = dict(WIDE_OFFSETS=wide, STRIDES_ALIGNED=rows_16_byte_aligned(q, k, v, grad_out, dq))
    dq_grid = (num_tokens // configs["dq"]["BLOCK_M"] + num_segments, num_heads)
    launches.append(KernelLaunch(_attn_bwd_dq_kernel, dq_grid, dq_args, {**configs["dq"], **dq_flags}))
    if positions is not None:
        launches += rotary_launches(dq, dk, dq, dk, positions, rope_theta, target, inverse=True)
    return launches


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
    if runs_torch(q.device):
        return vision_attn_backward_reference(
            grad_out, q, k, v, out, lse, cu_seqlens, softmax_scale, positions, rope_theta
        )
    dq, dk, dv = (torch.empty(q.shape, dtype=q.dtype, device=q.device) for _ in range(3))
    hint = None if max_seqlen is None else int(max_seqlen)
    target = device_target(q.device)
    launches = vision_attn_backward_launches(
        grad_out, q, k, v, out, lse, dq, dk, dv, cu_seqlens, softmax_scale, positions, rope_theta, target, hint
    )
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
    check_attn_args(q, k, v, cu_seqlens, max_seqlen, softmax_scale, positions, rope_theta, read_values=False)
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


# ----------------------------------------------------------------------------------------------------
# Autograd: vision_attn_with_lse's formula runs the backward op, and vision_attn routes the calls autograd
# records to vision_attn_with_lse.
# ----------------------------------------------------------------------------------------------------
def _with_lse_setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_seqlens, max_seqlen, softmax_scale, positions, rope_theta = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, positions)
    ctx.max_seqlen, ctx.softmax_scale, ctx.rope_theta = max_seqlen, softmax_scale, rope_theta


def _with_lse_backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, cu_seqlens, positions = ctx.saved_tensors
    forward_args = (cu_seqlens, ctx.max_seqlen, ctx.softmax_scale, positions, ctx.rope_theta)
    dq, dk, dv = torch.ops.qvl.vision_attn_backward(last_dim_contiguous(grad_out), q, k, v, out, lse, *forward_args)
    return dq, dk, dv, None, None, None, None, None


vision_attn_with_lse.register_autograd(_with_lse_backward, setup_context=_with_lse_setup_context)


# vision_attn takes the training forward when autograd records the call, so the forward writes the log-sum-exp
# only then (the custom op's own Autograd registration would run vision_attn itself, which has no LSE to save).
def _training_forward(q, k, v, cu_seqlens, max_seqlen=None, softmax_scale=None, positions=None, rope_theta=10000.0):
    return torch.ops.qvl.vision_attn_with_lse(q, k, v, cu_seqlens, max_seqlen, softmax_scale, positions, rope_theta)[0]


route_autograd("vision_attn", _training_forward)
# q, k and v in the autocast dtype, as scaled_dot_product_attention; softmax statistics stay fp32 inside.
follow_autocast("vision_attn", in_autocast_dtype(0, 1, 2))
follow_autocast("vision_attn_with_lse", in_autocast_dtype(0, 1, 2))
follow_autocast("vision_attn_backward")
