"""qvl.vit: the Qwen vision towers on qvl kernels (Qwen3-VL's family, Qwen2.5-VL, Qwen2-VL), their metadata,
checkpoints and the transformers patch. Each model family is declared once in :mod:`qvl.vit.families`; one tower
runner (:mod:`qvl.vit.runner`) runs every tower over any module tree.

The names below load on first use (and each submodule on first access, ``qvl.vit.families``), so that importing a
submodule that needs no torch, such as the ``qvl`` command line's parser (:mod:`qvl.vit.cli`), does not import it:
``qvl --help`` answers at once."""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import Qwen2VisionConfig, VisionConfig
    from .families import Family, ModuleNames, register
    from .hf_patch import UnfusedFallbackWarning, is_patched, patch_model, register_attention, unpatch_model
    from .metadata import VisionMetadata, build_metadata
    from .model import VisionTransformer
    from .qwen2_tower import Qwen2VisionTransformer
    from .runner import TowerRunner, build_tower_metadata, device_forward
    from .towers import load_tower, tower_from_hf

# Each public name and the submodule that defines it.
_EXPORTS = {
    "Qwen2VisionConfig": "config",
    "VisionConfig": "config",
    "Family": "families",
    "ModuleNames": "families",
    "register": "families",
    "UnfusedFallbackWarning": "hf_patch",
    "is_patched": "hf_patch",
    "patch_model": "hf_patch",
    "register_attention": "hf_patch",
    "unpatch_model": "hf_patch",
    "VisionMetadata": "metadata",
    "build_metadata": "metadata",
    "VisionTransformer": "model",
    "Qwen2VisionTransformer": "qwen2_tower",
    "TowerRunner": "runner",
    "build_tower_metadata": "runner",
    "device_forward": "runner",
    "load_tower": "towers",
    "tower_from_hf": "towers",
}

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


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    elif importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
