"""One tower forward over any module tree: host metadata -> device forward -> outputs.

Every tower qvl runs, of every family and under every entry point (its own tower classes, a transformers model
patched by :mod:`qvl.vit.hf_patch`, vLLM's modules in :mod:`qvl.vit.engines.vllm.tower`), goes through
:class:`TowerRunner`:

* **host part** (:meth:`TowerRunner.metadata`): ``grid_thw`` -> :class:`~qvl.vit.metadata.VisionMetadata`, built
  with numpy once per batch: segments, rotary positions, the position-table interpolation plan (towers with a
  table) and the window layout (windowed towers, positions then in window order);
* **device part** (:func:`device_forward`): tensors in, ``(last_hidden_state, merged, deepstack)`` out, with
  nothing read back to the host, so :meth:`TowerRunner.compile` compiles it once for every batch shape. Its ops
  come from :func:`qvl.kernels.ops_for`: on a CPU outside Triton's interpreter, the ops' torch path as plain torch
  (torch's fused attention per run of equal-length segments, the rotary once per q and k), which a compiled
  forward fuses with its neighbours (Inductor's C++ backend); on the Triton paths in eager code the ops' bodies
  without the dispatcher (:mod:`qvl.kernels.direct`); elsewhere (compiled, or under a dispatch mode)
  ``torch.ops.qvl``.

The device forward is a sequence of module steps, each reading the parameters of one module only: the patch
embedding (:func:`patch_embed_step`), the position table (:func:`position_step`, towers with one), each block
(:func:`block_step`) and each merger (:func:`merger_step`). Fusion stays inside a block: block ``i`` hands block
``i + 1`` its residual stream and its MLP output unsummed, and block ``i + 1`` adds them in the same op as its
first norm (with its own norm's weights), so no block reads another block's parameters.

A module tree has transformers' layout (``patch_embed.proj``, ``pos_embed``, ``blocks.{i}.norm1`` / ``attn.qkv`` /
``attn.proj`` / ``norm2`` / ``mlp``, ``merger``, deepstack mergers); where its q/k/v linear, MLP and merger parts
live is the family's :class:`~qvl.vit.families.ModuleNames`. Norms are read from the modules: ``nn.LayerNorm`` runs as
LayerNorm, any other norm (transformers' ``Qwen2RMSNorm``, vLLM's ``RMSNorm``) as RMSNorm with its
``variance_epsilon`` (or ``eps``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from qvl.kernels import ops_for, torch_path

from .config import MlpActivation, TowerConfig
from .families import ModuleNames
from .graphs import TowerGraphs, check_budgets
from .layers import (
    AllReduce,
    Product,
    column_parallel_input,
    embed_patches,
    layer_or_rms_norm,
    linear_parts,
    needs_grad,
    patch_merger,
    row_parallel_linear,
    stacked_swiglu_mlp,
    swiglu_mlp,
    unfold_image_rows,
    vision_mlp,
)
from .metadata import DeviceInputs, VisionMetadata, build_metadata, build_window_metadata

__all__ = [
    "DeviceInputs",
    "LinearParts",
    "ModuleForward",
    "TowerOutputs",
    "TowerRunner",
    "TowerSpec",
    "block_step",
    "bound_forward",
    "build_tower_metadata",
    "call_compiled",
    "device_forward",
    "forward_slot",
    "install_module_forwards",
    "merger_step",
    "part",
    "patch_embed_step",
    "position_step",
    "remove_module_forwards",
    "restore_forward",
    "unwrapped",
]

# A linear module -> (weight or bias-less product, bias), the arguments the layer functions take for it.
LinearParts = Callable[[nn.Module], tuple[torch.Tensor | Product, torch.Tensor | None]]


@dataclasses.dataclass(frozen=True)
class TowerSpec:
    """What the device forward reads besides tensors and modules: constants of one tower.

    Attributes:
        num_heads: attention heads held by the module tree: all of them, or this rank's share under tensor
            parallelism. head_dim: their width.
        rope_theta: the 2D rotary's base. spatial_merge_size: the merge block's side.
        deepstack_visual_indexes: blocks after which a deepstack merger taps the residual stream.
        windowed: blocks outside ``full_attention_blocks`` attend within windows (Qwen2.5-VL) of at most
            ``window_tokens`` tokens (their ``max_seqlen`` tile hint).
        position_table: the tower adds its learned position table, resampled per image (Qwen3-VL's family).
        mlp_activation: the MLP's activation (gated or not; fused, or torch's).
        names: where the module tree keeps its MLP and merger parts.
    """

    num_heads: int
    head_dim: int
    rope_theta: float
    spatial_merge_size: int
    deepstack_visual_indexes: tuple[int, ...]
    windowed: bool
    full_attention_blocks: tuple[int, ...]
    window_tokens: int | None
    position_table: bool
    mlp_activation: MlpActivation
    names: ModuleNames

    @classmethod
    def of(cls, config: TowerConfig, names: ModuleNames, num_heads: int | None = None) -> TowerSpec:
        """The spec of a tower of ``config`` whose module tree holds ``num_heads`` heads (default: all)."""
        return cls(
            num_heads=config.num_heads if num_heads is None else num_heads,
            head_dim=config.head_dim,
            rope_theta=config.rope_theta,
            spatial_merge_size=config.spatial_merge_size,
            deepstack_visual_indexes=tuple(config.deepstack_visual_indexes),
            windowed=config.windowed,
            full_attention_blocks=tuple(config.full_attention_blocks),
            window_tokens=config.window_tokens if config.windowed else None,
            position_table=config.num_grid_per_side is not None,
            mlp_activation=config.mlp_activation,
            names=names,
        )


class TowerOutputs(NamedTuple):
    """A device forward's results: ``last_hidden_state (T, C)`` (in the blocks' token order: window order for a
    windowed tower, as transformers returns it), ``merged (T / m^2, out_hidden)`` in the input's order (None where
    the tree's names have no merger), and the deepstack mergers' outputs of the same shape (an empty list for towers
    without them)."""

    last_hidden_state: torch.Tensor | None
    merged: torch.Tensor | None
    deepstack: list[torch.Tensor]


# Host work in numpy: under a caller's torch.compile it runs as it is (one graph break) instead of Dynamo turning
# the numpy into a CPU Inductor kernel, which costs compile time and, under torch 2.11 with dynamic shapes, died of
# SIGFPE (an integer division over the vectorized tail's zero-filled lanes).
@torch.compiler.disable(reason="the vision tower's host metadata (numpy)")
def build_tower_metadata(grid_thw, config: TowerConfig, device=None) -> VisionMetadata:
    """The host metadata of one batch for a tower of ``config``: :func:`build_metadata` (with the interpolation
    plan where the tower has a position table) and, for a windowed tower, its window layout, the rotary positions
    then permuted into window order. Moved to ``device`` once; never reads a device tensor. Not traced by
    torch.compile: a compiled caller runs it eagerly."""
    merge = config.spatial_merge_size
    device = torch.device("cpu") if device is None else torch.device(device)
    if not config.windowed:
        return build_metadata(grid_thw, merge, config.num_grid_per_side, device)
    meta = build_metadata(grid_thw, merge, config.num_grid_per_side)
    window = build_window_metadata(meta.grid_thw, merge, config.window_size, config.patch_size)
    positions = meta.positions.view(-1, merge * merge, 2)[window.window_index].view(-1, 2)
    return dataclasses.replace(meta, positions=positions.contiguous(), window=window).to(device)


def part(module: nn.Module, path: str) -> nn.Module:
    """The submodule (or attribute) at a dotted ``path`` of :class:`~qvl.vit.families.ModuleNames`' form; a digit
    indexes a sequence."""
    for name in path.split("."):
        module = module[int(name)] if name.isdigit() else getattr(module, name)
    return module


def _norm_parts(norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    """``(weight, bias, eps)`` of a LayerNorm; ``(weight, None, eps)`` of an RMSNorm. Norms are read, not called:
    a weight that a training stack still holds sharded or released raises here, naming the stack's setting."""
    weight = norm.weight
    if isinstance(weight, DTensor) or weight.numel() == 0:
        state = "sharded (a DTensor)" if isinstance(weight, DTensor) else "released (an empty placeholder)"
        raise RuntimeError(
            f"qvl: the weight of a {type(norm).__name__} in the patched tower is {state} when its block runs: the"
            " training stack must gather it for the call of the block (or a module above it) that holds it, as FSDP2's"
            " fully_shard of the block and DeepSpeed ZeRO-3 do; a norm sharded on its own is not; or unpatch_model"
        )
    if isinstance(norm, nn.LayerNorm):
        # A LayerNorm without bias (bias=False) gets a zero one: the layers run RMSNorm where the bias is None.
        bias = norm.bias if norm.bias is not None else weight.new_zeros(weight.shape)
        return weight, bias, norm.eps
    eps = getattr(norm, "variance_epsilon", None)
    return weight, None, norm.eps if eps is None else eps


