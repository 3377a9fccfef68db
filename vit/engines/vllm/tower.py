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

On a CPU the tower runs qvl's torch path, and only where :mod:`qvl.vit.engines.cpu_path` says it beats vLLM's own
tower in the model's dtype (measured; switch ``QVL_CPU_ROUTES``); elsewhere vLLM's tower stays, with one log line.

With vLLM's encoder CUDA graphs on (``cudagraph_mm_encoder``, token budgets), vLLM's graph manager captures and
replays qvl's forward on qvl's buffers (:class:`QvlTowerForward`); in data mode it then splits the batch over the
ranks itself, as for vLLM's tower. With ``compile_mm_encoder`` on, the device part of the forward is compiled once
with its token dim dynamic (and captured compiled).

What stays vLLM's: quantized towers, towers with LoRA adapters (``enable_tower_connector_lora``), fp8 encoder
attention, pipeline stages without the tower and towers whose shape qvl's forward does not match (one log line each,
at model build).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util

import numpy as np
import torch
from torch import nn
from vllm.distributed import get_tensor_model_parallel_world_size, get_tp_group, tensor_model_parallel_all_reduce
from vllm.logger import init_logger

from ...families import Family, config_from_hf
from ...families import vllm_architectures as family_architectures
from ...graphs import cover_pad_rows, pad_grid, pad_offsets
from ...layers import Product
from ...metadata import DeviceInputs, check_grid, grid_as_numpy
from ...parallel import DataParallel, SingleProcess
from ...runner import TowerRunner, part
from ..tower import EngineTowerForward, features_of, shared_mismatch
from .attention import cpu_step_aside
from .routes import count, record_tower

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
    bases = (_QvlEncoderGraphs, base) if hasattr(base, "encoder_cudagraph_forward") else (base,)

    class Model(*bases):
        def __init__(self, *, vllm_config, prefix: str = "model"):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            attach(self, vllm_config, family)

    Model.__name__ = Model.__qualname__ = base.__name__
    Model.__module__ = __name__
    Model.__doc__ = f"vLLM's ``{base.__name__}`` with its vision tower on qvl (see :mod:`{__name__}`)."
    return Model


def __getattr__(name: str) -> type[nn.Module]:
    # vLLM imports "qvl.vit.engines.vllm.tower:<architecture>": build that class from vLLM's own on first access.
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
    lora_config = getattr(vllm_config, "lora_config", None)
    if getattr(lora_config, "enable_tower_connector_lora", False):
        # vLLM wraps the tower's linears in LoRA layers after the model is built and adds the adapters in their
        # forward, which qvl's products (through the layers' quant_method) would skip.
        return "LoRA on the tower (enable_tower_connector_lora)"
    multimodal_config = getattr(vllm_config.model_config, "multimodal_config", None)
    if getattr(multimodal_config, "mm_encoder_attn_dtype", None) == "fp8":
        return "fp8 encoder attention (mm_encoder_attn_dtype='fp8')"
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
    reason = shared_mismatch(visual, config.depth, mergers, names.merger_norm)
    if reason is not None:
        return reason
    head_dim = visual.blocks[0].attn.hidden_size_per_attention_head
    rope = visual.rotary_pos_emb
    if not rope.is_neox_style or rope.rotary_dim != head_dim // 2 or head_dim % 4 or head_dim != config.head_dim:
        return f"a rotary embedding other than the 2D one qvl fuses (rotary_dim {rope.rotary_dim}, head dim {head_dim})"
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
        # vLLM's encoder CUDA graphs (where the model has them) capture qvl's forward; in data mode their manager
        # splits the batch over the ranks itself, so qvl's balancer steps back.
        graphs = _QvlEncoderGraphs in type(model).__mro__ and _encoder_graphs_on(vllm_config)
        if reason is None:
            forward, compiled = _qvl_forward(visual, vllm_config, family, split, graphs)
    except Exception as error:  # a vLLM that differs from what qvl expects must still serve
        reason = f"{type(error).__name__}: {error}"
    if reason is not None:
        logger.info_once(f"qvl: vLLM's own vision tower runs for {type(model).__name__}: {reason}")
        return
    visual.forward = forward
    if split == "data" and not graphs:
        # The model then hands the whole batch to the tower, whose strategy splits it.
        model.use_data_parallel = False
    record_tower({"model": type(model).__name__, "split": split, "compiled": compiled, "encoder_graphs": graphs})
    how = {None: "one rank", "weights": "weights split over ranks", "data": "qvl's balancer over ranks"}[split]
    if split == "data" and graphs:
        how = "vLLM's split over ranks"
    extras = ", compiled" * compiled + ", in vLLM's encoder CUDA graphs" * graphs
    logger.info_once(f"qvl: {type(model).__name__}'s vision tower runs on qvl ({how}{extras})")


