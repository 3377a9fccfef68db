"""qvl.vit: the Qwen vision towers on qvl kernels (Qwen3-VL's family, Qwen2.5-VL, Qwen2-VL), their metadata,
checkpoints and the transformers patch."""

from .config import VisionConfig
from .hf_patch import UnfusedFallbackWarning, is_patched, patch_model, register_attention, unpatch_model
from .metadata import VisionMetadata, build_metadata
from .model import VisionTransformer, tower_forward
from .qwen2_tower import Qwen2VisionConfig, Qwen2VisionTransformer
from .towers import load_tower, tower_from_hf

__all__ = [
    "Qwen2VisionConfig",
    "Qwen2VisionTransformer",
    "UnfusedFallbackWarning",
    "VisionConfig",
    "VisionMetadata",
    "VisionTransformer",
    "build_metadata",
    "is_patched",
    "load_tower",
    "patch_model",
    "register_attention",
    "tower_forward",
    "tower_from_hf",
    "unpatch_model",
]
