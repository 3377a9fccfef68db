"""The pieces more than one kernel family shares: Triton device functions, tiles, and the backward passes'
partial-sum reduction.

Strides the host found to be multiples of 16 bytes are re-derived in the kernel with
:func:`aligned_stride`, so that the compiler can prove every row of a tile starts on a 16-byte boundary.
Row-wise kernels whose widths and strides are multiples of a narrower vector (Qwen2.5-VL's 3,420-wide MLP: 8
bytes) get that width as a meta-parameter (:func:`row_vector`, re-derived with :func:`vector_multiple`), and
inputs that start off a 16-byte boundary (a stacked GEMM output's second half) are passed as aligned views plus a
constant shift (:func:`aligned_view`), so that their rows still move in vectors rather than element by element.

The row-wise elementwise epilogues (bias + GELU in :mod:`qvl.kernels.gelu`, biases + SwiGLU in
:mod:`qvl.kernels.swiglu`) share their tiling (:func:`row_tiles`, :func:`epilogue_backward_config`) and
:func:`times_sigmoid`.

Backward passes of the row-wise ops (LayerNorm, RMSNorm, bias + GELU, biases + SwiGLU) reduce their weight
and bias gradients over the rows without atomics, deterministically: each program walks
:func:`row_split`'s share of the rows, sums ``dweight`` (``dbias``) over them in fp32 registers and writes
one fp32 partial row; :func:`sum_partials_launch` then adds the partial rows in a fixed order and rounds once
to the parameter's dtype.
"""

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .common import FMA_CONTRACTION, KernelLaunch, cached_config, cdiv, next_power_of_2, triton_interpreting

__all__ = [
    "INTERPRETING",
    "LOG2E",
    "PARTIAL_ROWS",
    "aligned_stride",
    "aligned_view",
    "epilogue_backward_config",
    "last_dim_contiguous",
    "row_split",
    "row_tiles",
    "round_to",
    "row_vector",
    "sum_partials_launch",
    "times_sigmoid",
    "vector_multiple",
]

# log2(e) for the kernels (Triton reads globals only as constexprs).
LOG2E = tl.constexpr(math.log2(math.e))
# Whether the kernels run in Triton's interpreter: a constant, so compiled kernels drop the branches it decides.
INTERPRETING = tl.constexpr(triton_interpreting())


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """``x`` converted to ``dtype``, an fp32 value rounded to the nearest bf16 (ties to even) as a GPU's conversion
    rounds it.

    Triton's interpreter truncates fp32 -> bf16 whatever rounding is asked for. Truncation shrinks every value toward
    zero by half an ulp on average: where a kernel rounds intermediates (attention's probabilities and rotated q and
    k), that bias adds up coherently instead of averaging out, and the interpreter would compute less accurately than
    the GPU it stands in for. So under it the rounding is done on the bits (a NaN's bits are kept). Compiled
    kernels take the plain conversion."""
    if INTERPRETING:
        if x.dtype == tl.float32 and dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = tl.where(x == x, bits + 0x7FFF + ((bits >> 16) & 1), bits)
            return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


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


