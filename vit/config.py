"""The shape of a Qwen3-VL vision tower, read from transformers configs or config.json dicts, and what every tower
config offers the code that serves all tower kinds."""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Callable
from typing import Protocol

from qvl.kernels.attention import MAX_HEAD_DIM

__all__ = [
    "GELU_APPROXIMATIONS",
    "SILU_NAMES",
    "MlpActivation",
    "Qwen2VisionConfig",
    "TowerConfig",
    "TowerShape",
    "VisionConfig",
    "torch_activation",
]

# The GELUs transformers' configs name for a vision MLP (``hidden_act``, keys of its ACT2FN) -> the approximation
# bias_gelu computes them with: erf, the tanh formula (gelu_new, gelu_fast, gelu_accurate, gelu_python_tanh and
# gelu_pytorch_tanh are the same function), or QuickGELU's x * sigmoid(1.702 x).
GELU_APPROXIMATIONS = {
    "gelu": "none",
    "gelu_python": "none",
    "gelu_pytorch_tanh": "tanh",
    "gelu_python_tanh": "tanh",
    "gelu_new": "tanh",
    "gelu_fast": "tanh",
    "gelu_accurate": "tanh",
    "quick_gelu": "quick",
}
# ACT2FN's names of SiLU, which a gated MLP's bias_swiglu computes.
SILU_NAMES = frozenset({"silu", "swish"})


@functools.lru_cache(maxsize=None)
def torch_activation(hidden_act: str) -> Callable:
    """transformers' ``ACT2FN[hidden_act]``, one instance per name; ValueError for a name it does not resolve or a
    learned activation."""
    try:
        from transformers.activations import ACT2FN
    except ImportError:
        raise ValueError(
            f"the vision MLP's activation {hidden_act!r} has no fused qvl op; torch runs it as transformers' ACT2FN"
            " names it, which needs transformers (pip install 'qvl[hf]')"
        ) from None
    if hidden_act not in ACT2FN:
        raise ValueError(f"hidden_act must be one of transformers' ACT2FN names {sorted(ACT2FN)}, got {hidden_act!r}")
    module = ACT2FN[hidden_act]
    # A learned activation (prelu, xielu) has weights of its own in the checkpoint, which qvl's towers do not load.
    if any(True for _ in module.parameters()):
        raise ValueError(f"hidden_act {hidden_act!r} has learned parameters, which qvl's vision towers do not load")
    return module


@dataclasses.dataclass(frozen=True)
class MlpActivation:
    """A vision MLP's activation: ``hidden_act`` (any of transformers' ACT2FN names) on fc1's output, or with
    ``gated`` on a gated MLP's gate projection, times its up projection (Qwen2.5-VL's ``down(act(gate) * up)``).

    ``fused`` names the fused qvl op computing bias + activation: bias_gelu's approximation for a GELU, ``"swiglu"``
    for a gated SiLU; None where no fused op fits, and then ``function`` (transformers' module) runs after the
    bias-less GEMM and the bias add. Construction raises ValueError for a name ACT2FN does not resolve."""

    hidden_act: str
    gated: bool = False
    function: Callable | None = dataclasses.field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.fused is None:
            object.__setattr__(self, "function", torch_activation(self.hidden_act))

    @property
    def fused(self) -> str | None:
        if self.gated:
            return "swiglu" if self.hidden_act in SILU_NAMES else None
        return GELU_APPROXIMATIONS.get(self.hidden_act)


class TowerConfig(Protocol):
    """What code serving every tower kind reads of a tower's config (:class:`VisionConfig` or
    :class:`Qwen2VisionConfig`): the widths a parallel strategy splits, the batch layout it checks and the FLOP
    counts it balances by, and what the tower runner (:mod:`qvl.vit.runner`) builds metadata and runs blocks
    from."""

    num_heads: int
    intermediate_size: int
    merged_width: int
    spatial_merge_size: int
    patch_dim: int
    folded_patch_dim: int
    linear_flops_per_token: int
    flops_per_token_pair: int
    head_dim: int
    rope_theta: float
    deepstack_visual_indexes: tuple[int, ...]
    num_grid_per_side: int | None
    windowed: bool
    full_attention_blocks: tuple[int, ...]
    mlp_activation: MlpActivation


