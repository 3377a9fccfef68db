"""The attention kernels' launch and tile configuration, from host data only (shapes, strides, dtype, target,
the ``max_seqlen`` hint; no device sync).

:func:`launch_config` (the forward's meta-parameters: head-dim tiling, tiles from the packaged tile table or
the heuristic) and :func:`backward_launch_config` (the backward's), what both share (:func:`head_dim_config`,
:func:`segment_class` of the ``max_seqlen`` hint, the grid's :func:`segment_search_steps`, the offset width
of :func:`needs_wide_offsets`), the TMA descriptors of K and V (:func:`kv_descriptors`) and the matmul work a
launch executes (:func:`launch_work`). The launchers (:mod:`.forward`, :mod:`.backward`), the sm_90 compile
checks and the tile sweep (``bench/tune_attention.py``, which writes the tile table) all read them from here.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from triton.backends.compiler import GPUTarget
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import verdicts
from ..common import (
    FMA_CONTRACTION,
    INTERPRETER,
    device_target,
    next_power_of_2,
    shared_memory_per_block,
    strides_16_byte_aligned,
    triton_interpreting,
)

__all__ = [
    "MAX_HEAD_DIM",
    "SHORT_SEGMENT_MAX",
    "TILE_KEYS",
    "TILE_TABLE_PATH",
    "AttentionPlan",
    "AttentionWork",
    "attention_plan",
    "backward_launch_config",
    "descriptor_of",
    "head_dim_config",
    "HEAD_DIM_LAYOUTS",
    "HEAD_DIM_LAYOUT_VARIABLE",
    "HeadDimTiles",
    "head_dim_layout",
    "head_dim_layout_in",
    "head_dim_tiles",
    "heuristic_tiles",
    "kv_descriptors",
    "launch_config",
    "launch_work",
    "needs_wide_offsets",
    "segment_class",
    "segment_search_steps",
    "set_head_dim_layout",
    "reload_tile_table",
    "tile_key",
    "tile_table",
    "tma_capable",
    "wide_token_offsets",
]

MAX_HEAD_DIM = 256
# A ``max_seqlen`` hint at most this long selects the short-segment tiles (see launch_config).
SHORT_SEGMENT_MAX = 64


class HeadDimTiles(NamedTuple):
    """How the kernels tile a head of ``head_dim`` columns (:func:`head_dim_tiles`): a main tile over columns
    ``[0, main)`` and, where ``tail`` > 0, a tail tile over the last ``tail`` columns ``[head_dim - tail,
    head_dim)``, which may overlap the main tile. Both widths are powers of two of at least 16, as dots need."""

    main: int
    tail: int

    @property
    def width(self) -> int:
        """The columns the dots multiply per row: main plus tail."""
        return self.main + self.tail


# How heads whose width is not a power of two are tiled (see head_dim_tiles): "split", "split32" or "padded". This
# environment variable sets it for every attention kernel of the process, read once at import; unset, each target
# takes the layout its device verdicts allow (qvl.kernels.verdicts: padded on a GPU without a "right" verdict for a
# faster one, split on Triton's interpreter).
HEAD_DIM_LAYOUTS = ("split", "split32", "padded")
# The narrowest tail tile of each split layout.
_MIN_TAIL = {"split": 16, "split32": 32}
HEAD_DIM_LAYOUT_VARIABLE = "QVL_ATTENTION_HEAD_DIM"


def _checked_layout(layout: object, source: str) -> str:
    if layout not in HEAD_DIM_LAYOUTS:
        raise ValueError(f"{source} must be one of {', '.join(map(repr, HEAD_DIM_LAYOUTS))}, got {layout!r}")
    return layout


_setting = os.environ.get(HEAD_DIM_LAYOUT_VARIABLE)
_head_dim_layout = _checked_layout(_setting, HEAD_DIM_LAYOUT_VARIABLE) if _setting else None


def _default_target() -> GPUTarget:
    """The target of a launch that names none: the current CUDA device's where the kernels run compiled on one,
    else the interpreter's."""
    if not triton_interpreting() and torch.cuda.is_available():
        return device_target(torch.device("cuda"))
    return INTERPRETER


