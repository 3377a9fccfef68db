"""Where and under which launch settings a head-dim layout's attention goes wrong on a GPU:
``python -m bench.diagnose_attention``.

``qvl check`` says whether a layout (``split``, ``split32``) computes right on this machine; where it does not, this
tells the failure's shape apart. Each variant, the layout's own tiles (:func:`qvl.kernels.attention.launch_config`)
and one change at a time from them (one, two or three pipeline stages; 4 warps on 64-row tiles; 32- and 128-key
blocks; K and V through TMA descriptors or pointers), runs the forward on the cases that failed before
(:data:`qvl.kernels.verify.ATTENTION_CASES` ``ragged``, ``lone-33`` and ``300``: 16 heads, bf16; on a CPU the
interpreter's sizes) in a process of its own, all at once: a kernel that faults leaves the CUDA context unusable, so
a crash or a hang is that variant's result, not the end of the run. Each case is judged by the rule ``qvl check``
uses (:class:`~qvl.kernels.verify.AttentionProblem`, with the variant's key block), and a failure says where its
segment is off: the rows (from the segment's start), heads and head-dim columns (a ragged block's rows, a tail
tile's columns). With ``--sanitizer``, where ``compute-sanitizer`` is on the PATH, the layout's own tiles also run
under its ``racecheck`` and ``synccheck`` tools (shared-memory hazards and barrier misuse, which memcheck does not
report). The sm_90 machine code of any variant can be read without a GPU (``python -m bench.sass_attention``).

    python -m bench.diagnose_attention [--layouts split split32] [--head-dims 72 80] [--from-check check.json]
                                       [--timeout-s 90] [--sanitizer] [--json PATH]

``--from-check`` takes the layouts and head dims a ``qvl check --json`` file found wrong (nothing to do where it
found none). The exit status is 0 whatever the results (it diagnoses, it does not gate).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from qvl.kernels.attention import TILE_KEYS
from qvl.kernels.check import start_worker, worker_output

CASES = ("ragged", "lone-33", "300")
LAYOUTS = ("split", "split32")
HEAD_DIMS = (72, 80)
# Workers run ``python -m bench.diagnose_attention``: the repository's root on their path, wherever the parent ran.
ROOT = Path(__file__).resolve().parents[1]


class Result(NamedTuple):
    """One variant's outcome: per case ``(worst share of the bound, passed, what failed)``, or why it gave none."""

    layout: str
    head_dim: int
    tiles: dict
    cases: dict[str, tuple[float, bool, str]]
    failure: str | None


def variants(base: dict, tma: bool) -> list[dict]:
    """The layout's own tiles ``base`` first, then each single change from them (duplicates dropped): the other
    pipeline depths, 4 warps on 64-row tiles, the other key blocks, the other K/V load path where ``tma``."""
    changes = [dict(num_stages=stages) for stages in (1, 2, 3)]
    changes += [dict(BLOCK_M=64, num_warps=4)]
    changes += [dict(BLOCK_N=block_n) for block_n in (32, 64, 128)]
    if tma:
        changes += [dict(DESCRIPTORS=not base["DESCRIPTORS"])]
    found = [dict(base)]
    for change in changes:
        tiles = {**base, **change}
        if tiles not in found:
            found.append(tiles)
    return found


def tiles_name(tiles: dict) -> str:
    loads = "tma" if tiles["DESCRIPTORS"] else "ptr"
    return f"{tiles['BLOCK_M']}x{tiles['BLOCK_N']} w{tiles['num_warps']} s{tiles['num_stages']} {loads}"


