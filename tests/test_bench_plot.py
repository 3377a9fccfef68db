"""bench.plot: the figures drawn from benchmark reports' JSON, on an H200-like run built from the benches' own
GPU case lists (the case-name grammar the plot parses is theirs), and the hooks that draw them (python -m
bench, python -m bench.plot DIR)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# bench/ is a plain directory run from the repository root, not an installed package.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import bench_attention, bench_window, harness, plot, run_all  # noqa: E402
from bench.harness import Report, Timing  # noqa: E402
from bench.workloads import seqlens  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"
# A GPU by name and peaks only: nothing runs on it, the benches' GPU case lists and the report's "% peak" need it.
H200 = harness.Device(torch.device("cuda", 0), "NVIDIA H200", harness.PEAKS["H200"], 60 * 2**20)
RUN = "nvidia-h200-20260101-120000"


def timed(report: Report, case: str, impls: dict[str, float], work: float, metric: str | None = None) -> None:
    """Records of ``case`` at the given rates (report units), as a bench's check_then_time would add them."""
    scale = harness.METRICS[metric or report.metric][1]
    for impl, rate in impls.items():
        ms = work / (rate * scale) * 1e3
        report.add(case, impl, Timing(ms, 0.9 * ms, 1.1 * ms), work, None if impl == "qvl" else 1e-3, metric=metric)


def attention_report(bench: str, factor: float = 1.0) -> tuple[dict, dict[str, float]]:
    """bench_attention's full GPU case list at made-up rates; also {case: sum(S^2)/sum(S)}."""
    report = Report(bench, H200, torch.bfloat16, "flops", bench_attention.BASELINES)
    lengths = {}
    for case in bench_attention.cases(H200, quick=False):
        sizes = seqlens(case.grids)
        lengths[case.name] = sum(s * s for s in sizes) / sum(sizes)
        work = factor * harness.attention_flops(case.dims.num_heads, case.dims.head_dim, sizes)
        timed(report, case.name, {"qvl": 400.0, "qvl+rope": 380.0, "varlen_attn": 300.0}, work)
    return report.to_json(), lengths


def window_report() -> dict:
    """bench_window's full GPU case list: window and full-attention cases."""
    report = Report("window", H200, torch.bfloat16, "flops", bench_window.BASELINES)
    for case in bench_window.cases(H200, quick=False):
        dims = bench_window.QWEN2_5
        work = harness.attention_flops(dims.num_heads, dims.head_dim, case.seqlens)
        timed(report, case.name, {"qvl": 350.0, "varlen_attn": 250.0, "sdpa/batched": 100.0}, work)
    return report.to_json()


def bandwidth_reports() -> list[dict]:
    """rotary with two GB/s cases; merger with GB/s cases and a TFLOP/s one the bar chart leaves out."""
    rotary = Report("rotary", H200, torch.bfloat16, "bytes", ("hf eager",))
    for case in ("T=1024", "T=4096"):
        timed(rotary, case, {"qvl": 3000.0, "qvl in-place": 3100.0, "hf eager": 900.0}, 1e8)
    merger = Report("merger", H200, torch.bfloat16, "bytes", ("eager",))
    timed(merger, "layer_norm 4096x1152", {"qvl": 3500.0, "eager": 2000.0}, 2e7)
    timed(merger, "bias_gelu tanh 4096x4304", {"qvl": 3300.0, "qvl in-place": 3400.0, "eager": 1500.0}, 7e7)
    timed(merger, "merger T=4096 C=1152", {"qvl": 500.0, "eager": 450.0}, 1e11, metric="flops")
    return [rotary.to_json(), merger.to_json()]


def labels(ax) -> list[str]:
    return [line.get_label() for line in ax.get_lines()]


def test_constants_match_the_benches() -> None:
    assert plot.WINDOW_HEAD_DIM == bench_window.QWEN2_5.head_dim
    assert plot.WINDOW_PATCH_PX == bench_window.PATCH
    report = Report("x", H200, torch.bfloat16, "flops", ()).to_json()
    assert plot.peak(report, "TFLOP/s") == H200.peak("flops", torch.bfloat16)
    assert plot.peak(report, "GB/s") == H200.peak("bytes", torch.bfloat16)
    fp32 = Report("x", H200, torch.float32, "flops", ()).to_json()
    assert plot.peak(fp32, "TFLOP/s") is None


def test_attention_points_sit_at_sum_s2_over_sum_s() -> None:
    """x of every case, mixed batches included (their sum(S^2) recovered from the work), is sum(S^2)/sum(S)."""
    for bench, factor in (("attention", 1.0), ("attention_backward", 3.5)):
        data, lengths = attention_report(bench, factor)
        panels, unplaced = plot.attention_points(data)
        assert unplaced == [] and sorted(panels) == [64, 72]
        points = [p for points in panels.values() for p in points]
        assert sorted((p.case, p.impl) for p in points) == sorted((r["case"], r["impl"]) for r in data["records"])
        for p in points:
            assert p.x == pytest.approx(lengths[p.case]) and p.one_image == p.case.startswith(("8B S=", "2B S="))
    panels, unplaced = plot.attention_points(window_report())
    frame = {case.name: case.seqlens for case in bench_window.cases(H200, quick=False) if not case.window}
    assert unplaced == [name for name, lengths in frame.items() if len(set(lengths)) > 1]  # "full mixed 5"
    assert sorted(panels) == [80]
    for p in panels[80]:
        assert p.x == frame[p.case][0] and p.one_image == (len(frame[p.case]) == 1)


