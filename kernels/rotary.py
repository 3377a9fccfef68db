"""Qwen3-VL's axial 2D rotary embedding: ``torch.ops.qvl.rotary_2d`` and ``torch.ops.qvl.rotary_2d_``.

Semantics (transformers' ``Qwen3VLVisionRotaryEmbedding`` + ``apply_rotary_pos_emb_vision``): with
``D = head_dim`` and ``inv_freq[f] = rope_theta ** (-4 f / D)`` for ``f < D/4``, token ``t`` at grid
position ``(row, col)`` has angles ``[row * inv_freq | col * inv_freq]`` (width ``D/2``), duplicated to
width ``D``; q and k are rotated NeoX style (rotate-half, not interleaved) in fp32 and cast back.

The kernel computes cos/sin in fp32 from the int32 positions, once per token for every head and only for the
``D/2`` distinct angles: its tiles span half a head, dim ``j`` and its partner ``j + D/2`` rotated together from one
load of each. When ``torch.ops.qvl.vision_attn`` is given ``positions``, the kernel rotating its k also writes
those cos/sin values into a ``(T, D)`` fp32 scratch table, from which the attention kernel rotates q as it loads it
with the same arithmetic (:func:`rope_apply`), so no sin or cos is evaluated inside attention. As in attention,
layouts whose rows all start on 16-byte boundaries (packed qkv views, contiguous outputs) get strides the
compiler can prove aligned, so rows load and store in vectors (as wide as the half-head offset allows: 8 bytes
for D 72 in 16 bits).

``rotary_2d`` is differentiable: its backward (``torch.ops.qvl.rotary_2d_backward``) is the same kernel
rotating the gradients by the opposite angles. ``rotary_2d_`` mutates its inputs, for which torch.library
registers no backward, so it refuses calls autograd would have to record.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

from .autocast import follow_autocast
from .common import (
    FLOAT_DTYPES,
    FMA_CONTRACTION,
    KernelLaunch,
    backend_for,
    cached_config,
    cdiv,
    check_no_internal_overlap,
    check_same_device,
    check_tensor,
    device_target,
    next_power_of_2,
    refuse_autograd,
    rows_16_byte_aligned,
    run_launches,
    runs_torch,
    value_checks_enabled,
)
from .tiles import aligned_stride, last_dim_contiguous, round_to

__all__ = [
    "check_positions",
    "check_rope_head_dim",
    "check_rope_theta",
    "launch_config",
    "rope_apply",
    "rope_pairs",
    "rope_inv_freq",
    "rotary_2d",
    "rotary_2d_",
    "rotary_2d_backward",
    "rotary_2d_reference",
    "rotary_2d_torch",
    "rotary_launches",
]


# ----------------------------------------------------------------------------------------------------
# The rotate-half arithmetic, shared with the attention kernel's q rotation.
# ----------------------------------------------------------------------------------------------------
@triton.jit
def rope_pairs(offs_d, HEAD_DIM: tl.constexpr):
    """NeoX rotate-half pairing of the dims ``offs_d``: (partner dim ``(d + D/2) % D``, sign fp32), so that dim d
    rotates as ``x[d] * cos + sign * x[partner] * sin`` with the angle of ``d % (D/2)``."""
    half: tl.constexpr = HEAD_DIM // 2
    return (offs_d + half) % HEAD_DIM, tl.where(offs_d < half, -1.0, 1.0)


@triton.jit
def rope_apply(x, x_partner, cos, sin, sign):
    """Rotate one tile in fp32: ``x * cos + sign * x_partner * sin`` (``sign`` -1 or 1, broadcast to the tile).
    The rotary kernel and attention's q rotation both rotate through it, so both round alike."""
    return x.to(tl.float32) * cos + sign * x_partner.to(tl.float32) * sin


