"""The Qwen2-VL and Qwen2.5-VL vision towers on qvl ops, over transformers' own modules.

:func:`qwen2_tower_forward` runs a transformers ``Qwen2VisionTransformerPretrainedModel`` (Qwen2-VL) or
``Qwen2_5_VisionTransformerPretrainedModel`` (Qwen2.5-VL) module tree with its own parameters, as
:func:`qvl.vit.model.tower_forward` does for Qwen3-VL's; :mod:`qvl.vit.hf_patch` patches it in.

What differs from Qwen3-VL's tower: no learned position embedding (the 2D rotary alone, the same (row, col)
rotary that ``vision_attn(positions=...)`` applies), a bias-less patch embedding, and

* Qwen2-VL: LayerNorm blocks with an ``fc1`` / ``fc2`` MLP (QuickGELU in the released models), a merger with
  a LayerNorm ``ln_q``.
* Qwen2.5-VL: RMSNorm everywhere, a SwiGLU MLP with biases (``gate_proj``, ``up_proj``, ``down_proj``), and
  window attention: the tokens (and their rotary positions) run in window order, merge unit by merge unit;
  every block attends within its window except ``fullatt_block_indexes``, which attend over the whole frame;
  the merger's output is put back in the original order (``last_hidden_state`` stays in window order, as
  transformers returns it).

One forward: ``grid_thw`` -> host metadata (:func:`build_qwen2_metadata`, once per batch) -> device part
(:func:`qwen2_tower_forward`), which reads nothing back to the host.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import qvl.kernels  # noqa: F401  (registers torch.ops.qvl)
from qvl.kernels.attention import MAX_HEAD_DIM

from .layers import patch_merger, vision_mlp
from .metadata import build_metadata, build_window_metadata, grid_as_numpy, to_device

__all__ = [
    "QWEN2_VISION_MODEL_TYPES",
    "Qwen2TowerConfig",
    "Qwen2TowerMetadata",
    "build_qwen2_metadata",
    "qwen2_tower_forward",
]

# config.model_type of the vision models: Qwen2.5-VL's (window attention, RMSNorm, SwiGLU) and Qwen2-VL's.
QWEN2_5_VISION_MODEL_TYPE = "qwen2_5_vl_vision"
QWEN2_VISION_MODEL_TYPE = "qwen2_vl_vision"
QWEN2_VISION_MODEL_TYPES = (QWEN2_5_VISION_MODEL_TYPE, QWEN2_VISION_MODEL_TYPE)
# Qwen2-VL's MLP activations (config.hidden_act) -> bias_gelu_'s approximation.
_GELU_APPROXIMATIONS = {"quick_gelu": "quick", "gelu": "none", "gelu_pytorch_tanh": "tanh"}


@dataclasses.dataclass(frozen=True)
class Qwen2TowerConfig:
    """What the device part needs of a Qwen2-VL / Qwen2.5-VL vision config (:meth:`from_hf` checks it).

    Attributes:
        windowed: Qwen2.5-VL (window attention, RMSNorm, SwiGLU); False: Qwen2-VL.
        num_heads, head_dim: attention heads and their width.
        rope_theta: the 2D rotary's base.
        spatial_merge_size, patch_size, window_size: the merge block side, the patch side and the window side
            in pixels (``window_size`` unused by Qwen2-VL).
        fullatt_block_indexes: Qwen2.5-VL's blocks that attend over whole frames (the others within windows).
        gelu_approximate: Qwen2-VL's MLP activation as :func:`bias_gelu_` names it (Qwen2.5-VL: SiLU).
        deepstack_visual_indexes: always empty (what :mod:`qvl.vit.hf_patch` reads of any tower's config).
    """

    windowed: bool
    num_heads: int
    head_dim: int
    rope_theta: float
    spatial_merge_size: int
    patch_size: int
    window_size: int
    fullatt_block_indexes: tuple[int, ...]
    gelu_approximate: str
    deepstack_visual_indexes: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, hf_config) -> Qwen2TowerConfig:
        """From a transformers ``Qwen2_5_VLVisionConfig`` or ``Qwen2VLVisionConfig``; raises ValueError for one
        qvl cannot run (rotary other than axial, head_dim not a multiple of 4 or over the kernel's limit, an
        MLP activation qvl has no kernel for)."""
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in QWEN2_VISION_MODEL_TYPES:
            raise ValueError(f"Qwen2TowerConfig: not a Qwen2-VL / Qwen2.5-VL vision config: {model_type!r}")
        windowed = model_type == QWEN2_5_VISION_MODEL_TYPE
        width = hf_config.hidden_size if windowed else hf_config.embed_dim
        num_heads = hf_config.num_heads
        head_dim = width // num_heads
        rope = dict(getattr(hf_config, "rope_parameters", None) or {})
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"Qwen2TowerConfig: only the axial vision rotary is supported, got {rope['rope_type']!r}")
        if width % num_heads or head_dim % 4 or head_dim > MAX_HEAD_DIM:
            raise ValueError(
                f"Qwen2TowerConfig: width {width} over {num_heads} heads must give a head_dim that is a multiple"
                f" of 4 and at most {MAX_HEAD_DIM}"
            )
        act = hf_config.hidden_act
        if windowed and act != "silu":
            raise ValueError(f"Qwen2TowerConfig: Qwen2.5-VL's vision MLP must use SiLU (bias_swiglu), got {act!r}")
        if not windowed and act not in _GELU_APPROXIMATIONS:
            raise ValueError(
                f"Qwen2TowerConfig: Qwen2-VL's vision MLP activation must be one of {sorted(_GELU_APPROXIMATIONS)},"
                f" got {act!r}"
            )
        return cls(
            windowed=windowed,
            num_heads=num_heads,
            head_dim=head_dim,
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            spatial_merge_size=int(hf_config.spatial_merge_size),
            patch_size=int(hf_config.patch_size),
            window_size=int(getattr(hf_config, "window_size", 0) or 0),
            fullatt_block_indexes=tuple(int(i) for i in (getattr(hf_config, "fullatt_block_indexes", None) or ())),
            gelu_approximate="none" if windowed else _GELU_APPROXIMATIONS[act],
        )


@dataclasses.dataclass(frozen=True, eq=False)
class Qwen2TowerMetadata:
    """Host-built metadata of one batch, on the tower's device.

    Attributes:
        cu_seqlens: int32 ``(S + 1,)``: one segment per frame (the full-attention blocks' segments; in window
            order too, since windows never cross frames).
        max_seqlen: the longest frame in tokens (host int).
        positions: int32 ``(T, 2)``: (row, col) of every token in the order the blocks see them (window order
            for Qwen2.5-VL).
        window_index, reverse_index, cu_window_seqlens, max_window_seqlen: Qwen2.5-VL's window layout
            (:class:`~qvl.vit.metadata.WindowMetadata`); None (0) for Qwen2-VL.
        num_tokens: T.
    """

    cu_seqlens: torch.Tensor
    max_seqlen: int
    positions: torch.Tensor
    window_index: torch.Tensor | None
    reverse_index: torch.Tensor | None
    cu_window_seqlens: torch.Tensor | None
    max_window_seqlen: int
    num_tokens: int


def build_qwen2_metadata(grid_thw, config: Qwen2TowerConfig, device=None) -> Qwen2TowerMetadata:
    """The metadata of one batch (``grid_thw``: a CPU tensor, numpy array or list of (t, h, w)), built on the
    host and moved to ``device`` once."""
    grid = grid_as_numpy(grid_thw)
    merge = config.spatial_merge_size
    # num_grid_per_side only sizes Qwen3-VL's learned position table, which these towers do not have.
    meta = build_metadata(grid, spatial_merge_size=merge, num_grid_per_side=1)
    device = torch.device("cpu") if device is None else torch.device(device)
    positions = meta.positions
    window_index = reverse_index = cu_window_seqlens = None
    max_window_seqlen = 0
    if config.windowed:
        window = build_window_metadata(grid, merge, config.window_size, config.patch_size)
        unit = merge * merge
        positions = positions.view(-1, unit, 2)[window.window_index].view(-1, 2)
        window_index = to_device(window.window_index, device)
        reverse_index = to_device(window.reverse_index, device)
        cu_window_seqlens = to_device(window.cu_window_seqlens, device)
        max_window_seqlen = window.max_window_seqlen
    return Qwen2TowerMetadata(
        cu_seqlens=to_device(meta.cu_seqlens, device),
        max_seqlen=meta.max_seqlen,
        positions=to_device(positions.contiguous(), device),
        window_index=window_index,
        reverse_index=reverse_index,
        cu_window_seqlens=cu_window_seqlens,
        max_window_seqlen=max_window_seqlen,
        num_tokens=int(np.prod(grid, axis=1).sum()) if grid.size else 0,
    )


def _norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A transformers LayerNorm (Qwen2-VL) or RMSNorm (Qwen2.5-VL, ``variance_epsilon``) on qvl ops."""
    if isinstance(norm, nn.LayerNorm):
        return torch.ops.qvl.layer_norm(x, norm.weight, norm.bias, norm.eps)
    return torch.ops.qvl.rms_norm(x, norm.weight, norm.variance_epsilon)


def _add_norm(norm: nn.Module, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + delta, norm(x + delta))`` in one fused op."""
    if isinstance(norm, nn.LayerNorm):
        return torch.ops.qvl.add_layer_norm(x, delta, norm.weight, norm.bias, norm.eps)
    return torch.ops.qvl.add_rms_norm(x, delta, norm.weight, norm.variance_epsilon)


def _mlp(mlp: nn.Module, h: torch.Tensor, config: Qwen2TowerConfig) -> torch.Tensor:
    if config.windowed:  # Qwen2.5-VL: down(silu(gate(h)) * up(h)), every projection with a bias
        gate = torch.mm(h, mlp.gate_proj.weight.t())
        up = torch.mm(h, mlp.up_proj.weight.t())
        a = torch.ops.qvl.bias_swiglu(gate, up, mlp.gate_proj.bias, mlp.up_proj.bias)
        return F.linear(a, mlp.down_proj.weight, mlp.down_proj.bias)
    return vision_mlp(
        h, mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias, approximate=config.gelu_approximate
    )


def _merge(merger: nn.Module, x: torch.Tensor, merge: int) -> torch.Tensor:
    """transformers' ``PatchMerger`` / ``Qwen2_5_VLPatchMerger``: ``mlp(ln_q(x).view(-1, m^2 C))``, exact GELU."""
    norm, fc1, fc2 = merger.ln_q, merger.mlp[0], merger.mlp[2]
    if isinstance(norm, nn.LayerNorm):
        return patch_merger(
            x,
            norm.weight,
            norm.bias,
            fc1.weight,
            fc1.bias,
            fc2.weight,
            fc2.bias,
            spatial_merge_size=merge,
            eps=norm.eps,
        )
    h = _norm(norm, x).view(-1, x.shape[1] * merge * merge)
    h = torch.mm(h, fc1.weight.t())
    torch.ops.qvl.bias_gelu_(h, fc1.bias, "none")
    return F.linear(h, fc2.weight, fc2.bias)


def qwen2_tower_forward(
    tower: nn.Module,
    pixel_values: torch.Tensor,
    meta: Qwen2TowerMetadata,
    config: Qwen2TowerConfig,
    hidden_states_out: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The device part of a Qwen2-VL / Qwen2.5-VL vision tower over transformers' module tree.

    Args:
        tower: a transformers ``Qwen2VisionTransformerPretrainedModel`` or ``Qwen2_5_VisionTransformerPretrainedModel``
            (or a module tree with their names).
        pixel_values: ``(T, in_channels * temporal_patch_size * patch_size**2)`` patches in merge-block order.
        meta: :func:`build_qwen2_metadata` of the batch, on the tower's device.
        config: :meth:`Qwen2TowerConfig.from_hf` of the tower's config.
        hidden_states_out: a list that receives the residual stream as transformers records it: the first
            block's input (in window order for Qwen2.5-VL), then each block's output.

    Returns ``(last_hidden_state (T, C), merged (T / m^2, out_hidden))``: ``last_hidden_state`` in the blocks'
    order (window order for Qwen2.5-VL, as transformers returns it), ``merged`` in the input's order.
    """
    proj = tower.patch_embed.proj
    weight = proj.weight
    merge = config.spatial_merge_size
    x = F.linear(pixel_values.to(weight.dtype), weight.view(weight.shape[0], -1), proj.bias)
    if config.windowed:  # whole merge units into window order
        width = x.shape[1]
        x = x.view(-1, merge * merge, width).index_select(0, meta.window_index).view(-1, width)
    if hidden_states_out is not None:
        hidden_states_out.append(x)

    num_tokens = x.shape[0]
    blocks = tower.blocks
    full_blocks = set(config.fullatt_block_indexes)
    h = _norm(blocks[0].norm1, x)
    for index, block in enumerate(blocks):
        if config.windowed and index not in full_blocks:
            cu_seqlens, max_seqlen = meta.cu_window_seqlens, meta.max_window_seqlen
        else:
            cu_seqlens, max_seqlen = meta.cu_seqlens, meta.max_seqlen
        attn = block.attn
        qkv = F.linear(h, attn.qkv.weight, attn.qkv.bias)
        q, k, v = qkv.view(num_tokens, 3, config.num_heads, config.head_dim).unbind(1)
        a = torch.ops.qvl.vision_attn(
            q, k, v, cu_seqlens, max_seqlen=max_seqlen, positions=meta.positions, rope_theta=config.rope_theta
        )
        a = F.linear(a.flatten(1), attn.proj.weight, attn.proj.bias)
        x, h = _add_norm(block.norm2, x, a)
        m = _mlp(block.mlp, h, config)
        if index + 1 < len(blocks):
            x, h = _add_norm(blocks[index + 1].norm1, x, m)
        else:
            x = x + m
        if hidden_states_out is not None:
            hidden_states_out.append(x)
    merged = _merge(tower.merger, x, merge)
    if config.windowed:
        merged = merged.index_select(0, meta.reverse_index)
    return x, merged


def encode_qwen2(
    visual: nn.Module,
    config: Qwen2TowerConfig,
    hidden_states: torch.Tensor,
    grid_thw,
    hidden_states_out: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, Sequence[torch.Tensor]]:
    """``(last_hidden_state, merged, [])`` of a batch through a transformers vision module's own parameters
    (:mod:`qvl.vit.hf_patch`'s entry: the same shape of result as Qwen3-VL's, without deepstack features)."""
    weight = visual.patch_embed.proj.weight
    meta = build_qwen2_metadata(
        grid_thw.cpu() if isinstance(grid_thw, torch.Tensor) else grid_thw, config, device=weight.device
    )
    last, merged = qwen2_tower_forward(visual, hidden_states.to(weight.device), meta, config, hidden_states_out)
    return last, merged, []
