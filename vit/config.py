"""The shape of a Qwen3-VL vision tower, read from transformers configs or config.json dicts, and what every tower
config offers the code that serves all tower kinds."""

from __future__ import annotations

import dataclasses
from typing import Protocol

__all__ = ["QWEN3_FULL_MODEL_TYPES", "QWEN3_VISION_MODEL_TYPES", "TowerConfig", "TowerShape", "VisionConfig"]

# config.model_type of the models whose vision tower is Qwen3-VL's (VisionConfig's): full (or Qwen3-Omni's thinker)
# and vision models.
QWEN3_FULL_MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "qwen3_omni_moe_thinker")
QWEN3_VISION_MODEL_TYPES = (
    "qwen3_vl_vision", "qwen3_vl_moe_vision", "qwen3_5_vision", "qwen3_5_moe_vision", "qwen3_omni_moe_vision_encoder",
)  # fmt: skip


class TowerConfig(Protocol):
    """What a strategy reads of a tower's config (:class:`~qvl.vit.config.VisionConfig`, or
    :class:`~qvl.vit.qwen2_tower.Qwen2VisionConfig`): the widths it splits, the batch layout it checks and the
    FLOP counts it balances by."""

    num_heads: int
    intermediate_size: int
    merged_width: int
    spatial_merge_size: int
    patch_dim: int
    linear_flops_per_token: int
    flops_per_token_pair: int


class TowerShape:
    """The widths every tower config derives alike from its fields (``hidden_size``, ``num_heads``,
    ``spatial_merge_size``, ``in_channels``, ``temporal_patch_size``, ``patch_size``)."""

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


@dataclasses.dataclass(frozen=True)
class VisionConfig(TowerShape):
    """The shape of a Qwen3-VL vision tower (defaults: Qwen3-VL-8B)."""

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
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"VisionConfig: hidden_size {self.hidden_size} not divisible by num_heads {self.num_heads}"
            )
        side = int(round(self.num_position_embeddings**0.5))
        if side * side != self.num_position_embeddings:
            raise ValueError(f"VisionConfig: num_position_embeddings {self.num_position_embeddings} is not a square")
        if self.hidden_act != "gelu_pytorch_tanh":
            raise ValueError(f"VisionConfig: hidden_act must be 'gelu_pytorch_tanh', got {self.hidden_act!r}")
        if any(not 0 <= i < self.depth for i in self.deepstack_visual_indexes):
            raise ValueError(f"VisionConfig: deepstack_visual_indexes {self.deepstack_visual_indexes} outside depth")
        object.__setattr__(self, "deepstack_visual_indexes", tuple(self.deepstack_visual_indexes))

    @property
    def num_grid_per_side(self) -> int:
        return int(round(self.num_position_embeddings**0.5))

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
    def from_hf(cls, config: object) -> VisionConfig:
        """From a transformers ``Qwen3VLVisionConfig`` (or the MoE variant's, Qwen3.5's, which has no deepstack
        mergers, or a full model config)."""
        config = getattr(config, "vision_config", config)
        rope = getattr(config, "rope_parameters", None) or {}
        return cls(
            depth=config.depth,
            hidden_size=config.hidden_size,
            num_heads=config.num_heads,
            intermediate_size=config.intermediate_size,
            out_hidden_size=config.out_hidden_size,
            deepstack_visual_indexes=tuple(getattr(config, "deepstack_visual_indexes", ())),
            patch_size=config.patch_size,
            temporal_patch_size=config.temporal_patch_size,
            spatial_merge_size=config.spatial_merge_size,
            in_channels=config.in_channels,
            num_position_embeddings=config.num_position_embeddings,
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            hidden_act=config.hidden_act,
        )

    @classmethod
    def from_dict(cls, values: dict) -> VisionConfig:
        """From a config.json dict: a full model's config (its ``vision_config``, or Qwen3-Omni's
        ``thinker_config.vision_config``) or a vision config. Qwen3.5's towers (``model_type`` ``qwen3_5...``)
        have no deepstack mergers; other configs without ``deepstack_visual_indexes`` get Qwen3-VL's default."""
        values = values.get("thinker_config", values)
        model_type = values.get("model_type", "")
        values = values.get("vision_config", values)
        rope = values.get("rope_parameters") or {}
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in values.items() if k in fields}
        if "deepstack_visual_indexes" in kwargs:
            kwargs["deepstack_visual_indexes"] = tuple(kwargs["deepstack_visual_indexes"])
        elif (values.get("model_type") or model_type).startswith("qwen3_5"):
            kwargs["deepstack_visual_indexes"] = ()
        if "rope_theta" in rope:
            kwargs["rope_theta"] = float(rope["rope_theta"])
        return cls(**kwargs)