# ----------------------------------------------------------------------------------------------------
# Standalone kernel: one program rotates BLOCK_T tokens of every head of q and k (or of k alone), so
# each cos/sin value is computed once and used for every head. Tiles span half a head: dim j < D/2 and its
# partner j + D/2 share the angle j, so the cos/sin tiles are D/2 wide and each element is loaded once.
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _rotate_heads(X, XOut, x_strides, out_strides, tile, rope, num_heads, HALF: tl.constexpr):
    """Rotate the tile's tokens of every head of X into XOut with the cos/sin computed once by the caller.
    ``x_strides`` and ``out_strides`` are (token, head) strides; ``tile`` is ``(tokens, offs_j, mask)`` over the
    first half's dims and ``rope`` ``(cos, sin)``, ``(BLOCK_T, BLOCK_H)`` fp32."""
    stride_xt, stride_xh = x_strides
    stride_ot, stride_oh = out_strides
    tokens, offs_j, mask = tile
    cos, sin = rope
    x_rows = X + tokens[:, None] * stride_xt + offs_j[None, :]
    out_rows = XOut + tokens[:, None] * stride_ot + offs_j[None, :]
    for _ in range(num_heads):
        x1 = tl.load(x_rows, mask=mask, other=0.0)
        x2 = tl.load(x_rows + HALF, mask=mask, other=0.0)
        tl.store(out_rows, round_to(rope_apply(x1, x2, cos, sin, -1.0), XOut.dtype.element_ty), mask=mask)
        tl.store(out_rows + HALF, round_to(rope_apply(x2, x1, cos, sin, 1.0), XOut.dtype.element_ty), mask=mask)
        # Stepping the pointers keeps the head offset 64-bit: head * stride in int32 can pass 2**31 in a
        # head-major tensor whose token offsets do not.
        x_rows += stride_xh
        out_rows += stride_oh


@triton.jit
def _rotary_2d_kernel(
    # pointers (Q and QOut are not read when ROTATE_Q is off)
    Q,
    K,
    QOut,
    KOut,
    Positions,
    CosSin,
    # sizes
    num_tokens,
    num_heads,
    log2_theta,
    # strides (tokens, heads); the last dim is contiguous
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_pt,
    # meta-parameters
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr,
    ROTATE_Q: tl.constexpr,
    STRIDES_ALIGNED: tl.constexpr,
    INVERSE: tl.constexpr,
    WRITE_COS_SIN: tl.constexpr,
):
    if STRIDES_ALIGNED:
        # Multiples of 16 bytes on the host; proven so here, rows move in 16-byte vectors.
        stride_qt, stride_qh = aligned_stride(stride_qt, Q), aligned_stride(stride_qh, Q)
        stride_kt, stride_kh = aligned_stride(stride_kt, K), aligned_stride(stride_kh, K)
        stride_qot, stride_qoh = aligned_stride(stride_qot, QOut), aligned_stride(stride_qoh, QOut)
        stride_kot, stride_koh = aligned_stride(stride_kot, KOut), aligned_stride(stride_koh, KOut)
    half: tl.constexpr = HEAD_DIM // 2
    quarter: tl.constexpr = HEAD_DIM // 4
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < num_tokens
    tokens = offs_t.to(tl.int64)
    # Angle j < D/2: the row's frequency j for j < D/4, the column's frequency j - D/4 above.
    offs_j = tl.arange(0, BLOCK_H)
    mask = mask_t[:, None] & (offs_j < half)[None, :]
    from_col = offs_j >= quarter
    freq_index = tl.where(from_col, offs_j - quarter, offs_j)
    inv_freq = tl.exp2(freq_index.to(tl.float32) * (-4.0 / HEAD_DIM) * log2_theta)

    row_pos = tl.load(Positions + tokens * stride_pt, mask=mask_t, other=0)
    col_pos = tl.load(Positions + tokens * stride_pt + 1, mask=mask_t, other=0)
    angle = tl.where(from_col[None, :], col_pos[:, None], row_pos[:, None]).to(tl.float32) * inv_freq[None, :]
    cos, sin = tl.cos(angle), tl.sin(angle)
    if WRITE_COS_SIN:
        # The row holds the D/2 angles' cos, then their sin (attention reads dim d's at d % (D/2)).
        table = CosSin + tokens[:, None] * HEAD_DIM + offs_j[None, :]
        tl.store(table, cos, mask=mask)
        tl.store(table + half, sin, mask=mask)
    if INVERSE:
        # Dim j and its partner share one angle, so negating sin rotates each pair by -angle: the inverse
        # rotation, which is also its transpose (rotations are orthogonal), hence the backward.
        sin = -sin

    tile = (tokens, offs_j, mask)
    if ROTATE_Q:
        _rotate_heads(Q, QOut, (stride_qt, stride_qh), (stride_qot, stride_qoh), tile, (cos, sin), num_heads, half)
    _rotate_heads(K, KOut, (stride_kt, stride_kh), (stride_kot, stride_koh), tile, (cos, sin), num_heads, half)


