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

Head dims that are not a power of two are tiled in one of three layouts (:func:`head_dim_tiles`): ``padded``, one
power-of-two tile (D 72 and 80 as 128 columns: the layout that ran right on an H200), ``split``, a power-of-two main
tile and a narrower tail flush with the head's end (80/72 of the needed work at D 72, none extra at D 80), and
``split32`` (a tail of at least 32 columns). A GPU takes a split layout only where a device verdict says it ran
right there (:mod:`qvl.kernels.verdicts`; ``qvl check`` verifies a machine), padded otherwise; Triton's interpreter
takes split. ``QVL_ATTENTION_HEAD_DIM`` or :func:`set_head_dim_layout` set one outright.

Softmax runs online in fp32 with exp2 (log2(e) folded into the scale).

When every row of q, k, v and the output starts on a 16-byte boundary (checked on the host from strides
and data pointers: true of the views of a packed qkv projection for every Qwen3-VL head dim), the kernel
re-derives its strides in a form the compiler can prove 16-byte aligned (:func:`qvl.kernels.tiles.aligned_stride`),
so K and V tiles are fetched with 16-byte asynchronous copies pipelined over ``num_stages``; a head stride
such as 72 elements otherwise proves nothing and rows are loaded element by element. Other layouts take
the unproven path.

With ``positions`` the 2D rotary embedding is applied (see :mod:`qvl.kernels.rotary`): k is rotated once per call,
by the rotary kernel into a scratch tensor, before the attention launch; that kernel evaluates each token's sin and
cos once for all heads and also writes them into a ``(T, D)`` fp32 scratch table, from which each attention program
rotates its q tile as it loads it, once. Rotating k inside the key loop instead redoes its rotation for every q
block and head, S / BLOCK_M * H times per key, which makes the key loop longer; rotating q once per program leaves
the loop as it is without rope, and reading cos/sin from the table keeps sin and cos (inlined libdevice polynomials
with range reduction) out of the attention kernel altogether (``python -m bench.sass_attention`` prints both
variants).

Training: the op is differentiable in q, k and v. A call with grad mode on and one of them requiring grad
runs :func:`vision_attn_with_lse` instead (routed by the op's autograd keys): the same kernel, which then
also stores each row's log-sum-exp, so inference stores nothing more than the output. Its backward,
:func:`vision_attn_backward`, rebuilds the probabilities from that log-sum-exp tile by tile in a dK/dV
kernel and a dQ kernel (no ``(S x S)`` tensor, no atomics, the forward's grid formula, segment search and
head-dim tile; see the comment above the backward kernels in :mod:`.backward`). With ``positions`` it
rotates q and k again with the rotary kernel and rotates dq and dk back with its inverse.

The package's modules: :mod:`.config` (launch and tile configuration: the tile table, the heuristic, TMA
descriptors, the work a launch executes), :mod:`.forward` (the forward kernel, its launches, the
``vision_attn`` and ``vision_attn_with_lse`` ops, the reference) and :mod:`.backward` (the backward kernels,
their launches, the ``vision_attn_backward`` op, its reference, and the ops' autograd wiring).

On the torch path (CPU, no interpreter) the op runs :func:`vision_attn_sdpa`: torch's fused
``scaled_dot_product_attention`` per run of equal-length segments, memory O(S); the reference, which holds every
segment's fp32 logits, is the tests' oracle (``force_backend("reference")``).
"""

from .backward import vision_attn_backward, vision_attn_backward_launches, vision_attn_backward_reference
from .config import (
    HEAD_DIM_LAYOUT_VARIABLE,
    HEAD_DIM_LAYOUTS,
    MAX_HEAD_DIM,
    SHORT_SEGMENT_MAX,
    TILE_KEYS,
    TILE_TABLE_PATH,
    AttentionWork,
    HeadDimTiles,
    backward_launch_config,
    head_dim_layout,
    head_dim_layout_in,
    head_dim_tiles,
    heuristic_tiles,
    launch_config,
    launch_work,
    reload_tile_table,
    segment_class,
    set_head_dim_layout,
    tile_key,
    tile_table,
    tma_capable,
)
from .forward import (
    equal_length_runs,
    vision_attn,
    vision_attn_launches,
    vision_attn_reference,
    vision_attn_sdpa,
    vision_attn_with_lse,
)

__all__ = [
    "HEAD_DIM_LAYOUT_VARIABLE",
    "HEAD_DIM_LAYOUTS",
    "MAX_HEAD_DIM",
    "SHORT_SEGMENT_MAX",
    "TILE_KEYS",
    "TILE_TABLE_PATH",
    "AttentionWork",
    "backward_launch_config",
    "equal_length_runs",
    "HeadDimTiles",
    "head_dim_layout",
    "head_dim_layout_in",
    "head_dim_tiles",
    "heuristic_tiles",
    "launch_config",
    "launch_work",
    "reload_tile_table",
    "segment_class",
    "set_head_dim_layout",
    "tile_key",
    "tile_table",
    "tma_capable",
    "vision_attn",
    "vision_attn_backward",
    "vision_attn_backward_launches",
    "vision_attn_backward_reference",
    "vision_attn_launches",
    "vision_attn_reference",
    "vision_attn_sdpa",
    "vision_attn_with_lse",
]
