"""The attention forward: its Triton kernel, the launches of ``torch.ops.qvl.vision_attn`` and of its training
twin ``torch.ops.qvl.vision_attn_with_lse`` (which also stores each row's log-sum-exp), their op registrations
and the pure-torch reference. The algorithm is described in :mod:`qvl.kernels.attention`; the launch
configuration comes from :mod:`.config`. :func:`program_tile` (which segment and tile a program owns) and
:func:`load_rows` are the backward kernels' too.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

from ..common import (
    FLOAT_DTYPES,
    TORCH_BACKENDS,
    KernelLaunch,
    backend_for,
    check_cu_seqlens,
    check_same_device,
    check_tensor,
    device_target,
    run_launches,
)
from ..rotary import (
    check_positions,
    check_rope_head_dim,
    check_rope_theta,
    rope_apply,
    rope_pairs,
    rotary_2d_reference,
    rotary_2d_torch,
    rotary_launches,
)
from ..tiles import INTERPRETING, aligned_stride, round_to
from .config import MAX_HEAD_DIM, attention_plan, descriptor_of, segment_class

__all__ = [
    "check_attn_args",
    "equal_length_runs",
    "head_major",
    "load_rows",
    "mma",
    "program_tile",
    "vision_attn",
    "vision_attn_launches",
    "vision_attn_reference",
    "vision_attn_sdpa",
    "vision_attn_with_lse",
]

# ln(2) for the kernel (Triton reads globals only as constexprs).
LN2 = tl.constexpr(math.log(2.0))


@triton.jit
def mma(a, b, acc, DOT_PRECISION: tl.constexpr):
    """``acc + a @ b`` (``acc`` None: ``a @ b``) with fp32 accumulation, as a tensor core computes it. Triton's
    interpreter multiplies bf16 dot operands as raw bit patterns (off by ~1e9 on unit inputs; triton-lang issue
    11584): bf16 operands are exact in fp32, so widening them there gives the products and sums the GPU's dot
    gives."""
    if INTERPRETING:
        if a.dtype == tl.bfloat16:
            a = a.to(tl.float32)
        if b.dtype == tl.bfloat16:
            b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def load_rows(
    base,
    rows,
    stride_t,
    offs_d,
    row_mask,
    HEAD_DIM: tl.constexpr,
    MASK_ROWS: tl.constexpr,
    MASK_COLS: tl.constexpr = True,
):
    """Load a ``(len(rows), len(offs_d))`` tile, zeros outside the masks; rows are token indices. ``MASK_COLS``
    False: the caller knows every column is below HEAD_DIM (a tile as wide as the head), so a full block loads
    unmasked."""
    ptrs = base + rows[:, None] * stride_t + offs_d[None, :]
    if MASK_ROWS and MASK_COLS:
        return tl.load(ptrs, mask=row_mask[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    if MASK_ROWS:
        return tl.load(ptrs, mask=row_mask[:, None], other=0.0)
    if MASK_COLS:
        return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return tl.load(ptrs)


@triton.jit
def _load_kv(
    source,
    block,
    cols,
    HEAD_DIM: tl.constexpr,
    COL0: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK_ROWS: tl.constexpr,
    DESCRIPTORS: tl.constexpr,
):
    """A ``(BLOCK_N, WIDTH)`` key or value tile over the head-dim columns ``cols`` = ``COL0 + arange(WIDTH)`` (a
    main or a tail tile, see :func:`~.config.head_dim_tiles`). ``source`` is ``(X, token stride)``, ``block``
    ``(rows, kv_mask, desc_row, head)``. Pointer path: ``X`` points at the segment's first token of this head;
    columns need a mask only in a main tile wider than the head (heads under 16 columns). ``DESCRIPTORS``: ``X``
    is a TMA descriptor of the whole ``(T, H, D)`` tensor with ``(BLOCK_N, 1, WIDTH)`` boxes, read at token
    ``desc_row``; the hardware zero-fills columns past D and rows past T, and rows of the next segment are zeroed
    here (their logits are -inf already, but a value that is not finite would still turn 0 * x into NaN)."""
    X, stride_t = source
    rows, kv_mask, desc_row, head = block
    if DESCRIPTORS:
        x = X.load([desc_row, head, COL0]).reshape(BLOCK_N, WIDTH)
        if MASK_ROWS:
            x = tl.where(kv_mask[:, None], x, 0.0)
    else:
        x = load_rows(X, rows, stride_t, cols, kv_mask, HEAD_DIM, MASK_ROWS, COL0 + WIDTH > HEAD_DIM)
    return x


@triton.jit
def _load_q(
    base, rows, stride_t, cols, row_mask, CosSin, HEAD_DIM: tl.constexpr, ROTATE: tl.constexpr, MASK_COLS: tl.constexpr
):
    """Load a tile of q rows (masked by ``row_mask``) over the head-dim columns ``cols`` and, with ROTATE, rotate
    it and round it back to the input dtype, as the rotary kernel rotates and stores: ``CosSin`` points at the
    rows' ``(T, D)`` fp32 table (each row the ``D / 2`` angles' cos, then their sin; see
    :func:`~qvl.kernels.rotary.rotary_launches`). ``MASK_COLS``: the tile is wider than the head."""
    x = load_rows(base, rows, stride_t, cols, row_mask, HEAD_DIM, True, MASK_COLS)
    if ROTATE:
        half: tl.constexpr = HEAD_DIM // 2
        partner, sign = rope_pairs(cols, HEAD_DIM)
        angle = cols % half
        x_partner = load_rows(base, rows, stride_t, partner, row_mask, HEAD_DIM, True, MASK_COLS)
        cos = load_rows(CosSin, rows, HEAD_DIM, angle, row_mask, HEAD_DIM, True, False)
        sin = load_rows(CosSin + half, rows, HEAD_DIM, angle, row_mask, HEAD_DIM, True, False)
        x = rope_apply(x, x_partner, cos, sin, sign[None, :])
        if MASK_COLS:
            # Padding columns past HEAD_DIM hold x_partner * sin: zero them so they add nothing to q.k.
            x = tl.where(cols[None, :] < HEAD_DIM, x, 0.0)
        x = round_to(x, base.dtype.element_ty)
    return x


@triton.jit
def program_tile(CuSeqlens, pid, num_segments, search_steps, BLOCK: tl.constexpr):
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
def head_dim_columns(HEAD_DIM: tl.constexpr, D_MAIN: tl.constexpr, D_TAIL: tl.constexpr):
    """The columns of the main and the tail head-dim tiles (:func:`~.config.head_dim_tiles`): ``arange(D_MAIN)``
    and ``HEAD_DIM - D_TAIL + arange(D_TAIL)``. Without a tail (``D_TAIL`` 0) the second is a 16-wide
    placeholder that no load or store uses (Triton needs the name bound)."""
    tail_width: tl.constexpr = D_TAIL if D_TAIL > 0 else 16
    return tl.arange(0, D_MAIN), (HEAD_DIM - tail_width) + tl.arange(0, tail_width)


@triton.jit
def zero_shared_columns(tail, tail_cols, D_MAIN: tl.constexpr, HEAD_DIM: tl.constexpr, D_TAIL: tl.constexpr):
    """``tail`` (a tail tile) with the columns it shares with the main tile zeroed, so that a dot summing over the
    head dim counts them once (in the main tile's dot). Without a tail (``D_TAIL`` 0), ``tail`` unchanged."""
    if D_TAIL > 0 and HEAD_DIM - D_TAIL < D_MAIN:
        tail = tl.where(tail_cols[None, :] >= D_MAIN, tail, 0.0)
    return tail


@triton.jit
def store_rows(base, rows, stride_t, cols, row_mask, x, FIRST_COL: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Store the fp32 tile ``x`` over head-dim columns ``cols`` into rows (token indices, masked by ``row_mask``),
    rounded to base's dtype: only columns in ``[FIRST_COL, HEAD_DIM)`` (a tail tile stores the columns past the
    main tile; a main tile wider than the head, the head's)."""
    mask = row_mask[:, None] & (cols[None, :] >= FIRST_COL) & (cols[None, :] < HEAD_DIM)
    tl.store(base + rows[:, None] * stride_t + cols[None, :], round_to(x, base.dtype.element_ty), mask=mask)


@triton.jit
def _attn_kv_block(
    # the query tile's running state: (main, tail) accumulators, row max and row sum
    acc,
    m_i,
    l_i,
    # the key block's first key in the segment
    kv_start,
    # what the key loop reads (see the kernel): q's (main, tail) tiles, (K, KTail, token stride) and (V, VTail,
    # token stride) (see _load_kv), (first token in the batch, head, length) of the segment, the (main, tail)
    # head-dim columns, and the logits' scale
    q,
    keys,
    values,
    segment,
    cols,
    qk_scale,
    # meta-parameters
    HEAD_DIM: tl.constexpr,
    D_MAIN: tl.constexpr,
    D_TAIL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WIDE_OFFSETS: tl.constexpr,
    DESCRIPTORS: tl.constexpr,
    MASK_KV: tl.constexpr,
):
    """One step of the online softmax over keys ``[kv_start, kv_start + BLOCK_N)`` of the segment; ``MASK_KV``
    for the ragged last block."""
    seq_start, head, seqlen = segment
    q_main, q_tail = q
    acc_main, acc_tail = acc
    K, KTail, stride_kt = keys
    V, VTail, stride_vt = values
    main_cols, tail_cols = cols
    offs_n = kv_start + tl.arange(0, BLOCK_N)
    kv_mask = offs_n < seqlen
    rows = offs_n.to(tl.int64) if WIDE_OFFSETS else offs_n
    block = (rows, kv_mask, seq_start + kv_start, head)
    tail_col0: tl.constexpr = HEAD_DIM - D_TAIL

    k = _load_kv((K, stride_kt), block, main_cols, HEAD_DIM, 0, D_MAIN, BLOCK_N, MASK_KV, DESCRIPTORS)
    qk = mma(q_main, tl.trans(k), None, DOT_PRECISION)
    if D_TAIL > 0:
        k = _load_kv((KTail, stride_kt), block, tail_cols, HEAD_DIM, tail_col0, D_TAIL, BLOCK_N, MASK_KV, DESCRIPTORS)
        qk = mma(q_tail, tl.trans(k), qk, DOT_PRECISION)
    if MASK_KV:
        qk = tl.where(kv_mask[None, :], qk, float("-inf"))

    # The row max of the raw logits, scaled once per row (qk_scale > 0 keeps the order and rounding keeps it
    # exact), so that scaling each logit and subtracting the max below is one FMA.
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = round_to(p, q_main.dtype)

    v = _load_kv((V, stride_vt), block, main_cols, HEAD_DIM, 0, D_MAIN, BLOCK_N, MASK_KV, DESCRIPTORS)
    acc_main = mma(p, v, acc_main * alpha[:, None], DOT_PRECISION)
    if D_TAIL > 0:
        v = _load_kv((VTail, stride_vt), block, tail_cols, HEAD_DIM, tail_col0, D_TAIL, BLOCK_N, MASK_KV, DESCRIPTORS)
        acc_tail = mma(p, v, acc_tail * alpha[:, None], DOT_PRECISION)
    return (acc_main, acc_tail), m_new, l_i


@triton.jit(do_not_specialize=["num_segments", "search_steps"])
def _vision_attn_kernel(
    # pointers (CosSin, the rows' rotary cos/sin table, is read only with ROTATE_Q, Lse written only with STORE_LSE).
    # With DESCRIPTORS, K and V
    # are TMA descriptors of the (T, H, D) tensors with (BLOCK_N, 1, D_MAIN) boxes, KTail and VTail with
    # (BLOCK_N, 1, D_TAIL) boxes; without, KTail and VTail are K and V.
    Q,
    K,
    V,
    KTail,
    VTail,
    Out,
    CuSeqlens,
    CosSin,
    Lse,
    # sizes
    num_segments,
    search_steps,
    # scalars
    qk_scale,
    # strides (tokens, heads); the last dim is contiguous. Lse is flat (H * T,): stride_lh = T.
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_lh,
    # meta-parameters
    HEAD_DIM: tl.constexpr,
    D_MAIN: tl.constexpr,
    D_TAIL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROTATE_Q: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WIDE_OFFSETS: tl.constexpr,
    STRIDES_ALIGNED: tl.constexpr,
    STORE_LSE: tl.constexpr,
    DESCRIPTORS: tl.constexpr,
):
    pid = tl.program_id(0)
    head = tl.program_id(1)
    if STRIDES_ALIGNED:
        # Multiples of 16 bytes on the host; proven so here, every K/V tile row moves in 16-byte async copies.
        stride_qt, stride_qh = aligned_stride(stride_qt, Q), aligned_stride(stride_qh, Q)
        if not DESCRIPTORS:
            stride_kt, stride_kh = aligned_stride(stride_kt, K), aligned_stride(stride_kh, K)
            stride_vt, stride_vh = aligned_stride(stride_vt, V), aligned_stride(stride_vh, V)
        stride_ot, stride_oh = aligned_stride(stride_ot, Out), aligned_stride(stride_oh, Out)

    seq_start, seqlen, m_start = program_tile(CuSeqlens, pid, num_segments, search_steps, BLOCK_M)

    if m_start < seqlen:
        # The segment's first token in 64-bit scalar arithmetic; offsets inside the batch stay 32-bit
        # (vector address math in 64 bits costs registers and spills) unless T * stride can pass 2**31.
        first = seq_start.to(tl.int64)
        Q += first * stride_qt + head.to(tl.int64) * stride_qh
        if not DESCRIPTORS:
            K += first * stride_kt + head.to(tl.int64) * stride_kh
            V += first * stride_vt + head.to(tl.int64) * stride_vh
            KTail, VTail = K, V
        Out += first * stride_ot + head.to(tl.int64) * stride_oh

        offs_m = m_start + tl.arange(0, BLOCK_M)
        q_mask = offs_m < seqlen
        q_rows = offs_m.to(tl.int64) if WIDE_OFFSETS else offs_m
        main_cols, tail_cols = head_dim_columns(HEAD_DIM, D_MAIN, D_TAIL)

        if ROTATE_Q:
            CosSin += first * HEAD_DIM
        q_main = _load_q(Q, q_rows, stride_qt, main_cols, q_mask, CosSin, HEAD_DIM, ROTATE_Q, D_MAIN > HEAD_DIM)
        q_tail = q_main
        if D_TAIL > 0:
            q_tail = _load_q(Q, q_rows, stride_qt, tail_cols, q_mask, CosSin, HEAD_DIM, ROTATE_Q, False)
            q_tail = zero_shared_columns(q_tail, tail_cols, D_MAIN, HEAD_DIM, D_TAIL)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        tail_width: tl.constexpr = D_TAIL if D_TAIL > 0 else 16
        acc = (tl.zeros([BLOCK_M, D_MAIN], dtype=tl.float32), tl.zeros([BLOCK_M, tail_width], dtype=tl.float32))

        # What every key block reads (see _attn_kv_block).
        q = (q_main, q_tail)
        keys = (K, KTail, stride_kt)
        values = (V, VTail, stride_vt)
        segment = (seq_start, head, seqlen)
        cols = (main_cols, tail_cols)
        # Full key blocks need no row mask; the ragged last block is handled apart.
        full_end = (seqlen // BLOCK_N) * BLOCK_N
        for kv_start in range(0, full_end, BLOCK_N):
            acc, m_i, l_i = _attn_kv_block(
                acc,
                m_i,
                l_i,
                kv_start,
                q,
                keys,
                values,
                segment,
                cols,
                qk_scale,
                HEAD_DIM,
                D_MAIN,
                D_TAIL,
                BLOCK_N,
                DOT_PRECISION,
                WIDE_OFFSETS,
                DESCRIPTORS,
                MASK_KV=False,
            )
        if full_end < seqlen:
            acc, m_i, l_i = _attn_kv_block(
                acc,
                m_i,
                l_i,
                full_end,
                q,
                keys,
                values,
                segment,
                cols,
                qk_scale,
                HEAD_DIM,
                D_MAIN,
                D_TAIL,
                BLOCK_N,
                DOT_PRECISION,
                WIDE_OFFSETS,
                DESCRIPTORS,
                MASK_KV=True,
            )

        inv_l = 1.0 / l_i
        acc_main, acc_tail = acc
        store_rows(Out, q_rows, stride_ot, main_cols, q_mask, acc_main * inv_l[:, None], 0, HEAD_DIM)
        if D_TAIL > 0:
            store_rows(Out, q_rows, stride_ot, tail_cols, q_mask, acc_tail * inv_l[:, None], D_MAIN, HEAD_DIM)
        if STORE_LSE:
            # What the backward needs to rebuild each probability from one logit: the row's log-sum-exp of
            # the scaled logits, natural log (m_i and log2(l_i) are in base 2).
            lse = (m_i + tl.log2(l_i)) * LN2
            tl.store(Lse + (head.to(tl.int64) * stride_lh + first) + offs_m, lse, mask=q_mask)


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
    k into a scratch tensor allocated here and writing the rows' cos/sin into a scratch ``(T, D)`` fp32 table,
    from which the attention kernel then rotates q; then the attention kernel, tiled for the ``max_seqlen`` hint.
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
    cos_sin = None
    if positions is not None:
        # k is rotated once here; q, tile by tile, in the kernel (see :mod:`qvl.kernels.attention` for why).
        k_rotated = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        cos_sin = torch.empty((num_tokens, head_dim), dtype=torch.float32, device=k.device)
        launches += rotary_launches(None, k, None, k_rotated, positions, rope_theta, target, cos_sin=cos_sin)
        k = k_rotated
    plan = attention_plan(
        q.shape,
        (q.stride(), k.stride(), v.stride(), out.stride()),
        # The data pointers' 16-byte alignment: with the strides, whether every row of each tensor is aligned.
        (q.data_ptr() % 16 == 0, k.data_ptr() % 16 == 0, v.data_ptr() % 16 == 0, out.data_ptr() % 16 == 0),
        q.dtype,
        target,
        num_segments,
        segment_class(max_seqlen),
        softmax_scale,
        cos_sin is not None,
        lse is not None,
        tuple(sorted((tiles or {}).items())),
    )
    k_tail, v_tail = k, v
    if plan.descriptors is not None:
        k, k_tail, v, v_tail = (descriptor_of(proto, x) for proto, x in zip(plan.descriptors, (k, k, v, v)))
    args = dict(
        # pointers (or K/V descriptors); those a variant does not read get cu_seqlens as a placeholder
        Q=q,
        K=k,
        V=v,
        KTail=k_tail,
        VTail=v_tail,
        Out=out,
        CuSeqlens=cu_seqlens,
        CosSin=cu_seqlens if cos_sin is None else cos_sin,
        Lse=cu_seqlens if lse is None else lse,
        **plan.scalars,
    )
    launches.append(KernelLaunch(_vision_attn_kernel, plan.grid, args, plan.kwargs))
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


def vision_attn_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    softmax_scale: float | None = None,
    positions: torch.Tensor | None = None,
    rope_theta: float = 10000.0,
) -> torch.Tensor:
    """The op's torch path: :func:`vision_attn`'s result through torch's fused
    ``scaled_dot_product_attention``, whose CPU kernel (flash-style: key blocks, online softmax, fp32
    accumulation) holds no ``S x S`` logits, so memory grows as O(S) where :func:`vision_attn_reference` holds
    ``H x S^2`` fp32 logits per segment.

    With ``positions`` q and k are rotated once first (:func:`~qvl.kernels.rotary.rotary_2d_torch`), k into the
    head-major layout (:func:`head_major`) that k and v take before attending. Each run of consecutive segments
    of one length (a video's frames, a batch of same-size images) is one call, its segments a batch dim of
    strided views; empty segments are skipped. Reads ``cu_seqlens`` on the host. Returns a new contiguous
    ``(T, H, D)`` tensor in q's dtype.
    """
    if positions is not None:
        q, k = rotary_2d_torch(q, k, positions, rope_theta, k_head_major=True)
    k, v = head_major(k), head_major(v)
    num_tokens, num_heads, head_dim = q.shape
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    pieces = []
    for start, length, count in equal_length_runs(cu_seqlens.tolist()):
        end = start + length * count
        batch = (x[start:end].view(count, length, num_heads, head_dim).transpose(1, 2) for x in (q, k, v))
        out = F.scaled_dot_product_attention(*batch, scale=scale)
        # The kernel lays its output out like q: a view where q is token-major (rotated q is), else a copy.
        pieces.append(out.transpose(1, 2).reshape(end - start, num_heads, head_dim).contiguous())
    if not pieces:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def head_major(x: torch.Tensor) -> torch.Tensor:
    """``x (T, H, D)`` as a view of a contiguous ``(H, T, D)`` tensor: ``x`` itself where it is one, else a copy.
    torch's CPU attention kernel sweeps every key and value for each block of queries, and runs faster when a head's
    rows lie next to each other: on 2-core Sapphire Rapids, 16 heads of 72, with k and v in this layout (v
    copied) and q token-major, fp32 calls took 3-12% less time at one 4,096-token segment and 4-5% less at four of
    1,024 than on token-major views of a packed qkv (rows ``3 H D`` apart); one of 1,024, and bf16, moved by up to
    4% either way (two runs, best of 15 each)."""
    by_head = x.transpose(0, 1)
    return x if by_head.is_contiguous() else by_head.contiguous().transpose(0, 1)


def equal_length_runs(bounds: list[int]) -> list[tuple[int, int, int]]:
    """The non-empty segments of ``cu_seqlens`` values ``bounds`` as runs of consecutive equal lengths:
    ``(first token, segment length, segments in the run)``, in token order."""
    runs: list[tuple[int, int, int]] = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        length = end - start
        if length == 0:
            continue
        if runs and runs[-1][1] == length:
            first, _, count = runs[-1]
            runs[-1] = (first, length, count + 1)
        else:
            runs.append((start, length, 1))
    return runs


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


def check_attn_args(
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
        cu_seqlens: int32 ``(B + 1,)``, contiguous, on q's device: 0, non-decreasing, ends at T. Zero-length
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
            (same result as :func:`rotary_2d` first). k is rotated once, into a scratch ``(T, H, D)`` tensor,
            by a kernel that also writes the tokens' cos/sin into a scratch ``(T, D)`` fp32 table; q is rotated
            from that table as the attention kernel loads it. Both scratch tensors are freed on return. Needs
            D % 4 == 0.
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
    check_attn_args(q, k, v, cu_seqlens, max_seqlen, softmax_scale, positions, rope_theta, read_values=False)
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def _forward(
    q, k, v, cu_seqlens, max_seqlen, softmax_scale, positions, rope_theta, with_lse: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output and, ``with_lse``, the log-sum-exp (else None), on the inputs' path."""
    check_attn_args(q, k, v, cu_seqlens, max_seqlen, softmax_scale, positions, rope_theta)
    backend = backend_for(q.device)
    # torch's fused attention returns no log-sum-exp through a public API: a training forward on the torch path
    # takes the reference, which does.
    if backend == "torch" and not with_lse:
        return vision_attn_sdpa(q, k, v, cu_seqlens, softmax_scale, positions, rope_theta), None
    if backend in TORCH_BACKENDS:
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
    STORE_LSE. Arguments as :func:`vision_attn`; nothing is mutated. Its autograd formula
    (:mod:`~qvl.kernels.attention.backward`) runs :func:`~qvl.kernels.attention.vision_attn_backward`."""
    return _forward(q, k, v, cu_seqlens, max_seqlen, softmax_scale, positions, rope_theta, with_lse=True)


@vision_attn_with_lse.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, softmax_scale, positions, rope_theta):
    check_attn_args(q, k, v, cu_seqlens, max_seqlen, softmax_scale, positions, rope_theta, read_values=False)
    return torch.empty(q.shape, dtype=q.dtype, device=q.device), _empty_lse(q)
