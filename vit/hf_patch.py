"""``qvl.vit.patch_model(model)``: run a transformers Qwen3-VL model's vision tower on qvl kernels.

The patch replaces only the ``forward`` of the model's vision module instance with one that runs
:func:`qvl.vit.model.tower_forward` over the module's *own* parameters. Nothing is copied or renamed,
so ``generate``, ``save_pretrained``, the processor, ``.to(device)`` and dtype casts keep working, and
the weights stay where transformers put them.
"""

from __future__ import annotations

import functools
import types

import torch
from torch import nn

from .metadata import build_metadata
from .model import VisionConfig, tower_forward
from .parallel import make_parallel

__all__ = ["ATTENTION_NAME", "patch_model", "is_patched", "register_attention", "SUPPORTED_MODELS"]

SUPPORTED_MODELS = (
    "Qwen3VLForConditionalGeneration",
    "Qwen3VLModel",
    "Qwen3VLVisionModel",
    "Qwen3VLMoeForConditionalGeneration",
    "Qwen3VLMoeModel",
    "Qwen3VLMoeVisionModel",
)
_VISION_MODELS = ("Qwen3VLVisionModel", "Qwen3VLMoeVisionModel")
_MARK = "_qvl_patched"
# No "flash" in the name: transformers would then look for a flash-attn kernel under it.
ATTENTION_NAME = "qvl_vision"


def _vision_module(model: nn.Module) -> nn.Module:
    name = type(model).__name__
    if name in _VISION_MODELS:
        return model
    if name in SUPPORTED_MODELS:
        inner = getattr(model, "model", model)
        visual = getattr(inner, "visual", None)
        if visual is not None and type(visual).__name__ in _VISION_MODELS:
            return visual
    raise TypeError(f"patch_model: unsupported model {name}; supported: {', '.join(SUPPORTED_MODELS)}")


def _encode(visual: nn.Module, config: VisionConfig, hidden_states: torch.Tensor, grid_thw):
    """``(last_hidden_state, merged, deepstack)`` of a batch through the vision module's own parameters."""
    weight = visual.pos_embed.weight
    meta = build_metadata(
        grid_thw.cpu() if isinstance(grid_thw, torch.Tensor) else grid_thw,
        spatial_merge_size=config.spatial_merge_size,
        num_grid_per_side=config.num_grid_per_side,
        device=weight.device,
    )
    return tower_forward(
        visual,
        hidden_states.to(weight.device),
        meta.cu_seqlens,
        meta.positions,
        meta.interp_indices,
        meta.interp_weights,
        num_heads=config.num_heads,
        rope_theta=config.rope_theta,
        deepstack_visual_indexes=config.deepstack_visual_indexes,
        spatial_merge_size=config.spatial_merge_size,
    )


def _qvl_vision_forward(
    self: nn.Module, hidden_states: torch.Tensor, grid_thw: torch.Tensor, *, config: VisionConfig,
    data_parallel=None, **kwargs,
):
    """Drop-in for ``Qwen3VLVisionModel.forward`` on qvl kernels (same outputs).

    ``grid_thw`` is read on the host once (transformers' own forward reads it too); precomputed
    metadata keyword arguments from transformers are ignored, as qvl builds its own. With
    ``data_parallel`` each rank encodes its share and ``last_hidden_state`` is None: only the merged and
    deepstack features are gathered.
    """
    from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

    if data_parallel is None:
        last_hidden, merged, deepstack = _encode(self, config, hidden_states, grid_thw)
    else:
        last_hidden = None
        merged, deepstack = data_parallel.run(
            hidden_states, grid_thw, lambda pixels, grid: _encode(self, config, pixels, grid)[1:], self.pos_embed.weight.device
        )
    output = BaseModelOutputWithDeepstackFeatures(
        last_hidden_state=last_hidden, pooler_output=merged, deepstack_features=deepstack
    )
    return output if kwargs.get("return_dict", True) else output.to_tuple()


def patch_model(model: nn.Module, *, parallel: str | None = None, group=None) -> nn.Module:
    """Make ``model``'s vision tower run on qvl kernels, in place; returns ``model``.

    ``model``: a transformers ``Qwen3VLForConditionalGeneration``, ``Qwen3VLModel``, their MoE
    variants, or a bare ``Qwen3VLVisionModel`` / ``Qwen3VLMoeVisionModel``. Anything else raises
    TypeError. Patching again is harmless and sets the mode anew.

    ``parallel="data"`` (every rank of ``group``, default the world, holds the whole model and passes the
    same batch, e.g. a text model sharded over the ranks): each rank encodes a balanced share of the
    images and video frames and all ranks get every feature, as in ``VisionTransformer(parallel="data")``;
    the vision output's ``last_hidden_state`` is then None (transformers' Qwen3-VL models read only the
    merged and deepstack features). Weight sharding would change the model's parameters, so
    ``parallel="weights"`` raises ValueError: build ``VisionTransformer.from_hf(visual, parallel="weights")``
    instead.
    """
    visual = _vision_module(model)
    config = VisionConfig.from_hf(visual.config)  # rejects a tower qvl cannot run, before anything changes
    if parallel == "weights":
        raise ValueError(
            "patch_model: parallel='weights' would shard the model's own parameters; use "
            "qvl.vit.VisionTransformer.from_hf(visual, parallel='weights') for a weight-sharded tower"
        )
    strategy = make_parallel(parallel, config, group, caller="patch_model")
    data_parallel = strategy if strategy.mode == "data" else None
    forward = functools.partial(_qvl_vision_forward, config=config, data_parallel=data_parallel)
    visual.forward = types.MethodType(forward, visual)
    setattr(visual, _MARK, True)
    return model


def is_patched(model: nn.Module) -> bool:
    """Whether ``model``'s vision tower runs on qvl kernels."""
    return bool(getattr(_vision_module(model), _MARK, False))


def _qvl_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    """transformers attention-interface entry: one segment ``(1, H, S, D)`` per call, non-causal."""
    if attention_mask is not None or kwargs.get("is_causal"):
        raise ValueError(f"{ATTENTION_NAME}: only non-causal attention without a mask (the vision tower's) is supported")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    # Made on the device: torch.tensor([0, S], device=...) would copy from pageable memory and sync.
    cu_seqlens = torch.arange(2, dtype=torch.int32, device=q.device) * q.shape[0]
    out = torch.ops.qvl.vision_attn(q, k, v, cu_seqlens, softmax_scale=scaling)
    return out.unsqueeze(0), None


def register_attention() -> str:
    """Register qvl's attention in transformers' attention-function registry; returns its name.

    Only the attention changes (the rest of the tower stays transformers' own, which splits the batch per
    image on the host); :func:`patch_model` runs the whole tower on qvl instead. Use it for the vision
    tower only, e.g. ``from_pretrained(path, attn_implementation={"vision_config": register_attention(),
    "text_config": "sdpa", "": "sdpa"})``.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _qvl_attention)
    return ATTENTION_NAME
