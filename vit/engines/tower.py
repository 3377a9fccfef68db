"""What the vLLM and SGLang tower routes (:mod:`qvl.vit.engines.vllm.tower`, :mod:`qvl.vit.engines.sglang.tower`)
share: the checks a tower of either engine must pass (:func:`shared_mismatch`) and the tower instance's ``forward`` on
qvl's runner (:class:`EngineTowerForward`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..runner import TowerRunner, part

__all__ = ["EngineTowerForward", "features_of", "shared_mismatch"]


def shared_mismatch(visual: nn.Module, depth: int, mergers: list[nn.Module], merger_norm: str) -> str | None:
    """What both engines' towers must have for qvl's runner (None when they have it): ``depth`` blocks, norms that
    are torch's LayerNorm or an RMSNorm (read by the runner), a Conv3d patch embedding, and (Qwen3-VL's kind) the
    main merger norming before the merge and the deepstack ``mergers[1:]`` after it."""
    if len(visual.blocks) != depth:
        return f"{len(visual.blocks)} blocks where the config says {depth}"
    norms = [norm for block in visual.blocks for norm in (block.norm1, block.norm2)]
    norms += [part(merger, merger_norm) for merger in mergers]

    # The runner reads any norm but torch's LayerNorm as an RMSNorm: one with a bias (SGLang's own LayerNorm, on
    # its CPU engine) would lose its mean and bias.
    def readable(norm: nn.Module) -> bool:
        return type(norm) is nn.LayerNorm or (hasattr(norm, "variance_epsilon") and getattr(norm, "bias", None) is None)

    if not all(readable(norm) for norm in norms):
        return "norms other than torch's LayerNorm or an RMSNorm (without bias)"
    if visual.patch_embed.proj.weight.dim() != 5:
        return "a patch embedding that is not a Conv3d weight"
    if getattr(mergers[0], "use_postshuffle_norm", False) or not all(
        getattr(merger, "use_postshuffle_norm", True) for merger in mergers[1:]
    ):
        return "mergers that norm in another order than Qwen3-VL's"
    return None


class EngineTowerForward:
    """The ``forward`` of an engine's vision tower instance, on qvl's runner.

    ``forward(x, grid_thw)``: ``x`` the processor's ``(T, in_channels * temporal_patch_size * patch_size**2)``
    patches in merge-block order, ``grid_thw`` ``(N, 3)`` (a CPU tensor or list; one on a device is read once, the
    sync the engine's own forward makes). Returns the engines' layout: ``(T / m^2, out_hidden_size * (1 +
    len(deepstack)))``, the main merger's features then each deepstack merger's, in the input's order.
    ``strategy`` splits the batch over ranks (or not) around :meth:`TowerRunner.encode_grid`; ``count`` notes
    each call in the engine's route log.
    """

    def __init__(self, visual: nn.Module, runner: TowerRunner, strategy, count: Callable[[str], None]):
        self.visual = visual
        self.runner = runner
        self.strategy = strategy
        self.count = count

    def __call__(self, x: torch.Tensor, grid_thw) -> torch.Tensor:
        self.count("tower")
        if isinstance(grid_thw, torch.Tensor) and grid_thw.device.type != "cpu":
            grid_thw = grid_thw.tolist()
        merged, deepstack = self.strategy.run(x, grid_thw, self.runner.encode_grid, self.runner.device)
        return features_of(merged, deepstack)


def features_of(merged: torch.Tensor, deepstack: list[torch.Tensor]) -> torch.Tensor:
    """The engines' layout of a tower's outputs: the merged features, then each deepstack merger's, side by side."""
    return torch.cat([merged, *deepstack], dim=1) if deepstack else merged