def rope_inv_freq(head_dim: int, rope_theta: float, device=None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(head_dim // 4,)`` inverse frequencies in ``dtype``, computed the way transformers does (in fp32 by
    default, as transformers does; float64 for ground truth)."""
    spatial_dim = head_dim // 2
    return 1.0 / (rope_theta ** (torch.arange(0, spatial_dim, 2, dtype=dtype, device=device) / spatial_dim))


def rotary_2d_reference(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rope_theta: float = 10000.0, *, inverse: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch rotary: returns contiguous ``(q_rot, k_rot)`` in the inputs' dtypes.

    Math in fp32 (float64 inputs stay float64, which the tests use as ground truth). ``inverse`` rotates by
    the opposite angles: the inverse rotation, which is also the rotary's backward.
    """
    head_dim = q.shape[-1]
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    inv_freq = rope_inv_freq(head_dim, rope_theta, device=q.device, dtype=compute)
    freqs = positions.to(compute)[..., None] * inv_freq  # (T, 2, D/4)
    angles = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
    angles = torch.cat([angles, angles], dim=-1)[:, None, :]  # (T, 1, D)
    cos, sin = angles.cos(), -angles.sin() if inverse else angles.sin()

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.to(compute)
        x1, x2 = xf.chunk(2, dim=-1)
        return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)

    return rotate(q), rotate(k)


