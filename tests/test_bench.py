"""Smoke test of the benchmarks' CPU mode: each module runs in-process on its torch paths and reports
the rows it should, with finite positive numbers. Nothing here asserts on speed."""

import importlib.util
import json
import math
import os
import re
import signal
import sys
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

# bench/ is a plain directory run from the repository root, not an installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import (  # noqa: E402
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
    run_all,
)
from bench.workloads import label  # noqa: E402
from qvl.kernels import direct  # noqa: E402
from qvl.kernels.attention import head_dim_tiles  # noqa: E402
from qvl.kernels.common import HOPPER  # noqa: E402

CPU = harness.get_device("cpu")


def run_cpu(module, tmp_path: Path, capsys) -> tuple[dict, str]:
    path = tmp_path / "results.json"
    module.main(["--device", "cpu", "--json", str(path)])
    return json.loads(path.read_text()), capsys.readouterr().out


def check_records(
    data: dict, expected: set[tuple[str, str]], baseline: str, reference: str = "qvl", unchecked: tuple[str, ...] = ()
) -> None:
    """Exactly the expected (case, impl) rows, with finite positive numbers; errors are measured
    against ``reference``, which has none of its own, as have the ``unchecked`` rows (a copy computes nothing)."""
    assert {(r["case"], r["impl"]) for r in data["records"]} == expected
    for r in data["records"]:
        for key in ("ms", "ms_lo", "ms_hi", "work", "rate", "speedup"):
            assert isinstance(r[key], float) and math.isfinite(r[key]) and r[key] > 0, (key, r)
        assert r["ms_lo"] <= r["ms"] <= r["ms_hi"]
        assert r["baseline"] == baseline
        assert r["share"] is None  # no peaks for a CPU
        assert r["agrees"], r
        if r["impl"] == reference or r["impl"] in unchecked:
            assert r["max_rel_err"] is None
        else:
            assert math.isfinite(r["max_rel_err"]) and r["max_rel_err"] >= 0


def check_meta(data: dict, bench: str) -> None:
    assert data["bench"] == bench
    assert data["device"]["type"] == "cpu" and data["timings_meaningful"] is False
    assert data["dtype"] == "bfloat16"
    assert data["versions"]["torch"] and data["versions"]["triton"]
    assert data["date"]


def check_table_last(out: str, last_case: str, last_impl: str) -> None:
    last_line = out.rstrip().splitlines()[-1]
    assert re.match(rf"{re.escape(last_case)}\s+{re.escape(last_impl)}\s", last_line), last_line


