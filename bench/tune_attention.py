"""Tile sweep for the attention kernel on a GPU, written into the package's tile table:
``python -m bench.tune_attention``.

qvl never autotunes at run time: autotuning would benchmark inside a CUDA-graph capture or the first compiled
call. Instead this sweep runs once per device, and :func:`qvl.kernels.attention.launch_config` reads what it
wrote (``kernels/attention_tiles.json``, keyed by :func:`~qvl.kernels.attention.tile_key`: GPU arch, dtype, head
dim, segment-length class). Without an entry the launch keeps its heuristic.

For each case, in priority order (Qwen3-VL 8B's D 72 on long segments first), every candidate of
BLOCK_M {64, 128} x BLOCK_N {32, 64, 128} x warps {4, 8} x stages {2, 3, 4} x K/V loads {pointers, TMA
descriptors} (8 warps only with 128-row tiles; short segments: 64-row tiles over at most 64 keys) is compiled
ahead in worker processes (Triton's disk cache then serves the launches), checked against the torch reference
on the case's batch and on ragged segments that end inside a tile (the timed batches are multiples of every
tile, and a compiler bug on ragged blocks once passed a check on them alone) by the rule ``qvl check`` and the
tests judge with (:class:`qvl.kernels.verify.AttentionProblem`: each segment against float64 within its own bound,
torch's own result in the dtype as the baseline, the candidate's key block counted), and timed with
``triton.testing.do_bench`` on the case's batch. The fastest correct candidate becomes the entry, with its time
and the heuristic's. The sweep stops at ``--budget-s`` and writes what it measured. It sweeps the head-dim
layout in use (``QVL_ATTENTION_HEAD_DIM``); entries of the other layouts are keyed apart (``.../padded``,
``.../split32``).

    python -m bench.tune_attention [--budget-s 240] [--head-dims 64 72 80] [--dtypes bf16]
                                   [--table kernels/attention_tiles.json] [--dry-run]

``--dry-run`` lists the cases and candidates without a GPU.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import datetime
import itertools
import json
import math
import multiprocessing
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from qvl.kernels import attention
from qvl.kernels.common import device_target, run_launches
from qvl.kernels.tolerance import worst_of
from qvl.kernels.verify import AttentionProblem

from .harness import DTYPES, attention_flops

NUM_HEADS = 16
# One batch per segment-length class: long, an 8B tower's mixed request (a 4096-token image beside two of
# 1024); short, Qwen2.5-VL's 64-token windows of a 768 x 768 image (144 windows).
LAYOUTS = {"long": (4096, 1024, 1024), "short": (64,) * 144}
# Checked, not timed: segments ending inside query tiles and key blocks, an empty one, a 1-token one.
RAGGED = {"long": (1, 257, 33, 0, 130), "short": (64, 48, 0, 16, 1, 37)}
# The order cases are measured in while the budget lasts: Qwen3-VL's D 72 and 64 on whole images, then
# Qwen2.5-VL's D 80 windows and full blocks.
PRIORITY = (("long", 72), ("long", 64), ("short", 80), ("long", 80), ("short", 72), ("short", 64))


@dataclass(frozen=True)
class Case:
    head_dim: int
    dtype: torch.dtype
    segment_class: str

    @property
    def max_seqlen(self) -> int:
        return max(LAYOUTS[self.segment_class])

    @property
    def name(self) -> str:
        return f"D{self.head_dim} {str(self.dtype).removeprefix('torch.')} {self.segment_class}"


def candidates(segment_class: str) -> list[dict]:
    """The tiles swept for a segment-length class (dicts of :data:`qvl.kernels.attention.TILE_KEYS`)."""
    found = []
    for block_m, block_n, warps, stages, descriptors in itertools.product(
        (64, 128), (32, 64, 128), (4, 8), (2, 3, 4), (False, True)
    ):
        if warps == 8 and block_m == 64:
            continue  # two warpgroups on 64 rows: each warp's MMA rows would be split below its 16-row minimum
        if segment_class == "short" and (block_m > 64 or block_n > 64):
            continue  # a 64-token window is one 64 x 64 tile; larger tiles only add padding
        found.append(
            dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages, DESCRIPTORS=descriptors)
        )
    return found


def cases(head_dims: Iterable[int], dtypes: Iterable[torch.dtype]) -> list[Case]:
    """The cases to sweep in priority order (:data:`PRIORITY`, then any other head dim)."""
    head_dims, dtypes = list(head_dims), list(dtypes)
    order = [p for p in PRIORITY if p[1] in head_dims]
    order += [(c, d) for d in head_dims for c in LAYOUTS if (c, d) not in order]
    return [Case(d, dtype, c) for dtype in dtypes for c, d in order]


def case_inputs(case: Case, device: torch.device, lengths: Sequence[int] | None = None) -> tuple[torch.Tensor, ...]:
    """q, k, v as views of a packed qkv (the tower's layout), cu_seqlens, and the output buffer, for ``lengths``
    (default: the case's timed batch)."""
    lengths = LAYOUTS[case.segment_class] if lengths is None else lengths
    generator = torch.Generator(device=device).manual_seed(0)
    qkv = torch.randn(sum(lengths), 3, NUM_HEADS, case.head_dim, generator=generator, device=device).to(case.dtype)
    q, k, v = qkv.unbind(1)
    bounds = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    return q, k, v, bounds, torch.empty(q.shape, dtype=case.dtype, device=device)


def launches(case: Case, inputs: Sequence[torch.Tensor], tiles: dict | None, target) -> list:
    q, k, v, bounds, out = inputs
    return attention.vision_attn_launches(
        q, k, v, out, bounds, None, None, 10000.0, target, case.max_seqlen, None, tiles
    )


def _compile(case: Case, tiles: dict, target) -> str | None:
    """Compile one candidate into Triton's disk cache (a worker process); the reason it cannot run, or None."""
    from qvl.kernels.common import compile_launch, shared_memory_per_block

    stand_ins = case_inputs(case, torch.device("cpu"))
    try:
        compiled = compile_launch(launches(case, stand_ins, tiles, target)[-1], target)
    except Exception as exc:  # noqa: BLE001 - a candidate the compiler rejects is skipped with its reason
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:160]
    budget = shared_memory_per_block(target)
    if budget is not None and compiled.metadata.shared > budget:
        return f"shared memory {compiled.metadata.shared} B > {budget} B"
    return None


def compile_pool(workers: int) -> concurrent.futures.ProcessPoolExecutor:
    """The worker processes :func:`precompile` uses, started once for the whole sweep (each imports torch and
    Triton), in this process's head-dim layout. Spawned, not forked: the parent has initialized CUDA, which a
    forked child may not touch."""
    spawn = multiprocessing.get_context("spawn")
    return concurrent.futures.ProcessPoolExecutor(
        max_workers=workers,
        mp_context=spawn,
        initializer=attention.set_head_dim_layout,
        initargs=(attention.head_dim_layout(),),
    )


def precompile(pool, case: Case, tiles_list: Sequence[dict], target) -> list[str | None]:
    """Compile every candidate in ``pool``'s processes (a launch then finds it in Triton's cache)."""
    return list(pool.map(_compile, itertools.repeat(case), tiles_list, itertools.repeat(target)))


Timer = Callable[[Callable[[], None]], float]


def tune_case(case: Case, tiles_list: Sequence[dict], device: torch.device, timer: Timer,
              skip: Sequence[str | None] | None = None, deadline: float = math.inf) -> list[dict]:  # fmt: skip
    """Check each candidate on the timed batch and on :data:`RAGGED` (:class:`~qvl.kernels.verify.AttentionProblem`,
    every segment within its bound), then time it with ``timer`` (a zero-argument call -> ms); returns one row per
    candidate: its tiles, ``ms`` (None when not run), ``worst`` (its largest error over its bound, of both checks;
    above 1 is wrong) and ``skipped`` (why it did not count). Stops starting candidates at ``deadline``
    (``time.monotonic()``)."""
    target = device_target(device)
    checks = []
    for inputs in (case_inputs(case, device), case_inputs(case, device, RAGGED[case.segment_class])):
        q, k, v, bounds, _ = inputs
        checks.append((inputs, AttentionProblem(q, k, v, bounds, target, case.max_seqlen)))
    inputs = checks[0][0]
    rows = []
    for index, tiles in enumerate(tiles_list):
        row = {**tiles, "ms": None, "worst": None, "skipped": skip[index] if skip else None}
        rows.append(row)
        if row["skipped"] is not None:
            continue
        if time.monotonic() > deadline:
            row["skipped"] = "budget spent"
            continue
        candidate = launches(case, inputs, tiles, target)
        try:
            comparisons = []
            for checked, problem in checks:
                checked[-1].fill_(float("nan"))
                run_launches(launches(case, checked, tiles, target), device)
                comparisons += problem.check(checked[-1], tiles["BLOCK_N"])
            row["worst"], passed, failure = worst_of(comparisons)
            if not passed:
                row["skipped"] = f"wrong: {failure}"[:300]
                continue
            row["ms"] = timer(lambda c=candidate: run_launches(c, device))
        except Exception as exc:  # noqa: BLE001 - e.g. out of resources at launch: the candidate cannot run
            row["skipped"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:160]
    return rows


def best(rows: Sequence[dict]) -> dict | None:
    """The fastest candidate that ran (ties: the first), or None."""
    timed = [row for row in rows if row["ms"] is not None]
    return min(timed, key=lambda row: row["ms"]) if timed else None


def is_default(row: dict, default: dict) -> bool:
    return all(row[key] == default[key] for key in attention.TILE_KEYS)


def table_entry(rows: Sequence[dict], default: dict, flops: float) -> dict | None:
    """The tile-table entry for a case's sweep: the fastest tiles, with what was measured (its time, useful
    TFLOP/s, and the heuristic's time when it ran)."""
    chosen = best(rows)
    if chosen is None:
        return None
    default_ms = next((row["ms"] for row in rows if is_default(row, default)), None)
    return {
        **{key: chosen[key] for key in attention.TILE_KEYS},
        "ms": round(chosen["ms"], 5),
        "tflops": round(flops / (chosen["ms"] * 1e-3) / 1e12, 1),
        "heuristic_ms": None if default_ms is None else round(default_ms, 5),
    }


def merge_table(path: Path, entries: dict[str, dict], run: dict, base: dict | None = None) -> dict:
    """Write ``entries`` (tile key -> entry) into the table at ``path``, each tagged with the run's index in its
    ``runs`` list (device, versions, date); other keys stay. ``base``: the table to merge into (default: the file
    as it is now); a sweep writes its entries so far after every case into the table it started from, so a sweep
    cut short keeps its finished cases and its run is listed once. Returns the new table."""
    table = copy.deepcopy(base) if base is not None else json.loads(path.read_text())
    table["runs"].append(run)
    for key, entry in entries.items():
        table["tiles"][key] = {**entry, "run": len(table["runs"]) - 1}
    table["tiles"] = dict(sorted(table["tiles"].items()))
    path.write_text(json.dumps(table, indent=2) + "\n")
    return table


def run_record() -> dict:
    import triton

    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-s", type=float, default=240.0, help="stop starting candidates after this")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 72, 80])
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bf16"])
    parser.add_argument("--table", type=Path, default=attention.TILE_TABLE_PATH)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="compile processes")
    parser.add_argument("--dry-run", action="store_true", help="list cases and candidates; no GPU needed")
    args = parser.parse_args(argv)
    todo = cases(args.head_dims, [DTYPES[name] for name in args.dtypes])
    if args.dry_run:
        for case in todo:
            lengths = LAYOUTS[case.segment_class]
            print(f"{case.name}: {len(candidates(case.segment_class))} candidates, {len(lengths)} segments")
        return
    if not torch.cuda.is_available():
        raise SystemExit("tune_attention: needs a CUDA device (use --dry-run to list the sweep)")
    import triton

    deadline = time.monotonic() + args.budget_s
    device = torch.device("cuda")
    target = device_target(device)

    def timer(call: Callable[[], None]) -> float:
        return triton.testing.do_bench(call, warmup=10, rep=30)

    entries = {}
    base, record = json.loads(args.table.read_text()), run_record()
    with compile_pool(args.workers) as pool:
        for case in todo:
            if time.monotonic() > deadline:
                print(f"budget spent before {case.name}", flush=True)
                break
            tiles_list = candidates(case.segment_class)
            rows = tune_case(case, tiles_list, device, timer, precompile(pool, case, tiles_list, target), deadline)
            # The heuristic's tiles, not launch_config's: those are an earlier run's entry where the table has one.
            default = attention.heuristic_tiles(case.head_dim, case.dtype, target, case.max_seqlen)
            for row in rows:
                tag = " (heuristic)" if is_default(row, default) else ""
                timing = f"{row['ms']:.4f} ms" if row["ms"] is not None else f"skipped: {row['skipped']}"
                print(f"{case.name} {[row[k] for k in attention.TILE_KEYS]}{tag}: {timing}", flush=True)
            flops = attention_flops(NUM_HEADS, case.head_dim, LAYOUTS[case.segment_class])
            entry = table_entry(rows, default, flops)
            if entry is not None:
                key = attention.tile_key(target, case.head_dim, case.dtype, case.max_seqlen)
                entries[key] = entry
                merge_table(args.table, entries, record, base)
                print(f"chosen for {key}: {entry} (written to {args.table})", flush=True)
    print(f"wrote {len(entries)} entries to {args.table}")


if __name__ == "__main__":
    main()