def head_dim_layout(target: GPUTarget | None = None) -> str:
    """The head-dim layout the attention kernels use on ``target`` (default: the current GPU's, or the
    interpreter's): one of :data:`HEAD_DIM_LAYOUTS` (:func:`head_dim_tiles`). The one set
    (``QVL_ATTENTION_HEAD_DIM``, :func:`set_head_dim_layout`), else the target's default by its device verdicts
    (:func:`qvl.kernels.verdicts.decision`)."""
    if _head_dim_layout is not None:
        return _head_dim_layout
    target = target or _default_target()
    # Every launch configuration asks: decided once per target (and per set of verdicts: tests reset them).
    key = (target, verdicts.generation())
    layout = _default_layouts.get(key)
    if layout is None:
        layout = _default_layouts[key] = verdicts.decision("head_dim", target, _live_device(target)).variant
    return layout


_default_layouts: dict[tuple[GPUTarget, int], str] = {}


def _live_device(target: GPUTarget) -> int | None:
    """The current CUDA device's index where ``target`` is that device's (its own verdicts count), else None."""
    if target.backend != "cuda" or triton_interpreting() or not torch.cuda.is_available():
        return None
    index = torch.cuda.current_device()
    return index if device_target(torch.device("cuda", index)) == target else None


def set_head_dim_layout(layout: str | None) -> None:
    """Tile non-power-of-two heads as ``layout`` on every target from the next launch on, forward and backward
    (plans made for another layout are dropped); None: each target's default again. ``QVL_ATTENTION_HEAD_DIM``
    sets it at import. ValueError for any other value."""
    global _head_dim_layout
    _head_dim_layout = None if layout is None else _checked_layout(layout, "layout")
    reload_tile_table()


@contextlib.contextmanager
def head_dim_layout_in(layout: str | None) -> Iterator[None]:
    """:func:`set_head_dim_layout` for the ``with`` block; the setting before it comes back after it. Each
    launch reads the layout when it is built, the backward's too: a training step whose forward runs in the block
    takes its backward there as well, or the backward tiles the head dim in the layout of the moment."""
    before = _head_dim_layout
    set_head_dim_layout(layout)
    try:
        yield
    finally:
        set_head_dim_layout(before)


def head_dim_tiles(head_dim: int, layout: str | None = None, target: GPUTarget | None = None) -> HeadDimTiles:
    """The head-dim tiling of the attention kernels for heads of ``head_dim`` columns in ``layout`` (default: the
    one :func:`head_dim_layout` gives ``target``).

    A power of two is one tile in every layout (at least 16 wide: narrower heads take a 16-wide tile with masked
    columns). Otherwise, ``"split"``: the main tile is the largest power of two below ``head_dim`` and the tail
    tile the smallest power of two (at least 16) that holds the rest, placed flush with the head's end: 72 = 64 +
    the 16 columns ``[56, 72)``, 80 = 64 + ``[64, 80)``, 96 = 64 + 32. The dots then do 80/72 (1.11x) of the useful
    work at D 72 and none extra at 80 or 96, where one tile of the next power of two does 128/72 and 128/80. Where
    the tail would be as wide as the main tile (D 24, 112, 200), one tile of twice the main width is the same work.
    ``"split32"``: the same with a tail of at least 32 columns: 72 = 64 + ``[40, 72)`` (1.33x, the work of
    FlashAttention-3's 96-wide tile), 80 = 64 + ``[48, 80)`` (1.2x). Its dots over the tail have N = 32 where
    split's have N = 16, a different shape of the Hopper MMA instruction and its shared-memory operand (a 64-byte
    swizzle instead of a 32-byte one), so that a device run on which the 16-wide tail computes wrong results can
    tell whether the 32-wide one does too (``qvl check`` checks each, :mod:`qvl.kernels.check`).
    ``"padded"``: one tile of the next power of two, its columns past the head masked (the layout every Qwen head
    dim ran correctly on an H200, at 1.78x the useful work at D 72).

    Every tail column is a real column of the head: no load needs a column mask. The columns the two tiles
    share (``[56, 64)`` at D 72 in split) are counted once: the kernels zero them in the tail of the resident operand
    of each dot that sums over the head dim, and store only the tail's columns past the main tile. (The
    16-wide tail the kernels had before, columns ``[64, 80)`` masked to ``< 72``, computed wrong results on an
    H200 with Triton 3.6 wherever a segment ended inside a key block, though the same kernels were right in
    Triton's interpreter with the inputs inside NaN guard bands: bench/results/diag-20261204/. At D 80 today's split
    kernel compiles to the same PTX instructions as that one, so the cause is unknown: the split layouts have not run
    on a GPU yet, and a GPU takes them only with a device verdict, :mod:`qvl.kernels.verdicts`.)"""
    if head_dim <= 16:
        return HeadDimTiles(16, 0)
    main = next_power_of_2(head_dim)
    if main == head_dim:
        return HeadDimTiles(main, 0)
    layout = layout or head_dim_layout(target)
    if layout == "padded":
        return HeadDimTiles(main, 0)
    main //= 2
    tail = max(_MIN_TAIL[layout], next_power_of_2(head_dim - main))
    if tail >= main:
        return HeadDimTiles(2 * main, 0)
    return HeadDimTiles(main, tail)