def _norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return layer_or_rms_norm(ops_for(x.device), x, *_norm_parts(norm))


def _add_norm(norm: nn.Module, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + delta, norm(x + delta))`` in one fused op."""
    weight, bias, eps = _norm_parts(norm)
    ops = ops_for(x.device)
    if bias is None:
        return ops.add_rms_norm(x, delta, weight, eps)
    return ops.add_layer_norm(x, delta, weight, bias, eps)


def patch_embed_step(patch_embed: nn.Module, pixel_values: torch.Tensor) -> torch.Tensor:
    """The patch embedding (``patch_embed.proj``, one matmul): ``(T, C)`` in the weight's dtype."""
    return embed_patches(patch_embed.proj, pixel_values)


def position_step(
    pos_embed: nn.Module,
    x: torch.Tensor,
    interp_indices: torch.Tensor,
    interp_weights: torch.Tensor,
    table: str = "weight",
) -> torch.Tensor:
    """``x`` plus the learned position table (``pos_embed``'s parameter ``table``, its leading dims flattened: timm
    keeps it ``(1, side**2, C)``) resampled per token; in place unless autograd records it."""
    table = getattr(pos_embed, table)
    if table.dim() > 2:
        table = table.flatten(0, -2)
    ops = ops_for(x.device)
    if needs_grad(x, table):
        return x + ops.pos_embed_interp(table, interp_indices, interp_weights).to(x.dtype)
    ops.pos_embed_interp_add_(x, table, interp_indices, interp_weights)
    return x


