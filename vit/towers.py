"""Which qvl tower class serves a model, read from its config: :class:`~qvl.vit.model.VisionTransformer` for the
Qwen3-VL family (Qwen3-VL, Qwen3.5, their MoE variants, Qwen3-Omni),
:class:`~qvl.vit.qwen2_tower.Qwen2VisionTransformer` for Qwen2.5-VL and Qwen2-VL."""

from __future__ import annotations

import os

from torch import nn

from .checkpoint import read_config
from .config import QWEN3_FULL_MODEL_TYPES, QWEN3_VISION_MODEL_TYPES
from .model import TowerBase, VisionTransformer
from .qwen2_tower import QWEN2_FULL_MODEL_TYPES, QWEN2_VISION_MODEL_TYPES, Qwen2VisionTransformer

__all__ = ["SUPPORTED_CONFIG_MODEL_TYPES", "load_tower", "tower_class", "tower_from_hf"]

# Qwen3-Omni's config.json names the whole model "qwen3_omni_moe" (its thinker holds the tower).
_QWEN3_TYPES = (*QWEN3_FULL_MODEL_TYPES, *QWEN3_VISION_MODEL_TYPES, "qwen3_omni_moe")
_QWEN2_TYPES = QWEN2_FULL_MODEL_TYPES + QWEN2_VISION_MODEL_TYPES
# The model_type values a config may carry (one without any is read as a Qwen3-VL vision config).
SUPPORTED_CONFIG_MODEL_TYPES = _QWEN3_TYPES + _QWEN2_TYPES


def tower_class(config: dict) -> type[TowerBase]:
    """The tower class for a config.json dict (a full model's or a vision config), by its ``model_type`` (the
    model's, else its vision config's); raises ValueError naming an unsupported one."""
    vision = config.get("vision_config") or {}
    model_type = config.get("model_type") or vision.get("model_type")
    if model_type is None:
        return VisionTransformer
    if model_type in _QWEN2_TYPES:
        return Qwen2VisionTransformer
    if model_type in _QWEN3_TYPES:
        return VisionTransformer
    supported = ", ".join(SUPPORTED_CONFIG_MODEL_TYPES)
    raise ValueError(f"unsupported model_type {model_type!r}: qvl runs the vision towers of {supported}")


def load_tower(path: str | os.PathLike, **kwargs) -> TowerBase:
    """A tower loaded from a local checkpoint directory, of the class its config.json names (keyword arguments as
    for ``from_pretrained``)."""
    return tower_class(read_config(path)).from_pretrained(path, **kwargs)


def tower_from_hf(vision_module: nn.Module, **kwargs) -> TowerBase:
    """A qvl tower with a copy of a transformers vision module's weights, of the class its ``config.model_type``
    names (keyword arguments as for ``from_hf``)."""
    model_type = getattr(getattr(vision_module, "config", None), "model_type", None)
    if model_type in QWEN2_VISION_MODEL_TYPES:
        return Qwen2VisionTransformer.from_hf(vision_module, **kwargs)
    if model_type in QWEN3_VISION_MODEL_TYPES:
        return VisionTransformer.from_hf(vision_module, **kwargs)
    raise TypeError(f"tower_from_hf: not a supported transformers vision module: {type(vision_module).__name__}")
