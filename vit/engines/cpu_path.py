"""Whether qvl's engine plugins take an engine's vision work on a CPU: one decision for every engine.

On a GPU qvl's routes run its Triton kernels and stay on. On a CPU they run qvl's torch path (torch's fused
attention per run of equal-length segments, the rotary once per q and k: :mod:`qvl.kernels.torch_path`), which beats
an engine's own CPU vision tower only where it was measured to: :data:`MEASURED` holds, per engine and dtype, the time
of the engine's tower run by qvl's route over the engine's own run of it, from ``python -m bench.bench_cpu`` on one
machine (the file named in each entry). Where that ratio is above 1, or no one measured it, the routes step aside by
default and the engine's own code runs, with one log line saying why.

The switch, read from the environment variable :data:`SWITCH` each time a decision is made:

* unset or ``auto``: the measured table decides;
* ``on`` (or ``1``): route on any CPU;
* ``off`` (or ``0``): never route on a CPU.

The plugins ask :func:`cpu_route_decision` when they build a model's layers (vLLM: :mod:`qvl.vit.engines.vllm.attention`
and :mod:`qvl.vit.engines.vllm.tower`); a plugin's own switch (``QVL_VLLM``) still turns its routes off everywhere.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = ["MEASURED", "SWITCH", "Measurement", "cpu_route_decision", "forced_routes"]

SWITCH = "QVL_CPU_ROUTES"
_MODES = {"": "auto", "auto": "auto", "on": "on", "1": "on", "off": "off", "0": "off"}


@dataclass(frozen=True)
class Measurement:
    """qvl's route against an engine's own CPU vision tower, same weights, one run of ``python -m bench.bench_cpu``.

    Attributes:
        ratio: the routed tower's time over the engine's own, at the benchmark's largest ratio over its workloads
            (so the route is taken only where it is never slower).
        source: the results file under ``bench/results`` that holds the run.
    """

    ratio: float
    source: str


_BENCH = "cpu-intel-r-xeon-r-processor-2026-12-04-run2.txt"
_SGLANG_BENCH = "cpu-sglang-0.5.23-intel-r-xeon-r-processor-2026-12-04.txt"
# (engine, dtype) -> the measurement the default decision follows; an engine or dtype not listed steps aside.
MEASURED: dict[tuple[str, torch.dtype], Measurement] = {
    # vLLM 0.32.0's CPU build: its tower on qvl's route ("vLLM + qvl") over its own ("vLLM"), worst of the 1 x 1,024,
    # 1 x 4,096 and 4 x 1,024 patch workloads, in two runs of the same route code (fp32: 0.98 / 0.96 / 0.94 in
    # ...-2026-12-04.txt, then 1.01 / 0.88 / 0.98; bf16: 1.13 / 1.04 / 1.18, then 1.16 / 1.14 / 1.26; both towers run
    # vLLM's oneDNN linears): in fp32 the route wins at 4,096 patches but ties at 1,024, so it steps aside in both
    # dtypes.
    ("vllm", torch.float32): Measurement(1.01, _BENCH),
    ("vllm", torch.bfloat16): Measurement(1.26, _BENCH),
    # SGLang 0.5.23 on its generic CPU platform: its Qwen3-VL tower on qvl's routes ("SGLang + qvl") over its own
    # ("SGLang": sdpa ViT backend, which masks the whole batch at once), worst of the same workloads (0.67 / 0.37 /
    # 0.26 in fp32, 0.32 / 0.13 / 0.09 in bf16): the routes take it.
    ("sglang", torch.float32): Measurement(0.67, _SGLANG_BENCH),
    ("sglang", torch.bfloat16): Measurement(0.32, _SGLANG_BENCH),
}


def cpu_route_decision(engine: str, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether ``engine``'s plugin (``"vllm"``, ``"sglang"``) routes vision work in ``dtype`` to qvl on a CPU, and why:
    ``(route, reason)``, the reason one line for the engine's log. Follows :data:`SWITCH` (see the module docstring);
    an unknown value of it steps aside, saying so. Never raises."""
    value = os.environ.get(SWITCH, "")
    mode = _MODES.get(value.strip().lower())
    if mode is None:
        return False, f"{SWITCH}={value!r} is not one of {sorted(_MODES)[1:]}; stepping aside on CPU"
    if mode == "on":
        return True, f"{SWITCH}={value} routes on CPU"
    if mode == "off":
        return False, f"{SWITCH}={value} keeps {engine}'s own vision code on CPU"
    measured = MEASURED.get((engine, dtype))
    name = str(dtype).removeprefix("torch.")
    if measured is None:
        return False, f"qvl's CPU path was not measured against {engine}'s own in {name}; {SWITCH}=on routes anyway"
    verdict = f"{measured.ratio:.2f}x {engine}'s own CPU time in {name} ({measured.source})"
    if measured.ratio <= 1.0:
        return True, f"qvl's route takes {verdict}"
    return False, f"qvl's route would take {verdict}; {SWITCH}=on routes anyway"


@contextlib.contextmanager
def forced_routes(route: bool) -> Iterator[None]:
    """Inside the block, :data:`SWITCH` is ``on`` (``route``) or ``off``; the previous value comes back after (the
    benchmark measuring a route, tests)."""
    previous = os.environ.get(SWITCH)
    os.environ[SWITCH] = "on" if route else "off"
    try:
        yield
    finally:
        if previous is None:
            del os.environ[SWITCH]
        else:
            os.environ[SWITCH] = previous
