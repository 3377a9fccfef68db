"""What every qvl benchmark shares: the device and its ceilings, timing, work counting, peer probing,
agreement checks, and the report (a table printed last, a JSON file kept under ``bench/results``).

A benchmark module builds its cases and the implementations to compare, checks each against qvl,
times them with :func:`measure`, and hands the numbers to a :class:`Report`. CUDA timings come from
``triton.testing.do_bench`` (device events, median), and beside it the GPU time alone (:func:`device_time`: what a
kernel costs where the host's launch time hides it from do_bench). On CPU a wall-clock median stands in so that CI
can exercise the code paths; those numbers say nothing about kernels and are flagged as such.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import math
import platform
import re
import signal
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch
import triton
import triton.testing

import qvl.kernels.common as qvl_common
from qvl.kernels.attention import head_dim_layout

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# Largest max|out - ref| / max|ref| at which a peer still computes the same function as qvl. Both
# sides round their inputs and probabilities to the working dtype, so the bound follows its epsilon.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 2e-3}


# --------------------------------------------------------------------------------------------------
# Device and ceilings
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Peaks:
    """Ceilings of one GPU model. Shares of peak use the measured ones: they are what a kernel can
    reach on this hardware; the datasheet's numbers are kept in the JSON for context."""

    matmul_tflops: float  # dense 16-bit matrix product on random data
    copy_gbs: float  # device-to-device copy, bytes read plus bytes written
    datasheet_tflops: float
    datasheet_gbs: float
    source: str


# Keyed by a substring of torch.cuda.get_device_name(); an unlisted GPU gets no share-of-peak column
# rather than a guess.
PEAKS = {
    "H200": Peaks(
        matmul_tflops=790.0,
        copy_gbs=4300.0,
        datasheet_tflops=989.0,
        datasheet_gbs=4800.0,
        source="measured on this workplace's H200s: 8192^3 bf16 matmul 769-798 TFLOP/s, copy 4.3 TB/s",
    ),
    "H100": Peaks(
        matmul_tflops=798.0,
        copy_gbs=3000.0,
        datasheet_tflops=989.0,
        datasheet_gbs=3350.0,
        source="measured on this workplace's H100 80GB HBM3 (2026-11-13): 8192^3 bf16 matmul 798 TFLOP/s, copy 3 TB/s",
    ),
}


@dataclass(frozen=True)
class Device:
    torch_device: torch.device
    name: str
    peaks: Peaks | None
    l2_bytes: int

    @property
    def is_cuda(self) -> bool:
        return self.torch_device.type == "cuda"

    @property
    def slug(self) -> str:
        return re.sub(r"[^a-z0-9]+", "-", self.name.lower()).strip("-")

    def peak(self, metric: str, dtype: torch.dtype) -> float | None:
        """The ceiling a rate of ``metric`` ("flops" or "bytes"; none for "calls") is measured against, in report
        units."""
        if self.peaks is None or metric == "calls":
            return None
        if metric == "bytes":
            return self.peaks.copy_gbs
        # The measured matmul ceiling is a 16-bit one; fp32 work runs on other units.
        return self.peaks.matmul_tflops if dtype in (torch.float16, torch.bfloat16) else None


def get_device(requested: str = "auto") -> Device:
    """``auto`` is the GPU unless there is none or Triton's interpreter is on (qvl then runs CPU tensors only)."""
    auto_cuda = torch.cuda.is_available() and not qvl_common.triton_interpreting()
    if not (requested == "cuda" or (requested == "auto" and auto_cuda)):
        return Device(torch.device("cpu"), "cpu", None, 0)
    device = torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(device)
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 60 * 2**20)
    return Device(device, name, peaks_for(name), l2)


def peaks_for(name: str) -> Peaks | None:
    """The ceilings of the GPU torch names ``name`` (e.g. "NVIDIA H100 80GB HBM3"), None for one not in PEAKS."""
    return next((p for key, p in PEAKS.items() if key in name), None)


