"""Which qvl tower class serves a model: the one built from its family's config class (:mod:`qvl.vit.families`):
:class:`~qvl.vit.model.VisionTransformer` for the Qwen3-VL family (Qwen3-VL, Qwen3.5, their MoE variants,
Qwen3-Omni), :class:`~qvl.vit.qwen2_tower.Qwen2VisionTransformer` for Qwen2.5-VL and Qwen2-VL."""

from __future__ import annotations

import os

from torch import nn

from .checkpoint import read_config
from .families import Family, config_from_hf, family_of_config
from .model import TowerBase, VisionTransformer
from .qwen2_tower import Qwen2VisionTransformer

__all__ = ["TOWER_CLASSES", "load_tower", "tower_class", "tower_class_of", "tower_from_hf"]

TOWER_CLASSES: tuple[type[TowerBase], ...] = (VisionTransformer, Qwen2VisionTransformer)


def tower_class_of(family: Family) -> type[TowerBase]:
    """The qvl tower class that runs ``family``'s tower: the one whose config class the family reads into."""
    return next(cls for cls in TOWER_CLASSES if cls.config_class is family.config_class)


def tower_class(config: dict) -> type[TowerBase]:
    """The tower class for a config.json dict (a full model's or a vision config), by its family; raises
    ValueError naming an unsupported model type."""
    return tower_class_of(family_of_config(config))


def load_tower(path: str | os.PathLike, **kwargs) -> TowerBase:
    """A tower loaded from a local checkpoint directory, of the class its config.json's family names (keyword
    arguments as for ``from_pretrained``)."""
    return tower_class(read_config(path)).from_pretrained(path, **kwargs)


def tower_from_hf(vision_module: nn.Module, **kwargs) -> TowerBase:
    """A qvl tower with a copy of a transformers vision module's weights, of the class its family names (keyword
    arguments as for ``from_hf``)."""
    try:
        family, _ = config_from_hf(getattr(vision_module, "config", None))
    except ValueError:
        raise TypeError(
            f"tower_from_hf: not a supported transformers vision module: {type(vision_module).__name__}"
        ) from None
    return tower_class_of(family).from_hf(vision_module, **kwargs)