def rotary_2d_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    rope_theta: float = 10000.0,
    *,
    inverse: bool = False,
    k_head_major: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary on the ops' torch path: :func:`rotary_2d_reference`'s arithmetic (fp32, float64 stays float64,
    one rounding per element to the inputs' dtype, the same bits) in fewer passes. The ``D / 2`` distinct angles'
    cos and sin are computed once for q and k, and each half of a head is rotated on its own, where the
    reference builds duplicated ``(T, D)`` tables and a rotated-half copy. Plain torch, so torch.compile
    traces it and fuses each tensor's rotation into one loop.

    Returns new ``(q_rot, k_rot)`` of shape ``(T, H, D)``, contiguous; with ``k_head_major``, ``k_rot`` is a view of
    a contiguous ``(H, T, D)`` tensor instead (each head's keys adjacent, as torch's CPU attention reads them
    fastest; same values)."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    inv_freq = rope_inv_freq(q.shape[-1], rope_theta, device=q.device, dtype=compute)
    # (T, 2, D/4) -> (T, 1, D/2): the row's angles, then the column's, as every head's first half holds them.
    angles = (positions.to(compute)[..., None] * inv_freq).flatten(1)[:, None, :]
    cos, sin = angles.cos(), angles.sin()
    if torch.compiler.is_compiling():
        # Inductor inlines cheap pointwise producers into their consumers, which here evaluated the cos and sin
        # again for every head of q and k. A strided view needs storage, so this identity view has the (T, D/2)
        # tables written once and read by the rotation loops (2.5% of a compiled fp32 tower forward on CPU).
        cos, sin = (t.as_strided(t.shape, t.stride()) for t in (cos, sin))
    if inverse:
        sin = -sin
    if not k_head_major:
        return _rotate_halves(q, cos, sin), _rotate_halves(k, cos, sin)
    by_head = _rotate_halves(k.transpose(0, 1), cos.transpose(0, 1), sin.transpose(0, 1))
    return _rotate_halves(q, cos, sin), by_head.transpose(0, 1)


def _rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x (..., D)`` rotated NeoX style by angles whose cos and sin broadcast to ``(..., D / 2)``: ``[x1 cos - x2
    sin | x2 cos + x1 sin]``, computed in cos's dtype and rounded once into a new contiguous tensor of x's
    dtype."""
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1).to(x.dtype)


def check_positions(
    op: str, positions: object, num_tokens: int, device: torch.device, read_values: bool = True
) -> None:
    check_tensor(op, "positions", positions, ndim=2, dtypes=(torch.int32,))
    assert isinstance(positions, torch.Tensor)
    if positions.shape != (num_tokens, 2):
        raise ValueError(f"{op}: positions must have shape (T, 2) = ({num_tokens}, 2), got {tuple(positions.shape)}")
    if positions.device != device:
        raise ValueError(f"{op}: positions is on {positions.device} but q is on {device}")
    if positions.numel() and positions.stride(1) != 1:
        raise ValueError(f"{op}: positions must have a contiguous last dimension, got strides {positions.stride()}")
    if read_values and value_checks_enabled(device) and positions.numel() and bool((positions < 0).any()):
        raise ValueError(f"{op}: positions must be non-negative")


def check_rope_head_dim(op: str, head_dim: int) -> None:
    if head_dim <= 0 or head_dim % 4 != 0:
        raise ValueError(
            f"{op}: rotary needs a positive head_dim divisible by 4 (D/4 frequencies per axis), got {head_dim}"
        )


def check_rope_theta(op: str, rope_theta: object) -> None:
    if not isinstance(rope_theta, (int, float)) or isinstance(rope_theta, bool):
        raise TypeError(f"{op}: rope_theta must be a float, got {type(rope_theta).__name__}")
    if not (rope_theta > 1.0 and math.isfinite(rope_theta)):
        raise ValueError(f"{op}: rope_theta must be a finite number > 1, got {rope_theta}")


def _check_rotary_args(op: str, q, k, positions, rope_theta, read_values: bool = True) -> None:
    check_tensor(op, "q", q, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    check_tensor(op, "k", k, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    if k.shape != q.shape:
        raise ValueError(f"{op}: k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if k.dtype != q.dtype:
        raise TypeError(f"{op}: k must have q's dtype {q.dtype}, got {k.dtype}")
    check_same_device(op, {"q": q, "k": k})
    check_rope_head_dim(op, q.shape[-1])
    check_rope_theta(op, rope_theta)
    check_positions(op, positions, q.shape[0], q.device, read_values)


@cached_config
def launch_config(head_dim: int, target: GPUTarget) -> dict:
    """Everything the rotary launch passes besides tensors, scalars and per-call flags (q rotated too,
    aligned strides) for ``head_dim`` on ``target``: half a head per tile, tokens per program for about 1024
    values per tile (8 per thread of 4 warps), and compile options. Every target gets the same values (the
    interpreter ignores warps and options). On sm_90 the variant that also writes attention's cos/sin table takes
    112 registers and no stack at D 72 bf16; with 2048 values per tile it spilled (165 registers, 32 bytes of
    stack), and the earlier whole-head tiles of 4096 values hit the cap (255, 320 bytes)."""
    block_h = next_power_of_2(head_dim // 2)
    return dict(
        HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_T=max(1, min(64, 1024 // block_h)), num_warps=4, **FMA_CONTRACTION
    )


def rotary_launches(
    q,
    k,
    q_out,
    k_out,
    positions,
    rope_theta: float,
    target: GPUTarget,
    inverse: bool = False,
    cos_sin: torch.Tensor | None = None,
) -> list[KernelLaunch]:
    """The launch rotating ``q`` into ``q_out`` and ``k`` into ``k_out`` (``q`` and ``q_out`` None: ``k``
    alone), all ``(T, H, D)`` with a contiguous last dim, an output possibly its own input; empty when there
    is nothing to rotate. ``inverse`` rotates by the opposite angles (the backward of the rotation). Given
    ``cos_sin`` (fp32 contiguous ``(T, D)``), the launch also writes into it each token's ``D / 2`` angles' cos
    followed by their sin, exactly as it rotates with them (the attention kernel rotates q from it). Reads
    shapes, strides and data pointers only (no device sync)."""
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0 or num_heads == 0:
        return []
    rotate_q = q is not None
    q, q_out = (q, q_out) if rotate_q else (k, k_out)
    config = launch_config(head_dim, target)
    grid = (cdiv(num_tokens, config["BLOCK_T"]),)
    args = dict(
        # pointers
        Q=q,
        K=k,
        QOut=q_out,
        KOut=k_out,
        Positions=positions,
        CosSin=k_out if cos_sin is None else cos_sin,  # a placeholder pointer where nothing is written
        # sizes
        num_tokens=num_tokens,
        num_heads=num_heads,
        log2_theta=math.log2(rope_theta),
        # strides
        stride_qt=q.stride(0),
        stride_qh=q.stride(1),
        stride_kt=k.stride(0),
        stride_kh=k.stride(1),
        stride_qot=q_out.stride(0),
        stride_qoh=q_out.stride(1),
        stride_kot=k_out.stride(0),
        stride_koh=k_out.stride(1),
        stride_pt=positions.stride(0),
    )
    flags = dict(
        ROTATE_Q=rotate_q,
        STRIDES_ALIGNED=rows_16_byte_aligned(q, k, q_out, k_out),
        INVERSE=inverse,
        WRITE_COS_SIN=cos_sin is not None,
    )
    return [KernelLaunch(_rotary_2d_kernel, grid, args, {**config, **flags})]


def _empty_like(x: torch.Tensor) -> torch.Tensor:
    """A new contiguous tensor of x's shape, dtype and device (``empty_like`` would copy x's strides)."""
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("qvl::rotary_2d", mutates_args=(), device_types=("cpu", "cuda"))
def rotary_2d(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rope_theta: float = 10000.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply Qwen3-VL's 2D rotary embedding to q and k; returns new contiguous ``(q_rot, k_rot)``.

    Args:
        q, k: ``(T, H, D)`` fp16/bf16/fp32, same shape and dtype, last dim contiguous (other strides free,
            so views of a packed qkv work). ``D`` divisible by 4.
        positions: int32 ``(T, 2)``: each token's (row, col) on its image's patch grid.
        rope_theta: rotary base (10000 in every released Qwen3-VL config).

    Returns ``(T, H, D)`` tensors in q's dtype. Math in fp32. Nothing is mutated. Differentiable in q and k:
    the backward (:func:`rotary_2d_backward`) rotates the gradients back.
    """
    _check_rotary_args("rotary_2d", q, k, positions, rope_theta)
    return _rotate(q, k, positions, rope_theta, inverse=False)