def cpu_name() -> str:
    """The CPU's model name as a file-name slug (``/proc/cpuinfo``'s, else the platform's), e.g. for results files."""
    try:
        found = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
    except OSError:
        found = None
    name = found.group(1) if found else platform.processor() or platform.machine()
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def qvl_path(device: Device) -> contextlib.AbstractContextManager:
    """Wrap each qvl call in this: on CPU it pins the pure-torch path, so a CPU run stays fast even in a
    process where TRITON_INTERPRET=1 (the tests' setting) would send CPU tensors through the interpreter."""
    if device.is_cuda:
        return contextlib.nullcontext()
    return qvl_common.force_backend("torch")


# --------------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Timing:
    ms: float  # median
    ms_lo: float  # 20th percentile
    ms_hi: float  # 80th percentile
    device_ms: float | None = None  # median GPU time per call with the host's enqueue time taken out (device_time)


CPU_REPS = 5  # a CPU number only shows that the path runs: a few reps keep CI fast


def rotation_count(set_bytes: int, device: Device, max_sets: int = 64) -> int:
    """How many input sets to cycle through so a set has left L2 by the time it comes round again.

    do_bench flushes L2 before each timed rep, but pytest-benchmark (``microbench.py``) and any
    back-to-back loop (:func:`device_time`'s bursts) do not; cycling sets whose sum is twice the L2 keeps every
    timer honest.
    """
    if not device.is_cuda or set_bytes >= 2 * device.l2_bytes:
        return 1
    return min(max_sets, math.ceil(2 * device.l2_bytes / max(set_bytes, 1)))


def cycling(calls: Sequence[Callable[[], Any]]) -> Callable[[], Any]:
    """One zero-argument callable that runs the next of ``calls`` each time (one per input set)."""
    cycle = itertools.cycle(calls)
    return lambda: next(cycle)()


# device_time's bursts: at most this much GPU time and this many calls each, this many bursts per row.
BURST_MS = 10.0
BURST_CALLS = 64
BURST_REPS = 3
# The spin kernel's length in cycles for a second, a guess (Hopper's SM clock is 1.6-2 GHz): every burst checks on
# the device's own clock that the spin outlasted the host's enqueue, and longer spins are tried where it did not.
SPIN_CYCLES_PER_S = 2.0e9
SPIN_TRIES = 3


def device_time(step: Callable[[], Any], per_call_ms: float) -> float | None:
    """Milliseconds of GPU time per ``step()`` with the host taken out, or None where that cannot be had.

    ``triton.testing.do_bench`` times each call between two events; where the host takes longer to enqueue a call
    than the GPU takes to run it (small bandwidth kernels: tens of µs of host time against a few µs of work), the GPU
    waits for the host between those events, so its figure is host time, not the kernel's. Here a spin kernel
    (``torch.cuda._sleep``) holds the stream while the host enqueues a burst of calls; once the host is done before
    the spin ends (checked on the device's clock, against the host's own clock), the burst runs back to back and its
    events measure the device alone. A call that waits on the device (a sync inside) never finishes enqueueing
    before the spin ends: after ``SPIN_TRIES`` ever longer spins it gets None. ``per_call_ms`` (do_bench's median,
    never below the device time) sizes the burst to about ``BURST_MS``; a call longer than that gets None without a
    burst: its spins would cost seconds per row (a tower's forward; ``bench_tower`` reports the profiler's GPU time).
    """
    if per_call_ms > BURST_MS:
        return None
    calls = max(1, min(BURST_CALLS, int(BURST_MS / max(per_call_ms, 1e-4))))
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        step()
    host_s = time.perf_counter() - start
    torch.cuda.synchronize()
    spin_cycles = int(2 * host_s * SPIN_CYCLES_PER_S) + 1
    begin, spun, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    samples: list[float] = []
    tries = 0
    while len(samples) < BURST_REPS and tries < SPIN_TRIES:
        torch.cuda.synchronize()
        start = time.perf_counter()
        begin.record()
        torch.cuda._sleep(spin_cycles)
        spun.record()
        for _ in range(calls):
            step()
        end.record()
        host_ms = (time.perf_counter() - start) * 1e3
        torch.cuda.synchronize()
        if host_ms < begin.elapsed_time(spun):
            samples.append(spun.elapsed_time(end) / calls)
        else:
            tries += 1
            spin_cycles *= 2
    return statistics.median(samples) if samples else None


