"""The Qwen3-VL vision tower on qvl ops.

:class:`VisionTransformer` holds its parameters under transformers' names and shapes
(``patch_embed.proj``, ``pos_embed``, ``blocks.{i}.norm1`` / ``attn.qkv`` / ``attn.proj`` / ``norm2`` /
``mlp.linear_fc1`` / ``mlp.linear_fc2``, ``merger``, ``deepstack_merger_list``), so a transformers
vision state dict loads into it unchanged, and :func:`tower_forward` runs on either module tree: qvl's
own tower or a transformers ``Qwen3VLVisionModel`` patched in place by :mod:`qvl.vit.hf_patch`.

One forward: ``grid_thw`` -> host metadata (:mod:`qvl.vit.metadata`, once) -> device part
(:func:`tower_forward`: patch embed as one matmul, position-embedding interpolation added in place,
``depth`` blocks with fused rotary-in-attention and fused residual+LayerNorm, deepstack mergers, main
merger). The device part reads nothing back to the host, which is what lets :meth:`VisionTransformer.compile`
compile it once for every batch shape.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

import qvl.kernels  # noqa: F401  (registers torch.ops.qvl)

from .config import VisionConfig
from .graphs import TowerGraphs, check_budgets
from .layers import (
    AllReduce,
    Product,
    column_parallel_input,
    embed_patches,
    linear_parts,
    needs_grad,
    patch_merger,
    row_parallel_linear,
    run_blocks,
    vision_mlp,
)
from .metadata import VisionMetadata, build_metadata
from .parallel import LocalWidths, make_parallel

__all__ = ["LinearParts", "TowerBase", "VisionTransformer", "call_compiled", "tower_forward"]

# The last name of the norm modules, whose weights init_random_weights draws around 1.
_NORM_NAMES = frozenset({"norm", "norm1", "norm2", "ln_q"})

# A linear module -> (weight or bias-less product, bias), the arguments the layer functions take for it.
LinearParts = Callable[[nn.Module], tuple[torch.Tensor | Product, torch.Tensor]]


class _Attention(nn.Module):
    def __init__(self, hidden: int, qkv_out: int, proj_in: int):
        super().__init__()
        self.qkv = nn.Linear(hidden, qkv_out)
        self.proj = nn.Linear(proj_in, hidden)


class _MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.linear_fc1 = nn.Linear(hidden, intermediate)
        self.linear_fc2 = nn.Linear(intermediate, hidden)


class _Block(nn.Module):
    def __init__(self, config: VisionConfig, widths: LocalWidths):
        super().__init__()
        local_width = widths.num_heads * config.head_dim
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attn = _Attention(config.hidden_size, 3 * local_width, local_width)
        self.mlp = _MLP(config.hidden_size, widths.intermediate_size)


class _Merger(nn.Module):
    def __init__(self, config: VisionConfig, postshuffle_norm: bool, widths: LocalWidths):
        super().__init__()
        merged_width = config.merged_width
        self.norm = nn.LayerNorm(merged_width if postshuffle_norm else config.hidden_size, eps=config.layer_norm_eps)
        self.linear_fc1 = nn.Linear(merged_width, widths.merged_width)
        self.linear_fc2 = nn.Linear(widths.merged_width, config.out_hidden_size)


class _PatchEmbed(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel_size=kernel, stride=kernel, bias=True)


def tower_forward(
    tower: nn.Module,
    pixel_values: torch.Tensor,
    cu_seqlens: torch.Tensor,
    positions: torch.Tensor,
    interp_indices: torch.Tensor,
    interp_weights: torch.Tensor,
    *,
    num_heads: int,
    rope_theta: float,
    deepstack_visual_indexes: Sequence[int],
    spatial_merge_size: int,
    all_reduce: AllReduce | None = None,
    hidden_states_out: list[torch.Tensor] | None = None,
    linear: LinearParts | None = None,
    checkpoint_blocks: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The device part of the tower's forward over a module tree with transformers' names.

    Args:
        tower: qvl's :class:`VisionTransformer` or a transformers ``Qwen3VLVisionModel``.
        pixel_values: ``(T, in_channels * temporal_patch_size * patch_size**2)`` patches in merge-block
            order (the processor's output).
        cu_seqlens, positions, interp_indices, interp_weights: from :func:`build_metadata`, on the device.
        num_heads: heads held by this module tree (all of them, or this rank's share under tensor
            parallelism, where ``all_reduce`` sums the row-parallel partial products over the ranks).
        hidden_states_out: a list that receives the residual stream as transformers' ``output_hidden_states``
            records it: the embedded patches (the first block's input), then each block's output, ``depth + 1``
            tensors ``(T, C)``, the last one ``last_hidden_state`` itself. None (the default) records nothing.
        linear: maps each linear module (qkv, proj, fc1, fc2) to its ``(weight, bias)`` as the layer functions
            take them (:mod:`qvl.vit.layers`); the weight may be a :data:`~qvl.vit.layers.Product`. None (the
            default) is :func:`~qvl.vit.layers.linear_parts`: a plain ``nn.Linear``'s weight and bias, any other
            module in its place (a PEFT LoRA adapter) called.
        checkpoint_blocks: run each block under activation checkpointing (recomputed in backward), as
            transformers' ``gradient_checkpointing_enable()`` does.

    Forward and backward: every op has a backward, and the in-place ones give way to out-of-place forms where
    autograd records them.

    Returns ``(last_hidden_state (T, C), merged (T / m^2, out_hidden), deepstack list)``.
    """
    x = embed_patches(tower.patch_embed.proj, pixel_values)
    pos_embed = tower.pos_embed.weight
    if needs_grad(x, pos_embed):
        x = x + torch.ops.qvl.pos_embed_interp(pos_embed, interp_indices, interp_weights).to(x.dtype)
    else:
        torch.ops.qvl.pos_embed_interp_add_(x, pos_embed, interp_indices, interp_weights)

    num_tokens = x.shape[0]
    blocks = tower.blocks
    first = blocks[0].norm1
    h = torch.ops.qvl.layer_norm(x, first.weight, first.bias, first.eps)
    linear = linear or linear_parts
    # A recorded hidden state whose gradient autograd may be asked for (retain_grad) must be what the next block
    # reads: the fused residual add + norm would hand that block a normed copy computed beside it instead.
    separate_states = hidden_states_out is not None and torch.is_grad_enabled()

    def block_step(index: int, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        block = blocks[index]
        attn = block.attn
        qkv = row_parallel_linear(column_parallel_input(h, all_reduce), *linear(attn.qkv), None)
        q, k, v = qkv.view(num_tokens, 3, num_heads, qkv.shape[1] // (3 * num_heads)).unbind(1)
        a = torch.ops.qvl.vision_attn(q, k, v, cu_seqlens, positions=positions, rope_theta=rope_theta)
        a = row_parallel_linear(a.flatten(1), *linear(attn.proj), all_reduce)
        x, h = torch.ops.qvl.add_layer_norm(x, a, block.norm2.weight, block.norm2.bias, block.norm2.eps)
        mlp = block.mlp
        m = vision_mlp(h, *linear(mlp.linear_fc1), *linear(mlp.linear_fc2), all_reduce)
        if index + 1 == len(blocks):
            return x + m, None
        norm = blocks[index + 1].norm1
        if separate_states:
            x = x + m
            return x, torch.ops.qvl.layer_norm(x, norm.weight, norm.bias, norm.eps)
        return torch.ops.qvl.add_layer_norm(x, m, norm.weight, norm.bias, norm.eps)

    deepstack = []
    # int(): under torch.compile(dynamic=True) ints read from a plain object (a config) may arrive symbolic,
    # and Dynamo then took ``index in (symbolic ints)`` for False and dropped the deepstack features; int()
    # makes it specialize them (one guard) instead.
    deepstack_mergers = {int(layer): n for n, layer in enumerate(deepstack_visual_indexes)}

    def after_block(index: int, x: torch.Tensor) -> None:
        if index in deepstack_mergers:
            merger = tower.deepstack_merger_list[deepstack_mergers[index]]
            deepstack.append(_merge(merger, x, spatial_merge_size, True, all_reduce, linear))

    x = run_blocks(len(blocks), x, h, block_step, after_block, checkpoint_blocks, hidden_states_out)
    merged = _merge(tower.merger, x, spatial_merge_size, False, all_reduce, linear)
    return x, merged, deepstack


# Qwen3-Omni's vision encoder names its mergers' parts (merger_list.{i} | merger).(ln_q | mlp.0 | mlp.2).
_OMNI_MERGER_NAME = re.compile(r"^(merger_list\.\d+|merger)\.(ln_q|mlp\.0|mlp\.2)\.")
_QWEN3_VL_MERGER_PART = {"ln_q": "norm", "mlp.0": "linear_fc1", "mlp.2": "linear_fc2"}


def _qwen3_vl_merger_name(match: re.Match) -> str:
    merger = match.group(1).replace("merger_list", "deepstack_merger_list")
    return f"{merger}.{_QWEN3_VL_MERGER_PART[match.group(2)]}."


def call_compiled(compiled, *args: torch.Tensor):
    """Call a tower's compiled device part so that every batch reuses one graph: each argument's first
    (token) dim marked dynamic, and the first argument (pixel values) made a fresh tensor when it is a view
    with an offset (Dynamo guards on a view's storage offset)."""
    if args[0].storage_offset() != 0:
        args = (args[0].clone(),) + args[1:]
    for tensor in args:
        torch._dynamo.mark_dynamic(tensor, 0)
    # Float attributes (norm eps, rope theta) stay constants: as symbolic floats they make a training graph's
    # scalar pass restart the whole trace.
    with _size_oblivious_tracing(), torch._dynamo.config.patch(specialize_float=True):
        return compiled(*args)


def _size_oblivious_tracing() -> contextlib.AbstractContextManager:
    """Trace with token counts of 1 left unspecialized (one 2x2 image has one merged token), so no batch
    shape triggers a recompile. The switch lives in a private torch module: without it, a count of 1 costs
    one extra compile and nothing else."""
    try:
        from torch.fx.experimental import _config as fx_config

        return fx_config.patch(backed_size_oblivious=True)
    except (ImportError, AttributeError):
        return contextlib.nullcontext()


def merger_parts(merger: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module]:
    """``(norm, fc1, fc2)`` of a patch merger under either family's names: Qwen3-VL's and Qwen3.5's
    (``norm``, ``linear_fc1``, ``linear_fc2``) or Qwen3-Omni's (``ln_q``, ``mlp[0]``, ``mlp[2]``, the GELU
    between them)."""
    if hasattr(merger, "ln_q"):
        return merger.ln_q, merger.mlp[0], merger.mlp[2]
    return merger.norm, merger.linear_fc1, merger.linear_fc2


def _merge(
    merger: nn.Module, x, spatial_merge_size: int, postshuffle_norm: bool, all_reduce, linear: LinearParts
) -> torch.Tensor:
    norm, fc1, fc2 = merger_parts(merger)
    return patch_merger(
        x,
        norm.weight,
        norm.bias,
        *linear(fc1),
        *linear(fc2),
        spatial_merge_size=spatial_merge_size,
        postshuffle_norm=postshuffle_norm,
        eps=norm.eps,
        all_reduce=all_reduce,
    )


class TowerBase(nn.Module):
    """What qvl's tower classes share: the parallel strategy, weight loading, the host/device split of a forward
    and compilation.

    A subclass sets ``config_class`` (a config dataclass with ``from_hf(hf_config)`` and ``from_dict(dict)``),
    builds its parameters under transformers' names after ``super().__init__``, and defines :meth:`metadata`
    (host part of a batch), :meth:`_device_inputs` (the metadata's tensors the device part takes) and
    :meth:`_device_forward` (the device part: tensors in, ``(merged, deepstack list)`` out).

    ``tower(pixel_values, grid_thw)`` returns ``(merged, deepstack)``: the main merger's output
    ``(sum(t*h*w) / m^2, out_hidden_size)`` and the list of deepstack mergers' outputs of the same shape (empty
    for towers without them). ``parallel="weights"`` or ``"data"`` runs one tower over the processes of ``group``
    (default: the world), each rank calling it with the same batch and getting the whole batch's outputs; see
    :mod:`qvl.vit.parallel`. ``None``: a single-process tower.

    :meth:`capture` prepares CUDA graphs of the device part for token budgets (:mod:`qvl.vit.graphs`).
    """

    config_class: type

    def __init__(self, config, *, parallel: str | None = None, group=None):
        super().__init__()
        self.config = config
        self._compiled_forward = None
        self._graphs: TowerGraphs | None = None
        self._parallel = make_parallel(parallel, config, group, caller=type(self).__name__)
        self.num_local_heads = self._parallel.local_widths().num_heads

    @property
    def parallel(self) -> str | None:
        """The parallel mode this tower runs in: ``"weights"``, ``"data"`` or None (one process)."""
        return self._parallel.mode

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.proj.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.patch_embed.proj.weight.device

    def init_random_weights(self, seed: int = 0):
        """Deterministic random weights (for tests, benchmarks and the embedded default model); returns the tower."""
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in self.named_parameters():
                module_name, _, kind = name.rpartition(".")
                if kind == "weight" and module_name.rpartition(".")[2] in _NORM_NAMES:
                    values = 1.0 + 0.1 * torch.randn(param.shape, generator=generator)
                elif kind == "bias":
                    values = 0.02 * torch.randn(param.shape, generator=generator)
                else:
                    fan_in = param[0].numel() if param.dim() > 1 else 1
                    values = torch.randn(param.shape, generator=generator) * fan_in**-0.5
                param.copy_(values.to(param.dtype))
        return self

    @classmethod
    def from_hf(cls, vision_module: nn.Module, **kwargs):
        """A tower with a copy of a transformers vision model's weights (``parallel`` and ``group`` as for the
        constructor)."""
        config = cls.config_class.from_hf(vision_module.config)
        weight = vision_module.patch_embed.proj.weight
        tower = cls(config, dtype=weight.dtype, device=weight.device, **kwargs)
        tower.load_full_state_dict(vision_module.state_dict())
        return tower

    @classmethod
    def from_pretrained(cls, path, *, dtype: torch.dtype | None = None, device=None, **kwargs):
        """Load from a local checkpoint directory (config.json + safetensors, transformers' names); ``dtype``
        defaults to the checkpoint's."""
        from .checkpoint import load_vision_checkpoint

        config, state_dict = load_vision_checkpoint(path)
        dtype = dtype or next(iter(state_dict.values())).dtype
        tower = cls(cls.config_class.from_dict(config), dtype=dtype, device=device, **kwargs)
        tower.load_full_state_dict(state_dict)
        return tower

    def _canonical_names(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A whole tower's state dict under this class's own names (other checkpoints' names mapped)."""
        return state_dict

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load a whole (unsharded) tower's weights with transformers' names; extra keys are ignored. Under
        ``parallel="weights"`` each rank keeps its own part."""
        name = type(self).__name__
        state_dict = self._canonical_names(state_dict)
        own = self.state_dict()
        state_dict = self._parallel.local_state_dict(state_dict, {key: t.shape for key, t in own.items()})
        missing = [key for key in own if key not in state_dict]
        if missing:
            raise ValueError(f"{name}: the weights lack {len(missing)} tensors, e.g. {missing[:3]}")
        with torch.no_grad():
            for key, target in own.items():
                source = state_dict[key]
                if source.shape != target.shape:
                    raise ValueError(f"{name}: {key} has shape {tuple(source.shape)}, expected {tuple(target.shape)}")
                target.copy_(source)

    def metadata(self, grid_thw):
        """Host-side metadata of a batch (``grid_thw``: CPU tensor, numpy array or list of (t, h, w)), on this
        tower's device."""
        raise NotImplementedError

    def _device_inputs(self, meta) -> tuple:
        """The metadata tensors :meth:`_device_forward` takes after the pixel values."""
        raise NotImplementedError

    def _device_forward(self, pixel_values: torch.Tensor, *inputs) -> tuple[torch.Tensor, list[torch.Tensor]]:
        raise NotImplementedError

    def encode(self, pixel_values: torch.Tensor, meta) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The device part for a batch whose metadata is already built (in data mode only ``meta.grid_thw``
        is used: each rank builds its own share's metadata)."""
        if self._parallel.mode == "data":
            return self.forward(pixel_values, meta.grid_thw)

        def encode_local(pixels, grid):
            captured = self._encode_captured(pixels, grid)
            return self._encode_local(pixels, meta) if captured is None else captured

        return self._parallel.run(pixel_values, meta.grid_thw, encode_local, self.device)

    def _check_pixels(self, pixel_values: torch.Tensor, num_tokens: int) -> None:
        expected = (num_tokens, self.config.patch_dim)
        if tuple(pixel_values.shape) != expected:
            raise ValueError(
                f"{type(self).__name__}: pixel_values must have shape {expected}, got {tuple(pixel_values.shape)}"
            )

    def _encode_local(self, pixel_values: torch.Tensor, meta) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``encode`` of this process's own part of a batch, without checking that other ranks agree on it."""
        self._check_pixels(pixel_values, meta.num_tokens)
        if meta.num_tokens == 0:
            empty = torch.empty(0, self.config.out_hidden_size, dtype=self.dtype, device=self.device)
            return empty, [empty.clone() for _ in self.config.deepstack_visual_indexes]
        return self._run_device(pixel_values.to(self.device), *self._device_inputs(meta))

    def _run_device(self, pixel_values: torch.Tensor, *inputs: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The device part on device tensors: compiled after :meth:`compile`, else eager."""
        if self._compiled_forward is None:
            return self._device_forward(pixel_values, *inputs)
        return call_compiled(self._compiled_forward, pixel_values, *inputs)

    def _encode_captured(self, pixel_values: torch.Tensor, grid: np.ndarray):
        """``(merged, deepstack)`` through the captured budgets (:meth:`capture`), or None where they do not
        serve this batch (none captured, none fits, an empty batch, a forward autograd would record)."""
        if self._graphs is None:
            return None
        self._check_pixels(pixel_values, int(np.prod(grid, axis=1).sum()))
        return self._graphs.encode(self, pixel_values, grid)

    def forward(self, pixel_values: torch.Tensor, grid_thw) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Encode a batch: ``pixel_values (T, C*t*p*p)`` with ``grid_thw (N, 3)`` (CPU tensor or list)."""
        return self._parallel.run(pixel_values, grid_thw, self._encode_grid, self.device)

    def _encode_grid(self, pixel_values: torch.Tensor, grid: np.ndarray) -> tuple[torch.Tensor, list[torch.Tensor]]:
        captured = self._encode_captured(pixel_values, grid)
        return self._encode_local(pixel_values, self.metadata(grid)) if captured is None else captured

    def capture(self, token_budgets: Sequence[int], max_segments: int | None = None):
        """Prepare the device part for batches of up to each of ``token_budgets`` tokens, in place, and return the
        tower itself (as :meth:`compile` does; call :meth:`compile` first to capture compiled code).

        Afterwards, a batch (``forward`` / ``encode``) of T > 0 tokens in S frames is padded on the host to the
        smallest budget B >= T whose segment slots hold its frames and pad frames (:mod:`qvl.vit.graphs`:
        zero pixel values in extra frames that attend only to themselves, segment offsets extended to a fixed
        length) and its outputs are cut back to the real merged tokens: the unpadded batch's features (up to the
        rounding a GEMM's row count may change: BLAS libraries pick kernels by shape). On CUDA
        each budget is one ``torch.cuda.CUDAGraph``, captured here (after two warm-up runs) on static buffers of
        exactly B tokens and replayed with no device-to-host sync; the outputs are new tensors (the next replay
        overwrites the graph's own). On other devices the padded batch runs through the normal forward, the
        same padding without graphs (what the CPU tests exercise).

        Batches larger than every budget, with more frames than the slots, empty ones, and forwards autograd would
        record (grad mode on and pixel values or a parameter requiring grad: a replay records nothing) take the
        normal path. Calling ``capture`` again replaces the budgets; moving or casting the tower afterwards makes
        the next forward raise until ``capture`` runs again (the graphs read the old weights' memory).

        Args:
            token_budgets: ints >= 1, each a multiple of ``spatial_merge_size**2`` (the pad is whole merge
                blocks); order and repeats do not matter.
            max_segments: segment slots of every budget (real and pad frames together; capped at
                ``budget // spatial_merge_size**2``). None (the default): that cap, which every batch of the
                budget fits; fewer slots make the attention grid smaller and send batches of many frames to the
                normal path.

        ``parallel="data"``: each rank pads and replays its own share (the gather stays outside the graph).
        ``parallel="weights"`` raises ValueError: the all-reduces inside the forward would have to be captured
        and replayed in lockstep on every rank, which qvl does not do. Bad arguments raise TypeError /
        ValueError naming them.
        """
        name = f"{type(self).__name__}.capture"
        if self._parallel.mode == "weights":
            raise ValueError(
                f"{name}: parallel='weights' is not supported (its all-reduces would run inside the graphs); "
                f"use parallel='data' or None"
            )
        budgets = check_budgets(token_budgets, self.config.spatial_merge_size, max_segments, caller=name)
        self._graphs = None  # the old graphs' memory goes before the new ones are captured
        self._graphs = TowerGraphs(self, budgets, max_segments)
        return self

    @property
    def captured_budgets(self) -> tuple[int, ...]:
        """The token budgets of :meth:`capture`, ascending (empty before it)."""
        return () if self._graphs is None else self._graphs.budgets

    def compile(self, **compile_kwargs):
        """Compile the device part of the forward (not the host metadata) with the token dim dynamic, in
        place, and return the tower itself (so ``tower = VisionTransformer(...).compile()`` reads naturally;
        unlike ``nn.Module.compile``, which returns None).

        After the first call, batches with other image counts, sizes and videos reuse the compiled code.
        That relies on torch's size-oblivious tracing switch (``torch.fx.experimental._config``, a private
        module); on a torch without it, a batch whose token count is 1 compiles once more (a single 2x2
        image has one merged token), and nothing else changes. Extra keyword arguments go to
        ``torch.compile`` (``fullgraph=True, dynamic=True`` by default).
        """
        options = {"fullgraph": True, "dynamic": True, **compile_kwargs}
        self._compiled_forward = torch.compile(self._device_forward, **options)
        return self


class VisionTransformer(TowerBase):
    """A Qwen3-VL vision encoder on qvl kernels (also Qwen3.5's, their MoE variants' and Qwen3-Omni's, whose
    towers are the same modules).

    ``tower(pixel_values, grid_thw)`` returns ``(merged, deepstack)``: the main merger's output
    ``(sum(t*h*w) / m^2, out_hidden_size)`` and the list of deepstack mergers' outputs of the same
    shape, equal to transformers' ``pooler_output`` and ``deepstack_features``.

    Build it from a :class:`VisionConfig`, from a transformers vision module (:meth:`from_hf`, which
    copies its weights), or from a local checkpoint directory (:meth:`from_pretrained`).

    ``parallel="weights"`` or ``"data"`` (all three constructors) runs one tower over the processes of
    ``group`` (default: the world), each rank calling it with the same batch and getting the whole
    batch's outputs; see :mod:`qvl.vit.parallel`. ``None``: a single-process tower.
    """

    config_class = VisionConfig

    def __init__(
        self,
        config: VisionConfig,
        *,
        dtype: torch.dtype | None = None,
        device=None,
        parallel: str | None = None,
        group=None,
    ):
        super().__init__(config, parallel=parallel, group=group)
        widths = self._parallel.local_widths()
        self.patch_embed = _PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(_Block(config, widths) for _ in range(config.depth))
        self.merger = _Merger(config, False, widths)
        self.deepstack_merger_list = nn.ModuleList(
            _Merger(config, True, widths) for _ in config.deepstack_visual_indexes
        )
        if dtype is not None or device is not None:
            self.to(dtype=dtype, device=device)

    def _canonical_names(self, state_dict):
        """Qwen3-Omni's merger names (``merger_list``, ``ln_q``, ``mlp.0``, ``mlp.2``) become Qwen3-VL's."""
        return {_OMNI_MERGER_NAME.sub(_qwen3_vl_merger_name, name): t for name, t in state_dict.items()}

    def metadata(self, grid_thw) -> VisionMetadata:
        return build_metadata(
            grid_thw,
            spatial_merge_size=self.config.spatial_merge_size,
            num_grid_per_side=self.config.num_grid_per_side,
            device=self.device,
        )

    def _device_inputs(self, meta: VisionMetadata) -> tuple[torch.Tensor, ...]:
        return meta.cu_seqlens, meta.positions, meta.interp_indices, meta.interp_weights

    def _device_forward(self, pixel_values, cu_seqlens, positions, interp_indices, interp_weights):
        _, merged, deepstack = tower_forward(
            self,
            pixel_values,
            cu_seqlens,
            positions,
            interp_indices,
            interp_weights,
            num_heads=self.num_local_heads,
            rope_theta=self.config.rope_theta,
            deepstack_visual_indexes=self.config.deepstack_visual_indexes,
            spatial_merge_size=self.config.spatial_merge_size,
            all_reduce=self._parallel.all_reduce,
        )
        return merged, deepstack
