"""What the library adapters share (:mod:`qvl.vit.hf_patch` for transformers, :mod:`qvl.vit.timm_patch` for timm):
the warning of a call that runs the library's own forward, and the conditions every adapter checks alike before a
call reaches the runner."""

from __future__ import annotations

import warnings

import torch
from torch import nn

__all__ = ["UnfusedFallbackWarning", "devices_reason", "warn_fallback"]


class UnfusedFallbackWarning(UserWarning):
    """A patched vision tower ran its library's own (unfused) forward, transformers' or timm's, for a call qvl
    cannot serve; the message says why. Each reason is warned about once (Python's default warning filter); filter
    this category to silence them."""


def warn_fallback(caller: str, reason: str, forward: str) -> None:
    """Warn, once per ``reason``, that this call runs ``forward`` (the library's own, named)."""
    warnings.warn(f"{caller}: {reason}; this call runs {forward}", UnfusedFallbackWarning)


def devices_reason(tower: nn.Module) -> str | None:
    """Why ``tower`` cannot run fused now because of where its weights are (not all on one device, or on the meta
    device: offloaded by accelerate), or None."""
    devices = {param.device for param in tower.parameters()}
    if len(devices) > 1 or torch.device("meta") in devices:
        return (
            "the vision tower's weights are not all on one device (offloaded by accelerate: on the meta device"
            " until each submodule's hook loads them; or split over devices by a device map)"
        )
    return None
