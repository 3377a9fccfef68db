"""SGLang's vision towers of qvl's families on qvl's tower runner.

For a loaded SGLang model of an architecture a family declares (:mod:`qvl.vit.families`: Qwen3-VL, Qwen3-VL-MoE,
Qwen3.5 and Qwen3.5-MoE, whose towers are all SGLang's ``Qwen3VLMoeVisionModel``; Qwen2.5-VL and Qwen2-VL),
:func:`attach` sets the tower instance's ``forward`` to a :class:`~qvl.vit.engines.tower.EngineTowerForward`, which runs
:class:`qvl.vit.runner.TowerRunner` over SGLang's own modules and the weights SGLang loaded into them (nothing is
copied): host metadata once per batch (Qwen2.5-VL's windows too), then the patch embed, the position-embedding
kernel, the blocks with rotary fused into attention and residual fused into the norms, the MLP's fused activation
(SwiGLU over SGLang's stacked gate_up) and the mergers on qvl's ops.

SGLang's encoder modes:

* one rank: the tower runs in the scheduler process as above;
* tensor parallel (weights split over the ranks): the tower keeps SGLang's sharded linears (each rank's heads and
  widths) and sums the row-parallel products (attention out, MLP out, merger fc2) with an all-reduce over SGLang's
  attention tensor-parallel group; SGLang splits Qwen3-VL's position table by rows, so each forward all-gathers it
  (2304 x 1152: small next to the tower's activations);
* ``--mm-enable-dp-encoder`` (replicated tower weights over the tensor-parallel group): the batch is split by qvl's
  balancer (:mod:`qvl.vit.balance`: a cost model with attention's quadratic term, videos split by frame) instead of
  SGLang's greedy split of whole items, and one all-gather returns every rank's features. The model then hands
  the whole batch to the tower.

What stays SGLang's (one log line each, when the model is loaded): quantized towers, towers whose shape qvl's
forward does not match, and the ViT CUDA-graph path (``SGLANG_VIT_ENABLE_CUDA_GRAPH``), whose attention still runs
on qvl through the attention route.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from ...families import Family, config_from_hf, sglang_architectures
from ...layers import Product
from ...parallel import DataParallel, SingleProcess
from ...runner import TowerRunner, part
from ..routes import RouteLog
from ..tower import EngineTowerForward, shared_mismatch

__all__ = ["ARCHITECTURES", "attach", "tower_mismatch"]

logger = logging.getLogger("sglang.qvl")

# SGLang's model class name -> family.
ARCHITECTURES: dict[str, Family] = sglang_architectures()
# SGLang's switch for its ViT CUDA graphs, read by its towers' forward on every call.
CUDA_GRAPH_SWITCH = "SGLANG_VIT_ENABLE_CUDA_GRAPH"


def _split(model: nn.Module) -> str | None:
    if _attn_tp_group().world_size == 1:
        return None
    return "data" if getattr(model, "use_data_parallel", False) else "weights"


def tower_mismatch(model: nn.Module, hf_config, family: Family, split: str | None) -> str | None:
    """Why qvl's runner cannot run ``model.visual`` (None when it can); checked once, when the model is loaded, so
    no forward fails halfway. ``hf_config``: the model's transformers config (SGLang's ``model_config.hf_config``),
    ``split``: the encoder's parallel mode (None for one rank)."""
    visual = getattr(model, "visual", None)
    if visual is None:
        return "the model has no vision tower in this process"
    from sglang.srt.environ import envs

    # Read as SGLang reads it (its own parser: "1", "true", "yes", "y", any case).
    if getattr(envs, CUDA_GRAPH_SWITCH).get():
        return f"{CUDA_GRAPH_SWITCH} (SGLang's ViT CUDA graphs run its own tower forward)"
    names = family.sglang_names or family.names
    _, config = config_from_hf(hf_config)
    # A learned position table marks Qwen3-VL's tower kind (mergers norm before or after the merge, deepstack,
    # SGLang's get_rope); Qwen2.5-VL's and Qwen2-VL's have none (an inv_freq rotary).
    qwen3_kind = config.num_grid_per_side is not None
    linears = [names.attn_qkv, "attn.proj", *(f"mlp.{name}" for name in (*names.mlp_in, names.mlp_out))]
    mergers = [visual.merger]
    if config.deepstack_visual_indexes:
        mergers += list(part(visual, names.deepstack_mergers))
    try:
        checks = [(visual, ["patch_embed.proj.weight", "rotary_pos_emb", *["pos_embed.weight"] * qwen3_kind])]
        checks += [(block, ["norm1.weight", "norm2.weight", *linears]) for block in visual.blocks]
        checks += [(merger, [names.merger_norm, names.merger_fc1, names.merger_fc2]) for merger in mergers]
        for module, paths in checks:
            for path in paths:
                part(module, path)
    except (AttributeError, IndexError) as error:
        return f"the tower differs from what qvl expects ({type(error).__name__}: {error})"
    reason = shared_mismatch(visual, config.depth, mergers, names.merger_norm)
    if reason is not None:
        return reason
    layers = [part(block, path) for block in visual.blocks for path in linears]
    layers += [part(merger, path) for merger in mergers for path in (names.merger_fc1, names.merger_fc2)]
    methods = {type(layer.quant_method).__name__ for layer in layers}
    if methods != {"UnquantizedLinearMethod"}:
        return f"linears with weights other than plain ones ({', '.join(sorted(methods))})"
    ranks = _attn_tp_group().world_size if split == "weights" else 1
    heads = visual.blocks[0].attn.num_attention_heads_per_partition
    head_dim = visual.blocks[0].attn.head_size
    if heads * ranks != config.num_heads or head_dim != config.head_dim:
        expected = f"{config.num_heads} of {config.head_dim}"
        return f"{heads} heads of {head_dim} on each of {ranks} ranks where the config says {expected}"
    if not qwen3_kind:
        frequencies = visual.rotary_pos_emb.inv_freq.numel()
        if frequencies != head_dim // 4:
            return f"a rotary embedding of {frequencies} frequencies where the 2D one qvl fuses has {head_dim // 4}"
        return None
    if visual.pos_embed.weight.shape[0] * ranks < config.num_position_embeddings:
        return f"a position table of {visual.pos_embed.weight.shape[0]} rows on each of {ranks} ranks"
    rope = visual.rotary_pos_emb
    if not rope.is_neox_style or rope.rotary_dim != head_dim // 2 or head_dim % 4 or rope.base != config.rope_theta:
        return f"a rotary embedding other than the 2D one qvl fuses (rotary_dim {rope.rotary_dim}, base {rope.base})"
    if getattr(visual, "disable_merger_proj", False):
        return "mergers without their projection (disable_merger_proj)"
    return None


