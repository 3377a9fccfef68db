"""Token-budget CUDA graphs of a tower's device forward (:meth:`qvl.vit.runner.TowerRunner.capture`, behind
:meth:`qvl.vit.model.TowerBase.capture`, ``patch_model(..., token_budgets=...)`` and the engines' tower routes).

A CUDA graph replays fixed kernels on fixed buffers, so every tensor the device forward reads must have a shape
that does not depend on the batch. A batch of T tokens is padded on the host to exactly ``budget`` tokens:

* the ``budget - T`` pad tokens form extra frames appended to ``grid_thw`` (``(n, m, m * k)`` entries, m the
  merge size), so the tower's own metadata builder gives them valid rotary positions, interpolation entries and
  (Qwen2.5-VL) windows. Each frame is its own attention segment: pad tokens attend to pad tokens of their frame
  only and never reach a real token, since attention is per segment and every other op is per token or per
  merge block (the pad is whole merge blocks). Pad frames hold at most :data:`PAD_FRAME_UNITS` merge blocks
  while the segment slots allow, so the pad's attention costs a few tiles per frame, not ``(budget - T)**2``;
* the attention's tile hint is the budget (no segment of a padded batch is longer);
* the segment offsets (``cu_seqlens``; Qwen2.5-VL's ``cu_window_seqlens``) are extended to a fixed number of
  slots by repeating their last offset (zero-length segments, which every op allows);
* the pixel values of the pad tokens are zeros.

The device forward then sees the same shapes for every batch of a budget, and its outputs, sliced to the real
merged tokens (the pad frames come last, in every tower's output order), are the unpadded batch's: the same
computation on every real token, rounded alike except where a GEMM's kernel choice depends on its row count.

On CUDA :class:`TowerGraphs` captures one ``torch.cuda.CUDAGraph`` per budget; on any other device it keeps the
budgets and runs the padded batch through the normal (eager or compiled) device forward, which is what the CPU
tests exercise: the padding is the same code on every device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .layers import needs_grad
from .metadata import DeviceInputs, check_grid, check_int, grid_as_numpy

__all__ = [
    "PAD_FRAME_UNITS",
    "SMALL_FRAME_SLOTS",
    "PaddedBatch",
    "TowerGraphs",
    "check_budgets",
    "cover_pad_rows",
    "pad_batch",
    "pad_grid",
    "pad_offsets",
    "pad_pixels",
    "segment_slots",
]

# The most merge blocks one pad frame holds while segment slots are free: 64 tokens at merge size 2, one
# attention tile, so the pad's attention work grows linearly with the pad.
PAD_FRAME_UNITS = 16
# Segment slots a budget has by default beyond one per PAD_FRAME_UNITS merge blocks: room for that many frames
# smaller than a pad frame. Every slot is one program per head in each attention launch (a zero-length segment's
# program still searches the offsets), so the default stays near the budget's own tile count rather than at the
# most frames a budget could hold (one per merge block), which made a replayed 16,384-token batch launch ~4,100
# programs per head where ~130 do the work.
SMALL_FRAME_SLOTS = 16
# Eager runs before a capture: the first compiles (torch.compile, Triton) and settles the caching allocator.
_WARMUP_RUNS = 2


def _check_budget(caller: str, name: str, budget: object, spatial_merge_size: int) -> int:
    budget = check_int(caller, name, budget)
    block = spatial_merge_size**2
    if budget % block:
        raise ValueError(
            f"{caller}: {name} = {budget} must be a multiple of spatial_merge_size**2 = {block} (the pad must be "
            f"whole merge blocks)"
        )
    if budget >= 2**31:
        raise ValueError(f"{caller}: {name} = {budget} must be below 2**31 (qvl indexes tokens with int32)")
    return budget


def check_budgets(
    token_budgets: Sequence[int], spatial_merge_size: int, max_segments: int | None, caller: str = "capture"
) -> tuple[int, ...]:
    """``token_budgets`` sorted and without repeats, once each is an int >= 1, a multiple of
    ``spatial_merge_size**2`` and below 2**31, and ``max_segments`` is None or an int >= 1; raises
    TypeError / ValueError naming the argument (and the offending entry) otherwise."""
    if isinstance(token_budgets, (str, bytes)) or not isinstance(token_budgets, Sequence):
        raise TypeError(f"{caller}: token_budgets must be a sequence of ints, got {type(token_budgets).__name__}")
    if not token_budgets:
        raise ValueError(f"{caller}: token_budgets must hold at least one budget")
    budgets = {_check_budget(caller, f"token_budgets[{i}]", b, spatial_merge_size) for i, b in enumerate(token_budgets)}
    if max_segments is not None:
        check_int(caller, "max_segments", max_segments)
    return tuple(sorted(budgets))


def segment_slots(budget: int, spatial_merge_size: int, max_segments: int | None) -> int:
    """The segments (frames, pad frames included) a padded batch of ``budget`` tokens may hold: ``max_segments``,
    capped at ``budget // spatial_merge_size**2``, the most any such batch has (every frame holds at least one
    merge block). The default (None): one slot per :data:`PAD_FRAME_UNITS` merge blocks plus
    :data:`SMALL_FRAME_SLOTS`, under the same cap: every batch whose frames hold at least ``PAD_FRAME_UNITS``
    merge blocks each (64 tokens at merge size 2; Qwen3-VL's processors make none smaller) fits with its pad
    frames, and so do up to ``SMALL_FRAME_SLOTS`` smaller ones."""
    most = budget // spatial_merge_size**2
    if max_segments is None:
        return min(most, most // PAD_FRAME_UNITS + SMALL_FRAME_SLOTS)
    return min(max_segments, most)


def pad_grid(grid: np.ndarray, budget: int, spatial_merge_size: int, num_segments: int) -> np.ndarray | None:
    """``grid`` (a checked int64 ``(N, 3)`` array, :func:`~qvl.vit.metadata.grid_as_numpy`) followed by the pad
    frames that make it exactly ``budget`` tokens in at most ``num_segments`` frames, or None when the batch does
    not fit (more tokens than ``budget``, or no frame left for a needed pad).

    The pad's ``U = (budget - T) / m**2`` merge blocks are spread over ``min(ceil(U / PAD_FRAME_UNITS), free
    slots)`` frames of ``m`` rows, their sizes differing by at most one block: at most two entries
    ``(count, m, m * blocks)``. ``budget`` must be a multiple of ``m**2`` (the grid's token count is one by
    :func:`~qvl.vit.metadata.check_grid`)."""
    merge = spatial_merge_size
    tokens = int(np.prod(grid, axis=1).sum())
    frames = int(grid[:, 0].sum())
    if tokens > budget or frames > num_segments:
        return None
    units = (budget - tokens) // (merge * merge)
    if units == 0:
        return grid
    free = num_segments - frames
    if free == 0:
        return None
    count = min(-(-units // PAD_FRAME_UNITS), free)
    blocks, larger = divmod(units, count)
    pad = [(larger, merge, merge * (blocks + 1)), (count - larger, merge, merge * blocks)]
    return np.concatenate([grid, np.array([row for row in pad if row[0]], dtype=np.int64)])


def pad_offsets(offsets: torch.Tensor, length: int) -> torch.Tensor:
    """``offsets`` ``(S + 1,)`` extended to ``(length,)`` by repeating its last value (zero-length segments),
    on its own device and without reading its values (no sync)."""
    return torch.cat([offsets, offsets[-1:].expand(length - offsets.shape[0])])


def cover_pad_rows(offsets: torch.Tensor, num_tokens: int, spatial_merge_size: int) -> torch.Tensor:
    """``offsets`` (segment offsets ending at some T <= ``num_tokens``) followed by pad segments of
    ``PAD_FRAME_UNITS * spatial_merge_size**2`` tokens covering rows ``T..num_tokens`` (zero-length once they
    reach it), computed on the device with no sync: for buffers padded by someone else (vLLM's encoder graphs
    zero-fill rows past a batch), so every row lies in a segment, as the attention ops require, and the pad's
    attention stays linear in its length."""
    size = PAD_FRAME_UNITS * spatial_merge_size**2
    steps = torch.arange(1, -(-num_tokens // size) + 1, dtype=offsets.dtype, device=offsets.device) * size
    return torch.cat([offsets, torch.clamp(offsets[-1:] + steps, max=num_tokens)])


@dataclasses.dataclass(frozen=True, eq=False)
class PaddedBatch:
    """A batch padded to a token budget (see :func:`pad_batch`).

    Attributes:
        budget: the tokens of the padded batch.
        grid: CPU int64 ``(N + P, 3)``: the batch's entries, then its P pad frames (P may be 0).
        meta: the tower's metadata of ``grid`` on the tower's device, its segment offsets extended to static
            lengths: ``cu_seqlens`` ``(num_segments + 1,)``; with window attention ``cu_window_seqlens``
            ``(budget / m**2 + 1,)`` (no batch of the budget has more windows than merge blocks).
        num_tokens: the real tokens T (the first T rows of the padded pixel values).
        num_merged_tokens: the real merged tokens (the first rows of every padded output).
    """

    budget: int
    grid: np.ndarray
    meta: object
    num_tokens: int
    num_merged_tokens: int

    def inputs(self) -> DeviceInputs:
        """The device forward's inputs: ``meta``'s tensors, the budget as the tile hint (every batch of the
        budget replays the graph captured with it, and none has a longer segment)."""
        return DeviceInputs.of(self.meta)._replace(max_seqlen=self.budget)

    def real_outputs(self, outputs):
        """The padded batch's :class:`~qvl.vit.runner.TowerOutputs` cut to the real batch's rows (views; the pad
        frames come last in every output's token order, window order included)."""
        rows = self.num_merged_tokens
        last = outputs.last_hidden_state
        merged = outputs.merged[:rows]
        return type(outputs)(last[: self.num_tokens], merged, [features[:rows] for features in outputs.deepstack])


def pad_batch(runner, grid_thw, budget: int, max_segments: int | None = None) -> PaddedBatch | None:
    """Pad one batch to ``budget`` tokens on the host.

    Args:
        runner: the tower's :class:`~qvl.vit.runner.TowerRunner` (or a tower): supplies
            ``config.spatial_merge_size`` and builds the metadata (``metadata(grid)``, on its device).
        grid_thw: the batch's ``(N, 3)`` (t, h, w), any of :func:`~qvl.vit.build_metadata`'s forms (checked).
        budget: tokens of the padded batch, a multiple of ``spatial_merge_size**2``.
        max_segments: the segment slots (real and pad frames); None: :func:`segment_slots`' default.

    Returns a :class:`PaddedBatch`, or None when the batch does not fit. Pair it with :func:`pad_pixels`; the
    runner's device forward on both (``runner.run_device(pixels, batch.inputs())``) gives the unpadded batch's
    outputs in its first rows (:meth:`PaddedBatch.real_outputs`).
    """
    merge = runner.config.spatial_merge_size
    budget = _check_budget("pad_batch", "budget", budget, merge)
    if max_segments is not None:
        check_int("pad_batch", "max_segments", max_segments)
    grid = grid_as_numpy(grid_thw, "pad_batch")
    check_grid(grid, merge, "pad_batch")
    slots = segment_slots(budget, merge, max_segments)
    padded = pad_grid(grid, budget, merge, slots)
    if padded is None:
        return None
    meta = runner.metadata(padded)
    meta = dataclasses.replace(meta, cu_seqlens=pad_offsets(meta.cu_seqlens, slots + 1))
    window = meta.window
    if window is not None:
        offsets = pad_offsets(window.cu_window_seqlens, budget // merge**2 + 1)
        meta = dataclasses.replace(meta, window=dataclasses.replace(window, cu_window_seqlens=offsets))
    tokens = int(np.prod(grid, axis=1).sum())
    return PaddedBatch(budget, padded, meta, tokens, tokens // merge**2)


def pad_pixels(pixel_values: torch.Tensor, budget: int) -> torch.Tensor:
    """``pixel_values`` ``(T, D)`` followed by ``budget - T`` rows of zeros: a new ``(budget, D)`` tensor on the
    same device, in the same dtype."""
    padded = pixel_values.new_zeros(budget, pixel_values.shape[1])
    padded[: pixel_values.shape[0]] = pixel_values
    return padded


def _sentinels(runner) -> list[torch.Tensor]:
    """A few parameters spread over the tree: the patch embedding's weight, the last block's and the merger's first."""
    tree = runner.tree
    candidates = (next(tree.blocks[-1].parameters(), None), next(tree.merger.parameters(), None))
    return [tree.patch_embed.proj.weight, *(parameter for parameter in candidates if parameter is not None)]


class _WeightsAtCapture:
    """Where the tower's weights lived when its graphs were captured: the storage of a few parameters
    (:func:`_sentinels`; the first one also gives the tower's device and dtype). Moving, casting or loading with
    ``assign=True`` gives them new storage, which the graphs would not read: the old one is freed (its weak reference
    expires), even where the caching allocator hands the new one the same address. A few checks cost next to nothing
    per call, where every parameter would cost hundreds of microseconds."""

    def __init__(self, runner):
        sentinels = _sentinels(runner)
        self.pointers = [parameter.data_ptr() for parameter in sentinels]
        self.storages = [StorageWeakRef(parameter.untyped_storage()) for parameter in sentinels]

    def still_in(self, runner) -> bool:
        """Whether ``runner``'s tower still holds its weights where they were."""
        pointers = [parameter.data_ptr() for parameter in _sentinels(runner)]
        return pointers == self.pointers and not any(storage.expired() for storage in self.storages)


@dataclasses.dataclass(frozen=True, eq=False)
class _Graph:
    """One captured budget: the graph, the static buffers it reads (pixel values, then the device forward's
    metadata tensors) and the outputs it writes."""

    graph: torch.cuda.CUDAGraph
    pixels: torch.Tensor
    inputs: DeviceInputs
    outputs: object  # the runner's TowerOutputs


class TowerGraphs:
    """A runner's token budgets and, on CUDA, one captured graph per budget (:meth:`TowerRunner.capture`).

    Capturing runs the device forward on an all-pad batch of each budget, largest first, into one shared memory
    pool (the graphs never run at the same time, and replays copy their outputs out). The runner is not kept:
    every method takes it, so the runner owns this object and not the other way round.
    """

    def __init__(self, runner, budgets: tuple[int, ...], max_segments: int | None = None, caller: str = "capture"):
        """``budgets`` and ``max_segments`` as :func:`check_budgets` returns and checks them; captures on CUDA.
        ``caller`` names what captured them, for the error that asks for a new capture."""
        self.budgets = budgets
        self.max_segments = max_segments
        self.caller = caller
        self.device, self.dtype = runner.device, runner.dtype
        self._weights = _WeightsAtCapture(runner)
        self._graphs: dict[int, _Graph] = {}
        if self.device.type == "cuda":
            # Outside inference mode, so that replays under plain no_grad may copy into the static buffers (an
            # inference tensor refuses in-place writes outside inference mode).
            with torch.inference_mode(False), torch.no_grad():
                pixels = torch.zeros(self.budgets[-1], runner.config.patch_dim, dtype=self.dtype, device=self.device)
                pool = torch.cuda.graph_pool_handle()
                for budget in reversed(self.budgets):
                    self._graphs[budget] = self._capture(runner, budget, pixels[:budget], pool)

    def _capture(self, runner, budget: int, pixels: torch.Tensor, pool) -> _Graph:
        inputs = pad_batch(runner, np.zeros((0, 3), dtype=np.int64), budget, self.max_segments).inputs()
        # Warm-up on a side stream, as torch.cuda.graph asks: lazy initialization and compilation stay out of the
        # capture.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(_WARMUP_RUNS):
                runner.run_device(pixels, inputs)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # On the tower's own stream: torch.cuda.graph's default capture stream belongs to whichever device was
        # current when it was first made, and a tower on another GPU would launch outside the capture.
        with torch.cuda.graph(graph, pool=pool, stream=side):
            outputs = runner.run_device(pixels, inputs)
        return _Graph(graph, pixels, inputs, outputs)

    def encode(self, runner, pixel_values: torch.Tensor, grid: np.ndarray):
        """The :class:`~qvl.vit.runner.TowerOutputs` of a batch (``grid`` checked by the caller, ``pixel_values``
        of its shape) through the smallest budget that fits it, or None when none does, the batch is empty, or
        autograd would record the forward (a replay records nothing; the caller then runs the normal path).

        On CUDA: the padded metadata is built on the host and copied in without a sync, the pixel values are
        copied into the graph's buffer (from pinned memory when on the host) and the pad rows zeroed, the graph
        replays, and the outputs are copied out (the next replay overwrites the graph's own). Elsewhere the
        padded batch runs through the runner's normal device forward."""
        if not self._weights.still_in(runner):
            raise RuntimeError(
                f"{runner.name}: its graphs read the weights' memory as it was at capture (on {self.device} in "
                f"{self.dtype}), but the weights have moved since (now on {runner.device} in {runner.dtype}: moved, "
                f"cast or loaded into new storage); call {self.caller} again"
            )
        # Grad mode first: under no_grad / inference_mode the parameters are not walked (hundreds of µs a call).
        if grid.shape[0] == 0 or (torch.is_grad_enabled() and needs_grad(pixel_values, *runner.tree.parameters())):
            return None
        for budget in self.budgets:  # smallest first; pad_batch builds metadata only for a batch that fits
            batch = pad_batch(runner, grid, budget, self.max_segments)
            if batch is not None:
                break
        else:
            return None
        entry = self._graphs.get(batch.budget)
        if entry is None:
            padded = pad_pixels(pixel_values.to(self.device), batch.budget)
            return batch.real_outputs(runner.run_device(padded, batch.inputs()))
        source = pixel_values
        if source.device.type == "cpu":
            source = source.to(self.dtype).pin_memory()
        entry.pixels[: batch.num_tokens].copy_(source, non_blocking=True)
        entry.pixels[batch.num_tokens :].zero_()
        for static, fresh in zip(entry.inputs, batch.inputs()):
            if isinstance(static, torch.Tensor):
                static.copy_(fresh, non_blocking=True)
        with torch.cuda.device(self.device):  # a graph replays on the current device's stream
            entry.graph.replay()
        last, merged, deepstack = batch.real_outputs(entry.outputs)
        return type(entry.outputs)(last.clone(), merged.clone(), [features.clone() for features in deepstack])
