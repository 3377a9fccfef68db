"""Qwen3-VL vision-tower shapes the benchmarks run on, and random weights for the modules they build.

Images are patch grids ``(h, w)`` (one temporal slice each; h and w even, as the 2x2 spatial merge
requires). Tokens are in the processor's merge-block order, so rotary positions here are the ones the
tower really sees.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

Grid = tuple[int, int]


@dataclass(frozen=True)
class VisionDims:
    name: str
    num_heads: int
    head_dim: int
    hidden: int


MODELS = {
    "8B": VisionDims("8B", num_heads=16, head_dim=72, hidden=1152),  # also 32B, 30B-A3B, 235B-A22B
    "2B": VisionDims("2B", num_heads=16, head_dim=64, hidden=1024),  # also 4B
}

# Eight images of the sizes a chat request mixes (a thumbnail to a 1024x1024 photo at patch 16),
# 16016 patches in all: the packed varlen case the tower meets in serving.
MIXED_8: tuple[Grid, ...] = ((16, 16), (24, 40), (32, 32), (32, 48), (44, 44), (40, 64), (48, 76), (64, 64))
# A video of 16 frames of 512 x 512 pixels (32 x 32 patches at patch 16): each frame attends within itself.
VIDEO_16: tuple[Grid, ...] = ((32, 32),) * 16
# The same spread at CPU-test scale.
MIXED_TINY: tuple[Grid, ...] = ((4, 4), (4, 8), (8, 8), (8, 12))


def square(num_patches: int) -> tuple[Grid]:
    """One square image of ``num_patches`` patches."""
    side = round(num_patches**0.5)
    if side * side != num_patches or side % 2:
        raise ValueError(f"{num_patches} patches is not an even square grid")
    return ((side, side),)


def seqlens(grids: Sequence[Grid]) -> list[int]:
    return [h * w for h, w in grids]


def label(grids: Sequence[Grid]) -> str:
    sizes = seqlens(grids)
    if len(sizes) == 1:
        return f"S={sizes[0]}"
    return f"{len(sizes)} imgs {min(sizes)}..{max(sizes)} ({sum(sizes)})"


def cu_seqlens(grids: Sequence[Grid], device: torch.device) -> torch.Tensor:
    cu = torch.zeros(len(grids) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(seqlens(grids)).cumsum(0)
    return cu.to(device)


def positions(grids: Sequence[Grid], device: torch.device) -> torch.Tensor:
    """int32 ``(T, 2)`` (row, col) of each patch, each 2x2 merge block's four patches consecutive."""
    per_image = []
    for h, w in grids:
        rows = torch.arange(h).view(h // 2, 1, 2, 1).expand(h // 2, w // 2, 2, 2)
        cols = torch.arange(w).view(1, w // 2, 1, 2).expand(h // 2, w // 2, 2, 2)
        per_image.append(torch.stack([rows.reshape(-1), cols.reshape(-1)], dim=1))
    return torch.cat(per_image).to(device=device, dtype=torch.int32)


def randomize(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random weights of a sane scale, drawn on the module's device: LayerNorm scales near 1 (a norm
    left at exactly 1 and 0 hides mistakes), small biases, other weights scaled by 1/sqrt(fan in) so
    activations keep their size through a deep tower."""
    gen = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=gen, device=param.device, dtype=torch.float32)
            if "norm" in name and name.endswith("weight"):
                noise = 1 + 0.1 * noise
            elif name.endswith("bias"):
                noise = 0.02 * noise
            else:
                noise = noise * param[0].numel() ** -0.5
            param.copy_(noise)
    return module
