"""The Qwen2-VL and Qwen2.5-VL vision towers on qvl ops.

:class:`Qwen2VisionTransformer` holds a tower's parameters under transformers' names and shapes (as
:class:`~qvl.vit.model.VisionTransformer` does for Qwen3-VL's), and :func:`qwen2_tower_forward` runs either
module tree: qvl's own, or a transformers ``Qwen2VisionTransformerPretrainedModel`` (Qwen2-VL) /
``Qwen2_5_VisionTransformerPretrainedModel`` (Qwen2.5-VL) patched in place by :mod:`qvl.vit.hf_patch`.

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
(:func:`qwen2_tower_forward`), which reads nothing back to the host and takes no batch-dependent Python value
(the windowed blocks' tile hint is the window's size, a config constant), so ``tower.compile()`` serves every
batch with one graph.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

import qvl.kernels  # noqa: F401  (registers torch.ops.qvl)
from qvl.kernels.attention import MAX_HEAD_DIM

from .config import TowerShape
from .layers import (
    AllReduce,
    column_parallel_input,
    embed_patches,
    linear_parts,
    patch_merger,
    row_parallel_linear,
    run_blocks,
    swiglu_mlp,
    vision_mlp,
)
from .metadata import WindowMetadata, build_metadata, build_window_metadata, grid_as_numpy, to_device
from .model import TowerBase, _Attention
from .parallel import LocalWidths

__all__ = [
    "QWEN2_FULL_MODEL_TYPES",
    "QWEN2_VISION_MODEL_TYPES",
    "Qwen2TowerMetadata",
    "Qwen2VisionConfig",
    "Qwen2VisionTransformer",
    "build_qwen2_metadata",
    "qwen2_tower_forward",
]

# config.model_type of the vision models: Qwen2.5-VL's (window attention, RMSNorm, SwiGLU) and Qwen2-VL's, and of
# the full models that hold them.
QWEN2_5_VISION_MODEL_TYPE = "qwen2_5_vl_vision"
QWEN2_VISION_MODEL_TYPE = "qwen2_vl_vision"
QWEN2_VISION_MODEL_TYPES = (QWEN2_5_VISION_MODEL_TYPE, QWEN2_VISION_MODEL_TYPE)
QWEN2_FULL_MODEL_TYPES = ("qwen2_5_vl", "qwen2_vl")
# Qwen2-VL's MLP activations (config.hidden_act) -> bias_gelu_'s approximation.
_GELU_APPROXIMATIONS = {"quick_gelu": "quick", "gelu": "none", "gelu_pytorch_tanh": "tanh"}


@dataclasses.dataclass(frozen=True)
class Qwen2VisionConfig(TowerShape):
    """The shape of a Qwen2.5-VL (``windowed=True``) or Qwen2-VL vision tower (defaults: Qwen2.5-VL-7B's).

    Attributes:
        windowed: Qwen2.5-VL (window attention, RMSNorm, SwiGLU MLP); False: Qwen2-VL (full attention,
            LayerNorm, ``fc1``/``fc2`` MLP with ``hidden_act``).
        depth, hidden_size, num_heads, intermediate_size: the blocks (Qwen2-VL's ``embed_dim`` is
            ``hidden_size`` here and its ``embed_dim * mlp_ratio`` is ``intermediate_size``).
        out_hidden_size: the merger's output width (Qwen2-VL's config calls it ``hidden_size``).
        patch_size, temporal_patch_size, spatial_merge_size, in_channels: the patches.
        window_size: Qwen2.5-VL's window side in pixels; fullatt_block_indexes: its blocks that attend over
            whole frames (the others within windows). Unused by Qwen2-VL.
        hidden_act: ``"silu"`` (Qwen2.5-VL) or a GELU (Qwen2-VL: ``"quick_gelu"`` in the released models).
        rope_theta: the 2D rotary's base. norm_eps: every norm's epsilon (transformers fixes it at 1e-6).
    """

    windowed: bool = True
    depth: int = 32
    hidden_size: int = 1280
    num_heads: int = 16
    intermediate_size: int = 3420
    out_hidden_size: int = 3584
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        name = type(self).__name__
        object.__setattr__(self, "fullatt_block_indexes", tuple(int(i) for i in self.fullatt_block_indexes))
        head_dim, remainder = divmod(self.hidden_size, self.num_heads)
        if remainder or head_dim % 4 or head_dim > MAX_HEAD_DIM:
            raise ValueError(
                f"{name}: hidden_size {self.hidden_size} over num_heads {self.num_heads} must give a head_dim that"
                f" is a multiple of 4 and at most {MAX_HEAD_DIM}"
            )
        if self.windowed and self.hidden_act != "silu":
            raise ValueError(f"{name}: Qwen2.5-VL's vision MLP must use 'silu' (bias_swiglu), got {self.hidden_act!r}")
        if not self.windowed and self.hidden_act not in _GELU_APPROXIMATIONS:
            raise ValueError(
                f"{name}: Qwen2-VL's vision MLP activation (hidden_act) must be one of {sorted(_GELU_APPROXIMATIONS)},"
                f" got {self.hidden_act!r}"
            )
        if self.windowed and self.window_size < self.spatial_merge_size * self.patch_size:
            raise ValueError(
                f"{name}: window_size {self.window_size} must be at least spatial_merge_size * patch_size"
                f" = {self.spatial_merge_size * self.patch_size}"
            )
        if any(not 0 <= i < self.depth for i in self.fullatt_block_indexes):
            raise ValueError(f"{name}: fullatt_block_indexes {self.fullatt_block_indexes} outside depth {self.depth}")

    @property
    def deepstack_visual_indexes(self) -> tuple[int, ...]:
        """Always empty: these towers have no deepstack mergers (what code serving every tower kind reads)."""
        return ()

    @property
    def gelu_approximate(self) -> str:
        """Qwen2-VL's MLP activation as :func:`bias_gelu_` names it."""
        return _GELU_APPROXIMATIONS[self.hidden_act]

    @property
    def window_tokens(self) -> int:
        """The most tokens a window holds (64 for Qwen2.5-VL's 112-px windows of 14-px patches): the windowed
        blocks' ``max_seqlen`` tile hint, exact for every batch without reading the batch."""
        side = self.window_size // self.spatial_merge_size // self.patch_size * self.spatial_merge_size
        return side * side

    @property
    def linear_flops_per_token(self) -> int:
        """Forward FLOPs per token that do not depend on the segment's length (:class:`~qvl.vit.balance.SegmentCost`):
        patch embed, qkv / proj / MLP of every block, the merger, and the windowed blocks' attention (at most
        ``window_tokens`` keys per query)."""
        hidden = self.hidden_size
        mlp = (3 if self.windowed else 2) * self.intermediate_size
        windowed_blocks = self.depth - len(self.fullatt_block_indexes) if self.windowed else 0
        return (
            2 * self.patch_dim * hidden
            + self.depth * 2 * hidden * (4 * hidden + mlp)
            + windowed_blocks * 4 * hidden * self.window_tokens
            + 2 * hidden * (self.merged_width + self.out_hidden_size)
        )

    @property
    def flops_per_token_pair(self) -> int:
        """Forward FLOPs per pair of tokens in one segment (frame): the full-attention blocks' ``q k^T`` and
        ``p v``."""
        full_blocks = len(self.fullatt_block_indexes) if self.windowed else self.depth
        return full_blocks * 4 * self.hidden_size

    @classmethod
    def from_hf(cls, hf_config) -> Qwen2VisionConfig:
        """From a transformers ``Qwen2_5_VLVisionConfig`` or ``Qwen2VLVisionConfig`` (or a full model's config
        holding one); raises ValueError for one qvl cannot run (rotary other than axial, a head_dim that is not a
        multiple of 4 or over the kernel's limit, an MLP activation qvl has no kernel for)."""
        hf_config = getattr(hf_config, "vision_config", hf_config)
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in QWEN2_VISION_MODEL_TYPES:
            raise ValueError(f"{cls.__name__}: not a Qwen2-VL / Qwen2.5-VL vision config: {model_type!r}")
        return cls._from_values(hf_config.to_dict(), model_type == QWEN2_5_VISION_MODEL_TYPE)

    @classmethod
    def from_dict(cls, values: dict) -> Qwen2VisionConfig:
        """From a config.json dict: a full Qwen2.5-VL / Qwen2-VL model's config (its ``vision_config``) or a vision
        config. Which tower it is comes from ``model_type`` (the vision config's, else the model's), else from the
        keys only one of them has (Qwen2-VL's ``embed_dim``)."""
        model_type = values.get("model_type", "")
        vision = values.get("vision_config", values)
        kind = vision.get("model_type") or model_type
        if kind in ("qwen2_5_vl", QWEN2_5_VISION_MODEL_TYPE):
            windowed = True
        elif kind in ("qwen2_vl", QWEN2_VISION_MODEL_TYPE):
            windowed = False
        else:
            windowed = "embed_dim" not in vision
        return cls._from_values(vision, windowed)

    @classmethod
    def _from_values(cls, values: dict, windowed: bool) -> Qwen2VisionConfig:
        """From a vision config's fields under transformers' names (either model's, old checkpoints' too)."""
        rope = dict(values.get("rope_parameters") or {})
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"{cls.__name__}: only the axial vision rotary is supported, got {rope['rope_type']!r}")
        defaults = cls()
        if windowed:
            shape = {
                "hidden_size": values.get("hidden_size", defaults.hidden_size),
                "intermediate_size": values.get("intermediate_size", defaults.intermediate_size),
                "out_hidden_size": values.get("out_hidden_size", defaults.out_hidden_size),
                "window_size": values.get("window_size", defaults.window_size),
                "fullatt_block_indexes": tuple(values.get("fullatt_block_indexes", defaults.fullatt_block_indexes)),
                "hidden_act": values.get("hidden_act", "silu"),
            }
        else:
            embed_dim = values.get("embed_dim", 1280)
            shape = {
                "hidden_size": embed_dim,
                "intermediate_size": int(embed_dim * values.get("mlp_ratio", 4)),
                "out_hidden_size": values.get("hidden_size", defaults.out_hidden_size),
                "fullatt_block_indexes": (),
                "hidden_act": values.get("hidden_act", "quick_gelu"),
            }
        # Released checkpoints spell the channel count "in_chans".
        in_channels = values.get("in_channels", values.get("in_chans", defaults.in_channels))
        return cls(
            windowed=windowed,
            depth=values.get("depth", defaults.depth),
            num_heads=values.get("num_heads", defaults.num_heads),
            patch_size=values.get("patch_size", defaults.patch_size),
            temporal_patch_size=values.get("temporal_patch_size", defaults.temporal_patch_size),
            spatial_merge_size=values.get("spatial_merge_size", defaults.spatial_merge_size),
            in_channels=in_channels,
            rope_theta=float(rope.get("rope_theta", defaults.rope_theta)),
            **shape,
        )


