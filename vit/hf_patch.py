"""``qvl.vit.patch_model(model)``: run a transformers Qwen3-VL (or Qwen2.5-VL, Qwen2-VL) model's vision tower on
qvl kernels.

The patch replaces the ``forward`` of the model's vision module instance with one that runs the tower runner
(:mod:`qvl.vit.runner`) over the module's *own* parameters, calling its patch embedding, position table, blocks
and mergers as modules whose forwards then run qvl's ops (transformers' own on any other call). Nothing is copied
or renamed,
so ``generate``, ``save_pretrained``, the processor, ``.to(device)`` and dtype casts keep working, and
the weights stay where transformers put them. Training runs on qvl too (every op has a backward; adapters in the
linears' places and gradient checkpointing are honoured). Calls that qvl's fused tower cannot serve (attention
outputs, a tower offloaded submodule by submodule) run the forward the patch replaced, transformers' own, with an
:class:`UnfusedFallbackWarning`; :func:`unpatch_model` puts that forward back. A timm model goes to the timm adapter
(:mod:`qvl.vit.timm_patch`: timm's ``qwen3_vit_*`` backbones).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Sequence

import torch
from torch import nn

from . import timm_patch
from .families import config_from_hf, family_of, supported_model_types
from .layers import GradientMap
from .metadata import check_grid, grid_as_numpy
from .parallel import make_parallel
from .patching import UnfusedFallbackWarning, devices_reason, warn_fallback
from .runner import (
    TowerRunner,
    bound_forward,
    forward_slot,
    install_module_forwards,
    remove_module_forwards,
    restore_forward,
)
from .towers import tower_class_of

__all__ = [
    "ATTENTION_NAME",
    "UnfusedFallbackWarning",
    "is_patched",
    "patch_model",
    "register_attention",
    "unpatch_model",
]

# No "flash" in the name: transformers would then look for a flash-attn kernel under it.
ATTENTION_NAME = "qvl_vision"


def _model_type(module) -> str | None:
    return getattr(getattr(module, "config", None), "model_type", None)


def _vision_module(model: nn.Module, caller: str) -> nn.Module:
    """The vision module of ``model``, found by ``config.model_type`` (:mod:`qvl.vit.families`): the model itself,
    its ``visual``, or that of the first module down its chain of ``.model`` (or ``.thinker``) attributes
    (transformers' own nesting and wrappers')."""
    module, seen = model, set()
    while isinstance(module, nn.Module) and id(module) not in seen:
        seen.add(id(module))
        family = family_of(_model_type(module))
        if family is not None and _model_type(module) in family.vision_model_types:
            return module
        visual = getattr(module, "visual", None)
        if family is not None and _model_type(visual) in family.vision_model_types:
            return visual
        inner = getattr(module, "model", None)
        module = getattr(module, "thinker", None) if inner is None else inner
    raise TypeError(
        f"{caller}: unsupported model {type(model).__name__}; supported: a transformers model of a family qvl serves,"
        f" recognised by its config.model_type ({', '.join(map(repr, supported_model_types()))}: Qwen3-VL, Qwen3.5,"
        " their MoE variants, Qwen3-Omni-MoE, Qwen2.5-VL and Qwen2-VL, full, inner or vision models and subclasses),"
        " or a module whose .model (or .thinker) is one"
    )


def _select_hidden_states(states: list[torch.Tensor], request) -> tuple[torch.Tensor | None, ...]:
    """transformers' ``output_hidden_states`` selection: True keeps every state; an index or a list of indices
    (negative ones count from the end, out-of-range ones select nothing) keeps those and leaves None elsewhere."""
    if isinstance(request, bool):
        return tuple(states)
    count = len(states)
    kept = {i % count for i in ([request] if isinstance(request, int) else request) if -count <= i < count}
    return tuple(state if i in kept else None for i, state in enumerate(states))


class _PatchedForward:
    """The vision module's forward while patched: an instance attribute, in the slot that holds the forward the
    module runs (``forward``, or ``_old_forward`` under accelerate's hook wrapper).

    It keeps what the patch replaced (None: the class's own method), so that calls qvl cannot serve run that
    forward and :func:`unpatch_model` puts it back.
    """

    def __init__(self, visual, replaced_forward, replaced_extra_repr, runner: TowerRunner, data_parallel):
        self.visual = visual
        self.runner = runner
        self.config = runner.config
        self.replaced_forward = replaced_forward
        self.replaced_extra_repr = replaced_extra_repr
        self.data_parallel = data_parallel
        # What transformers' forward returns: its modeling module's output class with deepstack features
        # (Qwen3-VL, Qwen3-Omni), or plain pooling output (Qwen3.5).
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        # Looked up along the class hierarchy: a subclass may live in a module of its own.
        modules = (sys.modules.get(cls.__module__) for cls in type(visual).__mro__)
        deepstack_class = next(
            (
                m.BaseModelOutputWithDeepstackFeatures
                for m in modules
                if hasattr(m, "BaseModelOutputWithDeepstackFeatures")
            ),
            None,
        )
        has_deepstack = bool(self.config.deepstack_visual_indexes) and deepstack_class is not None
        self.output_class = deepstack_class if has_deepstack else BaseModelOutputWithPooling

    def original_forward(self):
        """The forward the patch replaced, bound to the module."""
        return bound_forward(self.visual, self.replaced_forward)

    def extra_repr(self) -> str:
        """The module's own ``extra_repr`` and a line saying that the forward is patched (``print(model)``)."""
        replaced = self.replaced_extra_repr or types.MethodType(type(self.visual).extra_repr, self.visual)
        own = replaced()
        mode = "" if self.data_parallel is None else "(parallel='data')"
        marker = f"forward patched by qvl.vit.patch_model{mode}"
        return f"{own}\n{marker}" if own else marker

    def _unfused_reason(self, output_hidden_states, kwargs) -> str | None:
        """Why this call cannot run on qvl, or None."""
        visual = self.visual
        if kwargs.get("output_attentions", getattr(visual.config, "output_attentions", False)):
            return "per-layer attention outputs were requested (output_attentions); qvl's fused attention has none"
        reason = devices_reason(visual)
        if reason is not None:
            return reason
        if self.data_parallel is not None and output_hidden_states:
            return (
                "output_hidden_states was requested in data-parallel mode, where each rank encodes only its share"
                " of the tokens; every rank runs the whole batch"
            )
        return None

    def __call__(self, hidden_states: torch.Tensor, grid_thw: torch.Tensor, **kwargs):
        """``Qwen3VLVisionModel.forward`` on qvl kernels: the same outputs (see :func:`patch_model`).

        ``grid_thw`` is read on the host once (transformers' own forward reads it too); precomputed metadata
        keyword arguments from transformers are ignored, as qvl builds its own.
        """
        hf_config = self.visual.config
        output_hidden_states = kwargs.get("output_hidden_states", getattr(hf_config, "output_hidden_states", False))
        reason = self._unfused_reason(output_hidden_states, kwargs)
        if reason is not None:
            warn_fallback("qvl.vit.patch_model", reason, "transformers' own vision forward")
            output = self.original_forward()(hidden_states, grid_thw, **kwargs)
            if self.data_parallel is not None and torch.is_grad_enabled():
                # Every rank ran the whole batch: its gradients are whole, and the ranks' sum (data mode's rule)
                # would count them once per rank.
                output = _scale_gradients(output, 1.0 / self.data_parallel.world_size)
            return output

        hidden = [] if output_hidden_states else None
        runner = self.runner
        # transformers hands the processor's grid over as it came, on the device with the pixels: read it once.
        grid_thw = grid_thw.cpu() if isinstance(grid_thw, torch.Tensor) else grid_thw
        if self.data_parallel is None:
            grid = grid_as_numpy(grid_thw)
            check_grid(grid, self.config.spatial_merge_size)
            if hidden is None:
                last_hidden, merged, deepstack = runner.encode_batch(hidden_states, grid)
            else:
                last_hidden, merged, deepstack = runner.encode(
                    hidden_states, runner.metadata(grid), hidden_states_out=hidden
                )
        else:
            last_hidden = None
            merged, deepstack = self.data_parallel.run(hidden_states, grid_thw, runner.encode_grid, runner.device)
        fields = {"last_hidden_state": last_hidden, "pooler_output": merged}
        if self.config.deepstack_visual_indexes:
            fields["deepstack_features"] = deepstack
        output = self.output_class(**fields)
        if hidden is not None:
            # Set after construction, as transformers' output capture does: to_tuple() then puts it last.
            output["hidden_states"] = _select_hidden_states(hidden, output_hidden_states)
        return output if kwargs.get("return_dict", getattr(hf_config, "return_dict", True)) else output.to_tuple()


def _scale_gradients(value, scale: float):
    """``value`` (a model output, tuple, list or tensor, nested) with the gradient of every tensor that requires
    grad scaled by ``scale``."""
    if isinstance(value, torch.Tensor):
        return GradientMap.apply(value, lambda grad: grad * scale) if value.requires_grad else value
    if isinstance(value, dict):  # transformers' ModelOutput
        for key in list(value.keys()):
            value[key] = _scale_gradients(value[key], scale)
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(_scale_gradients(item, scale) for item in value)
    return value


def _find_patch(visual: nn.Module) -> tuple[str, _PatchedForward | None]:
    """The slot holding the patched forward and that forward, or ``(slot to patch, None)`` when unpatched. The
    slot may have changed since patching: accelerate moves a patched forward into ``_old_forward`` when it
    hooks the module afterwards, and back into ``forward`` when it removes its hook."""
    for slot in ("_old_forward", "forward"):
        patched = vars(visual).get(slot)
        if isinstance(patched, _PatchedForward):
            return slot, patched
    return forward_slot(visual), None


def patch_model(
    model: nn.Module,
    *,
    parallel: str | None = None,
    group=None,
    token_budgets: Sequence[int] | None = None,
    max_segments: int | None = None,
) -> nn.Module:
    """Make ``model``'s vision tower run on qvl kernels, in place; returns ``model``.

    ``model``: a transformers model whose vision tower is Qwen3-VL's, recognised by its ``config.model_type``
    (:func:`qvl.vit.families.supported_model_types`: Qwen3-VL, Qwen3.5 and their MoE variants as full models
    (``...ForConditionalGeneration``), inner models (``...Model``), bare vision models and subclasses of them;
    Qwen3-Omni-MoE's thinker and its vision encoder; Qwen2.5-VL and Qwen2-VL, whose towers run on
    :mod:`qvl.vit.qwen2_tower`, full, inner or vision models), or a module whose ``.model`` (or ``.thinker``, as
    Qwen3-Omni's full model) is one (a wrapper, or a chain of them); or a timm ``qwen3_vit_*`` model
    (:mod:`qvl.vit.timm_patch`, which takes none of the options below). Anything else raises TypeError. Patching
    again is harmless and sets the mode anew. ``print(model)`` shows the patch on the vision module;
    :func:`unpatch_model` undoes it.

    The patched tower returns what transformers' returns, ``output_hidden_states`` included (the embedded
    patches and every block's output, from the argument or the config, a selection by index too). A call
    that qvl's fused tower cannot serve runs the forward the patch replaced (transformers' own, unfused) and
    warns once per reason with an :class:`UnfusedFallbackWarning`:

    * per-layer attention outputs (``output_attentions``, argument or config): the fused attention has none.
    * weights not all on one device when the call reaches the patch: offloaded by accelerate (CPU or disk
      offload of the tower's submodules keeps them on the meta device until each submodule's hook loads them,
      in transformers' forward, one submodule at a time), or split over devices by a device map. Loading the
      whole tower for a fused call would break the offload's memory bound, so such a tower runs unfused. The
      hook on the vision module itself is kept (the patch goes under accelerate's wrapper, whether the model is
      dispatched before or after patching), so it moves the inputs, and loads the weights where it offloads the
      whole module (``cpu_offload_with_hook``), before qvl runs; the hooks a device map puts on the submodules
      of a tower it keeps whole only move inputs, and qvl runs there too.
    * in data mode, ``output_hidden_states``: each rank encodes only its share of the tokens.

    Under ``torch.autocast``, mixed precision over fp32 weights included (HF Trainer's ``bf16=True``, accelerate's
    ``mixed_precision``), the tower runs on qvl and follows autocast as transformers' own forward does: linears and
    attention in the autocast dtype, norms in fp32, gradients reaching the fp32 weights.

    In data mode, such a call runs the whole batch on every rank (no collective: every rank makes the same call),
    its outputs' gradients scaled by 1 / world size, so that the ranks' summed parameter gradients (data mode's
    rule) are one process's.

    ``parallel="data"`` (every rank of ``group``, default the world, holds the whole model and passes the
    same batch, e.g. a text model sharded over the ranks): each rank encodes a balanced share of the
    images and video frames and all ranks get every feature, as in ``VisionTransformer(parallel="data")``;
    the vision output's ``last_hidden_state`` is then None (transformers' Qwen3-VL models read only the
    merged and deepstack features). Weight sharding would change the model's parameters, so
    ``parallel="weights"`` raises ValueError: build ``VisionTransformer.from_hf(visual, parallel="weights")``
    (``Qwen2VisionTransformer.from_hf`` for Qwen2.5-VL / Qwen2-VL) instead.

    The patched tower calls the patch embedding, the position table, each block and each merger as modules whose
    forwards run qvl's ops (:class:`qvl.vit.runner.ModuleForward`, installed here and removed by
    :func:`unpatch_model`; any other call of them runs transformers' forward), so hooks and wrappers on them act
    as on transformers' own: FSDP2's unshard and reshard, DeepSpeed ZeRO-3's gather and release, torch's
    ``checkpoint_wrapper``, and transformers' gradient checkpointing through each block's own
    ``_gradient_checkpointing_func`` (the function and kwargs ``gradient_checkpointing_enable`` installed). Inside
    a block qvl reads that block's parameters only. Linear layers inside a block that carry hooks (ZeRO-3's,
    PEFT's) are called too; norms are read, and one that a stack still holds sharded or released raises a
    RuntimeError naming it (FSDP2 sharding a norm on its own, apart from its block).

    ``token_budgets`` (and ``max_segments``): capture the tower's device part as one CUDA graph per token budget
    now, as :meth:`qvl.vit.VisionTransformer.capture` does, on the tower's current device and dtype (move and cast
    the model first; afterwards a forward raises until the model is patched again). Calls that autograd would
    record (training), ask for ``output_hidden_states`` or do not fit a budget run the normal path; a replayed
    call returns the same outputs. The tower must not be managed by a training stack (FSDP2, ZeRO-3: ValueError).
    """
    if timm_patch.is_timm_model(model):
        options = dict(parallel=parallel, group=group, token_budgets=token_budgets, max_segments=max_segments)
        return timm_patch.patch_model(model, **options)
    visual = _vision_module(model, "patch_model")
    # The config check rejects a tower qvl cannot run, before anything changes.
    family, config = config_from_hf(visual.config)
    if parallel == "weights":
        raise ValueError(
            "patch_model: parallel='weights' would shard the model's own parameters; use "
            f"qvl.vit.{tower_class_of(family).__name__}.from_hf(visual, parallel='weights') for a weight-sharded tower"
        )
    strategy = make_parallel(parallel, config, group, caller="patch_model")
    data_parallel = strategy if strategy.mode == "data" else None
    runner = TowerRunner(visual, config, family.names, module_calls=True, name="patch_model")
    if token_budgets is not None:
        token_budgets = runner.check_capture(token_budgets, max_segments, "patch_model")
    elif max_segments is not None:
        raise ValueError("patch_model: max_segments is given without token_budgets")
    _install(visual, runner, data_parallel)
    if token_budgets is not None:  # the capture calls the modules, whose qvl forwards are now installed
        runner.capture(token_budgets, max_segments, caller="patch_model")
    return model


def _install(visual: nn.Module, runner: TowerRunner, data_parallel) -> None:
    """Put a :class:`_PatchedForward` in the module's forward slot (anew when already patched)."""
    slot, current = _find_patch(visual)
    if current is None:
        replaced_forward, replaced_extra_repr = vars(visual).get(slot), vars(visual).get("extra_repr")
    else:
        replaced_forward, replaced_extra_repr = current.replaced_forward, current.replaced_extra_repr
    patched = _PatchedForward(visual, replaced_forward, replaced_extra_repr, runner, data_parallel)
    install_module_forwards(visual, runner.spec)
    setattr(visual, slot, patched)
    visual.extra_repr = patched.extra_repr


def unpatch_model(model: nn.Module) -> nn.Module:
    """Undo :func:`patch_model`, in place; returns ``model``. The vision module gets back the forward and
    ``extra_repr`` it had before patching, in the slot the forward now lives in: under accelerate's hook
    wrapper (which stays) when the model was dispatched before or after patching. An unpatched model is
    returned unchanged; an unsupported one raises TypeError."""
    if timm_patch.is_timm_model(model):
        return timm_patch.unpatch_model(model)
    visual = _vision_module(model, "unpatch_model")
    slot, patched = _find_patch(visual)
    if patched is None:
        return model
    restore_forward(visual, slot, patched.replaced_forward)
    if patched.replaced_extra_repr is None:
        del visual.extra_repr
    else:
        visual.extra_repr = patched.replaced_extra_repr
    remove_module_forwards(visual, patched.runner.spec)
    return model


def is_patched(model: nn.Module) -> bool:
    """Whether ``model``'s vision tower runs on qvl kernels."""
    if timm_patch.is_timm_model(model):
        return timm_patch.is_patched(model)
    return _find_patch(_vision_module(model, "is_patched"))[1] is not None


def _qvl_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    """transformers attention-interface entry: one segment ``(1, H, S, D)`` per call, non-causal."""
    if attention_mask is not None or kwargs.get("is_causal"):
        raise ValueError(
            f"{ATTENTION_NAME}: only non-causal attention without a mask (the vision tower's) is supported"
        )
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