# --------------------------------------------------------------------------------------------------------------
# The worker: one variant in its own process (python -m bench.diagnose_attention --worker HEAD_DIM TILES_JSON
# [small]), the layout set by QVL_ATTENTION_HEAD_DIM; one JSON line per case.
# --------------------------------------------------------------------------------------------------------------
def run_variant(head_dim: int, tiles: dict, small: bool = False) -> None:
    """The cases at the GPU's sizes (16 heads), or the interpreter's (2 heads) where ``small``, on a CPU, or under a
    sanitizer (whose racecheck takes minutes at the GPU's sizes)."""
    import torch

    from qvl.kernels.attention import vision_attn_launches
    from qvl.kernels.common import device_target, run_launches, triton_interpreting
    from qvl.kernels.tolerance import worst_of
    from qvl.kernels.verify import ATTENTION_CASES, INTERPRETER_ATTENTION_CASES, AttentionProblem, cu_seqlens_of

    on_cpu = triton_interpreting() or not torch.cuda.is_available()
    device = torch.device("cpu" if on_cpu else "cuda")
    target = device_target(device)
    cases, num_heads = (INTERPRETER_ATTENTION_CASES, 2) if small or on_cpu else (ATTENTION_CASES, 16)
    for index, case in enumerate(c for c in cases if c.name in CASES):
        generator = torch.Generator().manual_seed(head_dim * 100 + index)
        qkv = torch.randn(sum(case.lengths), 3, num_heads, head_dim, generator=generator).to(device, torch.bfloat16)
        q, k, v = qkv.unbind(1)
        cu_seqlens = cu_seqlens_of(case.lengths, device)
        out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=device)
        launches = vision_attn_launches(q, k, v, out, cu_seqlens, None, None, 10000.0, target, case.max_seqlen,
                                        tiles=tiles)  # fmt: skip
        run_launches(launches, device)
        problem = AttentionProblem(q, k, v, cu_seqlens, target, case.max_seqlen)
        worst, passed, failure = worst_of(problem.check(out, tiles["BLOCK_N"]))
        print(json.dumps(dict(case=case.name, worst=worst, passed=passed, failure=failure)), flush=True)


# --------------------------------------------------------------------------------------------------------------
# The parent.
# --------------------------------------------------------------------------------------------------------------
def _environment(layout: str) -> dict[str, str]:
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    return {**os.environ, "QVL_ATTENTION_HEAD_DIM": layout, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}


def _worker_command(head_dim: int, tiles: dict, small: bool = False) -> list[str]:
    command = [sys.executable, "-m", "bench.diagnose_attention", "--worker", str(head_dim), json.dumps(tiles)]
    return [*command, "small"] if small else command


def base_tiles(layout: str, head_dim: int) -> tuple[dict, bool]:
    """The tiles ``layout`` takes at ``head_dim`` for whole images (bf16, this process's device), and whether the
    device has TMA."""
    import torch

    from qvl.kernels import attention
    from qvl.kernels.common import device_target, triton_interpreting

    interpreting = triton_interpreting() or not torch.cuda.is_available()
    target = device_target(torch.device("cpu" if interpreting else "cuda"))
    with attention.head_dim_layout_in(layout):
        config = attention.launch_config(head_dim, torch.bfloat16, target)
    return {key: config[key] for key in TILE_KEYS}, attention.tma_capable(target)


def diagnose(
    layouts: Sequence[str], head_dims: Sequence[int], timeout_s: float, plans: dict | None = None
) -> list[Result]:
    """Every variant of each layout and head dim, each in its own process, all started at once, waited for until
    ``timeout_s`` from the start. ``plans`` (the tests' handle): ``{(layout, head_dim): [tiles, ...]}`` in place of
    :func:`variants` of :func:`base_tiles`."""
    deadline = time.monotonic() + timeout_s
    started = []
    for layout in layouts:
        for head_dim in head_dims:
            if plans is not None:
                tiles_list = plans[layout, head_dim]
            else:
                tiles_list = variants(*base_tiles(layout, head_dim))
            for tiles in tiles_list:
                command = _worker_command(head_dim, tiles)
                started.append((layout, head_dim, tiles, start_worker(command, _environment(layout))))
    results = []
    for layout, head_dim, tiles, process in started:
        stdout, failure = worker_output(process, deadline)
        cases = {}
        for line in stdout.splitlines():
            with contextlib.suppress(ValueError, KeyError):  # a worker that died mid-line leaves part of one
                row = json.loads(line)
                cases[row["case"]] = (row["worst"], row["passed"], row["failure"])
        results.append(Result(layout, head_dim, tiles, cases, failure))
    return results


