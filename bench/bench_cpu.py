"""The vision tower on a CPU, what a machine without a GPU runs: qvl's ``VisionTransformer`` (its torch path, eager
and ``tower.compile()``: Inductor's C++ backend) against transformers' ``Qwen3VLVisionModel`` with SDPA and, where
``vllm`` imports, vLLM's own CPU tower (``Qwen3_VisionTransformer`` built in this process, its linears packed for
oneDNN as vLLM's loader leaves them, without qvl's plugin) and the same tower run by qvl's vLLM tower route
("vLLM + qvl", forced on: what :mod:`qvl.vit.engines.cpu_path`'s measured table records); likewise, where ``sglang``
imports, SGLang's own CPU tower (``Qwen3VLMoeVisionModel`` with its sdpa ViT backend) and "SGLang + qvl".

    python -m bench.bench_cpu [--dtype fp32|bf16] [--quick] [--json PATH]

    # with vLLM's tower (vLLM's CPU environment; tests/vllm/sitecustomize.py lets its torchvision import):
    PYTHONPATH=tests/vllm .venv-vllm/bin/python -m bench.bench_cpu
    # with SGLang's tower (tests/sglang/sitecustomize.py: the same for SGLang's environment):
    PYTHONPATH=tests/sglang .venv-sglang/bin/python -m bench.bench_cpu

The tower has Qwen3-VL-8B's block shapes (hidden 1152, 16 heads of 72, MLP 4304, out 4096) at depth 4 with one
deepstack merger; every implementation gets the same random weights. Workloads: one image of 1,024 patches, one
of 4,096, four of 1,024; fp32 and bf16 (both unless ``--dtype`` picks one). Each call is a whole forward under
``torch.inference_mode`` as a caller makes it, per-batch metadata included.

Timing: after one warm-up call each (qvl's compiled tower compiles once per dtype, then serves every workload), the
implementations run in turns, ``REPS`` rounds, and each keeps its best time: the machine's other load hits them
alike. ``ratio`` is an implementation's time over transformers' in the same workload; the compiled column is qvl
compiled over transformers eager. Peak memory: the most tensor bytes alive at once during one more call, above
those alive before it (the profiler's allocation events, :func:`bench.harness.peak_tensor_bytes`): activations and
scratch, not the weights. Every output is checked against transformers' (max relative error, reported). Floor:
the time one call of qvl's compiled tower spends inside its GEMMs and torch's attention kernel (the profiler's own
time of those ops), over transformers' time: the kernels transformers' forward calls too, at the same shapes, so
that ratio bounds what any schedule of the rest can reach on this machine.

``--quick``: a tiny tower and small images, two rounds, the compiled tower through Dynamo alone (``backend="eager"``,
no C++ compile): the test suite's smoke run of these code paths, whose numbers mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from qvl.vit import VisionConfig, VisionTransformer

from . import harness
from .bench_tower import hf_tower, tower_flops
from .workloads import randomize

Grid = tuple[tuple[int, int, int], ...]

TOWER = VisionConfig(depth=4, deepstack_visual_indexes=(1,))
WORKLOADS: dict[str, Grid] = {
    "1 x 1024": ((1, 32, 32),),
    "1 x 4096": ((1, 64, 64),),
    "4 x 1024": ((1, 32, 32),) * 4,
}
QUICK_TOWER = VisionConfig(
    depth=2, hidden_size=128, num_heads=2, intermediate_size=256, out_hidden_size=64, deepstack_visual_indexes=(0,)
)
QUICK_WORKLOADS: dict[str, Grid] = {"1 x 64": ((1, 8, 8),), "4 x 16": ((1, 4, 4),) * 4}
REPS = 5
QUICK_REPS = 2
BASELINE = "transformers"
# The table's columns, left to right.
IMPLS = (BASELINE, "qvl", "qvl compiled", "vLLM", "vLLM + qvl", "SGLang", "SGLang + qvl")
MiB = 2**20
# The implementation whose kernel time is the floor column: the GEMMs and attention calls of qvl's compiled tower,
# which transformers' forward makes too (same shapes, same torch kernels), so no schedule around them runs faster.
FLOOR_IMPL = "qvl compiled"

Run = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (pixels, grid_thw on the CPU) -> merged features


@dataclass
class CpuTowerReport(harness.Report):
    """A :class:`~bench.harness.Report` whose table puts, per dtype and workload, each implementation's time ratio
    to transformers and its peak memory side by side. Records: one per (case, implementation), the note holding
    the peak memory in MiB."""

    peaks: dict[tuple[str, str], int] = field(default_factory=dict)  # (case, impl) -> peak tensor bytes
    floors: dict[str, float] = field(default_factory=dict)  # case -> ms of FLOOR_IMPL inside GEMMs and attention

    def table(self) -> str:
        cases = list(dict.fromkeys(r.case for r in self.records))
        present = [impl for impl in IMPLS if any(r.impl == impl for r in self.records)]
        times = {(r.case, r.impl): r.ms for r in self.records}
        header = ["case", f"{BASELINE} ms"]
        header += [f"{impl} / {BASELINE}" for impl in present[1:]]
        header += [f"floor / {BASELINE}"] if self.floors else []
        header += [f"peak MiB {impl}" for impl in present]
        rows = []
        for case in cases:
            base = times.get((case, BASELINE))
            row = [case, "-" if base is None else f"{base:.0f}"]
            for impl in present[1:]:
                ms = times.get((case, impl))
                row.append("-" if ms is None or base is None else f"{ms / base:.2f} ({ms:.0f} ms)")
            if self.floors:
                floor = self.floors.get(case)
                row.append("-" if floor is None or base is None else f"{floor / base:.2f} ({floor:.0f} ms)")
            for impl in present:
                peak = self.peaks.get((case, impl))
                row.append("-" if peak is None else f"{peak / MiB:.0f}")
            rows.append(row)
        widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [header, ["-" * w for w in widths], *rows]
        return "\n".join(fmt.format(*line).rstrip() for line in lines)

    def summary(self) -> str:
        """Context first, the table last."""
        head = f"{self.bench} | {harness.cpu_name()} | torch {torch.__version__}"
        skipped = [f"skipped {name}: {why}" for name, why in self.skipped.items()]
        return "\n".join([head, *skipped, *self.notes, "", self.table()])

    def to_json(self) -> dict:
        data = super().to_json()
        data["peak_tensor_bytes"] = [{"case": c, "impl": i, "bytes": b} for (c, i), b in self.peaks.items()]
        data["floor_ms"] = [{"case": c, "impl": FLOOR_IMPL, "ms": ms} for c, ms in self.floors.items()]
        return data


def pixels_of(config: VisionConfig, grid: Grid, dtype: torch.dtype) -> torch.Tensor:
    width = config.in_channels * config.temporal_patch_size * config.patch_size**2
    tokens = sum(t * h * w for t, h, w in grid)
    return torch.randn(tokens, width, generator=torch.Generator().manual_seed(0)).to(dtype)


def transformers_run(model: nn.Module) -> Run:
    return lambda pixels, grid: model(pixels, grid_thw=grid).pooler_output


def qvl_run(tower: VisionTransformer) -> Run:
    def run(pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        # The torch path, also in a process where Triton's interpreter is on (the test suite's smoke run).
        with harness.qvl_path(harness.get_device("cpu")):
            return tower(pixels, grid)[0]

    return run


def vllm_run(reference: nn.Module, dtype: torch.dtype, qvl_route: bool = False) -> Run:
    """vLLM's own tower of ``reference``'s weights (its output holds the merged features, then the deepstack ones);
    with ``qvl_route``, run by qvl's tower route as vLLM's plugin attaches it (forced on: the measurement the route's
    CPU decision rests on)."""
    if importlib.util.find_spec("vllm") is None:
        raise harness.Unavailable("vllm is not installed")
    from qvl.vit.engines import cpu_path

    from .vllm_inprocess import model_config_of, vllm_tower_of

    visual = vllm_tower_of(reference, dtype)
    if qvl_route:
        from types import SimpleNamespace

        from qvl.vit.engines.vllm import tower as vllm_tower
        from qvl.vit.families import family_of

        model = SimpleNamespace(visual=visual, use_data_parallel=False)
        with cpu_path.forced_routes(True):
            vllm_tower.attach(model, model_config_of(reference.config), family_of(reference.config.model_type))
        if not isinstance(visual.forward, vllm_tower.QvlTowerForward):
            raise harness.Unavailable("qvl's tower route did not attach to vLLM's tower")
    width = reference.config.out_hidden_size
    return lambda pixels, grid: visual(pixels, grid_thw=grid)[:, :width]


def sglang_run(reference: nn.Module, dtype: torch.dtype, qvl_route: bool = False) -> Run:
    """SGLang's own tower of ``reference``'s weights (its sdpa ViT backend, as SGLang picks on a CPU without AMX; its
    output holds the merged features, then the deepstack ones); with ``qvl_route``, run by qvl's routes as SGLang's
    plugin applies them (forced on: the measurement the routes' CPU decision rests on)."""
    if importlib.util.find_spec("sglang") is None:
        raise harness.Unavailable("sglang is not installed")
    from qvl.vit.engines import cpu_path

    from .sglang_inprocess import sglang_model_of

    model = sglang_model_of(reference, dtype)
    if qvl_route:
        from qvl.vit.engines.sglang import plugin as sglang_plugin
        from qvl.vit.engines.tower import EngineTowerForward

        with cpu_path.forced_routes(True):
            done = sglang_plugin.apply(model, reference.config)
        if done["tower"] != "qvl" or not isinstance(model.visual.forward, EngineTowerForward):
            raise harness.Unavailable(f"qvl's tower route did not attach to SGLang's tower: {done}")
    width = reference.config.out_hidden_size
    return lambda pixels, grid: model.visual(pixels, grid_thw=grid)[:, :width]


def implementations(config: VisionConfig, dtype: torch.dtype, quick: bool) -> tuple[dict[str, Run], dict[str, str]]:
    """Every implementation of ``config``'s tower in ``dtype`` that runs here, and why the others do not."""
    reference = randomize(hf_tower(config, harness.get_device("cpu"), torch.float32, "sdpa")).to(dtype)
    eager = VisionTransformer.from_hf(reference).requires_grad_(False)
    compiled = VisionTransformer.from_hf(reference).requires_grad_(False)
    compiled.compile(**({"backend": "eager"} if quick else {}))
    builders = {
        BASELINE: lambda: transformers_run(reference),
        "qvl": lambda: qvl_run(eager),
        "qvl compiled": lambda: qvl_run(compiled),
        "vLLM": lambda: vllm_run(reference, dtype),
        "vLLM + qvl": lambda: vllm_run(reference, dtype, qvl_route=True),
        "SGLang": lambda: sglang_run(reference, dtype),
        "SGLang + qvl": lambda: sglang_run(reference, dtype, qvl_route=True),
    }
    return harness.peers(builders)


def best_times(runs: dict[str, Run], pixels: torch.Tensor, grid: torch.Tensor, reps: int) -> dict[str, list[float]]:
    """Each implementation's times in ms over ``reps`` rounds, the implementations taking turns in every round."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(reps):
        for name, run in runs.items():
            start = time.perf_counter()
            run(pixels, grid)
            times[name].append((time.perf_counter() - start) * 1e3)
    return times


def run_dtype(report: CpuTowerReport, config: VisionConfig, workloads: dict[str, Grid], dtype, quick: bool) -> None:
    runs, skipped = implementations(config, dtype, quick)
    name = str(dtype).removeprefix("torch.")
    report.skipped.update({f"{impl} ({name})": why for impl, why in skipped.items()})
    for label, grid_thw in workloads.items():
        case = f"{name} {label}"
        pixels, grid = pixels_of(config, grid_thw, dtype), torch.tensor(grid_thw)
        expected = runs[BASELINE](pixels, grid)
        errors = {impl: harness.max_rel_err(run(pixels, grid), expected) for impl, run in runs.items()}
        times = best_times(runs, pixels, grid, QUICK_REPS if quick else REPS)
        for impl, run in runs.items():
            gc.collect()
            peak = harness.peak_tensor_bytes(lambda run=run: run(pixels, grid), "cpu")
            report.peaks[(case, impl)] = peak
            timing = harness.Timing(min(times[impl]), min(times[impl]), max(times[impl]))
            err = None if impl == BASELINE else errors[impl]
            report.add(case, impl, timing, tower_flops(config, grid_thw), err, note=f"peak {peak / MiB:.0f} MiB")
        floor = 1e3 * harness.cpu_op_seconds(
            lambda: runs[FLOOR_IMPL](pixels, grid), harness.CPU_GEMM_OPS | harness.CPU_ATTENTION_OPS
        )
        report.floors[case] = floor
        base = min(times[BASELINE])
        ratios = ", ".join(f"{impl} {min(times[impl]) / base:.2f}" for impl in runs if impl != BASELINE)
        print(f"{case}: {BASELINE} {base:.0f} ms; ratios {ratios}, floor {floor / base:.2f}", flush=True)


def benchmark(dtypes: Sequence[torch.dtype], quick: bool) -> CpuTowerReport:
    device = harness.get_device("cpu")
    report = CpuTowerReport("cpu", device, dtypes[0], "flops", (BASELINE,))
    config, workloads = (QUICK_TOWER, QUICK_WORKLOADS) if quick else (TOWER, WORKLOADS)
    report.notes.append(
        f"tower: depth {config.depth}, hidden {config.hidden_size}, {config.num_heads} heads of {config.head_dim}, "
        f"MLP {config.intermediate_size}, deepstack {list(config.deepstack_visual_indexes)}; "
        f"{torch.get_num_threads()} torch threads; best of {QUICK_REPS if quick else REPS} interleaved rounds"
    )
    report.notes.append(
        f"ratio = time / {BASELINE}' (eager, sdpa) in the same case; peak = tensor bytes above the start"
    )
    report.notes.append(
        f"floor = time one {FLOOR_IMPL} call spent inside its GEMMs and attention kernels (profiler, own time)"
    )
    if quick:
        report.notes.append("--quick: tiny tower, compiled through Dynamo alone; the numbers mean nothing")
    with torch.inference_mode():
        for dtype in dtypes:
            run_dtype(report, config, workloads, dtype, quick)
            gc.collect()
    return report


def main(argv: Sequence[str] | None = None) -> CpuTowerReport:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=sorted(harness.DTYPES), help="one dtype (default: fp32, then bf16)")
    parser.add_argument("--quick", action="store_true", help="tiny tower: a smoke run, numbers meaningless")
    parser.add_argument(
        "--json",
        type=Path,
        help="results file (default: bench/results/cpu-<machine>-<date>.json; with --quick, none unless given)",
    )
    parser.add_argument(
        "--device", choices=("auto", "cuda", "cpu"), default="auto", help="taken for python -m bench; always the CPU"
    )
    args = parser.parse_args(argv)
    dtypes = [harness.DTYPES[args.dtype]] if args.dtype else [torch.float32, torch.bfloat16]
    report = benchmark(dtypes, args.quick)
    report.finish(args.json, args.quick, f"cpu-{harness.cpu_name()}")
    return report


if __name__ == "__main__":
    main()