def aligned_view(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(view, shift)``: ``x`` as a view of its storage starting ``shift`` elements earlier, so that its data
    pointer is 16-byte aligned (Triton proves pointer alignment only from that), and ``shift``; ``(x, 0)`` where
    ``x`` is aligned already or its storage starts misaligned. A kernel handed the view adds ``shift`` (a
    constexpr) back: the stacked ``(N, 2F)`` GEMM output's second half starts 8 bytes off a 16-byte boundary at
    F = 3,420 in 16-bit dtypes, and loads from it then move in 8-byte vectors instead of element by element. The
    view's elements are a prefix of the storage's, so nothing outside it is addressed."""
    shift = x.data_ptr() % 16 // x.element_size()
    if shift == 0 or x.storage_offset() < shift:
        return x, 0
    return x.as_strided(x.shape, x.stride(), x.storage_offset() - shift), shift


def row_vector(num_cols: int, row_strides: Sequence[int], element_size: int) -> int:
    """The widest vector, in elements (a power of two, at most 16 bytes), that divides ``num_cols`` and every one
    of ``row_strides``: a row-wise kernel told so (a ``VEC`` meta-parameter, the sizes re-derived in the kernel
    with :func:`vector_multiple`) moves its rows in vectors that wide where the data pointers allow. Triton
    proves only multiples of 16 elements by itself, so rows of Qwen2.5-VL's 3,420-wide MLP, 8-byte aligned in
    16-bit dtypes, would otherwise move element by element."""
    width = 16 // element_size
    while width > 1 and (num_cols % width or any(stride % width for stride in row_strides)):
        width //= 2
    return width


@triton.jit
def vector_multiple(n, VEC: tl.constexpr):
    """``n``, which the host found to be a multiple of ``VEC`` (:func:`row_vector`), rounded down to it: the same
    value, in a form the compiler can prove divisible by ``VEC`` (see :func:`aligned_stride`)."""
    if VEC > 1:
        n = n // VEC * VEC
    return n


@triton.jit
def times_sigmoid(v, z):
    """``v * sigmoid(z)`` in fp32 as ``v / (1 + exp2(-z log2 e))``: one exp2 and one division, and no
    cancellation for z << 0. Overflow is benign: exp2 -> inf gives -0 (or +0) for z << 0."""
    return v / (1.0 + tl.exp2(z * (-LOG2E)))


@cached_config
def row_tiles(num_cols: int) -> dict:
    """The tiles of a row-wise elementwise epilogue over rows of ``num_cols``: up to 1024 columns and about
    4096 values per program (``BLOCK_M``, ``BLOCK_N``), 4 warps, and compile options. Rows of no columns get a
    one-column tile (their launches are empty)."""
    block_n = min(1024, next_power_of_2(max(num_cols, 1)))
    return dict(BLOCK_M=max(1, 4096 // block_n), BLOCK_N=block_n, num_warps=4, **FMA_CONTRACTION)


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
    return cdiv(cdiv(num_rows, block_m), blocks_per_program), blocks_per_program


def epilogue_backward_config(num_rows: int, num_cols: int) -> dict:
    """The tiles of an elementwise epilogue's backward (bias + GELU, biases + SwiGLU) over ``(num_rows,
    num_cols)``: :func:`row_tiles`, with the rows split over ``programs`` (grid axis 0) of
    ``blocks_per_program`` row blocks each by :func:`row_split`, one fp32 partial row of the bias gradients per
    program. The same on every target."""
    config = row_tiles(num_cols)
    programs, blocks_per_program = row_split(num_rows, config["BLOCK_M"])
    return dict(config, programs=programs, blocks_per_program=blocks_per_program)


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
        tl.store(Out0 + cols, round_to(total, Out0.dtype.element_ty), mask=mask_c)
    else:
        tl.store(Out1 + cols, round_to(total, Out1.dtype.element_ty), mask=mask_c)


def sum_partials_launch(partials: torch.Tensor, outs: tuple[torch.Tensor, ...]) -> KernelLaunch:
    """The launch reducing fp32 ``partials`` ``(K, P, C)`` (contiguous, K = len(outs), 1 or 2) over P into
    ``outs[k]`` (contiguous ``(C,)``, any float dtype, rounded once). Mutates ``outs`` only."""
    num_outs, num_partials, num_cols = partials.shape
    block_c = min(64, next_power_of_2(num_cols))
    grid = (cdiv(num_cols, block_c), num_outs)
    args = dict(
        Partials=partials,
        Out0=outs[0],
        Out1=outs[-1],
        num_partials=num_partials,
        num_cols=num_cols,
        stride_pk=partials.stride(0),
    )
    options = dict(BLOCK_P=32, BLOCK_C=block_c, num_warps=4, **FMA_CONTRACTION)
    return KernelLaunch(_sum_partials_kernel, grid, args, options)


def last_dim_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when its last dim is contiguous (row strides stay free), else a contiguous copy:
    gradients reaching a backward may be expanded (``y.sum().backward()`` gives stride 0)."""
    return tensor if tensor.shape[-1] <= 1 or tensor.stride(-1) == 1 else tensor.contiguous()