@dataclasses.dataclass(frozen=True, eq=False)
class Qwen2TowerMetadata:
    """Host-built metadata of one batch, on the tower's device (see :func:`build_qwen2_metadata`).

    Attributes:
        grid_thw: CPU int64 ``(N, 3)``: (t, h, w) patch counts per image/video.
        cu_seqlens: int32 ``(S + 1,)``: one segment per frame (the full-attention blocks' segments; in window
            order too, since windows never cross frames).
        positions: int32 ``(T, 2)``: (row, col) of every token in the order the blocks see them (window order
            for Qwen2.5-VL).
        window: Qwen2.5-VL's window layout (:class:`~qvl.vit.metadata.WindowMetadata`); None for Qwen2-VL.
        merged_token_counts: ``t * h * w // spatial_merge_size ** 2`` per entry, for splitting the merger's
            output per image.
    """

    grid_thw: torch.Tensor
    cu_seqlens: torch.Tensor
    positions: torch.Tensor
    window: WindowMetadata | None
    merged_token_counts: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


def build_qwen2_metadata(grid_thw, config: Qwen2VisionConfig, device=None) -> Qwen2TowerMetadata:
    """The metadata of one batch (``grid_thw``: a CPU tensor, numpy array or list of (t, h, w)), built on the
    host with numpy and moved to ``device`` once."""
    grid = grid_as_numpy(grid_thw)
    merge = config.spatial_merge_size
    device = torch.device("cpu") if device is None else torch.device(device)
    meta = build_metadata(grid, spatial_merge_size=merge, num_grid_per_side=None)
    positions, window = meta.positions, None
    if config.windowed:
        window = build_window_metadata(grid, merge, config.window_size, config.patch_size)
        positions = positions.view(-1, merge * merge, 2)[window.window_index].view(-1, 2)
        window = window.to(device)
    return Qwen2TowerMetadata(
        grid_thw=meta.grid_thw,
        cu_seqlens=to_device(meta.cu_seqlens, device),
        positions=to_device(positions.contiguous(), device),
        window=window,
        merged_token_counts=meta.merged_token_counts,
    )


