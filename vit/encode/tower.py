"""The encode job's tower: the checkpoint (or the embedded demo tower), its preparation parameters, device and dtype,
each failure an :class:`~qvl.vit.encode.errors.EncodeError` naming the option or file."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ..checkpoint import CheckpointError, read_config, read_processor_configs
from ..config import VisionConfig
from ..families import DEFAULT_FAMILY, Family, family_of_config
from ..hub import resolve_model
from ..model import VisionTransformer
from ..processing import Processing
from ..towers import tower_class_of
from .errors import EncodeError
from .options import EMBEDDED_MAX_PIXELS, EncodeOptions

__all__ = [
    "BACKEND_NAMES",
    "DTYPES",
    "EMBEDDED_CONFIG",
    "EMBEDDED_SEED",
    "default_dtype",
    "describe",
    "load_tower",
    "model_kind",
    "resolve_checkpoint",
    "resolve_device",
    "with_options",
]

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
BACKEND_NAMES = {
    "triton": "Triton compiled",
    "interpreter": "Triton interpreter",
    "torch": "torch CPU path (fused SDPA attention)",
    "reference": "torch reference",
}

# A small tower of Qwen3-VL's shape (patch 16, merge 2, temporal 2, 48x48 position grid, two deepstack
# taps), so `qvl encode` runs on a fresh machine without downloading a checkpoint.
EMBEDDED_CONFIG = VisionConfig(
    depth=4,
    hidden_size=256,
    num_heads=4,
    intermediate_size=1024,
    out_hidden_size=512,
    deepstack_visual_indexes=(1, 3),
    patch_size=16,
    temporal_patch_size=2,
    spatial_merge_size=2,
    num_position_embeddings=2304,
)
EMBEDDED_SEED = 0


def resolve_device(name: str | None) -> torch.device:
    """``--device`` as a torch device (None: cuda where available, else cpu); raises EncodeError for a name torch
    does not know or a GPU this machine lacks."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise EncodeError(f"--device {name}: {error}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EncodeError(f"--device {name}: CUDA is not available on this machine")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise EncodeError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def default_dtype(device: torch.device) -> str:
    """bf16 on a GPU that computes in it (Ampere and later), fp16 on an older one, fp32 on a CPU."""
    if device.type != "cuda":
        return "float32"
    with torch.cuda.device(device):  # the GPU the run uses, not the current one
        return "bfloat16" if torch.cuda.is_bf16_supported(including_emulation=False) else "float16"


def resolve_checkpoint(name: str, log) -> Path:
    """``--model``'s directory: an existing one, else a Hub model id fetched into the cache
    (:func:`~qvl.vit.hub.resolve_model`)."""
    try:
        return resolve_model(name, log)
    except CheckpointError as error:
        raise EncodeError(str(error)) from None


def model_kind(model: Path | None) -> tuple[type, object, Family, Processing]:
    """The tower class, config, family and input preparation of checkpoint ``model`` (from its config.json and
    processor configs alone, so that inputs are prepared before any weight is read), or of the embedded default (the
    family's defaults, images capped at :data:`~qvl.vit.encode.options.EMBEDDED_MAX_PIXELS`)."""
    if model is None:
        processing = DEFAULT_FAMILY.processing.for_checkpoint(EMBEDDED_CONFIG)
        processing = dataclasses.replace(processing, max_pixels=EMBEDDED_MAX_PIXELS)
        return VisionTransformer, EMBEDDED_CONFIG, DEFAULT_FAMILY, processing
    try:
        values = read_config(model)
        family = family_of_config(values)
        kind, config = tower_class_of(family), family.read_config(values)
        processing = family.processing.for_checkpoint(config, *read_processor_configs(model))
    except CheckpointError as error:
        raise EncodeError(str(error)) from None
    except (ValueError, TypeError) as error:
        raise EncodeError(f"{model}: {error}") from None
    return kind, config, family, processing


_OVERRIDES = ("fps", "max_frames", "min_pixels", "max_pixels", "video_min_pixels", "video_max_pixels")


def with_options(processing: Processing, options: EncodeOptions) -> Processing:
    """The checkpoint's preparation with the command line's overrides. Where only a cap is given below the
    checkpoint's smallest size, the smallest size follows it down."""
    changes = {name: getattr(options, name) for name in _OVERRIDES if getattr(options, name) is not None}
    processing = dataclasses.replace(processing, **changes)
    lowered = {}
    for low, high in (("min_pixels", "max_pixels"), ("video_min_pixels", "video_max_pixels")):
        if getattr(processing, low) > getattr(processing, high):
            if low in changes:
                raise EncodeError(
                    f"--{low.replace('_', '-')} {changes[low]} is larger than the checkpoint's {high}"
                    f" {getattr(processing, high)}"
                )
            lowered[low] = getattr(processing, high)
    return dataclasses.replace(processing, **lowered)


def load_tower(
    model: Path | None,
    dtype: torch.dtype,
    device: torch.device,
    parallel: str | None = None,
    kind: type = VisionTransformer,
):
    """The tower of class ``kind`` from checkpoint directory ``model`` (None: the embedded one), in ``parallel``
    mode across the default process group."""
    if model is None:
        full = VisionTransformer(EMBEDDED_CONFIG).init_random_weights(EMBEDDED_SEED)
        if parallel is None:
            return full.to(dtype=dtype, device=device)
        try:
            tower = VisionTransformer(EMBEDDED_CONFIG, parallel=parallel, dtype=dtype, device=device)
        except (ValueError, RuntimeError) as error:
            raise EncodeError(f"--parallel {parallel}: {error}") from None
        tower.load_full_state_dict(full.state_dict())
        return tower
    try:
        tower = kind.from_pretrained(model, dtype=dtype, device=device, parallel=parallel)
    except CheckpointError as error:
        raise EncodeError(str(error)) from None
    # A readable checkpoint can still hold a config or tensors that do not make a tower.
    except (ValueError, TypeError) as error:
        raise EncodeError(f"{model}: {error}") from None
    return tower


def describe(config, family: Family) -> str:
    """One line of what the tower is (family, sizes, deepstack taps or windows)."""
    if getattr(config, "windowed", False):
        extra = f"windows of {config.window_tokens} tokens, full attention in {list(config.fullatt_block_indexes)}"
    else:
        extra = f"deepstack {list(config.deepstack_visual_indexes)}"
    return (
        f"{family.name} tower: depth {config.depth}, hidden {config.hidden_size}, {config.num_heads} heads, "
        f"patch {config.patch_size}, out {config.out_hidden_size}, {extra}"
    )