def _encoder_graphs_on(vllm_config) -> bool:
    """Whether vLLM will run the tower in its encoder CUDA graphs: asked for (``cudagraph_mm_encoder``), not under
    ``enforce_eager``, and, with vLLM's V1 model runner, CUDA graphs not off (``cudagraph_mode`` NONE: V1 makes its
    graph manager in its capture step, which NONE skips; the V2 runner makes it whatever the decoder's mode)."""
    compilation_config = vllm_config.compilation_config
    if not getattr(compilation_config, "cudagraph_mm_encoder", False):
        return False
    if getattr(vllm_config.model_config, "enforce_eager", False):
        return False
    mode = getattr(compilation_config, "cudagraph_mode", None)
    return bool(getattr(vllm_config, "use_v2_model_runner", False)) or getattr(mode, "name", "NONE") != "NONE"


def _qvl_forward(visual: nn.Module, vllm_config, family: Family, split: str | None, graphs: bool):
    _, config = config_from_hf(vllm_config.model_config.hf_config)
    if split == "data" and not graphs:
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


class QvlTowerForward(EngineTowerForward):
    """The ``forward`` of a vLLM vision tower instance, on qvl (see
    :class:`~qvl.vit.engines.tower.EngineTowerForward`), and the tower's side of vLLM's encoder CUDA graphs.

    Under vLLM's ``cudagraph_mm_encoder`` the model (:class:`_QvlEncoderGraphs`) hands vLLM's graph manager qvl's
    static buffers: the pixel values and the runner's device inputs (:class:`~qvl.vit.metadata.DeviceInputs`).
    vLLM captures :meth:`graph_forward` per token budget and before each replay copies a batch's buffers
    (:meth:`replay_values`) into the captured ones, zero-filling the rows past the batch; the segment offsets are
    filled with their last value instead (zero-length segments), and the captured forward appends pad segments
    over the rows past the batch (:func:`~qvl.vit.graphs.cover_pad_rows`). Attention stays within segments and
    every other op works per token or per merge block, so the pad rows never reach the batch's rows, which vLLM
    reads back. Calls with ``encoder_metadata`` (vLLM's own metadata, from a path that did not go
    through :class:`_QvlEncoderGraphs`) run vLLM's own forward.
    """

    def __init__(self, visual: nn.Module, runner: TowerRunner, strategy):
        super().__init__(visual, runner, strategy, count)
        self.vllm_forward = type(visual).forward.__get__(visual)

    def __call__(self, x: torch.Tensor, grid_thw, *, encoder_metadata=None) -> torch.Tensor:
        if encoder_metadata is not None:
            count("tower_fallback")
            return self.vllm_forward(x, grid_thw, encoder_metadata=encoder_metadata)
        return super().__call__(x, grid_thw)

    def graph_keys(self) -> list[str]:
        """The buffers a captured graph reads: the pixel values and the device inputs this tower uses."""
        spec = self.runner.spec
        keys = ["pixel_values", "cu_seqlens", "positions"]
        if spec.position_table:
            keys += ["interp_indices", "interp_weights"]
        if spec.windowed:
            keys += ["window_index", "reverse_index", "cu_window_seqlens"]
        return keys

    def graph_config(self, config):
        """vLLM's ``EncoderCudaGraphConfig`` of the model (``config``: vLLM's own) with qvl's buffers."""
        offsets = dict.fromkeys(("cu_seqlens", "cu_window_seqlens"), _fill_with_last_offset)
        return dataclasses.replace(config, buffer_keys=self.graph_keys(), padding_logics=offsets)

    def capture_values(self, token_budget: int, max_segments: int) -> dict[str, torch.Tensor]:
        """The static buffers of a graph for ``token_budget`` merged tokens in at most ``max_segments`` frames:
        ``token_budget * m**2`` zero pixel rows and the metadata of pad frames filling them (:mod:`qvl.vit.graphs`),
        the offsets as long as any batch of the budget needs: ``max_segments``, at most ``token_budget`` (a frame
        holds one merged token or more), since every slot costs each attention launch one program per head."""
        runner = self.runner
        merge = runner.config.spatial_merge_size
        tokens = token_budget * merge * merge
        slots = max(1, min(max_segments, token_budget))
        grid = pad_grid(np.zeros((0, 3), dtype=np.int64), tokens, merge, slots)
        values = self._values(runner.metadata(grid))
        values["cu_seqlens"] = pad_offsets(values["cu_seqlens"], slots + 1)
        if "cu_window_seqlens" in values:
            values["cu_window_seqlens"] = pad_offsets(values["cu_window_seqlens"], token_budget + 1)
        dtype = getattr(self.visual.input_norm, "input_dtype", None) or runner.dtype
        values["pixel_values"] = torch.zeros(tokens, runner.config.patch_dim, dtype=dtype, device=runner.device)
        return values

    def replay_values(self, pixel_values: torch.Tensor, grid_thw) -> dict[str, torch.Tensor]:
        """A batch's buffers (``grid_thw``: list or CPU tensor), as long as the batch: vLLM pads them. Counted
        as a tower forward (vLLM replays a graph for every batch it calls this for)."""
        count("tower")
        grid = grid_as_numpy(grid_thw)
        check_grid(grid, self.runner.config.spatial_merge_size)
        return {**self._values(self.runner.metadata(grid)), "pixel_values": pixel_values}

    def graph_forward(self, values: dict[str, torch.Tensor]) -> torch.Tensor:
        """The device part on a graph's buffers, in vLLM's layout (what vLLM captures). The tile hint is the
        buffers' token count, which no segment exceeds. Runs at capture (and warm-up) only: the replays of a
        batch are counted by :meth:`replay_values`."""
        pixels = values["pixel_values"]
        fields = {name: values.get(name) for name in DeviceInputs._fields if name != "max_seqlen"}
        merge = self.runner.config.spatial_merge_size
        for name in ("cu_seqlens", "cu_window_seqlens"):
            if fields[name] is not None:
                fields[name] = cover_pad_rows(fields[name], pixels.shape[0], merge)
        outputs = self.runner.run_device(pixels, DeviceInputs(**fields, max_seqlen=pixels.shape[0]))
        return features_of(outputs.merged, outputs.deepstack)

    def _values(self, meta) -> dict[str, torch.Tensor]:
        inputs = DeviceInputs.of(meta)
        return {key: getattr(inputs, key) for key in self.graph_keys()[1:]}


