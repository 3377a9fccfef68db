"""Loading a Qwen vision tower (Qwen3-VL's family, Qwen2.5-VL's, Qwen2-VL's) from a local checkpoint directory.

A directory holds ``config.json`` (a full model's config with ``vision_config``, Qwen3-Omni's with
``thinker_config``, or a bare vision config) and safetensors weights: ``model.safetensors``, or shards listed in
``model.safetensors.index.json``, of which only those holding vision tensors are read (and need be present: a
Hub download fetches no others, :mod:`qvl.vit.hub`). Its processor configs (:func:`read_processor_configs`) say how
inputs are prepared. Tensor names are transformers': ``model.visual.*`` (current
layout), ``visual.*`` (older full-model layout) or bare vision names. Only safetensors are read: a
pickled checkpoint is never loaded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

__all__ = [
    "PROCESSOR_CONFIG_FILES",
    "SAFETENSORS_INDEX",
    "CheckpointError",
    "load_vision_checkpoint",
    "read_config",
    "read_processor_configs",
    "read_weight_map",
    "save_vision_checkpoint",
    "vision_shards",
]

# Where the tower's tensors live: Qwen3-VL's and Qwen3.5's full models, Qwen3-Omni's thinker, a bare tower.
_PREFIXES = ("model.visual.", "thinker.visual.", "visual.", "")
SAFETENSORS_INDEX = "model.safetensors.index.json"
# transformers' processor configs: the nested one (v5), the video processor's, and the image processor's (which
# the video processor falls back to).
_PROCESSOR = "processor_config.json"
_VIDEO_PROCESSOR = "video_preprocessor_config.json"
_IMAGE_PROCESSOR = "preprocessor_config.json"
PROCESSOR_CONFIG_FILES = (_PROCESSOR, _IMAGE_PROCESSOR, _VIDEO_PROCESSOR)


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be used; the message names the file."""


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as handle:
            values = json.load(handle)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not found") from None
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path}: unreadable ({error})") from None
    if not isinstance(values, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got a {type(values).__name__}")
    return values


def vision_shards(weight_map: dict[str, str]) -> list[str]:
    """The shards of a ``model.safetensors.index.json`` weight map that hold vision tower tensors, in index order."""
    prefix = _vision_prefix(list(weight_map))
    return list(dict.fromkeys(file for name, file in weight_map.items() if _is_vision_weight(name, prefix)))


def read_weight_map(directory: Path) -> dict[str, str] | None:
    """The weight map of ``directory``'s safetensors index, or None without an index."""
    index = directory / SAFETENSORS_INDEX
    if not index.is_file():
        return None
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: no weight_map")
    return weight_map


def _weight_files(directory: Path) -> list[Path]:
    weight_map = read_weight_map(directory)
    if weight_map is not None:
        return [directory / name for name in vision_shards(weight_map)]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors weights (pickled checkpoints are not loaded)")
    return files


def _tensor_names(file: Path) -> list[str]:
    if not file.is_file():
        raise CheckpointError(f"{file}: not found")
    try:
        with safe_open(str(file), framework="pt") as handle:
            return list(handle.keys())
    except (OSError, RuntimeError, ValueError, SafetensorError) as error:
        raise CheckpointError(f"{file}: unreadable safetensors ({error})") from None


def _is_text_weight(name: str) -> bool:
    return name.startswith(("model.", "lm_head."))


def _is_vision_weight(name: str, prefix: str) -> bool:
    """Whether tensor ``name`` belongs to the tower, whose tensors carry ``prefix`` (:func:`_vision_prefix`)."""
    return name.startswith(prefix) and (bool(prefix) or not _is_text_weight(name))


def _vision_prefix(names: list[str]) -> str:
    for prefix in _PREFIXES:
        if any(name.startswith(prefix + "patch_embed.") for name in names):
            return prefix
    return ""


def read_config(path: str | os.PathLike) -> dict:
    """A checkpoint directory's config.json; raises :class:`CheckpointError` naming the directory or file."""
    directory = Path(path)
    if not directory.is_dir():
        hint = ""
        if not directory.exists() and not directory.is_absolute() and len(directory.parts) == 2:
            hint = " (a Hugging Face Hub id? qvl.vit.hub.resolve_model fetches its vision tower into the cache)"
        raise CheckpointError(f"{directory}: not a directory{hint}")
    return _read_json(directory / "config.json")


def read_processor_configs(path: str | os.PathLike) -> tuple[dict | None, dict | None]:
    """A checkpoint directory's ``(image processor config, video processor config)`` as transformers finds them:
    each from ``processor_config.json``'s nested ``image_processor`` / ``video_processor`` where present, else the
    image one from ``preprocessor_config.json`` and the video one from ``video_preprocessor_config.json``, falling
    back to ``preprocessor_config.json``; None where the directory has none."""
    directory = Path(path)

    def read(name: str) -> dict | None:
        return _read_json(directory / name) if (directory / name).is_file() else None

    nested = read(_PROCESSOR) or {}
    image = nested.get("image_processor") or read(_IMAGE_PROCESSOR)
    video = nested.get("video_processor") or read(_VIDEO_PROCESSOR) or read(_IMAGE_PROCESSOR)
    return image, video


def load_vision_checkpoint(path: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read a checkpoint directory; returns ``(config dict, vision state dict with bare names)``.

    Only the vision tower's tensors are read from the shards. Raises :class:`CheckpointError` naming
    the file for a missing directory, a missing or unreadable config/index/shard, or a checkpoint
    without vision weights.
    """
    directory = Path(path)
    config = read_config(directory)
    names_by_file = {file: _tensor_names(file) for file in _weight_files(directory)}
    # Shards split the tower anywhere, so the naming layout is decided over all of them at once.
    prefix = _vision_prefix([name for names in names_by_file.values() for name in names])
    state_dict: dict[str, torch.Tensor] = {}
    for file, names in names_by_file.items():
        wanted = [name for name in names if _is_vision_weight(name, prefix)]
        if not wanted:
            continue
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in wanted:
                    state_dict[name[len(prefix) :]] = handle.get_tensor(name)
        except (OSError, RuntimeError, ValueError, SafetensorError) as error:
            raise CheckpointError(f"{file}: unreadable safetensors ({error})") from None
    if "patch_embed.proj.weight" not in state_dict:
        raise CheckpointError(f"{directory}: no vision tower weights (expected model.visual.patch_embed.proj.weight)")
    return config, state_dict


def save_vision_checkpoint(path: str | os.PathLike, config: dict, state_dict: dict[str, torch.Tensor]) -> None:
    """Write a vision-only checkpoint directory (config.json + model.safetensors, ``visual.*`` names)."""
    from safetensors.torch import save_file

    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "config.json", "w", encoding="utf-8") as handle:
        json.dump(config, handle, indent=2)
    tensors = {f"visual.{name}": tensor.detach().contiguous().cpu() for name, tensor in state_dict.items()}
    save_file(tensors, str(directory / "model.safetensors"))