def test_figures_draw_one_line_per_implementation_and_the_peaks() -> None:
    attention, _ = attention_report("attention")
    backward, _ = attention_report("attention_backward", 3.5)
    figs = plot.figures([attention, backward, window_report(), *bandwidth_reports()])
    assert list(figs) == ["attention", "attention_backward", "bandwidth"]
    peak_tflops = "measured peak 790 TFLOP/s"

    forward = figs["attention"]
    assert [ax.get_title().split(":")[0] for ax in forward.axes] == ["D 64", "D 72", "D 80"]
    assert forward.get_suptitle().startswith("Attention forward\nNVIDIA H200 | bfloat16\n")
    impls = ["qvl", "qvl+rope", "varlen_attn"]
    batches = [f"_{impl} batch" for impl in impls]
    for ax in forward.axes[:2]:  # single images on lines, the mixed batch as unjoined stars, the peak
        assert sorted(labels(ax)) == sorted([*impls, *batches, peak_tflops])
    window_impls = ["qvl", "varlen_attn", "sdpa/batched"]
    # D 80: one image (a line) and 16 equal frames (a batch); the mixed layout cannot be placed.
    assert sorted(labels(forward.axes[2])) == sorted(
        [*window_impls, *(f"_{i} batch" for i in window_impls), peak_tflops]
    )
    assert forward.get_suptitle().endswith(
        "not plotted (tokens per segment not in the case name): full mixed 5 (6 segs)"
    )
    assert [ax.get_title().split(":")[0] for ax in figs["attention_backward"].axes] == ["D 64", "D 72"]

    bars = figs["bandwidth"]
    assert [ax.get_title() for ax in bars.axes] == ["rotary", "merger"]
    rotary, merger = bars.axes
    assert len(rotary.patches) == 6 and len(merger.patches) == 5  # one bar per GB/s record
    for ax in bars.axes:
        assert labels(ax) == ["measured peak 4300 GB/s"]


def test_write_plots_and_cpu_title(tmp_path: Path) -> None:
    attention, _ = attention_report("attention")
    attention["timings_meaningful"] = False
    figs = plot.figures([attention])
    assert list(figs) == ["attention"] and "CPU: timings meaningless" in figs["attention"].get_suptitle()
    paths = plot.write_plots([attention, *bandwidth_reports()], tmp_path / "out", RUN)
    assert [p.name for p in paths] == [f"plot-attention-{RUN}.png", f"plot-bandwidth-{RUN}.png"]
    for path in paths:
        assert path.read_bytes().startswith(PNG) and path.stat().st_size > 10_000
    assert plot.write_plots([], tmp_path, RUN) == []


def test_python_m_bench_plot_redraws_a_directory(tmp_path: Path) -> None:
    attention, _ = attention_report("attention")
    for data in (attention, window_report(), *bandwidth_reports()):
        (tmp_path / f"{data['bench']}-{RUN}.json").write_text(json.dumps(data))
    (tmp_path / "other.json").write_text("[]")  # not a report: ignored
    result = subprocess.run(
        [sys.executable, "-m", "bench.plot", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    expected = {f"plot-{name}-{RUN}.png" for name in ("attention", "bandwidth")}
    assert {p.name for p in tmp_path.glob("*.png")} == expected
    assert all((tmp_path / name).read_bytes().startswith(PNG) for name in expected)
    assert plot.main([str(tmp_path / "other.json")]) == 1


def test_python_m_bench_plots_its_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert run_all.main(["--device", "cpu", "--only", "rotary", "--json-dir", str(tmp_path)]) == 0
    (json_path,) = tmp_path.glob("rotary-cpu-*.json")
    (png,) = tmp_path.glob("plot-bandwidth-cpu-*.png")
    assert png.name == f"plot-bandwidth-{json_path.stem.removeprefix('rotary-')}.png"
    assert png.read_bytes().startswith(PNG)
    assert f"plot: {png}" in capsys.readouterr().out


def test_a_plot_failure_does_not_fail_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(reports, out_dir, run):
        raise RuntimeError("no display")

    monkeypatch.setattr(plot, "write_plots", broken)
    assert run_all.main(["--device", "cpu", "--only", "rotary", "--json-dir", str(tmp_path)]) == 0
    assert "plots skipped: RuntimeError: no display" in capsys.readouterr().out
    assert list(tmp_path.glob("rotary-cpu-*.json")) and not list(tmp_path.glob("*.png"))