def _norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A LayerNorm (Qwen2-VL) or RMSNorm (Qwen2.5-VL: transformers' and qvl's keep ``variance_epsilon``) on qvl
    ops."""
    if isinstance(norm, nn.LayerNorm):
        return torch.ops.qvl.layer_norm(x, norm.weight, norm.bias, norm.eps)
    return torch.ops.qvl.rms_norm(x, norm.weight, norm.variance_epsilon)


def _add_norm(norm: nn.Module, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + delta, norm(x + delta))`` in one fused op."""
    if isinstance(norm, nn.LayerNorm):
        return torch.ops.qvl.add_layer_norm(x, delta, norm.weight, norm.bias, norm.eps)
    return torch.ops.qvl.add_rms_norm(x, delta, norm.weight, norm.variance_epsilon)


def _mlp(mlp: nn.Module, h: torch.Tensor, config: Qwen2VisionConfig, all_reduce: AllReduce | None) -> torch.Tensor:
    if config.windowed:
        parts = (linear_parts(mlp.gate_proj), linear_parts(mlp.up_proj), linear_parts(mlp.down_proj))
        return swiglu_mlp(h, *(tensor for part in parts for tensor in part), all_reduce)
    return vision_mlp(h, *linear_parts(mlp.fc1), *linear_parts(mlp.fc2), all_reduce, config.gelu_approximate)


