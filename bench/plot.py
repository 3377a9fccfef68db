"""Plots of a benchmark run, drawn from its reports' JSON. ``python -m bench`` draws them after its JSON files;

    python -m bench.plot PATH [PATH ...] [--out DIR]

redraws them from saved results: each PATH a results directory or a JSON file. Files named as
``python -m bench`` names them (``<bench>-<device>-<stamp>.json``) are grouped by run (device and stamp);
any other report file is a run of its own. Each run's PNGs go beside its JSON (or into ``--out``):

- ``plot-attention-<run>.png``: useful TFLOP/s of the attention forward against tokens per segment, one
  panel per head dim: D 64 (2B) and D 72 (8B) from ``bench_attention``, D 80 from ``bench_window``'s
  full-attention cases (Qwen2.5-VL, one segment per frame). Single images make the lines; batches of
  several segments are single markers at sum(S^2)/sum(S), the image length whose attention does the same
  work per token (so a mixed batch sits where its work per token says, not at its mean length).
- ``plot-attention_backward-<run>.png``: the same for forward + backward.
- ``plot-bandwidth-<run>.png``: the GB/s records of ``bench_rotary``, ``bench_pos_embed`` and
  ``bench_merger`` as grouped bars, one panel per benchmark.

The device's measured peak is a dashed line where the report has one. CPU runs are drawn too, titled as
meaningless. Figures use matplotlib's Agg canvas directly: no pyplot, so no window and no global state.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import NullLocator, ScalarFormatter

from .workloads import MODELS

# bench_window's Qwen2.5-VL head dim and pixels per patch (its QWEN2_5 and PATCH; that module is not
# imported because it loads the kernels, and tests/test_bench_plot.py keeps the two in step).
WINDOW_HEAD_DIM = 80
WINDOW_PATCH_PX = 14

BANDWIDTH_BENCHES = ("rotary", "pos_embed", "merger")
RUN_FILE = re.compile(r"^(?P<bench>[a-z_]+)-(?P<run>.+-\d{8}-\d{6})\.json$")
X_LABEL = "tokens per segment: S of one image (lines); sum(S²)/sum(S) of a batch (★)"


ReportJson = Mapping[str, Any]  # one report's JSON (harness.Report.to_json)


# --------------------------------------------------------------------------------------------------
# What the reports hold
# --------------------------------------------------------------------------------------------------
def peak(report: ReportJson, unit: str) -> float | None:
    """The measured ceiling the report's "% peak" uses for rates in ``unit`` (harness.Device.peak's rule:
    the matmul peak is a 16-bit one), or None."""
    peaks = report.get("peaks")
    if not peaks:
        return None
    if unit == "GB/s":
        return peaks["copy_gbs"]
    if unit == "TFLOP/s" and report["dtype"] in ("bfloat16", "float16"):
        return peaks["matmul_tflops"]
    return None


def rated(report: ReportJson, unit: str) -> list[dict[str, Any]]:
    """The report's records in ``unit`` with a finite rate (the JSON writes a non-finite one as a string)."""
    return [r for r in report["records"] if r["unit"] == unit and isinstance(r["rate"], (int, float))]


@dataclass(frozen=True)
class Split:
    """How a case's tokens split into attention segments, as far as its name says."""

    panel: int  # head dim
    segments: int
    tokens: int
    equal: bool  # all segments the same length (then tokens / segments is it)


