"""Data-parallel balancing simulator: how close each plan gets to the best possible split of a batch.

    python -m bench.balance [--batches 200] [--seed 0]

For seeded random batches (images only, and images mixed with videos) at world sizes 2, 4 and 8, prints
the makespan (the dearest rank's cost under the tower's ``a*n + b*n^2`` segment cost, Qwen3-VL-8B
dimensions) divided by its lower bound ``max(total / world, dearest segment)``, for qvl's balancer
("qvl mean" / "qvl worst" over the batches) and for the engines' greedy split ("greedy mean" / "greedy
worst": whole entries, most patches first, to the rank with the fewest patches, as re-implemented by
:func:`qvl.vit.balance.greedy_by_patches`); "qvl>greedy" counts the batches where qvl's makespan is the
larger, "plan ms" is qvl's mean host time to plan one batch. 1.00 is a perfect split; the bound is not
always reachable, so no plan need reach it. Nothing runs on a device: this is arithmetic over plans.

Where vLLM imports, the plan qvl's vLLM plugin replaces is priced as well: vLLM's own
``get_load_balance_assignment`` (what ``run_dp_sharded_mrope_vision_model`` calls in
``mm_encoder_tp_mode="data"``) on the entries' patch counts, each rank's entries under the same segment
cost. "vLLM mean" / "vLLM worst" are its makespan over the bound, "gain mean" / "gain best" its makespan
over qvl's. The first line of the output says whether vLLM was compared, and if not, why.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time
from collections.abc import Callable, Sequence

from qvl.vit.balance import SegmentCost, balance, greedy_by_patches, lower_bound
from qvl.vit.config import VisionConfig

WORLD_SIZES = (2, 4, 8)


def _image(rng: random.Random, low: int, high: int) -> tuple[int, int, int]:
    """One frame of log-uniform patch count in [low, high] and aspect ratio in [1/2, 2], h and w even
    (the 2x2 merge needs it)."""
    patches = low * (high / low) ** rng.random()
    aspect = 2.0 ** rng.uniform(-1.0, 1.0)
    h = max(2, 2 * round((patches * aspect) ** 0.5 / 2))
    w = max(2, 2 * round(patches / h / 2))
    return h, w


def image_batch(rng: random.Random) -> list[tuple[int, int, int]]:
    """4 to 32 images of 256 to 16k patches."""
    return [(1, *_image(rng, 256, 16384)) for _ in range(rng.randint(4, 32))]


def mixed_batch(rng: random.Random) -> list[tuple[int, int, int]]:
    """2 to 16 images as above and 1 to 4 videos of 8 to 64 temporal slices of 1k to 4k patches, shuffled."""
    entries = [(1, *_image(rng, 256, 16384)) for _ in range(rng.randint(2, 16))]
    entries += [(rng.randint(8, 64), *_image(rng, 1024, 4096)) for _ in range(rng.randint(1, 4))]
    rng.shuffle(entries)
    return entries


SCENARIOS = {"images": image_batch, "images+videos": mixed_batch}

# vLLM's get_load_balance_assignment(sizes, num_gpus) -> (entries rank by rank, entries per rank, patches per rank)
Split = Callable[[list[int], int], tuple[list[int], list[int], list[int]]]


def load_vllm_split() -> tuple[Split | None, str]:
    """vLLM's own data-parallel split and a line naming it, or None and a line saying why not. Imported
    here, not at the top: the main environment has no vLLM, and an installed one that fails to import
    (a torchvision built for another torch, say) leaves the comparison out rather than the whole table."""
    try:
        import vllm
        from vllm.model_executor.models.vision import get_load_balance_assignment
    except Exception as error:  # any failure means the same: nothing to compare with
        return None, f"vLLM not compared ({type(error).__name__}: {error})"
    return get_load_balance_assignment, f"vLLM {vllm.__version__}'s get_load_balance_assignment compared"


def vllm_shares(split: Split, grid: Sequence[tuple[int, int, int]], world: int) -> list[list[int]]:
    """The entries ``split`` gives each rank, as ``run_dp_sharded_mrope_vision_model`` reads its output:
    the first list cut into consecutive runs of the second's lengths, on the entries' patch counts."""
    order, counts, _ = split([t * h * w for t, h, w in grid], world)
    cuts = [0, *itertools.accumulate(counts)]
    return [order[start:stop] for start, stop in itertools.pairwise(cuts)]


def simulate(
    batches: int, seed: int, world_sizes: Sequence[int] = WORLD_SIZES, vllm_split: Split | None = None
) -> list[dict]:
    """One row per (scenario, world size): mean and worst ratios to the lower bound, batches where qvl's
    makespan exceeds greedy's, and the balancer's mean host time per batch. With ``vllm_split``
    (:func:`load_vllm_split`) also vLLM's ratios to the bound and vLLM's makespan over qvl's, mean and best
    (``vllm_mean``, ``vllm_worst``, ``gain_mean``, ``gain_best``)."""
    cost = SegmentCost.from_config(VisionConfig())
    rows = []
    for name, make in SCENARIOS.items():
        for world in world_sizes:
            rng = random.Random(f"{seed}-{name}-{world}")
            qvl, greedy, vllm, gain, worse, seconds = [], [], [], [], 0, 0.0
            for _ in range(batches):
                grid = make(rng)
                bound = lower_bound(grid, world, cost)
                start = time.perf_counter()
                plan = balance(grid, world, cost)
                seconds += time.perf_counter() - start
                baseline = greedy_by_patches(grid, world, cost)
                qvl.append(plan.makespan / bound)
                greedy.append(baseline.makespan / bound)
                worse += plan.makespan > baseline.makespan
                if vllm_split is not None:
                    shares = vllm_shares(vllm_split, grid, world)
                    makespan = max(sum(grid[e][0] * cost(grid[e][1] * grid[e][2]) for e in share) for share in shares)
                    vllm.append(makespan / bound)
                    gain.append(makespan / plan.makespan)
            row = dict(
                scenario=name,
                world=world,
                batches=batches,
                qvl_mean=statistics.fmean(qvl),
                qvl_worst=max(qvl),
                greedy_mean=statistics.fmean(greedy),
                greedy_worst=max(greedy),
                qvl_worse=worse,
                plan_ms=1e3 * seconds / batches,
            )
            if vllm_split is not None:
                row.update(
                    vllm_mean=statistics.fmean(vllm),
                    vllm_worst=max(vllm),
                    gain_mean=statistics.fmean(gain),
                    gain_best=max(gain),
                )
            rows.append(row)
    return rows


def format_table(rows: Sequence[dict]) -> str:
    """The vLLM columns appear when the rows have them (:func:`simulate` with ``vllm_split``)."""
    with_vllm = bool(rows) and "vllm_mean" in rows[0]
    header = (
        f"{'scenario':<14} {'world':>5} {'batches':>7}  {'qvl mean':>8} {'qvl worst':>9}  "
        f"{'greedy mean':>11} {'greedy worst':>12}  {'qvl>greedy':>10} {'plan ms':>7}"
    )
    if with_vllm:
        header += f"  {'vLLM mean':>9} {'vLLM worst':>10}  {'gain mean':>9} {'gain best':>9}"
    lines = [header, "-" * len(header)]
    for r in rows:
        line = (
            f"{r['scenario']:<14} {r['world']:>5} {r['batches']:>7}  {r['qvl_mean']:>8.4f} {r['qvl_worst']:>9.4f}  "
            f"{r['greedy_mean']:>11.4f} {r['greedy_worst']:>12.4f}  {r['qvl_worse']:>10} {r['plan_ms']:>7.2f}"
        )
        if with_vllm:
            line += f"  {r['vllm_mean']:>9.4f} {r['vllm_worst']:>10.4f}  {r['gain_mean']:>9.4f} {r['gain_best']:>9.4f}"
        lines.append(line)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=200, help="random batches per scenario and world size")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    split, compared = load_vllm_split()
    rows = simulate(args.batches, args.seed, vllm_split=split)
    cost = SegmentCost.from_config(VisionConfig())
    print(
        f"makespan / lower bound; segment cost {cost.linear}*n + {cost.quadratic}*n^2 FLOPs (Qwen3-VL-8B tower); "
        + compared
    )
    print(format_table(rows))
    return rows


if __name__ == "__main__":
    main()