def _merge(merger: nn.Module, x: torch.Tensor, merge: int, all_reduce: AllReduce | None) -> torch.Tensor:
    """transformers' ``PatchMerger`` / ``Qwen2_5_VLPatchMerger``: ``mlp(ln_q(x).view(-1, m^2 C))``, exact GELU."""
    norm, fc1, fc2 = merger.ln_q, merger.mlp[0], merger.mlp[2]
    layer_norm = isinstance(norm, nn.LayerNorm)
    return patch_merger(
        x,
        norm.weight,
        norm.bias if layer_norm else None,
        *linear_parts(fc1),
        *linear_parts(fc2),
        spatial_merge_size=merge,
        eps=norm.eps if layer_norm else norm.variance_epsilon,
        all_reduce=all_reduce,
    )


def qwen2_tower_forward(
    tower: nn.Module,
    pixel_values: torch.Tensor,
    cu_seqlens: torch.Tensor,
    positions: torch.Tensor,
    window_index: torch.Tensor | None = None,
    reverse_index: torch.Tensor | None = None,
    cu_window_seqlens: torch.Tensor | None = None,
    *,
    config: Qwen2VisionConfig,
    num_heads: int | None = None,
    all_reduce: AllReduce | None = None,
    hidden_states_out: list[torch.Tensor] | None = None,
    checkpoint_blocks: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The device part of a Qwen2-VL / Qwen2.5-VL vision tower over a module tree with transformers' names.

    Args:
        tower: qvl's :class:`Qwen2VisionTransformer` or a transformers ``Qwen2VisionTransformerPretrainedModel``
            / ``Qwen2_5_VisionTransformerPretrainedModel``.
        pixel_values: ``(T, in_channels * temporal_patch_size * patch_size**2)`` patches in merge-block order.
        cu_seqlens, positions: :func:`build_qwen2_metadata`'s, on the tower's device; window_index,
            reverse_index, cu_window_seqlens: its ``window`` tensors (Qwen2.5-VL only).
        config: the tower's :class:`Qwen2VisionConfig`.
        num_heads: heads held by this module tree: all of them (None, the default), or this rank's share under
            tensor parallelism, where ``all_reduce`` sums the row-parallel partial products over the ranks.
        hidden_states_out: a list that receives the residual stream as transformers records it: the first
            block's input (in window order for Qwen2.5-VL), then each block's output.
        checkpoint_blocks: run each block under activation checkpointing, as transformers'
            ``gradient_checkpointing_enable()`` does.

    Forward and backward, as :func:`~qvl.vit.model.tower_forward`: linear modules through
    :func:`~qvl.vit.layers.linear_parts` (a PEFT adapter in a linear's place runs).

    Returns ``(last_hidden_state (T, C), merged (T / m^2, out_hidden))``: ``last_hidden_state`` in the blocks'
    order (window order for Qwen2.5-VL, as transformers returns it), ``merged`` in the input's order.
    """
    merge = config.spatial_merge_size
    x = embed_patches(tower.patch_embed.proj, pixel_values)
    if config.windowed:  # whole merge units into window order
        width = x.shape[1]
        x = x.view(-1, merge * merge, width).index_select(0, window_index).view(-1, width)

    num_tokens = x.shape[0]
    num_heads = config.num_heads if num_heads is None else num_heads
    blocks = tower.blocks
    full_blocks = {int(index) for index in config.fullatt_block_indexes}
    # As in tower_forward: recorded hidden states that may be asked for their gradients feed the next block.
    separate_states = hidden_states_out is not None and torch.is_grad_enabled()

    def block_step(index: int, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if config.windowed and index not in full_blocks:
            segments, max_seqlen = cu_window_seqlens, config.window_tokens
        else:
            segments, max_seqlen = cu_seqlens, None
        block = blocks[index]
        attn = block.attn
        qkv = row_parallel_linear(column_parallel_input(h, all_reduce), *linear_parts(attn.qkv), None)
        q, k, v = qkv.view(num_tokens, 3, num_heads, config.head_dim).unbind(1)
        a = torch.ops.qvl.vision_attn(
            q, k, v, segments, max_seqlen=max_seqlen, positions=positions, rope_theta=config.rope_theta
        )
        a = row_parallel_linear(a.flatten(1), *linear_parts(attn.proj), all_reduce)
        x, h = _add_norm(block.norm2, x, a)
        m = _mlp(block.mlp, h, config, all_reduce)
        if index + 1 == len(blocks):
            return x + m, None
        if separate_states:
            x = x + m
            return x, _norm(blocks[index + 1].norm1, x)
        return _add_norm(blocks[index + 1].norm1, x, m)

    h = _norm(blocks[0].norm1, x)
    x = run_blocks(len(blocks), x, h, block_step, None, checkpoint_blocks, hidden_states_out)
    merged = _merge(tower.merger, x, merge, all_reduce)
    if config.windowed:
        merged = merged.index_select(0, reverse_index)
    return x, merged


def encode_qwen2(
    visual: nn.Module,
    config: Qwen2VisionConfig,
    hidden_states: torch.Tensor,
    grid_thw,
    hidden_states_out: list[torch.Tensor] | None = None,
    checkpoint_blocks: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, Sequence[torch.Tensor]]:
    """``(last_hidden_state, merged, [])`` of a batch through a transformers vision module's own parameters
    (:mod:`qvl.vit.hf_patch`'s entry: the same shape of result as Qwen3-VL's, without deepstack features)."""
    weight = visual.patch_embed.proj.weight
    meta = build_qwen2_metadata(
        grid_thw.cpu() if isinstance(grid_thw, torch.Tensor) else grid_thw, config, device=weight.device
    )
    last, merged = qwen2_tower_forward(
        visual,
        hidden_states.to(weight.device),
        *_tensors(meta),
        config=config,
        hidden_states_out=hidden_states_out,
        checkpoint_blocks=checkpoint_blocks,
    )
    return last, merged, []


def _tensors(meta: Qwen2TowerMetadata) -> tuple[torch.Tensor | None, ...]:
    """The metadata tensors :func:`qwen2_tower_forward` takes, in its order."""
    window = meta.window
    if window is None:
        return meta.cu_seqlens, meta.positions
    return meta.cu_seqlens, meta.positions, window.window_index, window.reverse_index, window.cu_window_seqlens


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

    def metadata(self, grid_thw) -> Qwen2TowerMetadata:
        return build_qwen2_metadata(grid_thw, self.config, device=self.device)

    def _device_inputs(self, meta: Qwen2TowerMetadata) -> tuple[torch.Tensor, ...]:
        return _tensors(meta)

    def _device_forward(self, pixel_values, cu_seqlens, positions, *window):
        _, merged = qwen2_tower_forward(
            self,
            pixel_values,
            cu_seqlens,
            positions,
            *window,
            config=self.config,
            num_heads=self.num_local_heads,
            all_reduce=self._parallel.all_reduce,
        )
        return merged, []
