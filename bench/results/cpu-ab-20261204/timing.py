"""The timing the A/B scripts here share: bench_cpu's tower and fp32/bf16 workloads, every run in turns."""

import resource
import sys
import time

import torch

from bench import harness
from bench.bench_cpu import TOWER, pixels_of
from bench.bench_tower import hf_tower
from bench.workloads import randomize

WORKLOADS = (((1, 32, 32),), ((1, 64, 64),), ((1, 32, 32),) * 4)


def reference_tower():
    """transformers' tower (sdpa) with random weights in the dtype named by argv[1] (fp32 or bf16), and that dtype."""
    torch.manual_seed(0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[sys.argv[1]]
    return randomize(hf_tower(TOWER, harness.get_device("cpu"), torch.float32, "sdpa")).to(dtype), dtype


def compare(runs: dict, dtype: torch.dtype, rounds: int, faults: bool = False) -> None:
    """Per workload: each run's max relative error against ``runs["hf"]``, then each run's (best, median) time over
    hf's best after ``rounds`` rounds in turns, and hf's best in ms; with ``faults``, each run's fewest minor page
    faults in one call after them (fresh pages the call touched: glibc maps allocations over 32 MiB anew each time)."""
    for grid_thw in WORKLOADS:
        pixels, grid = pixels_of(TOWER, grid_thw, dtype), torch.tensor(grid_thw)
        with torch.inference_mode():
            expected = runs["hf"](pixels, grid)
            for name, run in runs.items():
                print(name, "%.2e" % harness.max_rel_err(run(pixels, grid), expected), end=" ")
            times = {name: [] for name in runs}
            page_faults = {name: [] for name in runs}
            for _ in range(rounds):
                for name, run in runs.items():
                    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                    start = time.perf_counter()
                    run(pixels, grid)
                    times[name].append(time.perf_counter() - start)
                    page_faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        hf = min(times["hf"])
        ratios = {k: (round(min(v) / hf, 3), round(sorted(v)[len(v) // 2] / hf, 3)) for k, v in times.items()}
        fewest = {k: min(v) for k, v in page_faults.items()} if faults else ""
        print(grid_thw[0], len(grid_thw), ratios, round(hf * 1e3), fewest, flush=True)