def measure(calls: Sequence[Callable[[], Any]], device: Device, warmup_ms: int = 25, rep_ms: int = 100) -> Timing:
    """Time one call, cycling through ``calls``. The first call compiles/caches and is not timed. On CUDA the
    Timing carries :func:`device_time` beside do_bench's quantiles."""
    step = cycling(calls)
    if device.is_cuda:
        lo, med, hi = triton.testing.do_bench(step, warmup=warmup_ms, rep=rep_ms, quantiles=[0.2, 0.5, 0.8])
        try:
            on_device = device_time(step, med)
        except RuntimeError as exc:  # the row keeps do_bench's time; the device run's log says why it has no other
            print(f"  device time: {reason(exc)}", flush=True)
            on_device = None
        return Timing(med, lo, hi, on_device)
    step()
    times = []
    for _ in range(CPU_REPS):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    cuts = statistics.quantiles(times, n=5)
    return Timing(statistics.median(times), cuts[0], cuts[-1])


def cuda_kernel_ms(run: Callable[[], Any]) -> float | None:
    """Milliseconds of GPU kernel time in one ``run()`` (after a warm-up call), from the profiler: the sum of every
    CUDA kernel's duration, whatever the host did around them; None where the profiler recorded no kernel (its
    CUDA activity unavailable), which a sum would report as 0 ms."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    kernels = [event.device_time_total for event in prof.events() if event.device_type == DeviceType.CUDA]
    return sum(kernels) / 1e3 if kernels else None


# CPU GEMM and attention kernels as the profiler names them (self time: the wrappers above them hold none of it).
CPU_GEMM_OPS = frozenset({"aten::addmm", "aten::mm", "aten::bmm", "aten::baddbmm"})
CPU_ATTENTION_OPS = frozenset({"aten::_scaled_dot_product_flash_attention_for_cpu"})


def cpu_op_seconds(run: Callable[[], Any], ops: frozenset[str]) -> float:
    """Seconds the CPU spent inside the ops named ``ops`` (their own time, not their callers') during one
    ``run()``, from the profiler: e.g. how much of a forward no scheduling around those kernels can remove."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return sum(event.self_cpu_time_total for event in prof.key_averages() if event.key in ops) / 1e6


# --------------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------------
def cpu_allocation_sizes(run: Callable[[], Any]) -> list[int]:
    """Bytes of every CPU tensor allocation (positive) and free (negative) during ``run()``, in order, as
    the profiler records them from the allocator: requested sizes, whatever malloc does underneath."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()

    def walk(nodes):
        for node in nodes:
            yield node
            yield from walk(node.children)

    events = sorted(
        (node.start_time_ns, node.extra_fields.alloc_size)
        for node in walk(prof.profiler.kineto_results.experimental_event_tree())
        if node.tag == _EventType.Allocation
    )
    assert events, "the profiler recorded no allocations"
    return [size for _, size in events]


def peak_tensor_bytes(run: Callable[[], Any], device: str) -> int:
    """Most bytes of tensors alive at once during ``run()``, above what was alive when it started.

    On CUDA that is the caching allocator's own peak counter of allocated (not reserved) bytes. On CPU it
    is the running sum of the allocation and free events (:func:`cpu_allocation_sizes`): resident memory
    also counts malloc's arenas and fragmentation, which differ between runs by more than the effect
    measured.
    """
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    alive = peak = 0
    for size in cpu_allocation_sizes(run):
        alive += size
        peak = max(peak, alive)
    return peak


# --------------------------------------------------------------------------------------------------
# Useful work and agreement
# --------------------------------------------------------------------------------------------------
def attention_flops(num_heads: int, head_dim: int, seqlens: Sequence[int]) -> float:
    """Non-causal attention forward: QK^T and PV, 2 FLOPs per multiply-add, at the true head dim (a
    kernel that pads 72 to 80 or 128 gets no credit for the padding)."""
    return 4.0 * num_heads * head_dim * sum(s * s for s in seqlens)


def tensor_bytes(*tensors: torch.Tensor) -> int:
    """Bytes of the tensors' elements: sum them once per read and once per write for a minimum traffic."""
    return sum(t.numel() * t.element_size() for t in tensors)


def copy_call(like: torch.Tensor, traffic: float) -> Callable[[], object]:
    """``Tensor.copy_`` moving ``traffic`` bytes (half read, half written) in ``like``'s dtype and device: the
    device's copy bandwidth on a bandwidth kernel's footprint, the ceiling its rate is held against. Allocates
    its two buffers here, once."""
    count = int(traffic) // 2 // like.element_size()
    return partial(like.new_empty(count).copy_, like.new_zeros(count))


def max_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max|out - ref| / max|ref| in fp32; NaN anywhere in ``out`` gives NaN."""
    out32, ref32 = out.float(), ref.float()
    scale = ref32.abs().max().clamp_min(torch.finfo(torch.float32).tiny)
    return float((out32 - ref32).abs().max() / scale)


def agrees(err: float, dtype: torch.dtype) -> bool:
    return math.isfinite(err) and err <= TOLERANCE[dtype]


# --------------------------------------------------------------------------------------------------
# Peers
# --------------------------------------------------------------------------------------------------
class Unavailable(Exception):
    """Raised by a peer's builder that cannot run here; the message is the reason shown to the user."""


def require_cuda(device: Device) -> None:
    if not device.is_cuda:
        raise Unavailable("CPU run: torch paths only")


T = TypeVar("T")


def peers(
    builders: Mapping[str, Callable[[], T]],
    trial: Callable[[T], object] | None = None,
    skip: frozenset[str] = frozenset(),
) -> tuple[dict[str, T], dict[str, str]]:
    """Build each peer and run ``trial`` on it once: returns (the peers that ran, {name: why not}); those named in
    ``skip`` are not built, with that reason.

    Which peers exist depends on the device, the installed packages and their versions, so a failure
    here is a reason to report, not an error.
    """
    ready: dict[str, T] = {}
    skipped: dict[str, str] = {name: "left out (--skip)" for name in builders if name in skip}
    for name, build in builders.items():
        if name in skip:
            continue
        try:
            impl = build()
            if trial is not None:
                trial(impl)
        except Exception as exc:  # noqa: BLE001 - whatever breaks, the peer is unusable here
            skipped[name] = reason(exc)
        else:
            ready[name] = impl
    return ready, skipped


def device_peers(
    builders: Mapping[str, Callable[[Device], Callable[[T], Callable[[], object]]]],
    device: Device,
    trial_inputs: T,
    skip: frozenset[str] = frozenset(),
) -> tuple[dict[str, Callable[[T], Callable[[], object]]], dict[str, str]]:
    """:func:`peers` for a benchmark module's ``PEERS``: each built for ``device`` and run once on
    ``trial_inputs``; those named in ``skip`` are left out, with that reason."""
    return peers(
        {name: partial(build, device) for name, build in builders.items()}, lambda bind: bind(trial_inputs)(), skip
    )


def reason(exc: Exception) -> str:
    """One line saying why ``exc`` stopped an implementation, for the report's skipped list."""
    if isinstance(exc, Unavailable):
        return str(exc)
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:200]


