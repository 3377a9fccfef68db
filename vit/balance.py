"""The data-parallel balancer: which rank encodes which images and video frames.

Pure functions of ``grid_thw`` (no torch.distributed, no tensors), so every rank computes the same plan
without communicating, and the simulator (``python -m bench.balance``) runs them without processes. The
unit of work is one temporal slice, an attention segment, priced by a cost model that counts attention's
quadratic term (:class:`SegmentCost`); :func:`balance` splits a batch over the ranks,
:func:`greedy_by_patches` is what serving engines do instead, and :func:`lower_bound` bounds both.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
from collections.abc import Sequence

import numpy as np

from .config import TowerConfig
from .metadata import grid_as_numpy

__all__ = ["DataPlan", "Grid", "Piece", "SegmentCost", "balance", "greedy_by_patches", "lower_bound"]

Grid = tuple[tuple[int, int, int], ...]


@dataclasses.dataclass(frozen=True)
class SegmentCost:
    """Forward FLOPs of one attention segment (one temporal slice) of ``n`` tokens:
    ``linear * n + quadratic * n**2``, in Python integers so every rank's sums agree exactly."""

    linear: int
    quadratic: int

    @classmethod
    def from_config(cls, config: TowerConfig) -> SegmentCost:
        """From any tower config's FLOP counts: ``linear_flops_per_token`` and ``flops_per_token_pair``
        (:class:`~qvl.vit.config.VisionConfig`, :class:`~qvl.vit.qwen2_tower.Qwen2VisionConfig`)."""
        return cls(linear=config.linear_flops_per_token, quadratic=config.flops_per_token_pair)

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
    return tuple((int(t), int(h), int(w)) for t, h, w in grid_as_numpy(grid_thw).tolist())


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
