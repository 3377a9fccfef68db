"""One vision tower over several processes (torch.distributed): weight sharding or batch splitting.

Ask for a mode with ``VisionTransformer(config, parallel=..., group=...)`` (or the same arguments to
``from_hf`` / ``from_pretrained``); ``group`` defaults to the whole world.

* ``"weights"`` (tensor parallel): each rank keeps 1/world of every block's heads and MLP width and of
  every merger's hidden width, and runs the whole batch. qkv and every fc1 are split by output features
  (column parallel); attn.proj and every fc2 by input features (row parallel), their partial products
  summed by one all-reduce each: two per block, one per merger. Norms, patch embed and the position table
  are replicated, and the qvl ops run unchanged on the local heads. The all-reduces are functional
  collectives, so ``tower.compile()`` traces them into its graph.
* ``"data"``: each rank keeps all the weights and encodes a share of the batch, then one all-gather gives
  every rank every image's features in input order. Shares are balanced under a cost model that counts
  attention's quadratic term, and videos are split by temporal slice (:func:`balance`).

Every rank must call the tower with the same batch. Each call first exchanges a small fingerprint of it
(a hash of grid_thw and pixel_values' shape): a rank with a different or invalid batch then makes every
rank raise, instead of leaving the others waiting in a collective. The fingerprint travels between hosts
when the group has a CPU backend, so the check never waits for the GPU: ``init_from_env`` joins CUDA
ranks with ``"cpu:gloo,cuda:nccl"``, as does ``init_process_group()`` without a backend. A group with
nccl alone carries it on the tower's device, and reading it back is then one small device sync per call.
With one process either mode is exactly the single-process tower.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import heapq
import os
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from .metadata import VisionMetadata, _check_grid, _grid_as_numpy, _to_device

if TYPE_CHECKING:
    from .model import VisionConfig, VisionTransformer

__all__ = [
    "MODES",
    "DataPlan",
    "Piece",
    "SegmentCost",
    "balance",
    "greedy_by_patches",
    "has_cpu_backend",
    "init_from_env",
    "is_main_rank",
    "lower_bound",
    "make_parallel",
]

MODES = ("weights", "data")
# Newer torch names the functional all-gather all_gather_single and deprecates all_gather_tensor.
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
Grid = tuple[tuple[int, int, int], ...]


def is_main_rank(group: dist.ProcessGroup | None = None) -> bool:
    """Whether this process should print and write results: rank 0 of ``group`` (default: the world), or
    the only process when torch.distributed is not initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        return True
    return dist.get_rank(group) == 0


def init_from_env(device: torch.device | str | None = None) -> torch.device:
    """Join the process group a launcher such as torchrun describes in the environment (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), unless already joined, and return this rank's device.

    ``device`` defaults to CUDA when available, else CPU; a CUDA device without an index becomes
    ``cuda:LOCAL_RANK``. The backend follows the device: nccl for CUDA tensors (with gloo for CPU
    tensors beside it), gloo for CPU. Without
    ``WORLD_SIZE`` in the environment nothing is joined (a single process).
    """
    device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # gloo beside nccl lets the per-call batch check run on the host (see the module docstring).
        dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo")
    return device