def check_then_time(
    report: Report,
    case: str,
    work: float,
    calls: Mapping[str, Sequence[Callable[[], Any]]],
    check: Callable[[str, Callable[[], Any]], float | None],
    metric: str | None = None,
    rep_ms: int = 100,
) -> dict[str, Record]:
    """Check every implementation of one case, then time those whose check ran.

    ``calls[name]`` holds one call per rotating input set; ``check(name, calls[name][0])`` returns the
    max relative error against qvl (None for qvl itself). All checks run before any timing, so an
    in-place implementation's timing loop cannot corrupt the inputs another check reads. An
    implementation whose check raises is listed as skipped for this case. ``metric`` overrides the
    report's for this case's work; ``rep_ms`` is the CUDA timing budget per implementation (calls that
    take tens of ms need more than the default for a stable median).
    """
    errors: dict[str, float | None] = {}
    for name, impl_calls in calls.items():
        try:
            errors[name] = check(name, impl_calls[0])
        except Exception as exc:  # noqa: BLE001 - a peer that fails on one shape is reported, not fatal
            report.skipped[f"{name} ({case})"] = reason(exc)
    timed = {}
    for name, err in errors.items():
        timing = measure(calls[name], report.device, rep_ms=rep_ms)
        timed[name] = report.add(case, name, timing, work, err, metric=metric)
    return timed


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------
# "calls": host-time benchmarks (bench_host), whose work is one call.
METRICS = {"flops": ("TFLOP/s", 1e12), "bytes": ("GB/s", 1e9), "calls": ("kcall/s", 1e3)}


