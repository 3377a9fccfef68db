"""qvl's data-parallel balancer against the split it replaces in vLLM (``mm_encoder_tp_mode="data"``): vLLM's own
``get_load_balance_assignment``, over seeded random batches of images and videos.

``greedy_by_patches`` is qvl's re-implementation of that split, which ``python -m bench.balance`` prices in the
main environment (no vLLM there): it must give every rank exactly vLLM's entries, ties included. And
``balance``, which the plugin puts in its place, must never have the dearer makespan.
"""

import itertools
import random

import pytest
from vllm.model_executor.models.vision import get_load_balance_assignment, run_dp_sharded_mrope_vision_model

from qvl.vit.balance import SegmentCost, balance, greedy_by_patches
from qvl.vit.config import VisionConfig

COST = SegmentCost.from_config(VisionConfig())
BATCHES = 1000


def random_batch(rng: random.Random) -> list[tuple[int, int, int]]:
    """0 to 24 entries (so often fewer than the ranks), a third of them videos of 2 to 12 slices. The sides
    come from a few even values, so equal patch counts are common, and some of them from different shapes
    (1x8x8, 1x4x16 and 4x4x4 all have 64 patches but different costs): vLLM's order among equals decides
    which rank gets what."""
    sides = (2, 4, 8, 16, 32)
    return [
        (rng.randint(2, 12) if rng.random() < 1 / 3 else 1, rng.choice(sides), rng.choice(sides))
        for _ in range(rng.choice((0, rng.randint(1, 4), rng.randint(1, 24))))
    ]


def vllm_shares(grid: list[tuple[int, int, int]], world: int) -> list[list[int]]:
    """Each rank's entries, as ``run_dp_sharded_mrope_vision_model`` reads vLLM's answer: the entries rank by
    rank, cut by the per-rank counts, on the entries' patch counts."""
    order, counts, patches = get_load_balance_assignment([t * h * w for t, h, w in grid], world)
    assert len(counts) == len(patches) == world and sum(counts) == len(order) == len(grid)
    cuts = [0, *itertools.accumulate(counts)]
    return [order[start:stop] for start, stop in itertools.pairwise(cuts)]


def test_vllm_still_splits_with_get_load_balance_assignment():
    """The split compared below is the one vLLM's data-parallel vision path calls."""
    assert "get_load_balance_assignment" in run_dp_sharded_mrope_vision_model.__code__.co_names


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_greedy_replica_and_balance_against_vllm(world):
    rng = random.Random(f"vllm-balance-{world}")
    lengths = set()
    for _ in range(BATCHES):
        grid = random_batch(rng)
        lengths.add(len(grid))
        shares = vllm_shares(grid, world)
        loads = [sum(grid[e][0] * COST(grid[e][1] * grid[e][2]) for e in share) for share in shares]

        greedy = greedy_by_patches(grid, world, COST)
        assert [sorted(piece.entry for piece in share) for share in greedy.shares] == [sorted(s) for s in shares], grid
        assert all(piece.start == 0 and piece.stop == grid[piece.entry][0] for s in greedy.shares for piece in s)
        assert list(greedy.loads) == loads, grid

        assert balance(grid, world, COST).makespan <= max(loads), grid
    # The batches reached the edges: empty, fewer entries than ranks, more.
    assert 0 in lengths and min(lengths - {0}) < world < max(lengths)
