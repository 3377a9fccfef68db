"""The Qwen3-VL vision tower on qvl ops, and what qvl's tower classes share.

:class:`VisionTransformer` holds its parameters under transformers' names and shapes
(``patch_embed.proj``, ``pos_embed``, ``blocks.{i}.norm1`` / ``attn.qkv`` / ``attn.proj`` / ``norm2`` /
``mlp.linear_fc1`` / ``mlp.linear_fc2``, ``merger``, ``deepstack_merger_list``), so a transformers
vision state dict loads into it unchanged (other families' names, e.g. Qwen3-Omni's mergers, are mapped on load).

One forward: ``grid_thw`` -> host metadata (once) -> device part, both by the tower runner
(:mod:`qvl.vit.runner`, which also runs transformers' and vLLM's module trees): patch embed as one matmul,
position-embedding interpolation added in place, ``depth`` blocks with fused rotary-in-attention and fused
residual+LayerNorm, deepstack mergers, main merger. The device part reads nothing back to the host, which is
what lets :meth:`TowerBase.compile` compile it once for every batch shape.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

import torch
from torch import nn

from .config import TowerConfig, VisionConfig
from .families import QWEN3_VL_NAMES, Family, ModuleNames, config_from_dict, config_from_hf
from .metadata import VisionMetadata
from .parallel import LocalWidths, make_parallel
from .runner import TowerRunner

__all__ = ["TowerBase", "VisionTransformer"]

# The last name of the norm modules, whose weights init_random_weights draws around 1.
_NORM_NAMES = frozenset({"norm", "norm1", "norm2", "ln_q"})


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


class TowerBase(nn.Module):
    """What qvl's tower classes share: the parallel strategy, weight loading, the tower runner over the tower's own
    modules (host metadata and device forward, :mod:`qvl.vit.runner`), CUDA graphs and compilation.

    A subclass sets ``config_class`` (a config dataclass with ``from_dict``), builds its parameters under
    transformers' names after ``super().__init__`` and says where its MLP and merger parts live (:attr:`names`).

    ``tower(pixel_values, grid_thw)`` returns ``(merged, deepstack)``: the main merger's output
    ``(sum(t*h*w) / m^2, out_hidden_size)`` and the list of deepstack mergers' outputs of the same shape (empty
    for towers without them). ``parallel="weights"`` or ``"data"`` runs one tower over the processes of ``group``
    (default: the world), each rank calling it with the same batch and getting the whole batch's outputs; see
    :mod:`qvl.vit.parallel`. ``None``: a single-process tower.

    :meth:`capture` prepares CUDA graphs of the device part for token budgets (:mod:`qvl.vit.graphs`).
    """

    config_class: type

    def __init__(self, config: TowerConfig, *, parallel: str | None = None, group=None):
        super().__init__()
        self.config = config
        self._parallel = make_parallel(parallel, config, group, caller=type(self).__name__)
        self.num_local_heads = self._parallel.local_widths().num_heads
        self._runner = TowerRunner(
            self,
            config,
            self.names,
            num_heads=self.num_local_heads,
            all_reduce=self._parallel.all_reduce,
            name=type(self).__name__,
        )

    @property
    def names(self) -> ModuleNames:
        """Where this tower keeps its MLP and merger parts."""
        raise NotImplementedError

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
        family, config = config_from_hf(vision_module.config)
        cls._check_family(family)
        weight = vision_module.patch_embed.proj.weight
        tower = cls(config, dtype=weight.dtype, device=weight.device, **kwargs)
        tower.load_full_state_dict(vision_module.state_dict(), family.names)
        return tower

    @classmethod
    def from_pretrained(cls, path, *, dtype: torch.dtype | None = None, device=None, **kwargs):
        """Load from a local checkpoint directory (config.json + safetensors, transformers' names); ``dtype``
        defaults to the checkpoint's."""
        from .checkpoint import load_vision_checkpoint

        values, state_dict = load_vision_checkpoint(path)
        family, config = config_from_dict(values)
        cls._check_family(family)
        dtype = dtype or next(iter(state_dict.values())).dtype
        tower = cls(config, dtype=dtype, device=device, **kwargs)
        tower.load_full_state_dict(state_dict, family.names)
        return tower

    @classmethod
    def _check_family(cls, family: Family) -> None:
        if family.config_class is not cls.config_class:
            raise ValueError(
                f"{cls.__name__} does not run {family.name}'s tower; qvl.vit.load_tower / tower_from_hf pick the class"
            )

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor], names: ModuleNames | None = None) -> None:
        """Load a whole (unsharded) tower's weights with transformers' names (``names``: where that checkpoint's
        family keeps its MLP and merger parts, default this tower's own); extra keys are ignored. Under
        ``parallel="weights"`` each rank keeps its own part."""
        name = type(self).__name__
        if names is not None and names != self.names:
            state_dict = {_renamed(key, names, self.names): tensor for key, tensor in state_dict.items()}
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

    def metadata(self, grid_thw) -> VisionMetadata:
        """Host-side metadata of a batch (``grid_thw``: CPU tensor, numpy array or list of (t, h, w)), on this
        tower's device."""
        return self._runner.metadata(grid_thw)

    def encode(self, pixel_values: torch.Tensor, meta) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The device part for a batch whose metadata is already built (in data mode only ``meta.grid_thw``
        is used: each rank builds its own share's metadata)."""
        if self._parallel.mode == "data":
            return self.forward(pixel_values, meta.grid_thw)
        encode = functools.partial(self._runner.encode_grid, meta=meta)
        return self._parallel.run(pixel_values, meta.grid_thw, encode, self.device)

    def forward(self, pixel_values: torch.Tensor, grid_thw) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Encode a batch: ``pixel_values (T, C*t*p*p)`` with ``grid_thw (N, 3)`` (CPU tensor or list)."""
        return self._parallel.run(pixel_values, grid_thw, self._runner.encode_grid, self.device)

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
        normal path. Calling ``capture`` again replaces the budgets; moving or casting the tower afterwards, or
        loading weights into new storage (``load_state_dict(..., assign=True)``), makes the next forward raise
        until ``capture`` runs again (the graphs read the old weights' memory; the check compares the storage of
        the patch embedding's, the last block's and the merger's first weights). Weights copied in place
        (``load_state_dict`` without ``assign``) keep their storage, and the graphs read the new values.

        Args:
            token_budgets: ints >= 1, each a multiple of ``spatial_merge_size**2`` (the pad is whole merge
                blocks); order and repeats do not matter.
            max_segments: segment slots of every budget (real and pad frames together; capped at
                ``budget // spatial_merge_size**2``, the most frames a batch of the budget can hold). None (the
                default): one slot per :data:`~qvl.vit.graphs.PAD_FRAME_UNITS` merge blocks plus
                :data:`~qvl.vit.graphs.SMALL_FRAME_SLOTS` (:func:`~qvl.vit.graphs.segment_slots`), which every
                batch of frames of at least 16 merge blocks fits. Each slot is one attention program per head
                and block: more slots serve batches of many tiny frames at the cost of every replay; batches
                with more frames than the slots take the normal path.

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
        self._runner.capture(token_budgets, max_segments, caller=name)
        return self

    @property
    def captured_budgets(self) -> tuple[int, ...]:
        """The token budgets of :meth:`capture`, ascending (empty before it)."""
        return self._runner.captured_budgets

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
        self._runner.compile(**compile_kwargs)
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

    @property
    def names(self) -> ModuleNames:
        return QWEN3_VL_NAMES


def _renamed(key: str, source: ModuleNames, target: ModuleNames) -> str:
    """A parameter name of a tower with ``source``'s module names under ``target``'s (e.g. Qwen3-Omni's
    ``merger_list.0.ln_q.weight`` as Qwen3-VL's ``deepstack_merger_list.0.norm.weight``)."""
    match = re.match(rf"(merger|{re.escape(source.deepstack_mergers)}\.\d+)\.(.+)$", key)
    if match is not None:
        module, rest = match.groups()
        module = module.replace(source.deepstack_mergers, target.deepstack_mergers, 1)
        parts = zip(
            (source.merger_norm, source.merger_fc1, source.merger_fc2),
            (target.merger_norm, target.merger_fc1, target.merger_fc2),
        )
        return f"{module}.{_replace_prefix(rest, parts)}"
    match = re.match(r"(blocks\.\d+\.mlp)\.(.+)$", key)
    if match is not None and len(source.mlp_in) == len(target.mlp_in):
        parts = zip((*source.mlp_in, source.mlp_out), (*target.mlp_in, target.mlp_out))
        return f"{match.group(1)}.{_replace_prefix(match.group(2), parts)}"
    return key


def _replace_prefix(name: str, pairs) -> str:
    for old, new in pairs:
        if name.startswith(old + "."):
            return new + name[len(old) :]
    return name
