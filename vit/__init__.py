"""qvl.vit: the Qwen3-VL vision tower on qvl kernels, its metadata, checkpoints and the transformers patch."""

from .config import VisionConfig
from .hf_patch import UnfusedFallbackWarning, is_patched, patch_model, register_attention, unpatch_model
from .metadata import VisionMetadata, build_metadata
from .model import VisionTransformer, tower_forward

__all__ = [
    "UnfusedFallbackWarning",
    "VisionConfig",
    "VisionMetadata",
    "VisionTransformer",
    "build_metadata",
    "is_patched",
    "patch_model",
    "register_attention",
    "tower_forward",
    "unpatch_model",
]