def _fill_with_last_offset(buffer: torch.Tensor, offsets: torch.Tensor) -> None:
    """vLLM's padding logic for qvl's segment offsets: ``offsets`` then its last value repeated (zero-length
    segments), with no sync."""
    buffer[: offsets.shape[0]].copy_(offsets)
    buffer[offsets.shape[0] :].copy_(offsets[-1:].expand(buffer.shape[0] - offsets.shape[0]))


def _qvl_tower(model: nn.Module) -> QvlTowerForward | None:
    forward = vars(getattr(model, "visual", None) or nn.Module()).get("forward")
    return forward if isinstance(forward, QvlTowerForward) else None


class _QvlEncoderGraphs:
    """vLLM's encoder CUDA-graph protocol (``SupportsEncoderCudaGraph``) on qvl's tower, for the model classes whose
    vLLM base has it: where qvl runs the tower, vLLM's graph manager captures and replays qvl's forward on qvl's
    buffers (:class:`QvlTowerForward`); elsewhere, vLLM's own methods."""

    def get_encoder_cudagraph_config(self):
        config = super().get_encoder_cudagraph_config()
        tower = _qvl_tower(self)
        return config if tower is None else tower.graph_config(config)

    def prepare_encoder_cudagraph_capture_inputs(
        self, token_budget, max_batch_size, max_frames_per_batch, device, dtype, path="default", axis_keys=None
    ):
        tower = _qvl_tower(self)
        if tower is None:
            return super().prepare_encoder_cudagraph_capture_inputs(
                token_budget, max_batch_size, max_frames_per_batch, device, dtype, path, axis_keys
            )
        from vllm.v1.worker.encoder_cudagraph_defs import EncoderCudaGraphCaptureInputs

        # vLLM sizes image batches' offsets by items and videos' by frames.
        slots = max(max_batch_size, max_frames_per_batch or 0)
        return EncoderCudaGraphCaptureInputs(values=tower.capture_values(token_budget, slots))

    def prepare_encoder_cudagraph_replay_buffers(self, mm_kwargs, max_batch_size, max_frames_per_batch, path="default"):
        tower = _qvl_tower(self)
        if tower is None:
            return super().prepare_encoder_cudagraph_replay_buffers(
                mm_kwargs, max_batch_size, max_frames_per_batch, path
            )
        from vllm.v1.worker.encoder_cudagraph_defs import EncoderCudaGraphReplayBuffers

        pixel_values = self._get_pixel_values_by_modality(mm_kwargs)
        return EncoderCudaGraphReplayBuffers(
            tower.replay_values(pixel_values, self._get_grid_thw_by_modality(mm_kwargs))
        )

    def encoder_cudagraph_forward(self, values, path="default"):
        tower = _qvl_tower(self)
        if tower is None:
            return super().encoder_cudagraph_forward(values, path)
        return tower.graph_forward(values)


def _linear_parts(visual: nn.Module, module: nn.Module) -> tuple[Product, torch.Tensor | None]:
    # vLLM's CPU linears keep their weight packed for oneDNN (``module.weight`` is then empty) and some keep a
    # float32 bias: the product goes through the module's own method, the bias is cast to the tower's dtype (a
    # no-op otherwise).
    bias = None if module.bias is None else module.bias.to(visual.dtype)
    return functools.partial(_bias_less_product, module), bias


def _bias_less_product(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module.quant_method.apply(module, x, None)