def sanitize(layout: str, head_dim: int, tiles: dict, timeout_s: float) -> dict[str, str]:
    """The layout's tiles under compute-sanitizer's racecheck and synccheck, on the small cases: each tool's error
    summary (or why it did not run)."""
    tool = shutil.which("compute-sanitizer")
    if tool is None:
        return {"racecheck": "compute-sanitizer not found", "synccheck": "compute-sanitizer not found"}
    found = {}
    for name in ("racecheck", "synccheck"):
        command = [tool, "--tool", name, "--error-exitcode", "1", *_worker_command(head_dim, tiles, small=True)]
        try:
            done = subprocess.run(command, env=_environment(layout), capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            found[name] = "hung: no end within the time limit"
            continue
        summary = [line.strip() for line in done.stdout.splitlines() if "ERROR SUMMARY" in line]
        found[name] = (summary or [f"exit status {done.returncode}"])[-1]
    return found


def from_check(path: str) -> tuple[list[str], list[int]]:
    """The split layouts a ``qvl check --json`` file found wrong, and the head dims it checked them at."""
    with open(path) as file:
        checked = json.load(file)
    layouts = [
        layout for layout in LAYOUTS if checked["verdicts"].get(f"head_dim:{layout}", {}).get("verdict") == "wrong"
    ]
    head_dims = sorted({
        int(found.group(1))
        for row in checked["rows"]
        if row["variant"].removeprefix("head_dim ") in layouts and (found := re.match(r"vision_attn D(\d+)", row["op"]))
    })  # fmt: skip
    return layouts, head_dims or list(HEAD_DIMS)


def table(results: Sequence[Result], names: Sequence[str] = CASES) -> str:
    lines = [f"{'layout':<8} {'D':>3} {'tiles':<20} " + " ".join(f"{name:>16}" for name in names)]
    notes = []
    for result in results:
        cells = []
        for name in names:
            if name not in result.cases:
                cells.append("-")
                continue
            worst, passed, failure = result.cases[name]
            cells.append(f"{'right' if passed else 'WRONG'} {worst:.3g}")
            if not passed:
                notes.append(f"    {result.layout} D{result.head_dim} {tiles_name(result.tiles)}, {name}: {failure}")
        line = f"{result.layout:<8} {result.head_dim:>3} {tiles_name(result.tiles):<20} "
        line += " ".join(f"{cell:>16}" for cell in cells)
        if result.failure is not None:
            line += f"  {result.failure}"
        lines.append(line)
    return "\n".join([*lines, *notes])


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--worker"]:
        run_variant(int(argv[1]), json.loads(argv[2]), small=argv[3:] == ["small"])
        return 0
    parser = argparse.ArgumentParser(
        prog="python -m bench.diagnose_attention",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--head-dims", type=int, nargs="+", default=list(HEAD_DIMS))
    parser.add_argument("--from-check", metavar="JSON", help="the layouts and head dims a qvl check file found wrong")
    parser.add_argument("--timeout-s", type=float, default=90.0, help="for all variants at once (default: 90)")
    parser.add_argument("--sanitizer", action="store_true", help="racecheck and synccheck of each layout's tiles")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    layouts, head_dims = args.layouts, args.head_dims
    if args.from_check:
        layouts, head_dims = from_check(args.from_check)
        if not layouts:
            print(f"nothing to diagnose: {args.from_check} found no split layout wrong")
            return 0
    started = time.monotonic()
    results = diagnose(layouts, head_dims, args.timeout_s)
    print(table(results), flush=True)
    sanitizers = {}

    def write() -> None:  # after the variants and after each sanitizer run: a run cut short keeps what it found
        if args.json:
            with open(args.json, "w") as file:
                json.dump(dict(results=[r._asdict() for r in results], sanitizers=sanitizers), file, indent=1)

    write()
    if args.sanitizer:
        for layout in layouts:
            first = next(result for result in results if result.layout == layout)
            left = args.timeout_s - (time.monotonic() - started)
            sanitizers[layout] = sanitize(layout, first.head_dim, first.tiles, max(left / 2, 1.0))
            print(f"{layout} D{first.head_dim} {tiles_name(first.tiles)}: {sanitizers[layout]}", flush=True)
            write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