def attach(model: nn.Module, hf_config, family: Family, routes: RouteLog) -> str | None:
    """Run ``model.visual`` (a ``family`` model of transformers config ``hf_config``) on qvl when
    :func:`tower_mismatch` finds nothing; returns None when it does, else the reason SGLang's tower stays. Nothing
    of the model changes until everything qvl needs is in hand."""
    try:
        split = _split(model)
        reason = tower_mismatch(model, hf_config, family, split)
        if reason is None:
            forward = _qvl_forward(model, hf_config, family, split, routes)
    except Exception as error:  # an SGLang that differs from what qvl expects must still serve
        reason = f"{type(error).__name__}: {error}"
    if reason is not None:
        return reason
    model.visual.forward = forward
    if split == "data":
        # The model then hands the whole batch to the tower, whose strategy splits it.
        model.use_data_parallel = False
    routes.record_tower({"model": type(model).__name__, "split": split})
    return None


def _qvl_forward(model: nn.Module, hf_config, family: Family, split: str | None, routes: RouteLog):
    visual = model.visual
    _, config = config_from_hf(hf_config)
    names = family.sglang_names or family.names
    tree, all_reduce = visual, None
    if split == "data":
        group = _attn_tp_group()
        # Features travel over the device group, the per-call batch check over SGLang's gloo twin of it.
        strategy = DataParallel(config, group.device_group, host_group=group.cpu_group)
    else:
        strategy = SingleProcess(config)
    if split == "weights":
        group = _attn_tp_group()
        all_reduce = group.all_reduce
        if config.num_grid_per_side is not None:
            tree = _weights_split_tree(visual, names, config, group)
    num_heads = visual.blocks[0].attn.num_attention_heads_per_partition
    runner = TowerRunner(tree, config, names, num_heads=num_heads, all_reduce=all_reduce, linear=_linear_parts)
    return EngineTowerForward(visual, runner, strategy, routes.count)


def _attn_tp_group():
    from sglang.srt.runtime_context import get_parallel

    return get_parallel().attn_tp_group


class _GatheredPositionTable(nn.Module):
    """SGLang's row-split position table (a ``VocabParallelEmbedding``), read whole: ``weight`` all-gathers every
    rank's rows in rank order, which is the table's order (padding rows, if any, sit at the end)."""

    def __init__(self, pos_embed: nn.Module, group, num_positions: int):
        super().__init__()
        self.shard = pos_embed
        self.group = group
        self.num_positions = num_positions

    @property
    def weight(self) -> torch.Tensor:
        return self.group.all_gather(self.shard.weight, dim=0)[: self.num_positions]


def _weights_split_tree(visual: nn.Module, names, config, group) -> nn.Module:
    """The module tree the runner reads when SGLang splits the tower's weights: SGLang's own modules (not copies),
    with the position table read whole."""
    tree = nn.Module()
    tree.patch_embed, tree.blocks, tree.merger = visual.patch_embed, visual.blocks, visual.merger
    tree.pos_embed = _GatheredPositionTable(visual.pos_embed, group, config.num_position_embeddings)
    if config.deepstack_visual_indexes:
        setattr(tree, names.deepstack_mergers, part(visual, names.deepstack_mergers))
    return tree


def _linear_parts(module: nn.Module) -> tuple[Product, torch.Tensor | None]:
    # The product goes through the linear's own method (platforms may keep the weight packed); the bias is added
    # by qvl's fused epilogue.
    return functools.partial(module.quant_method.apply, module, bias=None), module.bias