class TowerShape:
    """The widths every tower config derives alike from its fields (``hidden_size``, ``num_heads``,
    ``spatial_merge_size``, ``in_channels``, ``temporal_patch_size``, ``patch_size``)."""

    # The integer sizes every tower config has; a config.json may hold anything in their place.
    SIZE_FIELDS = (
        "depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size", "patch_size",
        "temporal_patch_size", "spatial_merge_size", "in_channels",
    )  # fmt: skip

    def _check_sizes(self) -> None:
        """Raise TypeError / ValueError naming the field unless every size is an int >= 1 and the heads are
        ``head_dim`` wide, a multiple of 4 (the 2D rotary's four quarters) and at most the attention kernel's
        limit."""
        name = type(self).__name__
        for field in self.SIZE_FIELDS:
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{name}: {field} must be an int, got {value!r}")
            if value < 1:
                raise ValueError(f"{name}: {field} must be >= 1, got {value}")
        head_dim, remainder = divmod(self.hidden_size, self.num_heads)
        if remainder or head_dim % 4 or head_dim > MAX_HEAD_DIM:
            raise ValueError(
                f"{name}: hidden_size {self.hidden_size} over num_heads {self.num_heads} must give a head_dim that"
                f" is a multiple of 4 and at most {MAX_HEAD_DIM}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merged_width(self) -> int:
        """Width of a merged token, ``hidden_size * spatial_merge_size**2``: the mergers' fc1 in and out."""
        return self.hidden_size * self.spatial_merge_size**2

    @property
    def patch_dim(self) -> int:
        """Values per patch in ``pixel_values``: ``in_channels * temporal_patch_size * patch_size**2``."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def folded_patch_dim(self) -> int:
        """Values per patch in folded image rows (one temporal slot: an image's slots hold the same frame):
        ``in_channels * patch_size**2``."""
        return self.in_channels * self.patch_size**2


@dataclasses.dataclass(frozen=True)
class VisionConfig(TowerShape):
    """The shape of a Qwen3-VL vision tower (defaults: Qwen3-VL-8B)."""

    SIZE_FIELDS = (*TowerShape.SIZE_FIELDS, "num_position_embeddings")

    depth: int = 27
    hidden_size: int = 1152
    num_heads: int = 16
    intermediate_size: int = 4304
    out_hidden_size: int = 4096
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    num_position_embeddings: int = 2304
    rope_theta: float = 10000.0
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        self._check_sizes()
        side = int(round(self.num_position_embeddings**0.5))
        if side * side != self.num_position_embeddings:
            raise ValueError(f"VisionConfig: num_position_embeddings {self.num_position_embeddings} is not a square")
        try:
            MlpActivation(self.hidden_act)
        except ValueError as error:
            raise ValueError(f"VisionConfig: {error}") from None
        if any(not 0 <= i < self.depth for i in self.deepstack_visual_indexes):
            raise ValueError(f"VisionConfig: deepstack_visual_indexes {self.deepstack_visual_indexes} outside depth")
        object.__setattr__(self, "deepstack_visual_indexes", tuple(self.deepstack_visual_indexes))

    @property
    def num_grid_per_side(self) -> int:
        return int(round(self.num_position_embeddings**0.5))

    @property
    def windowed(self) -> bool:
        """False: every block attends over whole frames (what code serving every tower kind reads)."""
        return False

    @property
    def full_attention_blocks(self) -> tuple[int, ...]:
        return tuple(range(self.depth))

    @property
    def mlp_activation(self) -> MlpActivation:
        """The blocks' MLP activation (``fc2(act(fc1(x)))``)."""
        return MlpActivation(self.hidden_act)

    @property
    def linear_flops_per_token(self) -> int:
        """Forward FLOPs per token that do not depend on the segment's length (:class:`~qvl.vit.balance.SegmentCost`):
        patch embed, each block's qkv / proj / fc1 / fc2, and each merger's two linears (run on a quarter of the
        tokens at four times the width)."""
        hidden = self.hidden_size
        block = 2 * hidden * (4 * hidden + 2 * self.intermediate_size)
        mergers = (1 + len(self.deepstack_visual_indexes)) * 2 * hidden * (self.merged_width + self.out_hidden_size)
        return 2 * self.patch_dim * hidden + self.depth * block + mergers

    @property
    def flops_per_token_pair(self) -> int:
        """Forward FLOPs per pair of tokens in one segment: each block's ``q k^T`` and ``p v`` (4 * hidden)."""
        return self.depth * 4 * self.hidden_size

    @classmethod
    def from_dict(cls, values: dict, *, deepstack: bool = True) -> VisionConfig:
        """From a vision config's fields under transformers' names (a config.json's ``vision_config`` section, or
        a transformers vision config's ``to_dict()``); fields it does not know are ignored. ``deepstack=False``:
        a family without deepstack mergers (Qwen3.5), whose configs may omit ``deepstack_visual_indexes``; with
        it, a config that omits them gets Qwen3-VL's default. Which family a config belongs to is
        :mod:`qvl.vit.families`' business."""
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in values.items() if k in fields}
        if "deepstack_visual_indexes" in kwargs:
            kwargs["deepstack_visual_indexes"] = tuple(kwargs["deepstack_visual_indexes"])
        elif not deepstack:
            kwargs["deepstack_visual_indexes"] = ()
        rope = values.get("rope_parameters") or {}
        if "rope_theta" in rope:
            kwargs["rope_theta"] = float(rope["rope_theta"])
        return cls(**kwargs)


@dataclasses.dataclass(frozen=True)
class Qwen2VisionConfig(TowerShape):
    """The shape of a Qwen2.5-VL (``windowed=True``) or Qwen2-VL vision tower (defaults: Qwen2.5-VL-7B's).

    Attributes:
        windowed: Qwen2.5-VL (window attention, RMSNorm, SwiGLU MLP); False: Qwen2-VL (full attention,
            LayerNorm, ``fc1``/``fc2`` MLP with ``hidden_act``).
        depth, hidden_size, num_heads, intermediate_size: the blocks (Qwen2-VL's ``embed_dim`` is
            ``hidden_size`` here and its ``embed_dim * mlp_ratio`` is ``intermediate_size``).
        out_hidden_size: the merger's output width (Qwen2-VL's config calls it ``hidden_size``).
        patch_size, temporal_patch_size, spatial_merge_size, in_channels: the patches.
        window_size: Qwen2.5-VL's window side in pixels; fullatt_block_indexes: its blocks that attend over
            whole frames (the others within windows; indexes past ``depth`` are accepted and never reached, as in
            transformers). Unused by Qwen2-VL.
        hidden_act: the MLP's activation, any of transformers' ACT2FN names: on the gate of Qwen2.5-VL's gated MLP
            (``"silu"`` in the released models, fused as bias_swiglu), on fc1's output in Qwen2-VL's
            (``"quick_gelu"``, fused as bias_gelu); others run as torch's activation (:class:`MlpActivation`).
        rope_theta: the 2D rotary's base. norm_eps: every norm's epsilon (transformers fixes it at 1e-6).
    """

    SIZE_FIELDS = (*TowerShape.SIZE_FIELDS, "window_size")

    windowed: bool = True
    depth: int = 32
    hidden_size: int = 1280
    num_heads: int = 16
    intermediate_size: int = 3420
    out_hidden_size: int = 3584
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        name = type(self).__name__
        object.__setattr__(self, "fullatt_block_indexes", tuple(int(i) for i in self.fullatt_block_indexes))
        self._check_sizes()
        try:
            MlpActivation(self.hidden_act, gated=self.windowed)
        except ValueError as error:
            raise ValueError(f"{name}: {error}") from None
        if self.windowed and self.window_size < self.spatial_merge_size * self.patch_size:
            raise ValueError(
                f"{name}: window_size {self.window_size} must be at least spatial_merge_size * patch_size"
                f" = {self.spatial_merge_size * self.patch_size}"
            )

    @property
    def deepstack_visual_indexes(self) -> tuple[int, ...]:
        """Always empty: these towers have no deepstack mergers (what code serving every tower kind reads)."""
        return ()

    @property
    def num_grid_per_side(self) -> None:
        """None: these towers have no learned position table."""
        return None

    @property
    def mlp_activation(self) -> MlpActivation:
        """The blocks' MLP activation: on the gate of Qwen2.5-VL's gated MLP, on fc1's output in Qwen2-VL's."""
        return MlpActivation(self.hidden_act, gated=self.windowed)

    @property
    def full_attention_blocks(self) -> tuple[int, ...]:
        """The blocks that attend over whole frames: every block of Qwen2-VL; Qwen2.5-VL's
        ``fullatt_block_indexes`` below ``depth`` (transformers never reaches the others, and neither does qvl)."""
        if not self.windowed:
            return tuple(range(self.depth))
        return tuple(i for i in self.fullatt_block_indexes if 0 <= i < self.depth)

    @property
    def window_tokens(self) -> int:
        """The most tokens a window holds (64 for Qwen2.5-VL's 112-px windows of 14-px patches): the windowed
        blocks' ``max_seqlen`` tile hint, exact for every batch without reading the batch."""
        side = self.window_size // self.spatial_merge_size // self.patch_size * self.spatial_merge_size
        return side * side

    @property
    def linear_flops_per_token(self) -> int:
        """Forward FLOPs per token that do not depend on the segment's length (:class:`~qvl.vit.balance.SegmentCost`):
        patch embed, qkv / proj / MLP of every block, the merger, and the windowed blocks' attention (at most
        ``window_tokens`` keys per query)."""
        hidden = self.hidden_size
        mlp = (3 if self.windowed else 2) * self.intermediate_size
        windowed_blocks = self.depth - len(self.full_attention_blocks)
        return (
            2 * self.patch_dim * hidden
            + self.depth * 2 * hidden * (4 * hidden + mlp)
            + windowed_blocks * 4 * hidden * self.window_tokens
            + 2 * hidden * (self.merged_width + self.out_hidden_size)
        )

    @property
    def flops_per_token_pair(self) -> int:
        """Forward FLOPs per pair of tokens in one segment (frame): the full-attention blocks' ``q k^T`` and
        ``p v``."""
        return len(self.full_attention_blocks) * 4 * self.hidden_size

    @classmethod
    def from_dict(cls, values: dict, *, windowed: bool) -> Qwen2VisionConfig:
        """From a vision config's fields under transformers' names (a config.json's ``vision_config`` section or a
        transformers vision config's ``to_dict()``, released checkpoints' spellings too): Qwen2.5-VL's
        (``windowed=True``) or Qwen2-VL's (``embed_dim``, ``mlp_ratio``, the merger width as ``hidden_size``).
        Which family a config belongs to is :mod:`qvl.vit.families`' business. Raises ValueError for one qvl
        cannot run (rotary other than axial, a head_dim that is not a multiple of 4 or over the kernel's limit, an
        MLP activation qvl has no kernel for)."""
        rope = dict(values.get("rope_parameters") or {})
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"{cls.__name__}: only the axial vision rotary is supported, got {rope['rope_type']!r}")
        defaults = cls()
        if windowed:
            shape = {
                "hidden_size": values.get("hidden_size", defaults.hidden_size),
                "intermediate_size": values.get("intermediate_size", defaults.intermediate_size),
                "out_hidden_size": values.get("out_hidden_size", defaults.out_hidden_size),
                "window_size": values.get("window_size", defaults.window_size),
                "fullatt_block_indexes": tuple(values.get("fullatt_block_indexes", defaults.fullatt_block_indexes)),
                "hidden_act": values.get("hidden_act", "silu"),
            }
        else:
            embed_dim = values.get("embed_dim", 1280)
            shape = {
                "hidden_size": embed_dim,
                "intermediate_size": int(embed_dim * values.get("mlp_ratio", 4)),
                "out_hidden_size": values.get("hidden_size", defaults.out_hidden_size),
                "fullatt_block_indexes": (),
                "hidden_act": values.get("hidden_act", "quick_gelu"),
            }
        # Released checkpoints spell the channel count "in_chans".
        in_channels = values.get("in_channels", values.get("in_chans", defaults.in_channels))
        return cls(
            windowed=windowed,
            depth=values.get("depth", defaults.depth),
            num_heads=values.get("num_heads", defaults.num_heads),
            patch_size=values.get("patch_size", defaults.patch_size),
            temporal_patch_size=values.get("temporal_patch_size", defaults.temporal_patch_size),
            spatial_merge_size=values.get("spatial_merge_size", defaults.spatial_merge_size),
            in_channels=in_channels,
            rope_theta=float(rope.get("rope_theta", defaults.rope_theta)),
            **shape,
        )
