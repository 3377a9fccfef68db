"""Every qvl benchmark in one command, one module after another, with shared options:

    python -m bench [--quick] [--dtype bf16] [--json-dir bench/results] [--only pos_embed,tower] [--device auto]
                    [--skip flex_attention] [--stamp YYYYmmdd-HHMMSS]

(``python -m bench.run_all`` is the same.) Each module writes its JSON to ``--json-dir`` as
``<bench>-<device>-<date>.json`` and prints its summary as it finishes; all summaries are printed
again at the end, tables last. A module that fails is reported and the others still run; the exit
status is 1 if any failed. Plots of the results (:mod:`bench.plot`) go beside the JSON as
``plot-<figure>-<device>-<date>.png``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import traceback
from collections.abc import Sequence
from pathlib import Path

import torch

from . import (
    bench_attention,
    bench_attention_backward,
    bench_cpu,
    bench_host,
    bench_merger,
    bench_pos_embed,
    bench_rotary,
    bench_tower,
    bench_window,
    harness,
)
from .harness import Report

MODULES = {
    "attention": bench_attention,
    "attention_backward": bench_attention_backward,
    "rotary": bench_rotary,
    "pos_embed": bench_pos_embed,
    "merger": bench_merger,
    "tower": bench_tower,
    "cpu": bench_cpu,  # the tower on the CPU (torch paths), whatever --device says
    "host": bench_host,  # host time per call (CUDA only)
    "window": bench_window,  # last: device_check.sh shows the end of the log, and this is the open goal
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=sorted(harness.DTYPES), help="one dtype (default: each module's own)")
    parser.add_argument("--quick", action="store_true", help="fewer, smaller cases (always on for CPU runs)")
    parser.add_argument("--json-dir", type=Path, default=harness.RESULTS_DIR, help="where the JSON files go")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--only", help=f"comma-separated subset of: {','.join(MODULES)}")
    parser.add_argument("--skip", default="", help="comma-separated peers every module leaves out")
    parser.add_argument(
        "--stamp",
        type=_stamp,
        help="the run's YYYYmmdd-HHMMSS in file names (default: now); calls sharing one are one run for bench.plot",
    )
    args = parser.parse_args(argv)
    args.names = list(MODULES) if args.only is None else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in args.names if n not in MODULES]
    if unknown or not args.names:
        parser.error(f"--only takes names from {','.join(MODULES)}, got {args.only!r}")
    return args


def _stamp(text: str) -> str:
    try:
        datetime.datetime.strptime(text, "%Y%m%d-%H%M%S")
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected YYYYmmdd-HHMMSS, got {text!r}") from None
    return text


def run(argv: Sequence[str] | None = None) -> tuple[dict[str, Report], dict[str, str]]:
    """Run the chosen modules and plot their results; returns ({name: report}, {name: why it failed})."""
    args = parse_args(argv)
    slug = harness.get_device(args.device).slug
    stamp = args.stamp or datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    shared = (
        ["--device", args.device]
        + (["--dtype", args.dtype] if args.dtype else [])
        + (["--quick"] if args.quick else [])
        + (["--skip", args.skip] if args.skip else [])
    )
    reports: dict[str, Report] = {}
    failures: dict[str, str] = {}
    for name in args.names:
        print(f"=== {name}", flush=True)
        path = args.json_dir / f"{name}-{slug}-{stamp}.json"
        try:
            reports[name] = MODULES[name].main([*shared, "--json", str(path)])
        except Exception as exc:  # noqa: BLE001 - one broken module must not cost the others' results
            traceback.print_exc()
            failures[name] = harness.reason(exc)
        # Each module's tensors and compiled graphs are garbage once it returns: free the GPU for the next.
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    write_plots(reports, args.json_dir, f"{slug}-{stamp}")
    return reports, failures


def write_plots(reports: dict[str, Report], out_dir: Path, run: str) -> None:
    """Draw the run's plots beside its JSON files (:mod:`bench.plot`) and print their paths. A plotting
    failure, matplotlib missing included, costs the plots only: it is printed, the run goes on."""
    try:
        from . import plot

        paths = plot.write_plots([report.to_json() for report in reports.values()], out_dir, run)
    except Exception as exc:  # noqa: BLE001 - the measurements are saved already; the plots are extra
        print(f"plots skipped: {harness.reason(exc)}", flush=True)
        return
    for path in paths:
        print(f"plot: {path}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    reports, failures = run(argv)
    print("\n=== all results", flush=True)
    for report in reports.values():
        print(f"\n{report.summary()}")
    for name, why in failures.items():
        print(f"\nFAILED {name}: {why}")
    print(flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
