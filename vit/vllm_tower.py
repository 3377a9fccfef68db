"""vLLM's Qwen3-VL-family vision towers on qvl's tower forward.

For Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 and Qwen3.5-MoE (every vLLM model whose tower is vLLM's
``Qwen3_VisionTransformer``), :func:`install` registers with vLLM's ``ModelRegistry`` a subclass of vLLM's
own model class that differs in one thing: once vLLM has built the model, its tower instance's ``forward``
is :class:`QvlTowerForward`, which runs :func:`qvl.vit.model.tower_forward` over vLLM's own modules and the
weights vLLM loads into them (nothing is copied). One forward builds the batch's metadata on the host
(:func:`qvl.vit.metadata.build_metadata`) and runs the patch embed, the position-embedding kernel, the
blocks with rotary fused into attention and residual fused into LayerNorm, bias-GELU, the deepstack
mergers and the main merger on qvl's ops.

vLLM's two tensor-parallel encoder modes:

* ``mm_encoder_tp_mode="weights"``: the tower keeps vLLM's sharded linears (each rank's heads and widths)
  and vLLM's all-reduce after each row-parallel product (attention out, MLP fc2, merger fc2).
* ``mm_encoder_tp_mode="data"``: the batch is split by qvl's balancer (:mod:`qvl.vit.balance`: a cost
  model with attention's quadratic term, videos split by frame) over vLLM's tensor-parallel group, instead
  of vLLM's greedy split of whole items by patch count; one all-gather returns every rank's features.

What stays vLLM's: quantized towers, pipeline stages without the tower, towers whose shape qvl's forward
does not match (one log line each, at model build), and the encoder CUDA-graph path (calls that bring
vLLM's precomputed ``encoder_metadata``), whose attention still runs on qvl through the attention route.
With ``compile_mm_encoder`` on, the device part of the forward is compiled once with its token dim dynamic.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util

import numpy as np
import torch
from torch import nn
from vllm.distributed import get_tensor_model_parallel_world_size, get_tp_group, tensor_model_parallel_all_reduce
from vllm.logger import init_logger

from .config import VisionConfig
from .layers import Product
from .metadata import build_metadata
from .model import call_compiled, tower_forward
from .parallel import DataParallel, SingleProcess
from .vllm_routes import count, record_tower

__all__ = ["ARCHITECTURES", "QvlTowerForward", "attach", "install", "tower_mismatch"]

logger = init_logger("vllm.qvl")

# The vLLM architectures whose tower is Qwen3_VisionTransformer, and the vLLM module defining each.
ARCHITECTURES = {
    "Qwen3VLForConditionalGeneration": "vllm.model_executor.models.qwen3_vl",
    "Qwen3VLMoeForConditionalGeneration": "vllm.model_executor.models.qwen3_vl_moe",
    "Qwen3_5ForConditionalGeneration": "vllm.model_executor.models.qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "vllm.model_executor.models.qwen3_5",
}


def install() -> tuple[str, ...]:
    """Register qvl's model classes for the architectures this vLLM has; returns their names. Registration
    is lazy (``"module:class"``), so no vLLM model module is imported until vLLM loads that model."""
    from vllm import ModelRegistry

    known = ModelRegistry.get_supported_archs()
    taken = tuple(
        arch for arch, module in ARCHITECTURES.items() if arch in known and importlib.util.find_spec(module) is not None
    )
    for arch in taken:
        ModelRegistry.register_model(arch, f"{__name__}:{arch}")
    return taken


def _with_qvl_tower(base: type[nn.Module]) -> type[nn.Module]:
    class Model(base):
        def __init__(self, *, vllm_config, prefix: str = "model"):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            attach(self, vllm_config)

    Model.__name__ = Model.__qualname__ = base.__name__
    Model.__module__ = __name__
    Model.__doc__ = f"vLLM's ``{base.__name__}`` with its vision tower on qvl (see :mod:`{__name__}`)."
    return Model


def __getattr__(name: str) -> type[nn.Module]:
    # vLLM imports "qvl.vit.vllm_tower:<architecture>": build that class from vLLM's own on first access.
    if name not in ARCHITECTURES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    model_class = _with_qvl_tower(getattr(importlib.import_module(ARCHITECTURES[name]), name))
    globals()[name] = model_class
    return model_class


def _get(module: nn.Module, path: str):
    for part in path.split("."):
        module = module[int(part)] if part.isdigit() else getattr(module, part)
    return module


_TOWER_PARTS = (
    "patch_embed.proj.weight", "patch_embed.proj.bias", "pos_embed.weight", "input_norm", "spatial_merge_size",
    "num_grid_per_side", "deepstack_visual_indexes", "deepstack_merger_list", "rotary_pos_emb.base",
    "rotary_pos_emb.rotary_dim", "rotary_pos_emb.is_neox_style", "merger.use_postshuffle_norm",
)  # fmt: skip
_BLOCK_PARTS = (
    "attn.qkv.quant_method", "attn.qkv.bias", "attn.proj.quant_method", "attn.proj.bias",
    "attn.num_attention_heads_per_partition", "attn.hidden_size_per_attention_head", "mlp.linear_fc1.quant_method",
    "mlp.linear_fc1.bias", "mlp.linear_fc2.quant_method", "mlp.linear_fc2.bias",
)  # fmt: skip
_MERGER_PARTS = (
    "norm.weight", "linear_fc1.quant_method", "linear_fc1.bias", "linear_fc2.quant_method", "linear_fc2.bias",
)  # fmt: skip


def tower_mismatch(visual: nn.Module | None, vllm_config) -> str | None:
    """Why qvl's forward cannot run vLLM's tower ``visual`` of a model built with ``vllm_config`` (None when
    it can): checked once, when the model is built, so no forward fails halfway."""
    from vllm.model_executor.models.qwen3_vl import Qwen3_VisionTransformer

    if not isinstance(visual, Qwen3_VisionTransformer):
        return f"the model's tower is {type(visual).__name__}, not vLLM's Qwen3_VisionTransformer"
    if vllm_config.quant_config is not None:
        return f"quantized weights ({vllm_config.quant_config.get_name()})"
    try:
        VisionConfig.from_hf(vllm_config.model_config.hf_config)
        for path in _TOWER_PARTS:
            _get(visual, path)
        mergers = [visual.merger, *visual.deepstack_merger_list]
        for merger in mergers:
            for path in _MERGER_PARTS:
                _get(merger, path)
        for block in visual.blocks:
            for path in _BLOCK_PARTS:
                _get(block, path)
    except (AttributeError, IndexError, ValueError) as error:
        return f"the tower differs from what qvl expects ({type(error).__name__}: {error})"
    norms = [norm for block in visual.blocks for norm in (block.norm1, block.norm2)]
    if not all(type(norm) is nn.LayerNorm for norm in norms + [merger.norm for merger in mergers]):
        return "norms other than torch's LayerNorm"
    head_dim = visual.blocks[0].attn.hidden_size_per_attention_head
    rope = visual.rotary_pos_emb
    if not rope.is_neox_style or rope.rotary_dim != head_dim // 2 or head_dim % 4:
        return f"a rotary embedding other than Qwen3-VL's 2D one (rotary_dim {rope.rotary_dim}, head dim {head_dim})"
    if visual.patch_embed.proj.weight.dim() != 5:
        return "a patch embedding that is not a Conv3d weight"
    if visual.merger.use_postshuffle_norm or not all(m.use_postshuffle_norm for m in visual.deepstack_merger_list):
        return "mergers that norm in another order than Qwen3-VL's"
    return None


def attach(model: nn.Module, vllm_config) -> None:
    """Run ``model.visual`` on qvl when :func:`tower_mismatch` finds nothing, else leave it (one log line).
    Nothing of the model changes until everything qvl needs is in hand, so a failure leaves vLLM's tower."""
    visual = getattr(model, "visual", None)
    try:
        reason = tower_mismatch(visual, vllm_config)
        if reason is None:
            forward, split, compiled = _qvl_forward(model, visual, vllm_config)
    except Exception as error:  # a vLLM that differs from what qvl expects must still serve
        reason = f"{type(error).__name__}: {error}"
    if reason is not None:
        logger.info_once(f"qvl: vLLM's own vision tower runs: {reason}")
        return
    visual.forward = forward
    if split == "data":
        # The model then hands the whole batch to the tower, whose strategy splits it.
        model.use_data_parallel = False
    record_tower({"model": type(model).__name__, "split": split, "compiled": compiled})
    how = {None: "one rank", "weights": "weights split over ranks", "data": "qvl's balancer over ranks"}[split]
    logger.info_once(f"qvl: {type(model).__name__}'s vision tower runs on qvl ({how}{', compiled' * compiled})")


