"""vLLM's vision towers of qvl's families on qvl's tower runner.

For every vLLM architecture a family declares (:mod:`qvl.vit.families`: Qwen3-VL, Qwen3-VL-MoE, Qwen3.5,
Qwen3.5-MoE, Qwen2.5-VL, Qwen2-VL), :func:`install` registers with vLLM's ``ModelRegistry`` a subclass of vLLM's
own model class that differs in one thing: once vLLM has built the model, its tower instance's ``forward`` is
:class:`QvlTowerForward`, which runs :class:`qvl.vit.runner.TowerRunner` over vLLM's own modules and the weights
vLLM loads into them (nothing is copied). One forward builds the batch's metadata on the host (segments, rotary
positions, the position-table plan, Qwen2.5-VL's windows) and runs the patch embed, the position-embedding
kernel, the blocks with rotary fused into attention and residual fused into the norms, the MLP's fused
activation, the mergers and (Qwen2.5-VL) the window reordering on qvl's ops.

vLLM's two tensor-parallel encoder modes:

* ``mm_encoder_tp_mode="weights"``: the tower keeps vLLM's sharded linears (each rank's heads and widths)
  and vLLM's all-reduce after each row-parallel product (attention out, MLP out, merger fc2).
* ``mm_encoder_tp_mode="data"``: the batch is split by qvl's balancer (:mod:`qvl.vit.balance`: a cost
  model with attention's quadratic term, videos split by frame) over vLLM's tensor-parallel group, instead
  of vLLM's greedy split of whole items by patch count; one all-gather returns every rank's features.

On a CPU the tower runs qvl's torch path, and only where :mod:`qvl.vit.cpu_path` says it beats vLLM's own tower in
the model's dtype (measured; switch ``QVL_CPU_ROUTES``); elsewhere vLLM's tower stays, with one log line.

What stays vLLM's: quantized towers, pipeline stages without the tower, towers whose shape qvl's forward
does not match (one log line each, at model build), and the encoder CUDA-graph path (calls that bring
vLLM's precomputed ``encoder_metadata``), whose attention still runs on qvl through the attention route.
With ``compile_mm_encoder`` on, the device part of the forward is compiled once with its token dim dynamic.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util

import torch
from torch import nn
from vllm.distributed import get_tensor_model_parallel_world_size, get_tp_group, tensor_model_parallel_all_reduce
from vllm.logger import init_logger

from .families import Family, config_from_hf
from .families import vllm_architectures as family_architectures
from .layers import Product
from .parallel import DataParallel, SingleProcess
from .runner import TowerRunner, part
from .vllm_attention import cpu_step_aside
from .vllm_routes import count, record_tower

__all__ = ["ARCHITECTURES", "QvlTowerForward", "attach", "install", "tower_mismatch"]

logger = init_logger("vllm.qvl")

# vLLM's model class name -> (family, the vLLM module defining it).
ARCHITECTURES: dict[str, tuple[Family, str]] = family_architectures()


def install() -> tuple[str, ...]:
    """Register qvl's model classes for the architectures this vLLM has; returns their names. Registration
    is lazy (``"module:class"``), so no vLLM model module is imported until vLLM loads that model."""
    from vllm import ModelRegistry

    known = ModelRegistry.get_supported_archs()
    taken = tuple(
        arch
        for arch, (_, module) in ARCHITECTURES.items()
        if arch in known and importlib.util.find_spec(module) is not None
    )
    for arch in taken:
        ModelRegistry.register_model(arch, f"{__name__}:{arch}")
    return taken


def _with_qvl_tower(base: type[nn.Module], family: Family) -> type[nn.Module]:
    class Model(base):
        def __init__(self, *, vllm_config, prefix: str = "model"):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            attach(self, vllm_config, family)

    Model.__name__ = Model.__qualname__ = base.__name__
    Model.__module__ = __name__
    Model.__doc__ = f"vLLM's ``{base.__name__}`` with its vision tower on qvl (see :mod:`{__name__}`)."
    return Model


def __getattr__(name: str) -> type[nn.Module]:
    # vLLM imports "qvl.vit.vllm_tower:<architecture>": build that class from vLLM's own on first access.
    if name not in ARCHITECTURES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    family, module = ARCHITECTURES[name]
    model_class = _with_qvl_tower(getattr(importlib.import_module(module), name), family)
    globals()[name] = model_class
    return model_class


def tower_mismatch(visual: nn.Module | None, vllm_config, family: Family, split: str | None = None) -> str | None:
    """Why qvl's runner cannot run vLLM's tower ``visual`` of a ``family`` model built with ``vllm_config`` (None
    when it can): checked once, when the model is built, so no forward fails halfway. ``split``: the encoder's
    tensor-parallel mode (None for one rank)."""
    if visual is None:
        return "the model has no vision tower in this process"
    if vllm_config.quant_config is not None:
        return f"quantized weights ({vllm_config.quant_config.get_name()})"
    names = family.vllm_names or family.names
    try:
        _, config = config_from_hf(vllm_config.model_config.hf_config)
        rope = ("base", "rotary_dim", "is_neox_style")
        tower_parts = ["patch_embed.proj.weight", "input_norm", "merger", *(f"rotary_pos_emb.{a}" for a in rope)]
        if config.num_grid_per_side is not None:
            tower_parts.append("pos_embed.weight")
        linears = ["attn.qkv", "attn.proj", *(f"mlp.{name}" for name in (*names.mlp_in, names.mlp_out))]
        heads = ("num_attention_heads_per_partition", "hidden_size_per_attention_head")
        block_parts = ["norm1.weight", "norm2.weight", *(f"attn.{a}" for a in heads), *_linear_paths(linears)]
        merger_parts = [f"{names.merger_norm}.weight", *_linear_paths([names.merger_fc1, names.merger_fc2])]
        mergers = [visual.merger, *_deepstack_mergers(visual, names, config)]
        checks = [(visual, tower_parts)]
        checks += [(merger, merger_parts) for merger in mergers] + [(block, block_parts) for block in visual.blocks]
        for module, paths in checks:
            for path in paths:
                part(module, path)
    except (AttributeError, IndexError, ValueError) as error:
        return f"the tower differs from what qvl expects ({type(error).__name__}: {error})"
    if len(visual.blocks) != config.depth:
        return f"{len(visual.blocks)} blocks where the config says {config.depth}"
    norms = [norm for block in visual.blocks for norm in (block.norm1, block.norm2)]
    norms += [part(merger, names.merger_norm) for merger in mergers]
    if not all(type(norm) is nn.LayerNorm or hasattr(norm, "variance_epsilon") for norm in norms):
        return "norms other than torch's LayerNorm or an RMSNorm"
    head_dim = visual.blocks[0].attn.hidden_size_per_attention_head
    rope = visual.rotary_pos_emb
    if not rope.is_neox_style or rope.rotary_dim != head_dim // 2 or head_dim % 4 or head_dim != config.head_dim:
        return f"a rotary embedding other than the 2D one qvl fuses (rotary_dim {rope.rotary_dim}, head dim {head_dim})"
    if visual.patch_embed.proj.weight.dim() != 5:
        return "a patch embedding that is not a Conv3d weight"
    if getattr(visual.merger, "use_postshuffle_norm", False) or not all(
        getattr(merger, "use_postshuffle_norm", True) for merger in mergers[1:]
    ):
        return "mergers that norm in another order than Qwen3-VL's"
    if split == "weights" and type(visual.blocks[0].attn.qkv).__name__ != "QKVParallelLinear":
        # A plain column-parallel qkv gives each rank a slice of the stacked [q | k | v] rows, not its heads' q, k
        # and v; vLLM gathers them again in its own forward.
        return "its qkv projection splits the stacked q, k, v rows rather than heads over the ranks"
    return None


def _linear_paths(linears: list[str]) -> list[str]:
    return [f"{linear}.{attribute}" for linear in linears for attribute in ("quant_method", "bias")]


def _deepstack_mergers(visual: nn.Module, names, config) -> list[nn.Module]:
    if not config.deepstack_visual_indexes:
        return []
    return list(getattr(visual, names.deepstack_mergers))


def attach(model: nn.Module, vllm_config, family: Family) -> None:
    """Run ``model.visual`` on qvl when :func:`tower_mismatch` finds nothing, else leave it (one log line).
    Nothing of the model changes until everything qvl needs is in hand, so a failure leaves vLLM's tower."""
    visual = getattr(model, "visual", None)
    try:
        world_size = get_tensor_model_parallel_world_size()
        split = None if world_size == 1 else ("data" if getattr(model, "use_data_parallel", False) else "weights")
        reason = tower_mismatch(visual, vllm_config, family, split)
        if reason is None and cpu_step_aside(visual.dtype) is not None:
            return  # cpu_step_aside logged the one line
        if reason is None:
            forward, compiled = _qvl_forward(visual, vllm_config, family, split)
    except Exception as error:  # a vLLM that differs from what qvl expects must still serve
        reason = f"{type(error).__name__}: {error}"
    if reason is not None:
        logger.info_once(f"qvl: vLLM's own vision tower runs for {type(model).__name__}: {reason}")
        return
    visual.forward = forward
    if split == "data":
        # The model then hands the whole batch to the tower, whose strategy splits it.
        model.use_data_parallel = False
    record_tower({"model": type(model).__name__, "split": split, "compiled": compiled})
    how = {None: "one rank", "weights": "weights split over ranks", "data": "qvl's balancer over ranks"}[split]
    logger.info_once(f"qvl: {type(model).__name__}'s vision tower runs on qvl ({how}{', compiled' * compiled})")