@dataclass
class Record:
    case: str
    impl: str
    ms: float
    ms_lo: float
    ms_hi: float
    work: float  # useful FLOPs or minimum bytes of one call
    rate: float  # work per second in `unit`
    unit: str
    share: float | None  # of the device's measured peak
    max_rel_err: float | None  # against qvl's output; None for qvl itself
    agrees: bool
    note: str = ""
    speedup: float | None = None  # baseline's time / this time, same case
    baseline: str | None = None
    device_ms: float | None = None  # GPU time per call, host taken out (harness.device_time); None on CPU
    device_rate: float | None = None  # work per second of device_ms, in `unit`


@dataclass
class Report:
    bench: str
    device: Device
    dtype: torch.dtype
    metric: str  # "flops" or "bytes": the default for records added without one
    baselines: Sequence[str]  # speedups are against the first of these that ran in a case
    records: list[Record] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)  # extra top-level JSON fields (peer versions)
    # The report made last: what :func:`main` saves when a timeout's SIGTERM cuts its benchmark short.
    latest: ClassVar[Report | None] = None

    def __post_init__(self) -> None:
        Report.latest = self

    def add(
        self,
        case: str,
        impl: str,
        timing: Timing,
        work: float,
        err: float | None = None,
        note: str = "",
        metric: str | None = None,
    ) -> Record:
        """One timed row; ``metric`` (default: the report's) says whether ``work`` counts FLOPs or bytes."""
        metric = metric or self.metric
        unit, scale = METRICS[metric]

        def per_second(ms: float) -> float:
            return work / (ms * 1e-3) / scale

        rate = per_second(timing.ms)
        device_rate = None if timing.device_ms is None else per_second(timing.device_ms)
        peak = self.device.peak(metric, self.dtype)
        record = Record(
            case, impl, timing.ms, timing.ms_lo, timing.ms_hi, float(work), rate, unit,
            share=rate / peak if peak else None,
            max_rel_err=err,
            agrees=err is None or agrees(err, self.dtype),
            note=note,
            device_ms=timing.device_ms,
            device_rate=device_rate,
        )  # fmt: skip
        self.records.append(record)
        self._set_speedups(case)
        # Each row as it is measured: a run cut short (a device lease's limit) still shows the rows it finished.
        on_device = "" if device_rate is None else f"; device {timing.device_ms:.4g} ms, {device_rate:.4g}"
        print(f"  {impl}: {timing.ms:.4g} ms ({rate:.4g} {unit}{on_device}){f'; {note}' if note else ''}", flush=True)
        return record

    def _set_speedups(self, case: str) -> None:
        rows = [r for r in self.records if r.case == case]
        base = next((r for name in self.baselines for r in rows if r.impl == name), None)
        for r in rows:
            r.baseline = base.impl if base else None
            r.speedup = base.ms / r.ms if base else None

    def _units(self) -> list[str]:
        """The rate units of the records, in METRICS order (the report's own when it has none)."""
        used = {r.unit for r in self.records} or {METRICS[self.metric][0]}
        return [unit for unit, _ in METRICS.values() if unit in used]

    def table(self) -> str:
        # One unit heads the rate column; a report mixing units writes each row's unit beside its rate.
        units = self._units()
        mixed = len(units) > 1
        show_share = any(r.share is not None for r in self.records)
        show_device = any(r.device_ms is not None for r in self.records)
        rate_header = "rate" if mixed else units[0]
        header = ["case", "impl", "ms", rate_header] + (["% peak"] if show_share else [])
        header += ["device ms", f"device {rate_header}"] if show_device else []
        header += ["speedup", "max rel err", "note"]
        rows = []
        for r in self.records:
            row = [r.case, r.impl, f"{r.ms:.4g}", f"{r.rate:.4g} {r.unit}" if mixed else f"{r.rate:.4g}"]
            if show_share:
                row.append("-" if r.share is None else f"{100 * r.share:.1f}")
            if show_device:
                row.append("-" if r.device_ms is None else f"{r.device_ms:.4g}")
                row.append("-" if r.device_rate is None else f"{r.device_rate:.4g}")
            row.append("-" if r.speedup is None else f"{r.speedup:.2f}x")
            row.append("-" if r.max_rel_err is None else f"{r.max_rel_err:.1e}")
            row.append(("DISAGREES " if not r.agrees else "") + r.note)
            rows.append(row)
        widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [header, ["-" * w for w in widths], *rows]
        return "\n".join(fmt.format(*line).rstrip() for line in lines)

    def summary(self) -> str:
        """Context first, table last (a device run's reply carries only the end of the output)."""
        d = self.device
        lines = [
            f"{self.bench} | {d.name} | {str(self.dtype).removeprefix('torch.')} | "
            f"torch {torch.__version__} | triton {triton.__version__}"
        ]
        if not d.is_cuda:
            lines.append("CPU run: wall-clock times of the torch paths; meaningless for kernels")
        if d.peaks is not None:
            for metric, (unit, _) in METRICS.items():
                peak = d.peak(metric, self.dtype) if unit in self._units() else None
                if peak is not None:
                    lines.append(f"% peak of {peak:g} {unit} ({d.peaks.source})")
        lines += [f"skipped {name}: {why}" for name, why in self.skipped.items()]
        lines += self.notes
        bases = sorted({r.baseline for r in self.records if r.baseline})
        if bases:
            lines.append(f"speedup = time of {' / '.join(bases)} in the same case / time")
        if any(r.device_ms is not None for r in self.records):
            lines.append(
                "ms: do_bench's median per call (the host's time where it outlasts the GPU's); device ms: GPU time "
                "per call with the host's enqueue taken out (bursts behind a spin kernel; '-': a call that waits on "
                f"the device or takes over {BURST_MS:g} ms)"
            )
        lines.append("")
        lines.append(self.table())
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        d = self.device
        return strict_json(
            {
                "bench": self.bench,
                "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                "device": {"name": d.name, "type": d.torch_device.type, "l2_bytes": d.l2_bytes},
                "peaks": asdict(d.peaks) if d.peaks else None,
                "timings_meaningful": d.is_cuda,
                "dtype": str(self.dtype).removeprefix("torch."),
                "versions": _versions(),
                "metric": self.metric,
                "baselines": list(self.baselines),
                "skipped": self.skipped,
                "notes": self.notes,
                **self.meta,
                "records": [asdict(r) for r in self.records],
            }
        )

    def save(self, path: Path | None = None, name: str | None = None) -> Path:
        """Write the report to ``path``, else to ``results/<name>-<time>.json`` (``name`` defaulting to the bench's
        and the device's)."""
        if path is None:
            stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
            path = RESULTS_DIR / f"{name or f'{self.bench}-{self.device.slug}'}-{stamp}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path

    def finish(self, json_path: str | Path | None, quick: bool, name: str | None = None) -> None:
        """A benchmark's last step: save the report (to ``json_path`` when given, else as :meth:`save` names it) and
        print its summary. A quick (smoke) run's numbers mean nothing: it leaves no file in the checkout unless
        ``json_path`` asks for one."""
        if json_path or not quick:
            print(f"results: {self.save(Path(json_path) if json_path else None, name)}")
        print(self.summary(), flush=True)


