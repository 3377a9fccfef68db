"""Launch-configuration sweep of the tower's bandwidth kernels on a GPU (issue 31): ``python -m bench.tune_rows``.

The norms, the row-wise epilogues (bias + GELU; Qwen2.5-VL's biases + SwiGLU) and the rotary launch with
configurations chosen by a rule of thumb
(:func:`qvl.kernels.layer_norm.launch_config`, :func:`qvl.kernels.tiles.row_tiles`,
:func:`qvl.kernels.rotary.launch_config`), and the 2026-12-04 H200 run measured LayerNorm at 0.29-0.64x eager.
This sweep says what they should pick: for each case, at the tower's sizes and in priority order (the slowest
kernels first), every candidate (rows or tokens per program x columns per program x warps) runs the op's own
launch with only those meta-parameters and its grid changed, is checked against the default's output (within the
dtype's tolerance: warps change the order of a row's sums), and is timed with ``triton.testing.do_bench``; a
``Tensor.copy_`` of as many bytes is timed beside them. Rates are GB/s of each case's minimum traffic. Nothing is
written into the package: the table printed (and ``--json``) is the evidence a launch_config change needs.

    python -m bench.tune_rows [--budget-s 60] [--dtype bf16] [--json PATH] [--dry-run]

The sweep stops starting cases at ``--budget-s``. ``--dry-run`` lists the cases and candidates without a GPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from qvl.kernels.common import KernelLaunch, cdiv, device_target, next_power_of_2, run_launches
from qvl.kernels.gelu import bias_gelu_launches
from qvl.kernels.layer_norm import layer_norm_launches
from qvl.kernels.rotary import rotary_launches
from qvl.kernels.swiglu import bias_swiglu_launches

from .harness import DTYPES, agrees, copy_call, max_rel_err, tensor_bytes

Timer = Callable[[Callable[[], object]], float]  # milliseconds per call


@dataclass(frozen=True)
class Setup:
    """A case's default launch on its inputs: what it writes (compared between candidates), its minimum traffic,
    and its grid for a candidate's meta-parameters."""

    launch: KernelLaunch
    outputs: tuple[torch.Tensor, ...]
    bytes: int
    grid: Callable[[dict], tuple[int, ...]]


@dataclass(frozen=True)
class Case:
    name: str
    make: Callable[[torch.device, torch.dtype, float], Setup]  # (device, dtype, scale of the sizes)
    candidates: tuple[dict, ...]


@dataclass
class Row:
    case: str
    config: dict
    default: bool
    ms: float | None
    gb_per_s: float | None
    max_rel_err: float | None
    note: str = ""


