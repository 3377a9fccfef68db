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
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

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
from .tiles import aligned_stride, rope_apply, rope_cos_sin, rope_dim_tables

__all__ = [
    "MAX_HEAD_DIM",
    "SHORT_SEGMENT_MAX",
    "AttentionWork",
    "head_dim_tiles",
    "launch_config",
    "launch_work",
    "vision_attn",
    "vision_attn_launches",
    "vision_attn_reference",
]

MAX_HEAD_DIM = 256
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
def _load_rows(base, rows, stride_t, offs_d, row_mask, HEAD_DIM: tl.constexpr, MASK_ROWS: tl.constexpr):
    """Load a ``(len(rows), len(offs_d))`` tile; rows are int64 token indices."""
    ptrs = base + rows[:, None] * stride_t + offs_d[None, :]
    if MASK_ROWS:
        mask = row_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    else:
        mask = offs_d[None, :] < HEAD_DIM
    return tl.load(ptrs, mask=mask, other=0.0)


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
def _attn_kv_block(
    acc_main, acc_tail, m_i, l_i, q_main, q_tail,
    K, V, kv_start, seqlen, stride_kt, stride_vt, qk_scale, offs_dm, offs_dt,
    HEAD_DIM: tl.constexpr, HAS_TAIL: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_KV: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDE_OFFSETS: tl.constexpr,
):  # fmt: skip
    """One step of the online softmax over keys ``[kv_start, kv_start + BLOCK_N)`` of the segment (K and V
    point at the segment's first token)."""
    offs_n = kv_start + tl.arange(0, BLOCK_N)
    kv_mask = offs_n < seqlen
    rows = offs_n.to(tl.int64) if WIDE_OFFSETS else offs_n

    k_main = _load_rows(K, rows, stride_kt, offs_dm, kv_mask, HEAD_DIM, MASK_KV)
    qk = tl.dot(q_main, tl.trans(k_main), input_precision=DOT_PRECISION)
    if HAS_TAIL:
        k_tail = _load_rows(K, rows, stride_kt, offs_dt, kv_mask, HEAD_DIM, MASK_KV)
        qk = tl.dot(q_tail, tl.trans(k_tail), qk, input_precision=DOT_PRECISION)
    qk = qk * qk_scale
    if MASK_KV:
        qk = tl.where(kv_mask[None, :], qk, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(V.dtype.element_ty)

    v_main = _load_rows(V, rows, stride_vt, offs_dm, kv_mask, HEAD_DIM, MASK_KV)
    acc_main = tl.dot(p, v_main, acc_main * alpha[:, None], input_precision=DOT_PRECISION)
    if HAS_TAIL:
        v_tail = _load_rows(V, rows, stride_vt, offs_dt, kv_mask, HEAD_DIM, MASK_KV)
        acc_tail = tl.dot(p, v_tail, acc_tail * alpha[:, None], input_precision=DOT_PRECISION)
    return acc_main, acc_tail, m_new, l_i


@triton.jit(do_not_specialize=["num_segments", "search_steps"])
def _vision_attn_kernel(
    # pointers
    Q, K, V, Out, CuSeqlens, Positions,
    # sizes
    num_segments, search_steps,
    # scalars
    qk_scale, log2_theta,
    # strides (tokens, heads); the last dim is contiguous
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_pt,
    # meta-parameters
    HEAD_DIM: tl.constexpr, D_MAIN: tl.constexpr, D_TAIL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ROTATE_Q: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDE_OFFSETS: tl.constexpr, STRIDES_ALIGNED: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    head = tl.program_id(1)
    if STRIDES_ALIGNED:
        # Multiples of 16 bytes on the host; proven so here, every K/V tile row moves in 16-byte async copies.
        stride_qt, stride_qh = aligned_stride(stride_qt, Q), aligned_stride(stride_qh, Q)
        stride_kt, stride_kh = aligned_stride(stride_kt, K), aligned_stride(stride_kh, K)
        stride_vt, stride_vh = aligned_stride(stride_vt, V), aligned_stride(stride_vh, V)
        stride_ot, stride_oh = aligned_stride(stride_ot, Out), aligned_stride(stride_oh, Out)

    # Segment b starts at program cu[b] // BLOCK_M + b, strictly increasing in b: binary search for the
    # last segment starting at or before pid.
    lo = pid * 0
    hi = lo + num_segments
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        mid_start = tl.load(CuSeqlens + mid) // BLOCK_M + mid
        before = mid_start <= pid
        lo = tl.where(before, mid, lo)
        hi = tl.where(before, hi, mid)
    segment = lo
    seq_start = tl.load(CuSeqlens + segment)
    seqlen = tl.load(CuSeqlens + segment + 1) - seq_start
    m_start = (pid - (seq_start // BLOCK_M + segment)) * BLOCK_M

    if m_start < seqlen:
        HAS_TAIL: tl.constexpr = D_TAIL > 0
        D_TAIL_TILE: tl.constexpr = D_TAIL if D_TAIL > 0 else 16
        # The segment's first token in 64-bit scalar arithmetic; offsets inside the batch stay 32-bit
        # (vector address math in 64 bits costs registers and spills) unless T * stride can pass 2**31.
        first = seq_start.to(tl.int64)
        Q += first * stride_qt + head.to(tl.int64) * stride_qh
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
                K, V, kv_start, seqlen, stride_kt, stride_vt, qk_scale, offs_dm, offs_dt,
                HEAD_DIM, HAS_TAIL, BLOCK_N, False, DOT_PRECISION, WIDE_OFFSETS,
            )  # fmt: skip
        if full_end < seqlen:
            acc_main, acc_tail, m_i, l_i = _attn_kv_block(
                acc_main, acc_tail, m_i, l_i, q_main, q_tail,
                K, V, full_end, seqlen, stride_kt, stride_vt, qk_scale, offs_dm, offs_dt,
                HEAD_DIM, HAS_TAIL, BLOCK_N, True, DOT_PRECISION, WIDE_OFFSETS,
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


def launch_config(head_dim: int, dtype: torch.dtype, target: GPUTarget, max_seqlen: int | None = None) -> dict:
    """Everything the attention launch passes besides tensors, scalars and per-call flags (rope on q,
    64-bit offsets, aligned strides): head-dim tiling, tile sizes, pipelining and compile options for
    ``head_dim`` in ``dtype`` on ``target`` (see :func:`qvl.kernels.common.device_target`), given the
    caller's ``max_seqlen`` hint (a host int or None; only its class matters: None or longer than
    :data:`SHORT_SEGMENT_MAX`, or not).

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
    short = max_seqlen is not None and max_seqlen <= SHORT_SEGMENT_MAX
    if dtype == torch.float32 or main + tail > 128:
        tiles = dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
        budget = shared_memory_per_block(target)
        if dtype == torch.float32 and main + tail > 128 and budget is not None and budget < 136 * 1024:
            tiles = dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=2)
    elif short:
        tiles = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
    else:
        tiles = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
    return dict(
        HEAD_DIM=head_dim, D_MAIN=main, D_TAIL=tail, DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
        **tiles, **FMA_CONTRACTION,
    )  # fmt: skip


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
) -> list[KernelLaunch]:
    """The launches :func:`vision_attn` runs, in order, for checked arguments and its output ``out``
    (contiguous ``(T, H, D)``, written by the last launch): with ``positions``, the rotary kernel rotating
    k into a scratch tensor allocated here, then the attention kernel, tiled for the ``max_seqlen`` hint.
    Empty when there is nothing to do. Reads shapes, strides, data pointers and the host int ``max_seqlen``
    only (no device sync)."""
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
    config = launch_config(head_dim, q.dtype, target, max_seqlen)
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    grid = (num_tokens // config["BLOCK_M"] + num_segments, num_heads)
    args = (
        q, k, v, out, cu_seqlens, positions if apply_rope else cu_seqlens,
        num_segments, max(1, (num_segments - 1).bit_length()),
        scale * math.log2(math.e), math.log2(rope_theta),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), positions.stride(0) if apply_rope else 0,
    )  # fmt: skip
    flags = dict(
        ROTATE_Q=apply_rope,
        WIDE_OFFSETS=_needs_wide_offsets(num_tokens, q, k, v, out, positions),
        STRIDES_ALIGNED=rows_16_byte_aligned(q, k, v, out),
    )
    launches.append(KernelLaunch(_vision_attn_kernel, grid, args, {**config, **flags}))
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
    host: this is the CPU path and the tests' oracle, not a GPU path.
    """
    head_dim = q.shape[-1]
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    if positions is not None:
        q, k = rotary_2d_reference(q, k, positions, rope_theta)
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        qs, ks, vs = (x[start:end].to(compute).transpose(0, 1) for x in (q, k, v))
        weights = torch.softmax((qs @ ks.transpose(1, 2)) * scale, dim=-1)
        out[start:end] = (weights @ vs).transpose(0, 1).to(q.dtype)
    return out


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
    Nothing is mutated. Forward only (no autograd). Any layout is accepted; one whose rows all start on
    16-byte boundaries (packed qkv views, contiguous tensors with D * itemsize a multiple of 16) loads
    faster. No device-to-host sync on CUDA.
    """
    _check_attn_args(q, k, v, cu_seqlens, max_seqlen, softmax_scale, positions, rope_theta)
    if backend_for(q.device) == "torch":
        return vision_attn_reference(q, k, v, cu_seqlens, softmax_scale, positions, rope_theta)

    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    target = device_target(q.device)
    hint = None if max_seqlen is None else int(max_seqlen)
    launches = vision_attn_launches(q, k, v, out, cu_seqlens, softmax_scale, positions, rope_theta, target, hint)
    run_launches(launches, q.device)
    return out


@vision_attn.register_fake
def _(q, k, v, cu_seqlens, max_seqlen=None, softmax_scale=None, positions=None, rope_theta=10000.0):
    _check_attn_args(q, k, v, cu_seqlens, max_seqlen, softmax_scale, positions, rope_theta, read_values=False)
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)