# Tiles measured on devices by bench/tune_attention.py, read by launch_config (see tile_table).
TILE_TABLE_PATH = Path(__file__).parent.parent / "attention_tiles.json"
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
    """The tile table's key for a launch: ``"cuda:90/bfloat16/D72/long"``, with the head-dim layout appended
    (``"/padded"``, ``"/split32"``) where the target's layout is not split and tiles ``head_dim`` otherwise than split
    does (tiles measured for one tiling say nothing of another)."""
    dtype_name = str(dtype).removeprefix("torch.")
    key = f"{target.backend}:{target.arch}/{dtype_name}/D{head_dim}/{segment_class(max_seqlen)}"
    layout = head_dim_layout(target)
    if head_dim_tiles(head_dim, layout) != head_dim_tiles(head_dim, "split"):
        key += f"/{layout}"
    return key


def tma_capable(target: GPUTarget) -> bool:
    """Whether K and V may load through tensor descriptors on ``target``: Hopper and later NVIDIA GPUs (TMA
    hardware), and the interpreter, which emulates them (so the tests run the descriptor path on CPU)."""
    return (target.backend == "cuda" and target.arch >= 90) or target.backend == "interpreter"


def head_dim_config(head_dim: int, dtype: torch.dtype, target: GPUTarget) -> dict:
    """What every attention kernel's launch takes besides its tiles: the head-dim tiling (:func:`head_dim_tiles`:
    ``D_MAIN``, ``D_TAIL``, 0 for none), the dot precision (fp32 exact, 16-bit on tensor cores) and the FMA
    option."""
    precision = "ieee" if dtype == torch.float32 else "tf32"
    tiles = head_dim_tiles(head_dim, target=target)
    return dict(HEAD_DIM=head_dim, D_MAIN=tiles.main, D_TAIL=tiles.tail, DOT_PRECISION=precision, **FMA_CONTRACTION)


