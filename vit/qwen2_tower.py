"""The Qwen2-VL and Qwen2.5-VL vision towers on qvl ops.

:class:`Qwen2VisionTransformer` holds a tower's parameters under transformers' names and shapes (as
:class:`~qvl.vit.model.VisionTransformer` does for Qwen3-VL's); the tower runner (:mod:`qvl.vit.runner`) runs it,
as it runs a transformers ``Qwen2VisionTransformerPretrainedModel`` (Qwen2-VL) /
``Qwen2_5_VisionTransformerPretrainedModel`` (Qwen2.5-VL) patched by :mod:`qvl.vit.hf_patch`.

What differs from Qwen3-VL's tower: no learned position embedding (the 2D rotary alone, the same (row, col)
rotary that ``vision_attn(positions=...)`` applies), a bias-less patch embedding, and

* Qwen2-VL: LayerNorm blocks with an ``fc1`` / ``fc2`` MLP (QuickGELU in the released models), a merger with
  a LayerNorm ``ln_q``.
* Qwen2.5-VL: RMSNorm everywhere, a SwiGLU MLP with biases (``gate_proj``, ``up_proj``, ``down_proj``), and
  window attention: the tokens (and their rotary positions) run in window order, merge unit by merge unit;
  every block attends within its window except ``fullatt_block_indexes``, which attend over the whole frame;
  the merger's output is put back in the original order.

The windowed blocks' tile hint is the window's size, a config constant, so ``tower.compile()`` serves every
batch with one graph.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import Qwen2VisionConfig
from .families import QWEN2_5_VL_NAMES, QWEN2_VL_NAMES, ModuleNames
from .model import TowerBase, _Attention
from .parallel import LocalWidths

__all__ = ["Qwen2VisionTransformer"]


class _RMSNorm(nn.Module):
    """transformers' ``Qwen2RMSNorm`` parameters: a weight, and the epsilon under its name."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.variance_epsilon = eps


def _make_norm(width: int, config: Qwen2VisionConfig) -> nn.Module:
    return _RMSNorm(width, config.norm_eps) if config.windowed else nn.LayerNorm(width, eps=config.norm_eps)


class _SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate)
        self.up_proj = nn.Linear(hidden, intermediate)
        self.down_proj = nn.Linear(intermediate, hidden)


class _MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, intermediate)
        self.fc2 = nn.Linear(intermediate, hidden)


class _Block(nn.Module):
    def __init__(self, config: Qwen2VisionConfig, widths: LocalWidths):
        super().__init__()
        hidden = config.hidden_size
        self.norm1 = _make_norm(hidden, config)
        self.norm2 = _make_norm(hidden, config)
        local_width = widths.num_heads * config.head_dim
        self.attn = _Attention(hidden, 3 * local_width, local_width)
        self.mlp = (_SwiGLU if config.windowed else _MLP)(hidden, widths.intermediate_size)


class _Merger(nn.Module):
    def __init__(self, config: Qwen2VisionConfig, widths: LocalWidths):
        super().__init__()
        self.ln_q = _make_norm(config.hidden_size, config)
        self.mlp = nn.Sequential(
            nn.Linear(config.merged_width, widths.merged_width),
            nn.GELU(),
            nn.Linear(widths.merged_width, config.out_hidden_size),
        )


class _PatchEmbed(nn.Module):
    def __init__(self, config: Qwen2VisionConfig):
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel_size=kernel, stride=kernel, bias=False)


class Qwen2VisionTransformer(TowerBase):
    """A Qwen2.5-VL or Qwen2-VL vision encoder on qvl kernels (the kind from ``config.windowed``).

    ``tower(pixel_values, grid_thw)`` returns ``(merged, [])``: the merger's output ``(sum(t*h*w) / m^2,
    out_hidden_size)`` in the input's order, equal to what transformers' tower returns (its ``pooler_output``),
    and an empty deepstack list (the interface every qvl tower shares).

    Build it from a :class:`Qwen2VisionConfig`, from a transformers vision module (:meth:`from_hf`, which copies
    its weights), or from a local checkpoint directory (:meth:`from_pretrained`); ``parallel="weights"`` or
    ``"data"`` as for :class:`~qvl.vit.model.VisionTransformer` (under weight sharding each rank keeps its heads,
    its share of the MLP's gate/up (fc1) rows and down (fc2) columns and of the merger's width).
    """

    config_class = Qwen2VisionConfig

    def __init__(
        self,
        config: Qwen2VisionConfig,
        *,
        dtype: torch.dtype | None = None,
        device=None,
        parallel: str | None = None,
        group=None,
    ):
        super().__init__(config, parallel=parallel, group=group)
        widths = self._parallel.local_widths()
        self.patch_embed = _PatchEmbed(config)
        self.blocks = nn.ModuleList(_Block(config, widths) for _ in range(config.depth))
        self.merger = _Merger(config, widths)
        if dtype is not None or device is not None:
            self.to(dtype=dtype, device=device)

    @property
    def names(self) -> ModuleNames:
        return QWEN2_5_VL_NAMES if self.config.windowed else QWEN2_VL_NAMES
