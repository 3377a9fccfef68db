"""qvl.vit: the Qwen vision towers on qvl kernels (Qwen3-VL's family, Qwen2.5-VL, Qwen2-VL), their metadata,
checkpoints and the transformers patch. Each model family is declared once in :mod:`qvl.vit.families`; one tower
runner (:mod:`qvl.vit.runner`) runs every tower over any module tree."""

from .config import Qwen2VisionConfig, VisionConfig
from .families import Family, ModuleNames, register
from .hf_patch import UnfusedFallbackWarning, is_patched, patch_model, register_attention, unpatch_model
from .metadata import VisionMetadata, build_metadata
from .model import VisionTransformer
from .qwen2_tower import Qwen2VisionTransformer
from .runner import TowerRunner, build_tower_metadata, device_forward
from .towers import load_tower, tower_from_hf

__all__ = [
    "Family",
    "ModuleNames",
    "Qwen2VisionConfig",
    "Qwen2VisionTransformer",
    "TowerRunner",
    "UnfusedFallbackWarning",
    "VisionConfig",
    "VisionMetadata",
    "VisionTransformer",
    "build_metadata",
    "build_tower_metadata",
    "device_forward",
    "is_patched",
    "load_tower",
    "patch_model",
    "register",
    "register_attention",
    "tower_from_hf",
    "unpatch_model",
]