def _rotate(q, k, positions, rope_theta, inverse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """New contiguous rotated (or, with ``inverse``, rotated-back) q and k on the input's path."""
    backend = backend_for(q.device)
    if backend == "torch":
        return rotary_2d_torch(q, k, positions, rope_theta, inverse=inverse)
    if backend == "reference":
        return rotary_2d_reference(q, k, positions, rope_theta, inverse=inverse)
    q_out, k_out = _empty_like(q), _empty_like(k)
    launches = rotary_launches(q, k, q_out, k_out, positions, rope_theta, device_target(k.device), inverse)
    run_launches(launches, k.device)
    return q_out, k_out


@rotary_2d.register_fake
def _(q, k, positions, rope_theta=10000.0):
    _check_rotary_args("rotary_2d", q, k, positions, rope_theta, read_values=False)
    return _empty_like(q), _empty_like(k)


@torch.library.custom_op("qvl::rotary_2d_backward", mutates_args=(), device_types=("cpu", "cuda"))
def rotary_2d_backward(
    grad_q: torch.Tensor, grad_k: torch.Tensor, positions: torch.Tensor, rope_theta: float = 10000.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward of :func:`rotary_2d`: the gradients of its outputs rotated back by the same angles.

    The rotation is orthogonal, so its transpose is its inverse: the rotary kernel with the sines negated.
    Takes and returns what :func:`rotary_2d` does (``(T, H, D)``, last dim contiguous, new contiguous
    outputs in the gradients' dtype, math in fp32). Nothing is mutated.
    """
    _check_rotary_args("rotary_2d_backward", grad_q, grad_k, positions, rope_theta, read_values=False)
    return _rotate(grad_q, grad_k, positions, rope_theta, inverse=True)


@rotary_2d_backward.register_fake
def _(grad_q, grad_k, positions, rope_theta=10000.0):
    _check_rotary_args("rotary_2d_backward", grad_q, grad_k, positions, rope_theta, read_values=False)
    return _empty_like(grad_q), _empty_like(grad_k)


def _rotary_setup_context(ctx, inputs, output) -> None:
    _, _, positions, rope_theta = inputs
    ctx.save_for_backward(positions)
    ctx.rope_theta = rope_theta


def _rotary_backward(ctx, grad_q, grad_k):
    (positions,) = ctx.saved_tensors
    grad_q, grad_k = last_dim_contiguous(grad_q), last_dim_contiguous(grad_k)
    dq, dk = torch.ops.qvl.rotary_2d_backward(grad_q, grad_k, positions, ctx.rope_theta)
    return dq, dk, None, None


rotary_2d.register_autograd(_rotary_backward, setup_context=_rotary_setup_context)


@torch.library.custom_op("qvl::rotary_2d_", mutates_args=("q", "k"), device_types=("cpu", "cuda"))
def rotary_2d_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rope_theta: float = 10000.0) -> None:
    """In-place :func:`rotary_2d`: rotates q and k where they lie (views of a packed qkv included).

    q and k must not overlap each other. Returns nothing; mutates ``q`` and ``k``. No autograd (torch.library
    gives backward formulas to functional ops only): with grad mode on and q or k requiring grad it raises
    RuntimeError before mutating anything; use :func:`rotary_2d`, or ``vision_attn(..., positions=...)``.
    """
    _check_rotary_args("rotary_2d_", q, k, positions, rope_theta)
    check_no_internal_overlap("rotary_2d_", "q", q)
    check_no_internal_overlap("rotary_2d_", "k", k)
    if runs_torch(q.device):
        q_rot, k_rot = _rotate(q, k, positions, rope_theta, inverse=False)
        q.copy_(q_rot)
        k.copy_(k_rot)
        return
    run_launches(rotary_launches(q, k, q, k, positions, rope_theta, device_target(k.device)), k.device)


@rotary_2d_.register_fake
def _(q, k, positions, rope_theta=10000.0):
    _check_rotary_args("rotary_2d_", q, k, positions, rope_theta, read_values=False)


refuse_autograd("rotary_2d_", "torch.ops.qvl.rotary_2d (or vision_attn(..., positions=...), which rotates inside)")
# Elementwise work: no cast, as torch's own elementwise ops (transformers rotates in fp32 and rounds back).
for _op in ("rotary_2d", "rotary_2d_", "rotary_2d_backward"):
    follow_autocast(_op)