def test_attention_cpu(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    data, out = run_cpu(bench_attention, tmp_path, capsys)
    check_meta(data, "attention")
    names = [case.name for case in bench_attention.cases(CPU, quick=True)]
    impls = ("qvl", "qvl+rope", "rotary_2d+qvl", "rotary_2d_+qvl", "sdpa/image")
    check_records(data, {(c, i) for c in names for i in impls}, baseline="sdpa/image")
    for peer in ("varlen_attn", "flex_attention", "flash_attn"):
        assert data["skipped"][peer] == "CPU run: torch paths only"
    notes = (("qvl+rope", "fused rope "), ("rotary_2d+qvl", "separate rope "), ("rotary_2d_+qvl", "in-place rope "))
    for impl, note in notes:
        assert all(r["note"].startswith(note) for r in data["records"] if r["impl"] == impl)
    check_table_last(out, names[-1], "sdpa/image")


def test_attention_backward_cpu(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Forward + backward rows: every variant's gradients agree with qvl's (the rope variants' rotated back into
    the rotated frame), the work is 3.5x the forward's."""
    data, out = run_cpu(bench_attention_backward, tmp_path, capsys)
    check_meta(data, "attention_backward")
    cases = bench_attention.cases(CPU, quick=True)
    impls = ("qvl", "qvl+rope", "rotary_2d+qvl", "sdpa/image")
    check_records(data, {(c.name, i) for c in cases for i in impls}, baseline="sdpa/image")
    for case in cases:
        forward = harness.attention_flops(case.dims.num_heads, case.dims.head_dim, bench_attention.seqlens(case.grids))
        assert {r["work"] for r in data["records"] if r["case"] == case.name} == {3.5 * forward}
    for peer in ("varlen_attn", "flex_attention", "flash_attn"):
        assert data["skipped"][peer] == "CPU run: torch paths only"
    check_table_last(out, cases[-1].name, "sdpa/image")


def test_rotary_cpu(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    data, out = run_cpu(bench_rotary, tmp_path, capsys)
    check_meta(data, "rotary")
    names = [f"T={sum(h * w for h, w in grids)}" for grids in bench_rotary.cases(CPU, quick=True)]
    impls = ("qvl", "qvl in-place", "copy", "hf eager")
    check_records(data, {(c, i) for c in names for i in impls}, baseline="hf eager", unchecked=("copy",))
    assert data["skipped"]["hf compiled"] == "CPU run: torch paths only"
    for r in data["records"]:
        tokens = int(r["case"].removeprefix("T="))
        assert r["work"] == 2 * (2 * tokens * 16 * 72 * 2) + tokens * 2 * 4  # q, k (bf16) read and written; positions
    check_table_last(out, names[-1], "hf eager")


def test_pos_embed_cpu(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    data, out = run_cpu(bench_pos_embed, tmp_path, capsys)
    check_meta(data, "pos_embed")
    all_grids = bench_pos_embed.cases(CPU, quick=True)
    names = [label(grids) for grids in all_grids]
    impls = ("qvl", "qvl+metadata", "copy", "hf eager", "hf gather+add")
    check_records(data, {(c, i) for c in names for i in impls}, baseline="hf eager", unchecked=("copy",))
    for peer in ("hf compiled", "hf compiled gather+add"):
        assert data["skipped"][peer] == "CPU run: torch paths only"
    for grids in all_grids:
        tokens = sum(h * w for h, w in grids)
        # hidden (bf16, C = 1152) read and written, int32 indices and fp32 weights (4 taps), the 48x48 table
        work = 2 * tokens * 1152 * 2 + 2 * tokens * 4 * 4 + 48 * 48 * 1152 * 2
        assert {r["work"] for r in data["records"] if r["case"] == label(grids)} == {work}
    check_table_last(out, names[-1], "hf gather+add")


def test_merger_cpu(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    data, out = run_cpu(bench_merger, tmp_path, capsys)
    check_meta(data, "merger")
    all_cases = bench_merger.cases(CPU, quick=True)
    ops = {"layer_norm", "add_layer_norm", "rms_norm", "add_rms_norm", "bias_gelu", "bias_swiglu", "merger"}
    assert {c.op for c in all_cases} == ops
    assert {c.variant for c in all_cases if c.op == "bias_gelu"} == {"tanh", "none", "quick"}
    expected = set()
    for case in all_cases:
        impls = ("qvl", "qvl in-place", "eager") if case.op == "bias_gelu" else ("qvl", "eager")
        impls += ("copy",) if case.op != "merger" else ()
        expected |= {(case.name, impl) for impl in impls}
    check_records(data, expected, baseline="eager", unchecked=("copy",))
    assert data["skipped"]["compiled"] == "CPU run: torch paths only"
    units = {c.name: "TFLOP/s" if c.op == "merger" else "GB/s" for c in all_cases}
    assert all(r["unit"] == units[r["case"]] for r in data["records"])
    norm = next(c for c in all_cases if c.op == "layer_norm")
    norm_work = 2 * norm.rows * norm.cols * 2 + 2 * norm.cols * 2  # x read, y written, weight and bias (bf16)
    assert {r["work"] for r in data["records"] if r["case"] == norm.name} == {norm_work}
    swiglu = next(c for c in all_cases if c.op == "bias_swiglu")
    swiglu_work = 3 * swiglu.rows * swiglu.cols * 2 + 2 * swiglu.cols * 2  # gate and up read, y written, two biases
    assert {r["work"] for r in data["records"] if r["case"] == swiglu.name} == {swiglu_work}
    # Rows of both units share one table: each rate carries its unit.
    assert re.search(r"\sGB/s\s", out) and re.search(r"\sTFLOP/s\s", out)
    check_table_last(out, all_cases[-1].name, "eager")


def test_cpu_quick_run_leaves_no_file_unless_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A smoke run's numbers mean nothing: without --json it writes nothing into the checkout."""
    saved = []

    class Report:
        finish = harness.Report.finish

        def save(self, path, name=None):
            path = path or harness.RESULTS_DIR / f"{name}.json"
            saved.append(path)
            return path

        def summary(self):
            return ""

    monkeypatch.setattr(bench_cpu, "benchmark", lambda dtypes, quick: Report())
    bench_cpu.main(["--quick", "--dtype", "fp32"])
    assert saved == []
    bench_cpu.main(["--quick", "--dtype", "fp32", "--json", str(tmp_path / "r.json")])
    bench_cpu.main(["--dtype", "fp32"])
    assert saved[0] == tmp_path / "r.json" and saved[1].parent == harness.RESULTS_DIR


def test_cpu_tower_quick(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """bench_cpu's smoke run: per workload transformers, qvl and qvl compiled (vLLM's peers skipped where vllm does
    not import), each with its time, its error against transformers and its peak memory; the ratio table last."""
    path = tmp_path / "results.json"
    bench_cpu.main(["--quick", "--dtype", "fp32", "--json", str(path)])
    data, out = json.loads(path.read_text()), capsys.readouterr().out
    assert data["bench"] == "cpu" and data["dtype"] == "float32"
    cases = [f"float32 {label}" for label in bench_cpu.QUICK_WORKLOADS]
    impls = ["transformers", "qvl", "qvl compiled"]
    assert [(r["case"], r["impl"]) for r in data["records"]] == [(c, i) for c in cases for i in impls]
    for r in data["records"]:
        assert math.isfinite(r["ms"]) and r["ms"] > 0 and r["agrees"], r
        assert (r["max_rel_err"] is None) == (r["impl"] == "transformers")
    assert {(p["case"], p["impl"]) for p in data["peak_tensor_bytes"]} == {(c, i) for c in cases for i in impls}
    assert all(p["bytes"] > 0 for p in data["peak_tensor_bytes"])
    # The floor: qvl compiled's GEMM and attention time, once per case.
    assert [(f["case"], f["impl"]) for f in data["floor_ms"]] == [(c, "qvl compiled") for c in cases]
    assert all(math.isfinite(f["ms"]) and f["ms"] > 0 for f in data["floor_ms"])
    if importlib.util.find_spec("vllm") is None:
        assert data["skipped"]["vLLM (float32)"] == "vllm is not installed"
    header, _, *rows = out.rstrip().splitlines()[-2 - len(cases) :]
    assert header.split()[:4] == ["case", "transformers", "ms", "qvl"]
    assert [row.split()[:2] for row in rows] == [c.split()[:2] for c in cases]


def test_tower_cpu(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Forward cases (errors against hf sdpa's outputs) and a training-step case (errors of every implementation's
    parameter gradients against an fp32 copy of hf sdpa, transformers' own included), with their work counts."""
    data, out = run_cpu(bench_tower, tmp_path, capsys)
    check_meta(data, "tower")
    all_cases = bench_tower.cases(CPU, quick=True)
    forward = [case for case in all_cases if not case.training]
    training = [case for case in all_cases if case.training]
    assert [c.workload for c in forward] == bench_tower.workloads(CPU)
    assert [c.name for c in training] == ["tiny video 4 frames 4x4 training"]  # the smallest workload
    impls = ("qvl", "hf sdpa")
    by_mode = {mode: {**data, "records": [r for r in data["records"] if r["case"].endswith(" training") == mode]}
               for mode in (False, True)}  # fmt: skip
    check_records(by_mode[False], {(c.name, i) for c in forward for i in impls}, "hf sdpa", reference="hf sdpa")
    # transformers' own bf16 gradients are checked too; whether they are within the tolerance is theirs to say.
    qvl_training = {**data, "records": [r for r in by_mode[True]["records"] if r["impl"] == "qvl"]}
    check_records(qvl_training, {(c.name, "qvl") for c in training}, "hf sdpa", reference="hf sdpa")
    assert {(r["case"], r["impl"]) for r in by_mode[True]["records"]} == {(c.name, i) for c in training for i in impls}
    assert all(math.isfinite(r["max_rel_err"]) and r["max_rel_err"] > 0 for r in by_mode[True]["records"])
    for peer in ("qvl compiled", "hf flash_attention_2"):
        assert data["skipped"][peer] == "CPU run: torch paths only"
    for case in all_cases:
        rows = [r for r in data["records"] if r["case"] == case.name]
        work = bench_tower.forward_work(case.config, case.workload.grid_thw)
        forward_flops = work.patch_embed + work.linears + work.attention
        assert bench_tower.tower_flops(case.config, case.workload.grid_thw) == forward_flops
        expected = 2 * work.patch_embed + 3 * work.linears + 3.5 * work.attention if case.training else forward_flops
        assert {r["work"] for r in rows} == {expected}
        for r in rows:
            throughput, unit = data["throughput"][case.name][r["impl"]]
            assert unit == case.workload.unit and throughput == pytest.approx(case.workload.items / (r["ms"] * 1e-3))
            assert r["note"] == f"{throughput:.4g} {unit}, peak -"
            assert data["peak_memory_bytes"][case.name][r["impl"]] is None  # torch cannot measure CPU memory
    check_table_last(out, training[-1].name, "hf sdpa")


def test_a_benchmark_cut_by_sigterm_saves_its_rows(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A device script's timeout sends SIGTERM: the rows measured before it are saved and printed, noted as cut
    short, and the run exits with timeout's status; the previous SIGTERM handler is back afterwards."""
    previous = signal.getsignal(signal.SIGTERM)

    def benchmark(config: harness.RunConfig) -> harness.Report:
        report = harness.Report("cut", config.device, config.dtype, "bytes", ("a",))
        report.add("case", "a", harness.Timing(1.0, 0.9, 1.1), 1e6)
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(500):
                time.sleep(0.01)  # the handler raises at the next Python step
        except Exception:  # noqa: BLE001 - as a peer's failure handler does: the cut must pass through it
            pass
        raise AssertionError("SIGTERM did not cut the run")

    path = tmp_path / "cut.json"
    with pytest.raises(SystemExit) as exit_info:
        harness.main(None, benchmark, ["--device", "cpu", "--json", str(path)])
    assert exit_info.value.code == 124
    data = json.loads(path.read_text())
    assert [r["impl"] for r in data["records"]] == ["a"]
    assert data["notes"][-1].startswith("cut short by SIGTERM")
    assert "cut short by SIGTERM" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGTERM) is previous


def test_peers_skip_leaves_peers_unbuilt() -> None:
    """--skip's peers are never built (a compiled tower would take minutes); a failing build is a reason, not an
    error."""
    built = []

    def build(name: str) -> str:
        built.append(name)
        if name == "broken":
            raise RuntimeError("no such backend")
        return name

    builders = {name: partial(build, name) for name in ("kept", "left", "broken")}
    ready, skipped = harness.peers(builders, skip=frozenset({"left"}))
    assert ready == {"kept": "kept"} and built == ["kept", "broken"]
    assert skipped == {"left": "left out (--skip)", "broken": "RuntimeError: no such backend"}


class FakeStream:
    """One CUDA stream and the host's clock, simulated: what harness.device_time sees of a GPU. Seconds on both
    clocks; a launch costs the host ``host_s`` and the device ``kernel_s``; the spin kernel runs ``cycles /
    cycles_per_s``; ``syncs`` makes every call wait for the device first (as a ``.item()`` inside a call would)."""

    def __init__(self, host_s: float, kernel_s: float, cycles_per_s: float, syncs: bool = False):
        self.host = self.device = 0.0
        self.host_s, self.kernel_s, self.cycles_per_s, self.syncs = host_s, kernel_s, cycles_per_s, syncs
        self.spins: list[int] = []

    def synchronize(self) -> None:
        self.host = max(self.host, self.device)

    def enqueue(self, seconds: float) -> None:
        self.device = max(self.device, self.host) + seconds

    def sleep(self, cycles: int) -> None:
        self.spins.append(cycles)
        self.enqueue(cycles / self.cycles_per_s)

    def step(self) -> None:
        if self.syncs:
            self.synchronize()
        self.host += self.host_s
        self.enqueue(self.kernel_s)

    def event(self, enable_timing: bool = False):
        stream = self

        class Event:
            def record(self) -> None:
                stream.enqueue(0.0)
                self.at = stream.device

            def elapsed_time(self, end) -> float:
                return (end.at - self.at) * 1e3

        return Event()

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(torch.cuda, "synchronize", self.synchronize)
        monkeypatch.setattr(torch.cuda, "_sleep", self.sleep)
        monkeypatch.setattr(torch.cuda, "Event", self.event)
        monkeypatch.setattr(harness.time, "perf_counter", lambda: self.host)


@pytest.mark.parametrize("cycles_per_s", [1.5e9, 2.0e9, 4.0e9, 6.0e9])
def test_device_time_takes_the_host_out(monkeypatch: pytest.MonkeyPatch, cycles_per_s: float) -> None:
    """A 5 µs kernel behind 30 µs of host time per call (do_bench would say 30 µs): the bursts behind the spin give
    the kernel's 5 µs, whatever the device's clock (a spin shorter than the host's enqueue is retried twice as long)."""
    stream = FakeStream(host_s=30e-6, kernel_s=5e-6, cycles_per_s=cycles_per_s)
    stream.install(monkeypatch)
    assert harness.device_time(stream.step, per_call_ms=0.03) == pytest.approx(0.005)
    first = int(2 * harness.BURST_CALLS * 30e-6 * harness.SPIN_CYCLES_PER_S) + 1
    assert stream.spins[0] == first and len(stream.spins) <= harness.BURST_REPS + harness.SPIN_TRIES - 1
    assert all(later in (first, 2 * first, 4 * first) for later in stream.spins)


def test_device_time_of_a_call_that_waits_on_the_device_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = FakeStream(host_s=30e-6, kernel_s=5e-6, cycles_per_s=2e9, syncs=True)
    stream.install(monkeypatch)
    assert harness.device_time(stream.step, per_call_ms=0.035) is None
    assert len(stream.spins) == harness.SPIN_TRIES


def test_device_time_sizes_bursts_by_the_call() -> None:
    """Bursts of about BURST_MS of calls, BURST_CALLS at most; a call longer than BURST_MS (a tower's forward) gets
    none."""
    for per_call_ms, expected in ((50.0, 0), (6.0, 1), (0.2, 50), (0.001, harness.BURST_CALLS)):
        counted = []
        with pytest.MonkeyPatch.context() as patch:
            stream = FakeStream(host_s=1e-6, kernel_s=per_call_ms * 1e-3, cycles_per_s=2e9)
            stream.install(patch)

            def step(stream=stream) -> None:
                counted.append(1)
                stream.step()

            measured = harness.device_time(step, per_call_ms)
            assert measured == (pytest.approx(per_call_ms) if expected else None)
        assert len(counted) == expected * (1 + harness.BURST_REPS), per_call_ms


def test_peaks_of_the_lent_gpus() -> None:
    """Both kinds the device tool lends get their measured ceilings; another GPU gets no share-of-peak column."""
    assert harness.peaks_for("NVIDIA H200").copy_gbs == 4300.0
    assert harness.peaks_for("NVIDIA H100 80GB HBM3").copy_gbs == 3000.0
    assert harness.peaks_for("NVIDIA A100-SXM4-80GB") is None


def test_report_shows_device_time_beside_do_bench() -> None:
    report = harness.Report("device", CPU, torch.bfloat16, "bytes", ("a",))
    report.add("case", "a", harness.Timing(1.0, 0.9, 1.1, device_ms=0.25), 1e6)
    report.add("case", "b", harness.Timing(2.0, 1.9, 2.1), 1e6)
    a, b = report.records
    assert (a.device_ms, a.device_rate, a.rate) == (0.25, pytest.approx(4.0), pytest.approx(1.0))
    assert (b.device_ms, b.device_rate) == (None, None)
    header, _, row_a, row_b = report.table().splitlines()
    assert header.split()[:7] == ["case", "impl", "ms", "GB/s", "device", "ms", "device"]
    assert row_a.split()[2:5] == ["1", "1", "0.25"] and row_b.split()[2:6] == ["2", "0.5", "-", "-"]
    assert "device ms: GPU time per call" in report.summary()
    assert report.to_json()["records"][0]["device_rate"] == pytest.approx(4.0)


def test_tower_flops_counts_the_8b_tower() -> None:
    """A 64x64-patch image on the 8B tower, counted by hand from the model's shapes."""
    t, c, inter, out, heads = 4096, 1152, 4304, 4096, 16
    blocks = 27 * (2 * t * (3 * c * c + c * c + 2 * c * inter) + 4 * heads * (c // heads) * t * t)
    mergers = 4 * 2 * (t // 4) * (4 * c * 4 * c + 4 * c * out)
    patch_embed = 2 * t * 1536 * c
    config = bench_tower.TOWERS["8B"]
    assert bench_tower.tower_flops(config, [(1, 64, 64)]) == patch_embed + blocks + mergers


def test_tower_replay_budgets_hold_every_gpu_workload() -> None:
    """The replayed tower's budgets: each GPU workload fits one of them with less than REPLAY_BUDGET_STEP tokens
    of pad, and the replay row is never run for a training step."""
    gpu = SimpleNamespace(is_cuda=True)
    budgets = bench_tower.replay_budgets(gpu)
    assert budgets == [4096, 8192, 16384]
    for workload in bench_tower.workloads(gpu):
        tokens = sum(t * h * w for t, h, w in workload.grid_thw)
        fit = min(b for b in budgets if b >= tokens)
        assert fit - tokens < bench_tower.REPLAY_BUDGET_STEP, workload.name
    assert {"qvl replayed", "hf sdpa compiled"} <= bench_tower.FORWARD_ONLY


def test_window_cpu(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    data, out = run_cpu(bench_window, tmp_path, capsys)
    check_meta(data, "window")
    all_cases = bench_window.cases(CPU, quick=True)
    assert {c.window for c in all_cases} == {True, False}  # window blocks' segments and full-attention ones
    names = [case.name for case in all_cases]
    impls = ("qvl", "qvl no hint", "sdpa/window", "sdpa/batched")
    check_records(data, {(c, i) for c in names for i in impls}, baseline="sdpa/window")
    for peer in ("varlen_attn", "flex_attention", "flash_attn"):
        assert data["skipped"][peer] == "CPU run: torch paths only"
    for case in all_cases:
        assert max(case.seqlens) <= 64 if case.window else len(case.seqlens) == len(case.layout.grid_thw)
        rows = [r for r in data["records"] if r["case"] == case.name]
        assert {r["work"] for r in rows} == {4 * 16 * 80 * sum(s * s for s in case.seqlens)}
        hinted, plain = (w for w in data["executed_work"] if w["case"] == case.name)
        assert (hinted["hint"], plain["hint"]) == (max(case.seqlens), None)
        for r in rows:
            if r["impl"] in ("qvl", "qvl no hint"):
                work = hinted if r["impl"] == "qvl" else plain
                assert r["note"] == f"exec/useful {work['ratio']:.2f} ({work['tiles']} tiles)"
    check_table_last(out, names[-1], "sdpa/batched")


# Analytic counts of the launch (no kernel runs, no timing): Qwen2.5-VL's head dim 80 in both 16-bit dtypes.
@pytest.mark.parametrize("dtype", [harness.DTYPES["bf16"], harness.DTYPES["fp16"]], ids=["bf16", "fp16"])
@pytest.mark.usefixtures("empty_tile_table")  # the hint's effect on the heuristic's tiles
def test_window_hint_keeps_executed_work_near_useful(dtype) -> None:
    for layout in bench_window.LAYOUTS.values():
        window = bench_window.Case(layout, window=True)
        assert max(window.seqlens) == 64
        hinted, plain = bench_window.executed_work(window, dtype)
        assert hinted.hint == 64 and plain.hint is None
        # Rows and keys padded to tiles, times the head-dim tiles' columns of sm_90's layout (padded: 128 / 80).
        columns = head_dim_tiles(80, target=HOPPER).width / 80
        assert hinted.ratio <= 1.3 * columns, hinted
        assert 1.9 * columns <= plain.ratio <= 2.4 * columns, plain  # 128-row tiles half empty; edge windows more
        if all(h % 8 == 0 and w % 8 == 0 for _, h, w in layout.grid_thw):  # whole windows only
            assert (hinted.ratio, plain.ratio) == (columns, 2.0 * columns)
        # Full-attention segments are longer than 64: the hint selects nothing and nothing changes.
        full_hinted, full_plain = bench_window.executed_work(bench_window.Case(layout, window=False), dtype)
        assert full_hinted.ratio == full_plain.ratio <= 1.1 * columns and full_hinted.tiles == full_plain.tiles


@pytest.mark.usefixtures("empty_tile_table")  # the hint's effect on the heuristic's tiles
def test_window_work_table_prints_without_running_kernels(capsys: pytest.CaptureFixture) -> None:
    assert bench_window.main(["--work", "--device", "cpu"]) is None
    out = capsys.readouterr().out
    for layout in bench_window.LAYOUTS.values():
        for window in (True, False):
            name = bench_window.Case(layout, window).name
            assert len(re.findall(rf"^{re.escape(name)}\s", out, re.MULTILINE)) == 2  # with and without the hint
    # D 80 runs as wide as sm_90's layout tiles it (head_dim_tiles): whole windows execute the useful work times the
    # columns hinted, twice that without.
    columns = head_dim_tiles(80, target=HOPPER).width / 80
    hinted, plain = re.escape(f"{columns:.3f}"), re.escape(f"{2 * columns:.3f}")
    assert re.search(rf"^window 1344x1344 \(144 segs\)\s+9216\s+64\s+64\s+64x64\s.*\s{hinted}$", out, re.MULTILINE)
    assert re.search(rf"^window 1344x1344 \(144 segs\)\s+9216\s+64\s+none\s+128x64\s.*\s{plain}$", out, re.MULTILINE)


def test_run_all_only_selects_and_validates(capsys: pytest.CaptureFixture) -> None:
    assert list(run_all.MODULES) == [
        "attention",
        "attention_backward",
        "rotary",
        "pos_embed",
        "merger",
        "tower",
        "cpu",
        "host",
        "window",
    ]
    assert run_all.parse_args(["--only", "tower, pos_embed"]).names == ["tower", "pos_embed"]
    assert run_all.parse_args([]).names == list(run_all.MODULES)
    with pytest.raises(SystemExit):
        run_all.parse_args(["--only", "tower,nope"])
    assert "--only takes names from" in capsys.readouterr().err


def test_run_all_cpu(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    stamp = ["--stamp", "20261205-064220"]  # device_check.sh's calls share one: their files are one run for bench.plot
    assert run_all.main(["--device", "cpu", "--only", "pos_embed", "--json-dir", str(tmp_path), *stamp]) == 0
    (path,) = tmp_path.glob("pos_embed-cpu-20261205-064220.json")
    with pytest.raises(SystemExit):
        run_all.parse_args(["--stamp", "2026-12-05"])
    assert json.loads(path.read_text())["bench"] == "pos_embed"
    out = capsys.readouterr().out
    assert "=== all results" in out
    check_table_last(out, label(bench_pos_embed.cases(CPU, quick=True)[-1]), "hf gather+add")


def test_host_parses_its_arguments_and_needs_cuda(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = harness.parse_args(bench_host.__doc__, ["--device", "cpu", "--dtype", "fp16"])
    assert config.device == CPU and config.quick and config.dtype == torch.float16
    data, out = run_cpu(bench_host, tmp_path, capsys)
    assert data["bench"] == "host" and data["metric"] == "calls" and data["baselines"] == ["torch"]
    assert data["records"] == [] and data["skipped"] == {"all": bench_host.CUDA_NEEDED}
    assert bench_host.CUDA_NEEDED in out


def test_host_cases_call_each_op_and_its_torch_equivalent() -> None:
    """Every case's arguments fit its op (run here on the torch path), its direct call, and torch's call."""
    cases = bench_host.cases(CPU, torch.bfloat16)
    assert set(cases) == {
        "layer_norm", "add_layer_norm", "rms_norm", "add_rms_norm", "bias_gelu", "bias_swiglu", "rotary_2d",
        "pos_embed_interp_add_", "vision_attn",
    }  # fmt: skip
    with harness.qvl_path(CPU):
        for name, (args, torch_call) in cases.items():
            getattr(torch.ops.qvl, name)(*args)
            getattr(direct, name)(*args)
            torch_call()