def _qvl_forward(model: nn.Module, visual: nn.Module, vllm_config):
    config = VisionConfig.from_hf(vllm_config.model_config.hf_config)
    world_size = get_tensor_model_parallel_world_size()
    split = None if world_size == 1 else ("data" if getattr(model, "use_data_parallel", False) else "weights")
    if split == "data":
        group = get_tp_group()
        # Features travel over the device group; the per-call batch check over vLLM's gloo twin of it, so on
        # GPUs it never waits for the device.
        strategy = DataParallel(config, group.device_group, host_group=group.cpu_group)
    else:
        strategy = SingleProcess(config)
    all_reduce = tensor_model_parallel_all_reduce if split == "weights" else None
    compiled = bool(getattr(vllm_config.compilation_config, "compile_mm_encoder", False))
    return QvlTowerForward(visual, config, strategy, all_reduce, compiled=compiled), split, compiled


class QvlTowerForward:
    """The ``forward`` of a vLLM ``Qwen3_VisionTransformer`` instance, on qvl.

    ``forward(x, grid_thw)``: ``x`` the processor's ``(T, in_channels * temporal_patch_size * patch_size**2)``
    patches in merge-block order, ``grid_thw`` ``(N, 3)`` (a CPU tensor or list). Returns vLLM's layout:
    ``(T / m^2, out_hidden_size * (1 + len(deepstack)))``, the main merger's features then each deepstack
    merger's. Calls with ``encoder_metadata`` (vLLM's encoder CUDA graphs) run vLLM's own forward.
    """

    def __init__(self, visual: nn.Module, config: VisionConfig, strategy, all_reduce, *, compiled: bool = False):
        self.visual = visual
        self.config = config
        self.strategy = strategy
        self.all_reduce = all_reduce
        self.vllm_forward = type(visual).forward.__get__(visual)
        self.compiled = torch.compile(self._device_forward, fullgraph=True, dynamic=True) if compiled else None

    def __call__(self, x: torch.Tensor, grid_thw, *, encoder_metadata=None) -> torch.Tensor:
        if encoder_metadata is not None:
            count("tower_fallback")
            return self.vllm_forward(x, grid_thw, encoder_metadata=encoder_metadata)
        count("tower")
        if isinstance(grid_thw, torch.Tensor) and grid_thw.device.type != "cpu":
            # vLLM keeps grid_thw on the CPU for these models; read elsewhere, it costs the sync vLLM's own
            # forward would make.
            grid_thw = grid_thw.tolist()
        merged, deepstack = self.strategy.run(x, grid_thw, self._encode, self.visual.device)
        return torch.cat([merged, *deepstack], dim=1) if deepstack else merged

    def _encode(self, pixel_values: torch.Tensor, grid: np.ndarray) -> tuple[torch.Tensor, list[torch.Tensor]]:
        visual = self.visual
        meta = build_metadata(
            grid,
            spatial_merge_size=self.config.spatial_merge_size,
            num_grid_per_side=self.config.num_grid_per_side,
            device=visual.device,
        )
        if meta.num_tokens == 0:
            empty = torch.empty(0, self.config.out_hidden_size, dtype=visual.dtype, device=visual.device)
            return empty, [empty.clone() for _ in self.config.deepstack_visual_indexes]
        pixels = visual.input_norm(pixel_values.to(device=visual.device, non_blocking=True), visual.dtype)
        args = (pixels, meta.cu_seqlens, meta.positions, meta.interp_indices, meta.interp_weights)
        if self.compiled is None:
            return self._device_forward(*args)
        return call_compiled(self.compiled, *args)

    def _device_forward(self, pixel_values, cu_seqlens, positions, interp_indices, interp_weights):
        # The tower's sizes are read from vLLM's modules, whose int attributes torch.compile keeps as
        # constants (with dynamic=True, a plain object's become symbolic ints and cost guards).
        visual = self.visual
        _, merged, deepstack = tower_forward(
            visual,
            pixel_values,
            cu_seqlens,
            positions,
            interp_indices,
            interp_weights,
            num_heads=visual.blocks[0].attn.num_attention_heads_per_partition,
            rope_theta=visual.rotary_pos_emb.base,
            deepstack_visual_indexes=visual.deepstack_visual_indexes,
            spatial_merge_size=visual.spatial_merge_size,
            all_reduce=self.all_reduce,
            linear=self._linear_parts,
        )
        return merged, deepstack

    def _linear_parts(self, module: nn.Module) -> tuple[Product, torch.Tensor]:
        # vLLM's CPU linears keep their weight packed for oneDNN (``module.weight`` is then empty) and some
        # keep a float32 bias: the product goes through the module's own method, the bias is cast to the
        # tower's dtype (a no-op otherwise).
        return functools.partial(_bias_less_product, module), module.bias.to(self.visual.dtype)


def _bias_less_product(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module.quant_method.apply(module, x, None)
