"""What more than one kernel family shares: Triton device functions, and the pieces of the backward passes.

Strides the host found to be multiples of 16 bytes are re-derived in the kernel with
:func:`aligned_stride`, so that the compiler can prove every row of a tile starts on a 16-byte boundary.

Qwen3-VL's 2D rotary embedding on a ``(tokens, head dims)`` tile: the standalone rotary kernel
(:mod:`qvl.kernels.rotary`) and the attention kernel, which rotates q as it loads it
(:mod:`qvl.kernels.attention`), compute cos/sin in fp32 from int32 (row, col) positions with these, so
both round exactly alike.

Backward passes of the row-wise ops (LayerNorm, RMSNorm, bias + GELU, biases + SwiGLU) reduce their weight
and bias gradients over the rows without atomics, deterministically: each program walks
:func:`row_split`'s share of the rows, sums ``dweight`` (``dbias``) over them in fp32 registers and writes
one fp32 partial row; :func:`sum_partials_launch` then adds the partial rows in a fixed order and rounds once
to the parameter's dtype. :func:`refuse_autograd` guards the in-place ops, which torch.library cannot give
a backward.
"""

import torch
import triton
import triton.language as tl

from .common import KernelLaunch

__all__ = [
    "PARTIAL_ROWS",
    "aligned_stride",
    "last_dim_contiguous",
    "refuse_autograd",
    "route_autograd",
    "rope_apply",
    "rope_cos_sin",
    "rope_dim_tables",
    "row_split",
    "sum_partials_launch",
]


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


# Rows a backward program sums its parameter gradients over before writing one fp32 partial row. The partials
# are written once and read once by the reduction: at 32 rows that is 8 bytes per 32 rows and column, a
# sixteenth of the traffic of one 16-bit (N, C) gradient, while N / 32 programs still fill a GPU from a
# few thousand tokens on.
PARTIAL_ROWS = 32


def row_split(num_rows: int, block_m: int) -> tuple[int, int]:
    """``(programs, row blocks per program)`` for a backward pass over ``num_rows`` rows in blocks of
    ``block_m`` (a power of two) that writes one partial row per program: about :data:`PARTIAL_ROWS` rows each
    (one block when a block is taller). A pure function of the shape, so the partial sums, and the gradients,
    come out bit-identical from run to run."""
    blocks_per_program = max(1, PARTIAL_ROWS // block_m)
    return triton.cdiv(triton.cdiv(num_rows, block_m), blocks_per_program), blocks_per_program


@triton.jit
def _sum_partials_kernel(
    Partials,
    Out0,
    Out1,
    num_partials,
    num_cols,
    stride_pk,
    BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # Program (j, k) sums column block j of partials[k] over its rows, in row order.
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = cols < num_cols
    base = Partials + tl.program_id(1).to(tl.int64) * stride_pk
    acc = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)
    for start in range(0, num_partials, BLOCK_P):
        offs_p = start + tl.arange(0, BLOCK_P)
        mask = (offs_p < num_partials)[:, None] & mask_c[None, :]
        acc += tl.load(base + offs_p.to(tl.int64)[:, None] * num_cols + cols[None, :], mask=mask, other=0.0)
    total = tl.sum(acc, axis=0)
    if tl.program_id(1) == 0:
        tl.store(Out0 + cols, total.to(Out0.dtype.element_ty), mask=mask_c)
    else:
        tl.store(Out1 + cols, total.to(Out1.dtype.element_ty), mask=mask_c)


def sum_partials_launch(partials: torch.Tensor, outs: tuple[torch.Tensor, ...]) -> KernelLaunch:
    """The launch reducing fp32 ``partials`` ``(K, P, C)`` (contiguous, K = len(outs), 1 or 2) over P into
    ``outs[k]`` (contiguous ``(C,)``, any float dtype, rounded once). Mutates ``outs`` only."""
    num_outs, num_partials, num_cols = partials.shape
    block_c = min(64, triton.next_power_of_2(num_cols))
    grid = (triton.cdiv(num_cols, block_c), num_outs)
    args = (partials, outs[0], outs[-1], num_partials, num_cols, partials.stride(0))
    return KernelLaunch(_sum_partials_kernel, grid, args, dict(BLOCK_P=32, BLOCK_C=block_c, num_warps=4))


def last_dim_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when its last dim is contiguous (row strides stay free), else a contiguous copy:
    gradients reaching a backward may be expanded (``y.sum().backward()`` gives stride 0)."""
    return tensor if tensor.shape[-1] <= 1 or tensor.stride(-1) == 1 else tensor.contiguous()


# The library fragment holding the in-place ops' autograd guards (kept alive with the module).
_AUTOGRAD_KEYS = torch.library.Library("qvl", "FRAGMENT")


def route_autograd(op: str, under_grad) -> None:
    """Give ``qvl::<op>`` its own kernel on the AutogradCPU / AutogradCUDA keys: with grad mode on and a tensor
    argument requiring grad the call runs ``under_grad(*args)``; otherwise it goes to the keys below autograd,
    as the custom op's own no-grad path does (inference is unchanged, eager or compiled).

    The dispatcher prefers these per-backend keys to the custom op's ``Autograd`` registration, and they still
    see the caller's grad mode (the op body runs under the autograd function's no-grad). The check reads Python
    attributes only.
    """
    overload = getattr(torch.ops.qvl, op).default

    def route(keyset, *args):
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return under_grad(*args)
        return overload.redispatch(keyset & torch._C._after_autograd_keyset, *args)

    for key in ("AutogradCPU", "AutogradCUDA"):
        _AUTOGRAD_KEYS.impl(op, route, key, with_keyset=True)


def refuse_autograd(op: str, alternative: str) -> None:
    """Make the in-place op ``qvl::<op>`` raise a RuntimeError naming ``alternative`` when autograd would record
    it (:func:`route_autograd`). torch.library gives mutating custom ops no autograd formula
    (``register_autograd`` refuses non-functional schemas); without this guard such a call would mutate its input
    and silently leave the autograd graph believing the old value."""
    message = (
        f"qvl::{op} mutates its input and has no backward (torch.library supports autograd for functional "
        f"custom ops only); under torch.no_grad() or with inputs that do not require grad it runs as usual. "
        f"For gradients use the out-of-place {alternative}."
    )

    def refuse(*args):
        raise RuntimeError(message)

    route_autograd(op, refuse)