def launch_config(head_dim: int, dtype: torch.dtype, target: GPUTarget, max_seqlen: int | None = None) -> dict:
    """Everything the attention launch passes besides tensors, scalars and per-call flags (rope on q,
    64-bit offsets, aligned strides): head-dim tiling, tile sizes, pipelining, whether K and V may load
    through TMA descriptors, and compile options for ``head_dim`` in ``dtype`` on ``target`` (see
    :func:`qvl.kernels.common.device_target`), given the caller's ``max_seqlen`` hint (a host int or None; only
    its class matters: :func:`segment_class`).

    A tile-table entry for the launch (:func:`tile_table`, keyed by :func:`tile_key`: what a device measured)
    sets the tiles; without one, the heuristic below does, with pointer loads. A descriptor entry is only
    followed where the tensors allow it (see :func:`~qvl.kernels.attention.vision_attn_launches`).

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
    tuned = tile_table().get(tile_key(target, head_dim, dtype, max_seqlen))
    if tuned is not None:
        tiles = {key: tuned[key] for key in TILE_KEYS}
    else:
        tiles = heuristic_tiles(head_dim, dtype, target, max_seqlen)
    return {**head_dim_config(head_dim, dtype, target), **tiles}


def heuristic_tiles(head_dim: int, dtype: torch.dtype, target: GPUTarget, max_seqlen: int | None = None) -> dict:
    """The :data:`TILE_KEYS` :func:`launch_config` takes where the tile table has no entry (its docstring says
    why these)."""
    width = head_dim_tiles(head_dim, target=target).width
    if dtype == torch.float32 or width > 128:
        budget = shared_memory_per_block(target)
        if dtype == torch.float32 and width > 128 and budget is not None and budget < 136 * 1024:
            return dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=2, DESCRIPTORS=False)
        return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2, DESCRIPTORS=False)
    if segment_class(max_seqlen) == "short":
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2, DESCRIPTORS=False)
    return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, DESCRIPTORS=False)


def backward_launch_config(
    head_dim: int, dtype: torch.dtype, target: GPUTarget, max_seqlen: int | None = None
) -> dict[str, dict]:
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
    width = head_dim_tiles(head_dim, target=target).width
    if dtype == torch.float32:
        dkdv = dict(BLOCK_M=16, BLOCK_N=32, num_warps=8, num_stages=2)
        dq = dict(BLOCK_M=32, BLOCK_N=16, num_warps=8, num_stages=2)
    elif width > 128:
        dkdv = dict(BLOCK_M=32, BLOCK_N=64, num_warps=8, num_stages=2)
        dq = dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=2)
    elif segment_class(max_seqlen) == "short":
        dkdv = dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=2)
        dq = dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
    else:
        dkdv = dict(BLOCK_M=32, BLOCK_N=128, num_warps=8, num_stages=3)
        dq = dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=3)
    common = head_dim_config(head_dim, dtype, target)
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
    ``BLOCK_M``-row q tile with ``ceil(S / BLOCK_N)`` key blocks of ``BLOCK_N`` keys, over the ``D_MAIN + D_TAIL``
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


def segment_search_steps(num_segments: int) -> int:
    """Binary-search steps that find a program's segment among ``num_segments`` (see
    :func:`~qvl.kernels.attention.forward.program_tile`)."""
    return max(1, (num_segments - 1).bit_length())


def needs_wide_offsets(num_tokens: int, *tensors: torch.Tensor | None) -> bool:
    """Whether a token offset inside the batch (at most T * token stride) can pass int32."""
    return wide_token_offsets(num_tokens, [t.stride(0) for t in tensors if t is not None])


def wide_token_offsets(num_tokens: int, token_strides: Sequence[int]) -> bool:
    """Whether ``num_tokens`` times any of ``token_strides`` (elements) can pass int32."""
    return any(num_tokens * stride >= 2**31 for stride in token_strides)


def kv_descriptors(x: torch.Tensor, config: dict) -> tuple[TensorDescriptor, TensorDescriptor]:
    """The TMA descriptors of a ``(T, H, D)`` key or value tensor for the main and the tail head-dim tiles
    (:func:`head_dim_tiles`), with ``(BLOCK_N, 1, D_MAIN)`` and ``(BLOCK_N, 1, D_TAIL)`` boxes; without a tail,
    the main one twice (the kernel reads only the first). Rows past T, and columns past D of a main tile wider
    than the head, read as zeros."""
    main = TensorDescriptor(x, list(x.shape), list(x.stride()), [config["BLOCK_N"], 1, config["D_MAIN"]])
    if not config["D_TAIL"]:
        return main, main
    return main, TensorDescriptor(x, list(x.shape), list(x.stride()), [config["BLOCK_N"], 1, config["D_TAIL"]])


class AttentionPlan(NamedTuple):
    """What an attention launch takes besides its tensors, for one key of :func:`attention_plan`: the grid, the
    kernel's scalar arguments (sizes, scale, strides), its meta-parameters and compile options, and, where K and V
    load through TMA, the four descriptors' templates (K main, K tail, V main, V tail; see :func:`descriptor_of`)."""

    grid: tuple[int, int]
    scalars: dict
    kwargs: dict
    descriptors: tuple[TensorDescriptor, ...] | None