def _qvl_forward(visual: nn.Module, vllm_config, family: Family, split: str | None):
    _, config = config_from_hf(vllm_config.model_config.hf_config)
    if split == "data":
        group = get_tp_group()
        # Features travel over the device group; the per-call batch check over vLLM's gloo twin of it, so on
        # GPUs it never waits for the device.
        strategy = DataParallel(config, group.device_group, host_group=group.cpu_group)
    else:
        strategy = SingleProcess(config)
    runner = TowerRunner(
        visual,
        config,
        family.vllm_names or family.names,
        num_heads=visual.blocks[0].attn.num_attention_heads_per_partition,
        all_reduce=tensor_model_parallel_all_reduce if split == "weights" else None,
        linear=functools.partial(_linear_parts, visual),
        prepare_pixels=lambda pixel_values: visual.input_norm(pixel_values, visual.dtype),
    )
    compiled = bool(getattr(vllm_config.compilation_config, "compile_mm_encoder", False))
    if compiled:
        runner.compile()
    return QvlTowerForward(visual, runner, strategy), compiled


class QvlTowerForward:
    """The ``forward`` of a vLLM vision tower instance, on qvl.

    ``forward(x, grid_thw)``: ``x`` the processor's ``(T, in_channels * temporal_patch_size * patch_size**2)``
    patches in merge-block order, ``grid_thw`` ``(N, 3)`` (a CPU tensor or list). Returns vLLM's layout:
    ``(T / m^2, out_hidden_size * (1 + len(deepstack)))``, the main merger's features then each deepstack
    merger's (the merger's alone for towers without deepstack). Calls with ``encoder_metadata`` (vLLM's encoder
    CUDA graphs) run vLLM's own forward.
    """

    def __init__(self, visual: nn.Module, runner: TowerRunner, strategy):
        self.visual = visual
        self.runner = runner
        self.strategy = strategy
        self.vllm_forward = type(visual).forward.__get__(visual)

    def __call__(self, x: torch.Tensor, grid_thw, *, encoder_metadata=None) -> torch.Tensor:
        if encoder_metadata is not None:
            count("tower_fallback")
            return self.vllm_forward(x, grid_thw, encoder_metadata=encoder_metadata)
        count("tower")
        if isinstance(grid_thw, torch.Tensor) and grid_thw.device.type != "cpu":
            # vLLM keeps grid_thw on the CPU for these models; read elsewhere, it costs the sync vLLM's own
            # forward would make.
            grid_thw = grid_thw.tolist()
        merged, deepstack = self.strategy.run(x, grid_thw, self.runner.encode_grid, self.runner.device)
        return torch.cat([merged, *deepstack], dim=1) if deepstack else merged


def _linear_parts(visual: nn.Module, module: nn.Module) -> tuple[Product, torch.Tensor | None]:
    # vLLM's CPU linears keep their weight packed for oneDNN (``module.weight`` is then empty) and some keep a
    # float32 bias: the product goes through the module's own method, the bias is cast to the tower's dtype (a
    # no-op otherwise).
    bias = None if module.bias is None else module.bias.to(visual.dtype)
    return functools.partial(_bias_less_product, module), bias


def _bias_less_product(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module.quant_method.apply(module, x, None)