def strict_json(value: Any) -> Any:
    """Non-finite floats become strings: strict JSON has no NaN or Infinity."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [strict_json(v) for v in value]
    return value


def _versions() -> dict[str, str | None]:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent, capture_output=True, text=True, timeout=5, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "qvl_commit": commit,
        # How the attention kernels tiled heads that are not a power of two (device runs may fall back to padded).
        "attention_head_dim_layout": head_dim_layout(),
    }


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunConfig:
    device: Device
    dtype: torch.dtype
    quick: bool
    json_path: Path | None
    # implementations to leave out (reported as skipped), e.g. a peer whose compiles would spend a short GPU lease
    skip: frozenset[str] = frozenset()


def parse_args(description: str | None, argv: Sequence[str] | None = None) -> RunConfig:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--quick", action="store_true", help="fewer, smaller cases (always on for CPU runs)")
    parser.add_argument("--json", type=Path, help="results file (default: bench/results/<bench>-<device>-<date>.json)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--skip", default="", help="comma-separated peers to leave out (e.g. flex_attention)")
    args = parser.parse_args(argv)
    device = get_device(args.device)
    skip = frozenset(name for name in args.skip.split(",") if name)
    return RunConfig(device, DTYPES[args.dtype], args.quick or not device.is_cuda, args.json, skip)


@contextlib.contextmanager
def cpu_threads(device: Device) -> Iterator[None]:
    """One torch thread for CPU runs: CI shares its cores, and small ops waiting at an OpenMP barrier for
    a descheduled thread ran 100x slower there. CPU numbers only show that the paths run."""
    if device.is_cuda:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class Cut(BaseException):
    """SIGTERM arrived (``timeout`` ending a benchmark): raised in the main thread between two Python steps. A
    BaseException, as KeyboardInterrupt is, so the handlers that report a failing peer and go on let it through."""


def _cut(signum: int, frame: Any) -> None:
    raise Cut


def main(description: str | None, benchmark: Callable[[RunConfig], Report], argv: Sequence[str] | None) -> Report:
    """A benchmark module's command line: parse, run, write the JSON, print the summary with the table last.

    A SIGTERM during the run (a device script's ``timeout``) saves and prints the rows measured so far, noted as cut
    short, then exits with status 124 (timeout's own) instead of losing them."""
    config = parse_args(description, argv)
    started = Report.latest
    previous = signal.signal(signal.SIGTERM, _cut)
    cut = False
    try:
        with cpu_threads(config.device):
            report = benchmark(config)
    except Cut:
        if Report.latest is started:
            raise SystemExit(124) from None
        report, cut = Report.latest, True
        report.notes.append("cut short by SIGTERM (a timeout): only the rows measured before it")
    finally:
        signal.signal(signal.SIGTERM, previous)
    path = report.save(config.json_path)
    print(f"results: {path}")
    print(report.summary(), flush=True)
    if cut:
        raise SystemExit(124)
    return report