def _mlp(mlp: nn.Module, h: torch.Tensor, spec: TowerSpec, all_reduce, linear: LinearParts) -> torch.Tensor:
    names = spec.names
    down = linear(part(mlp, names.mlp_out))
    activation = spec.mlp_activation
    if not activation.gated:
        act = activation.fused or activation.function
        return vision_mlp(h, *linear(part(mlp, names.mlp_in[0])), *down, all_reduce, act)
    if len(names.mlp_in) == 1:  # gate and up as one stacked linear (vLLM's gate_up_proj)
        return stacked_swiglu_mlp(h, *linear(part(mlp, names.mlp_in[0])), *down, all_reduce, activation.function)
    gate, up = (linear(part(mlp, name)) for name in names.mlp_in)
    return swiglu_mlp(h, *gate, *up, *down, all_reduce, activation.function)


def block_step(
    block: nn.Module,
    x: torch.Tensor,
    delta: torch.Tensor | None,
    *,
    windowed: bool,
    spec: TowerSpec,
    inputs: DeviceInputs,
    all_reduce: AllReduce | None = None,
    linear: LinearParts = linear_parts,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block on the residual stream ``x + delta`` (``delta`` None: ``x`` alone), reading only this block's
    parameters; ``windowed``: it attends within windows (``inputs.cu_window_seqlens``), else over whole frames.
    Returns ``(x, m)``, whose sum is the block's output: ``x`` the stream after attention, ``m`` the MLP's output,
    left for the next block's fused add + norm."""
    if delta is None:
        h = _norm(block.norm1, x)
    else:
        x, h = _add_norm(block.norm1, x, delta)
    # The attention's qkv and output die inside _attention, before the MLP's (T, intermediate) activation exists.
    x, h = _add_norm(block.norm2, x, _attention(block, h, windowed, spec, inputs, all_reduce, linear))
    return x, _mlp(block.mlp, h, spec, all_reduce, linear)


def _attention(
    block: nn.Module,
    h: torch.Tensor,
    windowed: bool,
    spec: TowerSpec,
    inputs: DeviceInputs,
    all_reduce: AllReduce | None,
    linear: LinearParts,
) -> torch.Tensor:
    """The block's attention on the normed stream ``h (T, C)``: qkv, rotary and attention, output projection."""
    if windowed:
        segments, max_seqlen = inputs.cu_window_seqlens, spec.window_tokens
    else:
        segments, max_seqlen = inputs.cu_seqlens, inputs.max_seqlen
    qkv = row_parallel_linear(column_parallel_input(h, all_reduce), *linear(part(block, spec.names.attn_qkv)), None)
    q, k, v = qkv.view(qkv.shape[0], 3, spec.num_heads, spec.head_dim).unbind(1)
    a = ops_for(q.device).vision_attn(
        q, k, v, segments, max_seqlen=max_seqlen, positions=inputs.positions, rope_theta=spec.rope_theta
    )
    return row_parallel_linear(a.flatten(1), *linear(block.attn.proj), all_reduce)


def merger_step(
    merger: nn.Module,
    x: torch.Tensor,
    *,
    spec: TowerSpec,
    postshuffle_norm: bool,
    all_reduce: AllReduce | None = None,
    linear: LinearParts = linear_parts,
) -> torch.Tensor:
    """A patch merger on ``x (T, C)``: norm per token then merge (the main merger) or merge then norm
    (``postshuffle_norm``: Qwen3-VL's deepstack mergers), fc1, exact GELU, fc2. Returns ``(T / m^2, out)``."""
    names = spec.names
    weight, bias, eps = _norm_parts(part(merger, names.merger_norm))
    return patch_merger(
        x,
        weight,
        bias,
        *linear(part(merger, names.merger_fc1)),
        *linear(part(merger, names.merger_fc2)),
        spatial_merge_size=spec.spatial_merge_size,
        postshuffle_norm=postshuffle_norm,
        eps=eps,
        all_reduce=all_reduce,
    )


def unwrapped(module: nn.Module) -> nn.Module:
    """The module inside activation-checkpoint / offload wrappers (torch's ``checkpoint_wrapper``)."""
    while hasattr(module, "_checkpoint_wrapped_module"):
        module = module._checkpoint_wrapped_module
    return module


def _run_step(module: nn.Module, step: Callable, *args, **options):
    return step(unwrapped(module), *args, **options)


def _call_module(module: nn.Module, step: Callable, *args, **options):
    return module(*args, qvl=(step, options))


def device_forward(
    tree: nn.Module,
    spec: TowerSpec,
    pixel_values: torch.Tensor,
    inputs: DeviceInputs,
    *,
    all_reduce: AllReduce | None = None,
    linear: LinearParts | None = None,
    hidden_states_out: list[torch.Tensor] | None = None,
    module_calls: bool = False,
) -> TowerOutputs:
    """The device part of a tower's forward over a module tree with transformers' layout.

    Args:
        tree: the tower's modules: qvl's own tower, a transformers vision model, vLLM's.
        spec: the tower's constants (:class:`TowerSpec`).
        pixel_values: ``(T, in_channels * temporal_patch_size * patch_size**2)`` patches in merge-block order (the
            processor's output), in any float dtype (cast to the patch embedding's).
        inputs: the batch's metadata on the tree's device (:meth:`DeviceInputs.of`).
        all_reduce: under tensor parallelism, sums the row-parallel partial products over the ranks (each rank's
            tree then holds its heads and its slices of the MLP and merger widths). None: one process.
        linear: maps each linear module (qkv, proj, the MLP's and mergers' linears) to its ``(weight, bias)`` as
            the layer functions take them; the weight may be a :data:`~qvl.vit.layers.Product`. None (the
            default) is :func:`~qvl.vit.layers.linear_parts`: a plain ``nn.Linear``'s weight and bias, any other
            module in its place (a PEFT LoRA adapter, a hooked linear) called.
        hidden_states_out: a list that receives the residual stream as transformers' ``output_hidden_states``
            records it: the first block's input, then each block's output, ``depth + 1`` new tensors ``(T, C)``.
        module_calls: call the patch embedding, the position table, each block and each merger as modules
            (``module(*tensors, qvl=(step, options))``, which :func:`install_module_forwards` makes run the step), so
            their hooks and wrappers act (FSDP2's unshard, ZeRO-3's gather, checkpoint wrappers, transformers'
            checkpointing); else each step runs on the module directly.

    Forward and backward: every op has a backward, and the in-place ones give way to out-of-place forms where
    autograd records them. Returns :class:`TowerOutputs`.
    """
    linear = linear or linear_parts
    call = _call_module if module_calls else _run_step
    parts = dict(spec=spec, all_reduce=all_reduce, linear=linear)
    x = call(tree.patch_embed, patch_embed_step, pixel_values)
    if spec.position_table:
        owner, _, table = spec.names.position_table.rpartition(".")
        plan = (inputs.interp_indices, inputs.interp_weights)
        if owner:
            x = call(part(tree, owner), position_step, x, *plan, table=table)
        else:  # a table of the tree's own (timm's), read in the tree's call around this forward
            x = position_step(tree, x, *plan, table=table)
    if spec.windowed:  # whole merge units into window order
        unit = spec.spatial_merge_size**2
        x = x.view(-1, unit, x.shape[1]).index_select(0, inputs.window_index).view(-1, x.shape[1])
    # int(): under torch.compile(dynamic=True) ints read from a plain object may arrive symbolic, and Dynamo then
    # took ``index in (symbolic ints)`` for False and dropped the deepstack features; int() specializes them.
    deepstack_mergers = {int(layer): n for n, layer in enumerate(spec.deepstack_visual_indexes)}
    full_attention_blocks = {int(index) for index in spec.full_attention_blocks}
    blocks = tree.blocks
    # On the torch path no kernel fuses the residual add into the next block's norm, and a pending delta would keep a
    # second (T, C) tensor alive through that whole block: each block's output is summed at once there.
    sum_each_block = ops_for(x.device) is torch_path
    if hidden_states_out is not None:
        hidden_states_out.append(x)
    deepstack, delta = [], None
    for index, block in enumerate(blocks):
        options = dict(windowed=spec.windowed and index not in full_attention_blocks, inputs=inputs, **parts)
        x, delta = call(block, block_step, x, delta, **options)
        # The block's output, summed where something reads it; elsewhere the next block's norm adds it.
        if sum_each_block or index + 1 == len(blocks) or index in deepstack_mergers or hidden_states_out is not None:
            x, delta = x + delta, None
        if hidden_states_out is not None:
            hidden_states_out.append(x)
        if index in deepstack_mergers:
            merger = getattr(tree, spec.names.deepstack_mergers)[deepstack_mergers[index]]
            deepstack.append(call(merger, merger_step, x, postshuffle_norm=True, **parts))
    if spec.names.merger is None:
        return TowerOutputs(x, None, deepstack)
    merged = call(part(tree, spec.names.merger), merger_step, x, postshuffle_norm=False, **parts)
    if spec.windowed:
        merged = merged.index_select(0, inputs.reverse_index)
    return TowerOutputs(x, merged, deepstack)


class ModuleForward:
    """A module's forward while qvl's runner calls it as a module (:func:`install_module_forwards`).

    A call carrying ``qvl=(step, options)`` runs ``step(module, *args, **options)``: qvl's ops on the module's own
    parameters, inside the module's call, where its hooks have acted (FSDP2 unsharded it, ZeRO-3 gathered it).
    Where transformers' gradient checkpointing is on for the module (a ``GradientCheckpointingLayer`` after
    ``gradient_checkpointing_enable``, in training, grad mode on), the step runs through the module's own
    ``_gradient_checkpointing_func``: whatever function and kwargs the user, a trainer or a library installed.
    transformers before 5.23 checkpoints such a layer in its ``__call__``, around this forward: the step then runs
    as it is, inside that one checkpoint (from 5.23 the layer checkpoints its class's ``forward``, which this one
    replaces). Any other call runs the forward this one replaced (transformers' own, e.g. its unfused fallback).

    ``checkpoint``: for a library that decides checkpointing above the module (timm's ``set_grad_checkpointing`` on
    the encoder), called with the module at each call, it returns the checkpoint function to run the step through
    (called as transformers' is), or None.
    """

    def __init__(
        self,
        module: nn.Module,
        replaced: Callable | None,
        checkpoint: Callable[[nn.Module], Callable | None] | None = None,
    ):
        self.module = module
        self.replaced = replaced
        self.checkpoint = checkpoint
        self.checkpointed_by_call = _checkpointed_by_call(module)

    def original_forward(self) -> Callable:
        """The forward this one replaced, bound to the module."""
        return bound_forward(self.module, self.replaced)

    def __call__(self, *args, qvl: tuple[Callable, dict] | None = None, **kwargs):
        if qvl is None:
            return self.original_forward()(*args, **kwargs)
        step, options = qvl
        module = self.module
        function = None if self.checkpoint is None else self.checkpoint(module)
        if function is not None:
            return function(functools.partial(step, module, **options), *args)
        if (
            getattr(module, "gradient_checkpointing", False)
            and module.training
            and torch.is_grad_enabled()
            and not self.checkpointed_by_call
        ):
            # The tensors go positionally, as transformers asks for its reentrant checkpointing.
            return module._gradient_checkpointing_func(functools.partial(step, module, **options), *args)
        return step(module, *args, **options)


def _checkpointed_by_call(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers ``GradientCheckpointingLayer`` whose ``__call__`` checkpoints it
    (transformers before 5.23), so that its forward already runs inside the checkpoint."""
    layer = _call_checkpointing_layer()
    return layer is not None and isinstance(module, layer)


@functools.cache
def _call_checkpointing_layer() -> type | None:
    """transformers' ``GradientCheckpointingLayer`` where it checkpoints in ``__call__``; None where it checkpoints
    ``forward`` (5.23 on) or transformers is not installed."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return None
    return GradientCheckpointingLayer if "__call__" in vars(GradientCheckpointingLayer) else None


def forward_slot(module: nn.Module) -> str:
    """The attribute that holds the forward a module runs. accelerate's ``add_hook_to_module`` moves it to
    ``_old_forward`` and sets ``forward`` to a wrapper that runs the hook's ``pre_forward`` (moving inputs,
    loading offloaded weights) before calling it."""
    hooked = getattr(module, "_hf_hook", None) is not None and "_old_forward" in vars(module)
    return "_old_forward" if hooked else "forward"


def bound_forward(module: nn.Module, replaced: Callable | None) -> Callable:
    """The forward a wrapper installed on ``module`` replaced: the instance attribute it held, or the class's."""
    return replaced or types.MethodType(type(module).forward, module)


def restore_forward(module: nn.Module, slot: str, replaced: Callable | None) -> None:
    """Take a wrapper out of ``module``'s forward ``slot`` (:func:`forward_slot`), putting back what it replaced.
    Where it replaced no instance attribute: in ``forward`` the attribute goes and the class's forward shows
    again; in ``_old_forward`` (accelerate hooked the module after the wrapper went in) accelerate's hook keeps
    calling that slot, so the class's forward, bound, goes there."""
    if replaced is None and slot == "forward":
        del module.forward
    else:
        setattr(module, slot, bound_forward(module, replaced))


def _called_parts(tree: nn.Module, spec: TowerSpec) -> list[nn.Module]:
    """The modules :func:`device_forward` calls with ``module_calls=True``, inside any wrappers."""
    names = spec.names
    parts = [tree.patch_embed, *tree.blocks]
    if names.merger is not None:
        parts.append(part(tree, names.merger))
    owner = names.position_table.rpartition(".")[0]
    if spec.position_table and owner:
        parts.append(part(tree, owner))
    if spec.deepstack_visual_indexes:
        parts += list(getattr(tree, spec.names.deepstack_mergers))
    return [unwrapped(module) for module in parts]


def install_module_forwards(
    tree: nn.Module, spec: TowerSpec, checkpoint: Callable[[nn.Module], Callable | None] | None = None
) -> None:
    """Give each module :func:`device_forward` calls a :class:`ModuleForward` (once; again is harmless), with
    ``checkpoint`` (see :class:`ModuleForward`)."""
    for module in _called_parts(tree, spec):
        slot = forward_slot(module)
        current = vars(module).get(slot)
        if not isinstance(current, ModuleForward):
            setattr(module, slot, ModuleForward(module, current, checkpoint))


def remove_module_forwards(tree: nn.Module, spec: TowerSpec) -> None:
    """Undo :func:`install_module_forwards`: each module gets back the forward it had."""
    for module in _called_parts(tree, spec):
        for slot in ("_old_forward", "forward"):
            current = vars(module).get(slot)
            if isinstance(current, ModuleForward):
                restore_forward(module, slot, current.replaced)


class TowerRunner:
    """Host metadata -> device forward -> outputs, over one module tree.

    Args:
        tree: the tower's modules (see :func:`device_forward`).
        config: the tower's config (:class:`~qvl.vit.config.VisionConfig` or
            :class:`~qvl.vit.config.Qwen2VisionConfig`).
        names: where ``tree`` keeps its MLP and merger parts.
        num_heads: heads ``tree`` holds (default: all of ``config``'s).
        all_reduce, linear, module_calls: as for :func:`device_forward` (``module_calls``: a tree whose stacks hook
            its modules, transformers'; :func:`install_module_forwards` must have run on it).
        prepare_pixels: applied to the pixel values on the device before the patch embedding (vLLM's
            ``input_norm``); None: none.
        name: what error messages call the tower (its class, or the entry point's name).
    """

    def __init__(
        self,
        tree: nn.Module,
        config: TowerConfig,
        names: ModuleNames,
        *,
        num_heads: int | None = None,
        all_reduce: AllReduce | None = None,
        linear: LinearParts | None = None,
        module_calls: bool = False,
        prepare_pixels: Callable[[torch.Tensor], torch.Tensor] | None = None,
        name: str = "qvl tower",
    ):
        self.tree = tree
        self.config = config
        self.spec = TowerSpec.of(config, names, num_heads)
        self.all_reduce = all_reduce
        self.linear = linear
        self.module_calls = module_calls
        self.prepare_pixels = prepare_pixels
        self.name = name
        self.graphs: TowerGraphs | None = None
        self._forward = _Forward(self.spec, all_reduce, linear, module_calls)
        self._compiled = None

    @property
    def device(self) -> torch.device:
        return self.tree.patch_embed.proj.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tree.patch_embed.proj.weight.dtype

    def metadata(self, grid_thw) -> VisionMetadata:
        """The host metadata of a batch (``grid_thw``: CPU tensor, numpy array or list of (t, h, w)), on the
        tree's device."""
        return build_tower_metadata(grid_thw, self.config, self.device)

    def compile(self, **compile_kwargs) -> None:
        """Compile the device part with the token dim dynamic (``fullgraph=True, dynamic=True`` unless
        ``compile_kwargs`` says otherwise); later calls of :meth:`run_device`, and of :meth:`encode` without hidden
        states, take the compiled code. Budgets captured before keep the code they captured."""
        options = {"fullgraph": True, "dynamic": True, **compile_kwargs}
        self._compiled = torch.compile(self._forward, **options)

    def capture(self, token_budgets, max_segments: int | None = None, *, caller: str = "capture") -> None:
        """Serve batches of up to each of ``token_budgets`` tokens from CUDA graphs (:mod:`qvl.vit.graphs`): from
        now on :meth:`encode_grid` pads a batch on the host to the smallest budget whose segment slots
        (``max_segments``; None: :func:`~qvl.vit.graphs.segment_slots`' default) hold it and replays that budget's
        graph, captured here after two warm-up runs of the device part (compiled after :meth:`compile`). Off CUDA
        the padded batch runs through the normal device part. Capturing again replaces the budgets.

        Raises TypeError / ValueError naming ``caller``'s argument for bad budgets, and ValueError for a runner
        with an all-reduce (weights split over ranks) or a tree whose parameters a training stack holds sharded
        or released (a graph would replay their gathers, or read memory they no longer own)."""
        budgets = self.check_capture(token_budgets, max_segments, caller)
        self.graphs = None  # the old graphs' memory goes before the new ones are captured
        self.graphs = TowerGraphs(self, budgets, max_segments, caller)

    def check_capture(self, token_budgets, max_segments: int | None, caller: str) -> tuple[int, ...]:
        """What :meth:`capture` checks before it captures anything: the budgets, sorted and without repeats."""
        budgets = check_budgets(token_budgets, self.config.spatial_merge_size, max_segments, caller=caller)
        if self.all_reduce is not None:
            raise ValueError(f"{caller}: a tower whose weights are split over ranks cannot be captured")
        if any(isinstance(p, DTensor) or p.numel() == 0 for p in self.tree.parameters()):
            raise ValueError(
                f"{caller}: the tower's parameters must be whole on its device (a training stack holds some sharded "
                "or released: FSDP2, ZeRO-3); capture a tower that a stack does not manage"
            )
        return budgets

    @property
    def captured_budgets(self) -> tuple[int, ...]:
        """The token budgets of :meth:`capture`, ascending (empty before it)."""
        return () if self.graphs is None else self.graphs.budgets

    def run_device(self, pixel_values: torch.Tensor, inputs: DeviceInputs) -> TowerOutputs:
        """The device part on device tensors (``prepare_pixels`` first): compiled after :meth:`compile`, else
        eager."""
        if self.prepare_pixels is not None:
            pixel_values = self.prepare_pixels(pixel_values)
        if self._compiled is None:
            return self._forward(self.tree, pixel_values, inputs)
        return call_compiled(self._compiled, self.tree, pixel_values, inputs)

    def empty_outputs(self) -> TowerOutputs:
        """The outputs of an empty batch (no device forward runs)."""
        empty = torch.empty(0, self.config.out_hidden_size, dtype=self.dtype, device=self.device)
        last = torch.empty(0, self.config.hidden_size, dtype=self.dtype, device=self.device)
        return TowerOutputs(last, empty, [empty.clone() for _ in self.spec.deepstack_visual_indexes])

    def check_pixels(self, pixel_values: torch.Tensor, grid: np.ndarray) -> None:
        """Raise ValueError unless ``pixel_values`` is ``(tokens, patch_dim)`` for the batch of ``grid`` (``(N, 3)``),
        or folded image rows ``(tokens, folded_patch_dim)`` (:func:`~qvl.vit.layers.embed_patches`) of a batch of
        images only (every ``t`` 1)."""
        tokens = int(np.prod(grid, axis=1).sum()) if len(grid) else 0
        config = self.config
        if tuple(pixel_values.shape) == (tokens, config.folded_patch_dim) and config.temporal_patch_size > 1:
            if (np.asarray(grid)[:, 0] != 1).any():
                raise ValueError(
                    f"{self.name}: pixel_values of {config.folded_patch_dim} values a row are folded image rows, but"
                    " the batch holds a video (a grid with t > 1): fold images only"
                )
            return
        expected = (tokens, config.patch_dim)
        if tuple(pixel_values.shape) != expected:
            raise ValueError(f"{self.name}: pixel_values must have shape {expected}, got {tuple(pixel_values.shape)}")

    def unfolded(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``pixel_values`` with folded image rows written back into every temporal slot (others as they are)."""
        config = self.config
        if pixel_values.shape[-1] == config.patch_dim:
            return pixel_values
        return unfold_image_rows(pixel_values, config.in_channels, config.temporal_patch_size)

    def encode(
        self,
        pixel_values: torch.Tensor,
        meta: VisionMetadata,
        *,
        hidden_states_out: list[torch.Tensor] | None = None,
    ) -> TowerOutputs:
        """The device part of a batch whose metadata is built (``hidden_states_out``: see :func:`device_forward`),
        never replayed. After :meth:`compile`, calls without ``hidden_states_out`` take the compiled code; calls
        with it run eagerly."""
        self.check_pixels(pixel_values, meta.grid_thw.numpy())
        if meta.num_tokens == 0:
            return self.empty_outputs()
        pixels, inputs = pixel_values.to(self.device, non_blocking=True), DeviceInputs.of(meta)
        if hidden_states_out is None:
            return self.run_device(pixels, inputs)
        if self.prepare_pixels is not None:
            pixels = self.prepare_pixels(pixels)
        return device_forward(
            self.tree,
            self.spec,
            pixels,
            inputs,
            all_reduce=self.all_reduce,
            linear=self.linear,
            hidden_states_out=hidden_states_out,
            module_calls=self.module_calls,
        )

    def encode_batch(self, pixel_values: torch.Tensor, grid: np.ndarray, meta: VisionMetadata | None = None):
        """The outputs of a batch from its checked ``grid``: the host entry of every caller (qvl's towers, the
        transformers patch, the engines' tower routes, through :meth:`encode_grid` under a parallel strategy). A
        captured budget that serves the batch replays (:meth:`capture`); else the metadata (``meta``, when the
        caller built it for ``grid``) and the device part run. Returns :class:`TowerOutputs`.

        Under ``torch.autocast`` to another dtype than the weights' (fp32 master weights under bf16 autocast), the
        forward follows autocast as transformers' does: the linears and the attention in the autocast dtype, the
        norms in fp32, the residual stream in the patch embedding's dtype (each op's rule:
        :mod:`qvl.kernels.autocast`), eagerly or compiled, never from captured graphs (captured without autocast).
        Autocast to the weights' own dtype changes no result, and is switched off inside, so such a call runs as
        without it."""
        device_type = self.device.type
        autocast = torch.is_autocast_enabled(device_type)
        mixed = autocast and torch.get_autocast_dtype(device_type) != self.dtype
        own_dtype = torch.autocast(device_type, enabled=False) if autocast and not mixed else None
        with own_dtype or contextlib.nullcontext():
            if self.graphs is not None and not mixed:
                self.check_pixels(pixel_values, grid)
                # The graphs' buffers hold whole rows: folded ones are unfolded for them.
                replayed = self.graphs.encode(self, self.unfolded(pixel_values), grid)
                if replayed is not None:
                    return replayed
            return self.encode(pixel_values, self.metadata(grid) if meta is None else meta)

    def encode_grid(
        self, pixel_values: torch.Tensor, grid: np.ndarray, meta: VisionMetadata | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``(merged, deepstack)`` of :meth:`encode_batch`: the ``encode`` a parallel strategy's ``run`` takes."""
        outputs = self.encode_batch(pixel_values, grid, meta)
        return outputs.merged, outputs.deepstack


class _Forward(nn.Module):
    """:func:`device_forward` (without hidden states) as a module's forward: torch.compile keeps the
    ints of a module's attributes (the spec) constant, where a plain object's would become symbolic under
    ``dynamic=True`` (and a symbolic head count hides that q, k and v are views of one buffer, which costs copies).
    Holds no parameters: the tree is an argument."""

    def __init__(self, spec: TowerSpec, all_reduce: AllReduce | None, linear: LinearParts | None, module_calls: bool):
        super().__init__()
        self.spec = spec
        self.all_reduce = all_reduce
        self.linear = linear
        self.module_calls = module_calls

    def forward(self, tree: nn.Module, pixel_values: torch.Tensor, inputs: DeviceInputs) -> TowerOutputs:
        return device_forward(
            tree,
            self.spec,
            pixel_values,
            inputs,
            all_reduce=self.all_reduce,
            linear=self.linear,
            module_calls=self.module_calls,
        )


def call_compiled(compiled, tree: nn.Module, pixel_values: torch.Tensor, inputs: DeviceInputs):
    """Call a compiled device part so that every batch reuses one graph: each tensor's first (token) dim marked
    dynamic, and the pixel values made a fresh tensor when they are a view with an offset (Dynamo guards on a
    view's storage offset)."""
    if pixel_values.storage_offset() != 0:
        pixel_values = pixel_values.clone()
    for tensor in (pixel_values, *inputs):
        if isinstance(tensor, torch.Tensor):
            torch._dynamo.mark_dynamic(tensor, 0)
    # Float attributes (norm eps, rope theta) stay constants: as symbolic floats they make a training graph's
    # scalar pass restart the whole trace.
    with _size_oblivious_tracing(), torch._dynamo.config.patch(specialize_float=True):
        return compiled(tree, pixel_values, inputs)


def _size_oblivious_tracing() -> contextlib.AbstractContextManager:
    """Trace with token counts of 1 left unspecialized (one 2x2 image has one merged token), so no batch
    shape triggers a recompile. The switch lives in a private torch module: without it, a count of 1 costs
    one extra compile and nothing else."""
    try:
        from torch.fx.experimental import _config as fx_config

        return fx_config.patch(backed_size_oblivious=True)
    except (ImportError, AttributeError):
        return contextlib.nullcontext()