def _randn(rows: int, cols: int, device: torch.device, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(rows, cols, generator=generator, device=device).to(dtype)


def norm_case(rows: int, cols: int, residual: bool) -> Callable[[torch.device, torch.dtype, float], Setup]:
    """LayerNorm (with the residual add when ``residual``) of ``rows x cols``: reads x (and delta), writes y (and h)."""

    def make(device: torch.device, dtype: torch.dtype, scale: float) -> Setup:
        n = max(1, int(rows * scale))
        x, delta = _randn(n, cols, device, dtype, 0), _randn(n, cols, device, dtype, 1)
        weight, bias = _randn(1, cols, device, dtype, 2)[0], _randn(1, cols, device, dtype, 3)[0]
        y = torch.empty_like(x)
        h = torch.empty_like(x) if residual else None
        (launch,) = layer_norm_launches(x, delta if residual else None, h, weight, bias, y, 1e-6, device_target(device))
        outputs = (y, h) if residual else (y,)
        traffic = tensor_bytes(x, *outputs, weight, bias) + (tensor_bytes(delta) if residual else 0)
        return Setup(launch, outputs, traffic, lambda config: (cdiv(n, config["BLOCK_M"]),))

    return make


def gelu_case(rows: int, cols: int, approximate: str) -> Callable[[torch.device, torch.dtype, float], Setup]:
    """bias + GELU of ``rows x cols`` out of place: reads x and the bias, writes y."""

    def make(device: torch.device, dtype: torch.dtype, scale: float) -> Setup:
        n = max(1, int(rows * scale))
        x, bias = _randn(n, cols, device, dtype, 0), _randn(1, cols, device, dtype, 1)[0]
        y = torch.empty_like(x)
        (launch,) = bias_gelu_launches(x, bias, y, approximate, device_target(device))

        def grid(config: dict) -> tuple[int, int]:
            return cdiv(n, config["BLOCK_M"]), cdiv(cols, config["BLOCK_N"])

        return Setup(launch, (y,), tensor_bytes(x, y, bias), grid)

    return make


def swiglu_case(rows: int, cols: int) -> Callable[[torch.device, torch.dtype, float], Setup]:
    """biases + SwiGLU of ``rows x cols`` as vLLM's Qwen2.5-VL hands it over: gate and up the column halves of one
    ``(rows, 2 cols)`` GEMM output, the biases the halves of one vector; reads both halves and biases, writes y."""

    def make(device: torch.device, dtype: torch.dtype, scale: float) -> Setup:
        n = max(1, int(rows * scale))
        gate, up = _randn(n, 2 * cols, device, dtype, 0).chunk(2, dim=1)
        gate_bias, up_bias = _randn(1, 2 * cols, device, dtype, 1)[0].chunk(2)
        y = torch.empty(n, cols, dtype=dtype, device=device)
        (launch,) = bias_swiglu_launches(gate, up, gate_bias, up_bias, y, device_target(device))

        def grid(config: dict) -> tuple[int, int]:
            return cdiv(n, config["BLOCK_M"]), cdiv(cols, config["BLOCK_N"])

        return Setup(launch, (y,), tensor_bytes(gate, up, y, gate_bias, up_bias), grid)

    return make


def rotary_case(tokens: int, heads: int, head_dim: int) -> Callable[[torch.device, torch.dtype, float], Setup]:
    """rotary_2d of q and k views of a packed qkv (the tower's layout) into new tensors."""

    def make(device: torch.device, dtype: torch.dtype, scale: float) -> Setup:
        n = max(1, int(tokens * scale))
        qkv = _randn(n, 3 * heads * head_dim, device, dtype, 0).view(n, 3, heads, head_dim)
        q, k, _ = qkv.unbind(1)
        positions = torch.randint(0, 64, (n, 2), dtype=torch.int32, device=device)
        q_out, k_out = (torch.empty(n, heads, head_dim, dtype=dtype, device=device) for _ in range(2))
        (launch,) = rotary_launches(q, k, q_out, k_out, positions, 10000.0, device_target(device))
        traffic = 2 * tensor_bytes(q_out, k_out) + tensor_bytes(positions)
        return Setup(launch, (q_out, k_out), traffic, lambda config: (cdiv(n, config["BLOCK_T"]),))

    return make


def norm_candidates(cols: int) -> tuple[dict, ...]:
    """Rows per program x warps, for whole rows of ``next_power_of_2(cols)`` per program (what the kernel keeps)."""
    block_c = next_power_of_2(cols)
    found = []
    for block_m, warps in itertools.product((1, 2, 4, 8), (2, 4, 8, 16)):
        per_thread = block_m * block_c // (32 * warps)
        if 4 <= per_thread <= 64:
            found.append(dict(BLOCK_M=block_m, num_warps=warps))
    return tuple(found)


def row_tile_candidates() -> tuple[dict, ...]:
    """Columns per program x values per program x warps for the row-wise epilogues."""
    return tuple(
        dict(BLOCK_M=values // block_n, BLOCK_N=block_n, num_warps=warps)
        for block_n, values, warps in itertools.product((512, 1024, 2048), (2048, 4096, 8192), (4, 8))
        if values >= block_n
    )


def rotary_candidates() -> tuple[dict, ...]:
    return tuple(dict(BLOCK_T=t, num_warps=w) for t, w in itertools.product((8, 16, 32, 64), (2, 4, 8)))


# Priority: the kernels furthest below eager on 2026-12-04 first, at Qwen3-VL 8B's sizes; Qwen2.5-VL's SwiGLU last.
CASES = (
    Case("layer_norm 4096x4608", norm_case(4096, 4608, False), norm_candidates(4608)),
    Case("add_layer_norm 16384x1152", norm_case(16384, 1152, True), norm_candidates(1152)),
    Case("layer_norm 16384x1152", norm_case(16384, 1152, False), norm_candidates(1152)),
    Case("bias_gelu erf 4096x4608", gelu_case(4096, 4608, "none"), row_tile_candidates()),
    Case("rotary_2d 16384 tokens x 16 heads x 72", rotary_case(16384, 16, 72), rotary_candidates()),
    Case("bias_gelu tanh 16384x4304", gelu_case(16384, 4304, "tanh"), row_tile_candidates()),
    Case("bias_swiglu stacked 16384x3420", swiglu_case(16384, 3420), row_tile_candidates()),
)


def is_default(config: dict, launch: KernelLaunch) -> bool:
    return all(launch.kwargs.get(key) == value for key, value in config.items())


def with_config(setup: Setup, config: dict) -> KernelLaunch:
    launch = setup.launch
    return KernelLaunch(launch.kernel, setup.grid(config), launch.args, {**launch.kwargs, **config})


def sweep_case(case: Case, device: torch.device, dtype: torch.dtype, timer: Timer, scale: float = 1.0) -> list[Row]:
    """The default first, then every other candidate: checked against the default's outputs, then timed. A copy of
    the case's bytes is the last row (config ``{"copy": True}``)."""
    setup = case.make(device, dtype, scale)
    run_launches([setup.launch], device)
    expected = [out.clone() for out in setup.outputs]
    default = {key: setup.launch.kwargs[key] for key in case.candidates[0]}
    configs = [default] + [c for c in case.candidates if not is_default(c, setup.launch)]
    rows = []
    for config in configs:
        launch = with_config(setup, config)
        for out in setup.outputs:
            out.fill_(math.nan)
        try:
            run_launches([launch], device)
        except Exception as exc:  # noqa: BLE001 - a candidate the compiler rejects is reported, not fatal
            rows.append(Row(case.name, config, config is default, None, None, None, f"{type(exc).__name__}"))
            continue
        err = max(max_rel_err(out, ref) for out, ref in zip(setup.outputs, expected))
        ms = timer(lambda launch=launch: run_launches([launch], device))
        rows.append(Row(case.name, config, config is default, ms, setup.bytes / ms / 1e6, err))
    ms = timer(copy_call(setup.outputs[0], setup.bytes))
    rows.append(Row(case.name, {"copy": True}, False, ms, setup.bytes / ms / 1e6, None))
    return rows


def table(rows: Sequence[Row], dtype: torch.dtype) -> str:
    """One line per row; each case's rows by rate, its default marked, each rate also as a share of the default's
    and of the copy's; an error outside the dtype's tolerance of the default's output is flagged (``!``)."""
    lines = [f"{'case':<40} {'config':<44} {'GB/s':>8} {'x default':>10} {'of copy':>8} {'max rel err':>12}"]
    for name in dict.fromkeys(r.case for r in rows):
        mine = [r for r in rows if r.case == name]
        base = next((r for r in mine if r.default), None)
        copy = next((r for r in mine if "copy" in r.config), None)
        for r in sorted(mine, key=lambda r: -(r.gb_per_s or 0)):
            config = "copy" if "copy" in r.config else ", ".join(f"{k}={v}" for k, v in r.config.items())
            config += " (default)" if r.default else ""
            if r.gb_per_s is None:
                lines.append(f"{name:<40} {config:<44} {'-':>8} {r.note}")
                continue
            vs_default = f"{r.gb_per_s / base.gb_per_s:.2f}x" if base and base.gb_per_s else "-"
            of_copy = f"{r.gb_per_s / copy.gb_per_s:.0%}" if copy else "-"
            err = "-" if r.max_rel_err is None else f"{r.max_rel_err:.1e}{'' if agrees(r.max_rel_err, dtype) else ' !'}"
            lines.append(f"{name:<40} {config:<44} {r.gb_per_s:8.0f} {vs_default:>10} {of_copy:>8} {err:>12}")
    return "\n".join(lines)


def do_bench_timer(call: Callable[[], object]) -> float:
    import triton

    return triton.testing.do_bench(call, warmup=10, rep=40)


def sweep(
    cases: Sequence[Case],
    device: torch.device,
    dtype: torch.dtype,
    timer: Timer,
    budget_s: float,
    scale: float = 1.0,
    after_case: Callable[[list[Row], list[str]], None] | None = None,
) -> tuple[list[Row], list[str]]:
    """Every case while the budget lasts, each case's table printed as soon as it is measured; returns the rows and
    the names of the cases left unswept. ``after_case(rows, unswept)`` is called after each case with the rows so far
    and the cases not swept yet (so that a call cut by its time limit can keep them)."""
    started = time.monotonic()
    rows, left = [], []
    for index, case in enumerate(cases):
        if time.monotonic() - started > budget_s:
            left.append(case.name)
            continue
        print(f"tune_rows: {case.name} ({len(case.candidates)} candidates)", flush=True)
        case_rows = sweep_case(case, device, dtype, timer, scale)
        print(table(case_rows, dtype), flush=True)
        rows += case_rows
        if after_case is not None:
            after_case(rows, left + [later.name for later in cases[index + 1 :]])
    return rows, left


def main(argv: Sequence[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-s", type=float, default=60.0, help="no case starts after this many seconds")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--json", type=Path, help="write the rows here too")
    parser.add_argument("--dry-run", action="store_true", help="list the cases and candidates; run nothing")
    args = parser.parse_args(argv)
    dtype = DTYPES[args.dtype]
    if args.dry_run:
        for case in CASES:
            print(f"{case.name}: {len(case.candidates)} candidates: {list(case.candidates)}")
        return []
    if not torch.cuda.is_available():
        parser.error("the sweep times kernels on a CUDA GPU (--dry-run lists it without one)")
    device = torch.device("cuda")

    def write_json(rows: list[Row], unswept: list[str]) -> None:
        if args.json:
            payload = {
                "device": torch.cuda.get_device_name(device),
                "dtype": args.dtype,
                "rows": [asdict(r) for r in rows],
                "left": unswept,
            }
            args.json.write_text(json.dumps(payload, indent=2) + "\n")

    # The JSON after every case too: a call cut by its time limit keeps what it measured.
    rows, left = sweep(CASES, device, dtype, do_bench_timer, args.budget_s, after_case=write_json)
    write_json(rows, left)
    if left:
        print(f"not swept (budget {args.budget_s:.0f} s): {', '.join(left)}")
    return rows


if __name__ == "__main__":
    main()