def split(bench: str, case: str) -> Split | None:
    """Parse a case name of bench_attention(_backward) ("8B S=4096", "8B 8 imgs 256..4096 (16016)") or of
    bench_window's full-attention cases ("full 1344x1344 (1 seg)", "full 16x 1344x1344 (16 segs)",
    "full video 4x 644x868 (4 segs)"); None for anything else (window segments, a mixed window layout)."""
    if bench == "window":
        m = re.fullmatch(r"full (?:video )?(?:\d+x )?(\d+)x(\d+) \((\d+) segs?\)", case)
        if m is None:
            return None
        height, width, count = (int(g) for g in m.groups())
        per_frame = (height // WINDOW_PATCH_PX) * (width // WINDOW_PATCH_PX)
        return Split(WINDOW_HEAD_DIM, count, count * per_frame, equal=True)
    model, _, rest = case.partition(" ")
    if model not in MODELS:
        return None
    head_dim = MODELS[model].head_dim
    if m := re.fullmatch(r"S=(\d+)", rest):
        return Split(head_dim, 1, int(m[1]), equal=True)
    if m := re.fullmatch(r"(\d+) imgs \d+\.\.\d+ \((\d+)\)", rest):
        return Split(head_dim, int(m[1]), int(m[2]), equal=False)
    return None


@dataclass(frozen=True)
class Point:
    case: str
    x: float  # sum(S^2) / sum(S)
    one_image: bool
    impl: str
    rate: float


def attention_points(report: ReportJson) -> tuple[dict[int, list[Point]], list[str]]:
    """The report's TFLOP/s records by head dim, and the cases that could not be placed on the x axis.

    A batch of unequal segments gets sum(S^2) from its work: useful FLOPs are a constant times sum(S^2)
    (harness.attention_flops), and an equal-segment case of the same head dim in the report gives the
    constant, so no model constant is repeated here.
    """
    # bench_window's window cases are many short segments, not full attention: not drawn.
    records = [r for r in rated(report, "TFLOP/s") if report["bench"] != "window" or r["case"].startswith("full ")]
    splits = {r["case"]: split(report["bench"], r["case"]) for r in records}
    per_pair = {}  # head dim -> useful FLOPs per query-key pair
    for r in records:
        s = splits[r["case"]]
        if s is not None and s.equal:
            per_pair.setdefault(s.panel, r["work"] / (s.tokens**2 / s.segments))
    panels: dict[int, list[Point]] = {}
    unplaced = []
    for r in records:
        s = splits[r["case"]]
        if s is None or not (s.equal or s.panel in per_pair):
            if r["case"] not in unplaced:
                unplaced.append(r["case"])
            continue
        x = s.tokens / s.segments if s.equal else r["work"] / per_pair[s.panel] / s.tokens
        panels.setdefault(s.panel, []).append(Point(r["case"], x, s.segments == 1, r["impl"], r["rate"]))
    return panels, unplaced


# --------------------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------------------
def _colors(impls: Iterable[str]) -> dict[str, Any]:
    """One colour per implementation, in order of first appearance (qvl, listed first by every bench, is blue)."""
    order = list(dict.fromkeys(impls))
    cmap = colormaps["tab10" if len(order) <= 10 else "tab20"]
    return {impl: cmap(i % cmap.N) for i, impl in enumerate(order)}


def _title(what: str, reports: Sequence[ReportJson]) -> str:
    first = reports[0]
    title = f"{what}\n{first['device']['name']} | {first['dtype']}"
    if not all(r.get("timings_meaningful", True) for r in reports):
        title += " | CPU: timings meaningless"
    return title


def _peak_line(ax, value: float | None, unit: str) -> None:
    if value is not None:
        ax.axhline(value, color="0.3", linestyle="--", linewidth=1, label=f"measured peak {value:g} {unit}")


def _legend(fig: Figure, extra: Mapping[str, Any] | None = None) -> None:
    """One legend below the panels, each label once (an implementation has one colour in all of them): a
    legend inside a panel would hide the bars or points under it."""
    entries = {}
    for ax in fig.axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            entries.setdefault(label, handle)
    entries.update(extra or {})
    fig.legend(list(entries.values()), list(entries), loc="outside lower center", ncols=min(len(entries), 5))


def attention_figure(what: str, reports: Sequence[ReportJson]) -> Figure | None:
    """Useful TFLOP/s against tokens per segment, a panel per head dim, from attention-type reports
    (bench_attention, bench_attention_backward, bench_window); None when no record can be placed."""
    panels: dict[int, tuple[ReportJson, list[Point]]] = {}
    unplaced = []
    for report in reports:
        by_dim, missed = attention_points(report)
        unplaced += missed
        for dim, points in by_dim.items():
            panels[dim] = (report, points)
    if not panels:
        return None
    colors = _colors(p.impl for _, points in panels.values() for p in points)
    fig = Figure(figsize=(1 + 6 * len(panels), 6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, dim in zip(axes, sorted(panels), strict=True):
        report, points = panels[dim]
        if report["bench"] == "window":
            source = "Qwen2.5-VL full-attention blocks (window bench)"
        else:
            source = "Qwen3-VL " + " ".join(name for name, dims in MODELS.items() if dims.head_dim == dim)
        for impl in dict.fromkeys(p.impl for p in points):
            line = sorted((p.x, p.rate) for p in points if p.impl == impl and p.one_image)
            batch = [(p.x, p.rate) for p in points if p.impl == impl and not p.one_image]
            if line:
                ax.plot(*zip(*line, strict=True), marker="o", color=colors[impl], label=impl)
            if batch:
                # Unjoined: a batch is not a point on the single-image curve, only placed by its work per token.
                ax.plot(*zip(*batch, strict=True), linestyle="none", marker="*", markersize=12, color=colors[impl],
                        label=f"_{impl} batch")  # fmt: skip
        _peak_line(ax, peak(report, "TFLOP/s"), "TFLOP/s")
        ax.set_xscale("log", base=2)
        # Ticks at the lengths measured: powers of two alone leave a narrow CPU run's axis unlabelled.
        ax.set_xticks(sorted({round(p.x) for p in points}))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_ylim(bottom=0)
        ax.set_title(f"D {dim}: {source}")
        ax.set_xlabel(X_LABEL)
        ax.set_ylabel("useful TFLOP/s")
        ax.grid(alpha=0.3)
    batches = any(not p.one_image for _, points in panels.values() for p in points)
    star = Line2D([], [], linestyle="none", marker="*", markersize=12, color="0.4")
    _legend(fig, {"batch of several segments": star} if batches else {})
    # Under the title: a note at the bottom would collide with the legend there.
    missing = f"\nnot plotted (tokens per segment not in the case name): {', '.join(unplaced)}" if unplaced else ""
    fig.suptitle(_title(what, reports) + missing)
    return fig


def bandwidth_figure(reports: Sequence[ReportJson]) -> Figure | None:
    """GB/s per case and implementation as grouped bars, a panel per report; None when none has GB/s records."""
    panels = [(r, rated(r, "GB/s")) for r in reports]
    panels = [(r, recs) for r, recs in panels if recs]
    if not panels:
        return None
    colors = _colors(rec["impl"] for _, recs in panels for rec in recs)
    widths = [max(5.0, 1.3 * len({rec["case"] for rec in recs})) for _, recs in panels]
    fig = Figure(figsize=(sum(widths) + 1, 6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False, width_ratios=widths)[0]
    for ax, (report, records) in zip(axes, panels, strict=True):
        cases = list(dict.fromkeys(rec["case"] for rec in records))
        impls = list(dict.fromkeys(rec["impl"] for rec in records))
        width = 0.8 / len(impls)
        rates = {(rec["case"], rec["impl"]): rec["rate"] for rec in records}
        for i, impl in enumerate(impls):
            drawn = [(c, rates[case, impl]) for c, case in enumerate(cases) if (case, impl) in rates]
            ax.bar([c + (i - (len(impls) - 1) / 2) * width for c, _ in drawn], [rate for _, rate in drawn],
                   width, color=colors[impl], label=impl)  # fmt: skip
        _peak_line(ax, peak(report, "GB/s"), "GB/s")
        ax.set_xticks(range(len(cases)), cases, rotation=20, ha="right", fontsize="small")
        ax.set_title(report["bench"])
        ax.set_ylabel("GB/s (minimum traffic)")
        ax.grid(axis="y", alpha=0.3)
    _legend(fig)
    fig.suptitle(_title("Memory-bound kernels", [r for r, _ in panels]))
    return fig


def figures(reports: Iterable[ReportJson]) -> dict[str, Figure]:
    """One run's figures by name ("attention", "attention_backward", "bandwidth"), each only where its
    reports are there; other reports (tower) are not drawn."""
    by_bench = {r["bench"]: r for r in reports}
    drawn = {
        "attention": attention_figure(
            "Attention forward", [by_bench[b] for b in ("attention", "window") if b in by_bench]
        ),
        "attention_backward": attention_figure(
            "Attention forward + backward", [by_bench[b] for b in ("attention_backward",) if b in by_bench]
        ),
        "bandwidth": bandwidth_figure([by_bench[b] for b in BANDWIDTH_BENCHES if b in by_bench]),
    }
    return {name: fig for name, fig in drawn.items() if fig is not None}


def write_plots(reports: Iterable[ReportJson], out_dir: Path, run: str) -> list[Path]:
    """Draw one run's reports and save ``plot-<figure>-<run>.png`` files in ``out_dir``; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, fig in figures(reports).items():
        path = out_dir / f"plot-{name}-{run}.png"
        fig.savefig(path, dpi=110)
        paths.append(path)
    return paths


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------
def load_runs(paths: Iterable[Path]) -> dict[tuple[Path, str], list[ReportJson]]:
    """Report JSON files found at ``paths`` (directories are searched, not recursively), grouped by
    (directory, run); a JSON file that is not a report is ignored."""
    files = [f for p in paths for f in (sorted(p.glob("*.json")) if p.is_dir() else [p])]
    runs: dict[tuple[Path, str], list[ReportJson]] = {}
    for f in files:
        data = json.loads(f.read_text())
        if not (isinstance(data, dict) and "bench" in data and "records" in data):
            continue
        m = RUN_FILE.match(f.name)
        runs.setdefault((f.parent, m["run"] if m else f.stem), []).append(data)
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    """Redraw saved runs; exit status 1 when no report was found."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.plot", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("paths", nargs="+", type=Path, help="results directories or report JSON files")
    parser.add_argument("--out", type=Path, help="where the PNGs go (default: beside each run's JSON)")
    args = parser.parse_args(argv)
    missing = [str(path) for path in args.paths if not path.exists()]
    if missing:
        parser.error(f"no such file or directory: {', '.join(missing)}")
    runs = load_runs(args.paths)
    if not runs:
        print(f"no benchmark reports in {', '.join(map(str, args.paths))}")
        return 1
    for (folder, run), reports in runs.items():
        for path in write_plots(reports, args.out or folder, run):
            print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