def has_cpu_backend(group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``group`` can run collectives on CPU tensors (its backend config names one for ``cpu``)."""
    entries = dict(entry.partition(":")[::2] for entry in dist.get_backend_config(group).split(","))
    return entries.get("cpu", "none") != "none"


def make_parallel(
    mode: str | None, config: VisionConfig, group: dist.ProcessGroup | None = None, caller: str = "VisionTransformer"
):
    """The strategy a tower runs with: None for the single-process tower (``mode=None``, or a group of one
    process), else a :class:`WeightsParallel` or :class:`DataParallel`. Raises on every rank alike (nothing
    here communicates) when the mode is unknown, torch.distributed is not initialized, this process is not
    in ``group``, or (weights mode) a width does not divide by the group's size; ``caller`` names the API
    in those errors."""
    if mode is None:
        return None
    if mode not in MODES:
        raise ValueError(f"{caller}: parallel must be None or one of {MODES}, got {mode!r}")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{caller}(parallel={mode!r}) needs torch.distributed's process group: call "
            f"torch.distributed.init_process_group (or qvl.vit.parallel.init_from_env) first"
        )
    group = group if group is not None else dist.group.WORLD
    if dist.get_rank(group) < 0:
        raise ValueError(f"{caller}(parallel={mode!r}): this process is not a member of the group passed")
    if dist.get_world_size(group) == 1:
        return None
    return (WeightsParallel if mode == "weights" else DataParallel)(config, group)


class _Parallel:
    """What both modes share: the group, and the check that every rank passes the same batch."""

    mode = ""

    def __init__(self, config: VisionConfig, group: dist.ProcessGroup):
        self.config = config
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.exchanges_on_host = has_cpu_backend(group)

    def build(self, tower: VisionTransformer) -> None:
        """Create this rank's parameters on ``tower`` (all of them unless the mode shards them)."""
        config = self.config
        tower._build(config.num_heads, config.intermediate_size, _merged_width(config))

    def local_state_dict(self, state_dict: dict[str, torch.Tensor], local_shapes: dict[str, torch.Size]):
        """This rank's part of a whole tower's state dict (``local_shapes``: the tower's own parameters)."""
        return state_dict

    def agree_on_batch(self, tower: VisionTransformer, pixel_values, grid_thw) -> np.ndarray:
        """``grid_thw`` as a checked ``(N, 3)`` int64 array, once every rank has shown it holds the same
        valid batch. The local checks run before the exchange and their error is raised after it, so a
        rank that fails them still takes part and the others learn of it instead of hanging."""
        problem = None
        try:
            grid = _grid_as_numpy(grid_thw)
            _check_grid(grid, self.config.spatial_merge_size)
            shape = (int(np.prod(grid, axis=1).sum()), tower.patch_embed.proj.weight[0].numel())
            if not isinstance(pixel_values, torch.Tensor) or tuple(pixel_values.shape) != shape:
                got = tuple(pixel_values.shape) if isinstance(pixel_values, torch.Tensor) else type(pixel_values)
                raise ValueError(f"VisionTransformer: pixel_values must have shape {shape}, got {got}")
            digest = hashlib.blake2b(np.ascontiguousarray(grid).tobytes(), digest_size=8).digest()
            fingerprint = [1, int.from_bytes(digest, "little", signed=True), *shape]
        except (TypeError, ValueError) as error:
            problem, fingerprint = error, [0, 0, 0, 0]
        local = torch.tensor(fingerprint, dtype=torch.int64, device="cpu" if self.exchanges_on_host else tower.device)
        everyone = _all_gather(local, 0, self.group).view(self.world_size, -1).tolist()
        if problem is not None:
            raise problem
        invalid = [rank for rank, seen in enumerate(everyone) if not seen[0]]
        if invalid:
            raise ValueError(
                f"parallel={self.mode!r}: rank(s) {invalid} passed an invalid batch (their error says why); "
                f"every rank must pass the same batch"
            )
        if any(seen != everyone[0] for seen in everyone):
            described = "; ".join(
                f"rank {rank}: pixel_values {tuple(seen[2:])}, grid_thw hash {seen[1] & (2**64 - 1):016x}"
                for rank, seen in enumerate(everyone)
            )
            raise ValueError(f"parallel={self.mode!r}: every rank must pass the same batch, got {described}")
        return grid


def _merged_width(config: VisionConfig) -> int:
    return config.hidden_size * config.spatial_merge_size**2


# --------------------------------------------------------------------------------------------------
# Weights mode
# --------------------------------------------------------------------------------------------------
_QKV = re.compile(r"blocks\.\d+\.attn\.qkv\.(weight|bias)")
_COLUMN = re.compile(r"(blocks\.\d+\.mlp|merger|deepstack_merger_list\.\d+)\.linear_fc1\.(weight|bias)")
_ROW = re.compile(
    r"(blocks\.\d+\.mlp|merger|deepstack_merger_list\.\d+)\.linear_fc2\.weight" r"|blocks\.\d+\.attn\.proj\.weight"
)


class WeightsParallel(_Parallel):
    """Tensor parallelism: this rank's heads and widths, and the all-reduce of the row-parallel linears."""

    mode = "weights"

    def __init__(self, config: VisionConfig, group: dist.ProcessGroup):
        super().__init__(config, group)
        widths = {
            "num_heads": config.num_heads,
            "intermediate_size": config.intermediate_size,
            "hidden_size * spatial_merge_size**2 (the mergers' width)": _merged_width(config),
        }
        uneven = {name: width for name, width in widths.items() if width % self.world_size}
        if uneven:
            raise ValueError(
                f"VisionTransformer(parallel='weights') splits heads and widths evenly over the group's "
                f"{self.world_size} ranks, but {uneven} do not divide by {self.world_size}"
            )

    def build(self, tower: VisionTransformer) -> None:
        config, ways = self.config, self.world_size
        tower._build(config.num_heads // ways, config.intermediate_size // ways, _merged_width(config) // ways)
        tower._all_reduce = self.all_reduce

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(partial, "sum", self.group)

    def local_state_dict(self, state_dict, local_shapes):
        local = {}
        for name, shape in local_shapes.items():
            if name not in state_dict:
                continue  # the caller reports what is missing
            tensor, dim = state_dict[name], self._split_dim(name)
            if dim is None:
                local[name] = tensor
                continue
            whole = list(shape)
            whole[dim] *= self.world_size
            if list(tensor.shape) != whole:
                raise ValueError(
                    f"VisionTransformer: {name} has shape {tuple(tensor.shape)}, expected the whole tower's "
                    f"{tuple(whole)} (parallel='weights' keeps 1/{self.world_size} of it on each rank)"
                )
            if _QKV.fullmatch(name):
                # Rows are laid out (3, heads, head_dim): this rank's heads are one contiguous run inside
                # each of q, k and v, not one run of the whole.
                local[name] = tensor.unflatten(0, (3, self.world_size, -1))[:, self.rank].flatten(0, 1)
            else:
                local[name] = tensor.chunk(self.world_size, dim)[self.rank]
        return local

    @staticmethod
    def _split_dim(name: str) -> int | None:
        if _QKV.fullmatch(name) or _COLUMN.fullmatch(name):
            return 0
        if _ROW.fullmatch(name):
            return 1
        return None

    def forward(self, tower: VisionTransformer, pixel_values: torch.Tensor, grid_thw):
        grid = self.agree_on_batch(tower, pixel_values, grid_thw)
        return tower._encode_local(pixel_values, tower.metadata(grid))

    def encode(self, tower: VisionTransformer, pixel_values: torch.Tensor, meta: VisionMetadata):
        self.agree_on_batch(tower, pixel_values, meta.grid_thw)
        return tower._encode_local(pixel_values, meta)


# --------------------------------------------------------------------------------------------------
# Data mode: the cost model and the balancer (pure functions of grid_thw, so every rank computes the
# same plan without communicating), then the split, the local forward and one gather.
# --------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SegmentCost:
    """Forward FLOPs of one attention segment (one temporal slice) of ``n`` tokens:
    ``linear * n + quadratic * n**2``, in Python integers so every rank's sums agree exactly."""

    linear: int
    quadratic: int

    @classmethod
    def from_config(cls, config: VisionConfig) -> SegmentCost:
        """Per token: patch embed, each block's qkv / proj / fc1 / fc2, and each merger's two linears
        (run on a quarter of the tokens at four times the width); per pair of tokens in a segment, each
        block's attention (``q k^T`` and ``p v``: 4 * hidden FLOPs)."""
        hidden, merged = config.hidden_size, _merged_width(config)
        patch = config.in_channels * config.temporal_patch_size * config.patch_size**2
        block = 2 * hidden * (4 * hidden + 2 * config.intermediate_size)
        mergers = (1 + len(config.deepstack_visual_indexes)) * 2 * hidden * (merged + config.out_hidden_size)
        return cls(linear=2 * patch * hidden + config.depth * block + mergers, quadratic=config.depth * 4 * hidden)

    def __call__(self, n: int) -> int:
        return n * (self.linear + self.quadratic * n)


@dataclasses.dataclass(frozen=True)
class Piece:
    """Temporal slices ``start:stop`` of batch entry ``entry``: whole attention segments, which the
    tower encodes independently of everything else (attention, position embedding and the 2x2 mergers
    all stay inside one slice)."""

    entry: int
    start: int
    stop: int


@dataclasses.dataclass(frozen=True)
class DataPlan:
    """Who encodes what: ``shares[rank]`` lists that rank's pieces (by entry), ``loads[rank]`` their cost."""

    grid: Grid
    shares: tuple[tuple[Piece, ...], ...]
    loads: tuple[int, ...]

    @property
    def makespan(self) -> int:
        return max(self.loads)

    def local_grid(self, rank: int) -> list[tuple[int, int, int]]:
        """grid_thw of ``rank``'s share, one row per piece."""
        return [(piece.stop - piece.start, *self.grid[piece.entry][1:]) for piece in self.shares[rank]]

    def merged_rows(self, rank: int, merge: int) -> int:
        """Rows of merger output ``rank`` produces (``merge``: spatial_merge_size)."""
        return sum(t * h * w for t, h, w in self.local_grid(rank)) // merge**2

    def gather_index(self, merge: int, stride: int) -> np.ndarray:
        """For merger outputs gathered as ``(world * stride, width)``, each rank's rows padded to
        ``stride``: the gathered row of every output row in input order."""
        located = []  # (entry, start, first gathered row, rows)
        for rank, share in enumerate(self.shares):
            offset = rank * stride
            for piece in share:
                _, h, w = self.grid[piece.entry]
                rows = (piece.stop - piece.start) * h * w // merge**2
                located.append((piece.entry, piece.start, offset, rows))
                offset += rows
        located.sort()
        if not located:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([np.arange(first, first + rows, dtype=np.int64) for _, _, first, rows in located])


def _as_grid(grid_thw) -> Grid:
    return tuple((int(t), int(h), int(w)) for t, h, w in _grid_as_numpy(grid_thw).tolist())


def lower_bound(grid_thw, world_size: int, cost: SegmentCost) -> int:
    """No plan's makespan is below this: the average load, or the dearest single segment."""
    grid = _as_grid(grid_thw)
    return _lower_bound(grid, [cost(h * w) for _, h, w in grid], world_size)


def _lower_bound(grid: Grid, unit: Sequence[int], world_size: int) -> int:
    total = sum(t * cost for (t, _, _), cost in zip(grid, unit))
    return max(-(-total // world_size), max(unit, default=0))


def greedy_by_patches(grid_thw, world_size: int, cost: SegmentCost) -> DataPlan:
    """What serving engines do: whole entries, most patches first, each to the rank with the fewest
    patches so far. ``cost`` only prices the result."""
    grid = _as_grid(grid_thw)
    return _plan(grid, _greedy_counts(grid, world_size), [cost(h * w) for _, h, w in grid])


def balance(grid_thw, world_size: int, cost: SegmentCost) -> DataPlan:
    """Split a batch over ``world_size`` ranks so the dearest rank's cost (the makespan) is small.

    The unit of work is one temporal slice (an attention segment) priced by ``cost``; a video's slices
    may go to different ranks. The plan starts from longest-processing-time-first over the slices and is
    improved by local search: move one slice, or swap two, between the dearest rank and another whenever
    that lowers the larger of the two loads. Should :func:`greedy_by_patches` still do better, its plan is
    improved the same way and kept, so the result is never worse than the engines' greedy split. The
    search stops within 0.01 % of the lower bound, far below the cost model's own error, which bounds the
    time on batches of thousands of images. Deterministic: equal inputs give equal plans on every rank.
    """
    if world_size < 1:
        raise ValueError(f"balance: world_size must be >= 1, got {world_size}")
    grid = _as_grid(grid_thw)
    unit = [cost(h * w) for _, h, w in grid]
    bound = _lower_bound(grid, unit, world_size)
    good_enough = bound + bound // 10_000
    plan = _plan(grid, _improve(_lpt_counts(grid, unit, world_size), unit, good_enough), unit)
    greedy = _greedy_counts(grid, world_size)
    if _plan(grid, greedy, unit).makespan < plan.makespan:
        plan = min(plan, _plan(grid, _improve(greedy, unit, good_enough), unit), key=lambda p: p.makespan)
    return plan


# counts[rank] = {entry: temporal slices of that entry the rank encodes}
Counts = list[dict[int, int]]


def _lpt_counts(grid: Grid, unit: Sequence[int], world_size: int) -> Counts:
    """Each slice, dearest first, to the least loaded rank."""
    counts: Counts = [{} for _ in range(world_size)]
    ranks = [(0, rank) for rank in range(world_size)]
    for entry in sorted(range(len(grid)), key=lambda e: (-unit[e], e)):
        for _ in range(grid[entry][0]):
            load, rank = heapq.heappop(ranks)
            counts[rank][entry] = counts[rank].get(entry, 0) + 1
            heapq.heappush(ranks, (load + unit[entry], rank))
    return counts


def _greedy_counts(grid: Grid, world_size: int) -> Counts:
    counts: Counts = [{} for _ in range(world_size)]
    ranks = [(0, rank) for rank in range(world_size)]
    for entry in sorted(range(len(grid)), key=lambda e: (-grid[e][0] * grid[e][1] * grid[e][2], e)):
        patches, rank = heapq.heappop(ranks)
        counts[rank][entry] = grid[entry][0]
        heapq.heappush(ranks, (patches + grid[entry][0] * grid[entry][1] * grid[entry][2], rank))
    return counts


def _improve(counts: Counts, unit: Sequence[int], good_enough: int) -> Counts:
    """Local search from ``counts`` (see :func:`balance`) until the makespan is ``good_enough`` or no
    step helps; returns new counts.

    Slices of equal cost are interchangeable, so each rank is held as ``{cost: {entry: slices}}`` and a
    step searches the distinct costs only: between the dearest rank and a rank ``gap`` cheaper, handing
    over ``d`` (a slice's cost, less the cost of one taken back, if any) leaves the pair's larger load at
    ``top - min(d, gap - d)``, so for each cost given the best cost taken back is the one nearest to
    ``given - gap / 2``, found by bisection. Every step lowers the sum of squared loads, so the search
    ends; the step cap only bounds the time on pathological batches.
    """
    world_size = len(counts)
    held: list[dict[int, dict[int, int]]] = [{} for _ in range(world_size)]
    for rank, row in enumerate(counts):
        for entry, count in row.items():
            held[rank].setdefault(unit[entry], {})[entry] = count
    loads = [sum(cost * sum(entries.values()) for cost, entries in costs.items()) for costs in held]
    distinct = [sorted(costs) for costs in held]
    for _ in range(world_size * sum(sum(row.values()) for row in counts)):
        top = max(range(world_size), key=lambda rank: (loads[rank], -rank))
        if loads[top] <= good_enough:
            break
        best = None  # (new larger load of the pair, other rank, cost given, cost taken back or 0)
        for other in range(world_size):
            gap = loads[top] - loads[other]
            if gap <= 0:
                continue
            takes = [0, *distinct[other]]
            for give in distinct[top]:
                nearest = bisect.bisect_left(takes, give - gap // 2)
                for take in takes[max(nearest - 1, 0) : nearest + 1]:
                    handed = give - take
                    if 0 < handed < gap:
                        larger = loads[top] - min(handed, gap - handed)
                        if best is None or larger < best[0]:
                            best = (larger, other, give, take)
        if best is None:
            break
        _, other, give, take = best
        _move(held, top, other, give)
        if take:
            _move(held, other, top, take)
        loads[top] += take - give
        loads[other] += give - take
        distinct[top], distinct[other] = sorted(held[top]), sorted(held[other])
    return [{entry: count for entries in costs.values() for entry, count in entries.items()} for costs in held]


def _move(held: list[dict[int, dict[int, int]]], source: int, target: int, cost: int) -> None:
    """Move one slice of cost ``cost`` from ``source`` to ``target``, from an entry ``target`` already
    holds if there is one (fewer pieces)."""
    entries, theirs = held[source][cost], held[target].setdefault(cost, {})
    entry = next((e for e in entries if e in theirs), next(iter(entries)))
    entries[entry] -= 1
    if not entries[entry]:
        del entries[entry]
        if not entries:
            del held[source][cost]
    theirs[entry] = theirs.get(entry, 0) + 1


def _plan(grid: Grid, counts: Counts, unit: Sequence[int]) -> DataPlan:
    """Turn per-rank slice counts into pieces: each entry's slices go out in rank order, so a rank's
    part of an entry is one contiguous range and the outputs re-join by concatenation."""
    next_slice = [0] * len(grid)
    shares = []
    for row in counts:
        share = []
        for entry in sorted(row):
            share.append(Piece(entry, next_slice[entry], next_slice[entry] + row[entry]))
            next_slice[entry] += row[entry]
        shares.append(tuple(share))
    loads = tuple(sum(unit[entry] * count for entry, count in row.items()) for row in counts)
    return DataPlan(grid, tuple(shares), loads)


class DataParallel(_Parallel):
    """Data parallelism: replicated weights, the batch split by :func:`balance`, one all-gather."""

    mode = "data"

    def __init__(self, config: VisionConfig, group: dist.ProcessGroup):
        super().__init__(config, group)
        self.cost = SegmentCost.from_config(config)

    def forward(self, tower: VisionTransformer, pixel_values: torch.Tensor, grid_thw, encode_share=None):
        """Encode this rank's share and gather everyone's. ``encode_share(pixel_values, grid) -> (merged,
        deepstack)`` encodes one share; it defaults to ``tower``'s own single-process encode (the
        transformers patch passes one that runs over transformers' modules)."""
        grid = self.agree_on_batch(tower, pixel_values, grid_thw)
        merge = self.config.spatial_merge_size
        plan = balance(grid, self.world_size, self.cost)
        entry_rows = np.concatenate([[0], np.cumsum(np.prod(grid, axis=1))]).tolist()
        parts = []
        for piece in plan.shares[self.rank]:
            frame = plan.grid[piece.entry][1] * plan.grid[piece.entry][2]
            first = entry_rows[piece.entry] + piece.start * frame
            parts.append(pixel_values[first : first + (piece.stop - piece.start) * frame])
        # A new tensor, not a view: the compiled forward guards on its input's storage offset (0, 1 or more),
        # and a rank's share starts at a different row in every batch.
        local_pixels = torch.cat(parts or [pixel_values[:0]])
        local_grid = plan.local_grid(self.rank)
        if encode_share is None:
            merged, deepstack = tower._encode_local(local_pixels, tower.metadata(local_grid))
        else:
            merged, deepstack = encode_share(local_pixels, local_grid)

        stride = max(plan.merged_rows(rank, merge) for rank in range(self.world_size))
        if stride == 0:
            return merged, deepstack  # an empty batch on every rank
        # Main and deepstack features travel together, each rank's rows padded to the longest share (the
        # padding is never read back).
        local = merged.new_empty(stride, merged.shape[1] * (1 + len(deepstack)))
        torch.cat([merged, *deepstack], dim=1, out=local[: merged.shape[0]])
        gathered = _all_gather(local, 0, self.group)
        order = _to_device(torch.from_numpy(plan.gather_index(merge, stride)), gathered.device)
        merged, *deepstack = gathered.index_select(0, order).split(merged.shape[1], dim=1)
        return merged.contiguous(), [features.contiguous() for features in deepstack]

    def encode(self, tower: VisionTransformer, pixel_values: torch.Tensor, meta: VisionMetadata):
        # Only meta's grid is used: each rank builds the metadata of its own share.
        return self.forward(tower, pixel_values, meta.grid_thw)