# Token counts change from batch to batch; a tower's blocks share one batch's plan, so few entries stay in use.
@functools.lru_cache(maxsize=64)
def attention_plan(
    shape: torch.Size,
    strides: tuple[tuple[int, ...], ...],
    aligned_pointers: tuple[bool, ...],
    dtype: torch.dtype,
    target: GPUTarget,
    num_segments: int,
    segment_class_name: str,
    softmax_scale: float | None,
    rotate_q: bool,
    store_lse: bool,
    tiles: tuple[tuple[str, object], ...],
) -> AttentionPlan:
    """The launch plan of :func:`~.forward.vision_attn_launches` for inputs of ``shape`` with (q, k, v, out)
    ``strides`` and data pointers (16-byte) ``aligned_pointers``: everything that depends on host metadata alone,
    decided once per key, so that the calls of a tower's blocks, which share one batch, are a lookup (the
    per-forward plan). Cached with the tile table it read: :func:`reload_tile_table` clears both."""
    num_tokens, num_heads, head_dim = shape
    q_strides, k_strides, v_strides, out_strides = strides
    element = dtype.itemsize
    rows_aligned = [
        pointer and strides_16_byte_aligned(shape, x, element) for pointer, x in zip(aligned_pointers, strides)
    ]
    # A TMA descriptor checks every stride, a size-1 dim's too, though the kernel never steps it.
    kv_descriptor_ready = all(
        pointer and not any(stride * element % 16 for stride in x[:-1])
        for pointer, x in zip(aligned_pointers[1:3], strides[1:3])
    )
    max_seqlen = SHORT_SEGMENT_MAX if segment_class_name == "short" else None
    config = {**launch_config(head_dim, dtype, target, max_seqlen), **dict(tiles)}
    config["DESCRIPTORS"] = bool(config["DESCRIPTORS"]) and tma_capable(target) and kv_descriptor_ready
    token_strides = [x[0] for x in strides] + ([head_dim] if rotate_q else [])  # the cos/sin table's rows too
    flags = dict(
        ROTATE_Q=rotate_q,
        WIDE_OFFSETS=wide_token_offsets(num_tokens, token_strides),
        STRIDES_ALIGNED=all(rows_aligned),
        STORE_LSE=store_lse,
    )
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    scalars = dict(
        # sizes
        num_segments=num_segments,
        search_steps=segment_search_steps(num_segments),
        # scalars
        qk_scale=scale * math.log2(math.e),
        # strides
        stride_qt=q_strides[0],
        stride_qh=q_strides[1],
        stride_kt=k_strides[0],
        stride_kh=k_strides[1],
        stride_vt=v_strides[0],
        stride_vh=v_strides[1],
        stride_ot=out_strides[0],
        stride_oh=out_strides[1],
        stride_lh=num_tokens if store_lse else 0,
    )
    descriptors = None
    if config["DESCRIPTORS"]:
        # Templates, validated here once (TensorDescriptor checks shapes, strides and alignment as it is made) and
        # holding no tensor: a plan must not keep a batch's k and v alive.
        k_main, k_tail = kv_descriptors(torch.empty_strided(shape, k_strides, dtype=dtype, device="meta"), config)
        v_main, v_tail = kv_descriptors(torch.empty_strided(shape, v_strides, dtype=dtype, device="meta"), config)
        descriptors = (k_main, k_tail, v_main, v_tail)
        for descriptor in descriptors:
            descriptor.base = None
    grid = (num_tokens // config["BLOCK_M"] + num_segments, num_heads)
    return AttentionPlan(grid, scalars, {**config, **flags}, descriptors)


def descriptor_of(template: TensorDescriptor, x: torch.Tensor) -> TensorDescriptor:
    """``template``'s descriptor of ``x`` (which has the shape and strides it was made for, and a 16-byte aligned
    data pointer), made without TensorDescriptor's checks: the plan ran them."""
    descriptor = TensorDescriptor.__new__(TensorDescriptor)
    descriptor.__dict__.update(template.__dict__, base=x)
    return descriptor


def reload_tile_table() -> None:
    """Forget the tile table read so far and every plan made from it: the next launch reads the table file again
    (after ``bench/tune_attention.py`` rewrote it, or a test patched :func:`tile_table` or :func:`launch_config`)."""
    for cached in _CACHES:
        cached.cache_clear()


# The cached functions themselves (a test may shadow the module's names with stand-ins while it runs).
_CACHES = (tile_table, attention_plan)
