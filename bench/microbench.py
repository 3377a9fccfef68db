"""The benchmark modules' cases as pytest-benchmark microbenchmarks (bf16)::

    python -m pytest bench/microbench.py                      # GPU: full case lists; CPU: the tiny ones
    python -m pytest bench/microbench.py -k "rotary and qvl" --benchmark-json out.json

Not part of the test suite: pytest only collects this file when it is named (its name does not match
``test_*.py``). pytest-benchmark times wall clock, so each timed call ends with a device sync, and the
inputs rotate through sets larger than L2 because nothing here flushes it between rounds. Each
benchmark's ``extra_info`` carries its useful work (``flop`` or ``bytes``) for rates.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import pytest
import torch

from . import bench_attention, bench_merger, bench_pos_embed, bench_rotary, harness
from .workloads import Grid, seqlens

DEVICE = harness.get_device()
DTYPE = torch.bfloat16


@pytest.fixture(autouse=True)
def _cpu_threads():
    with harness.cpu_threads(DEVICE):
        yield


def _id(prefix: str, grids: Sequence[Grid]) -> str:
    """Test ids usable in ``-k`` expressions (no '=', spaces or brackets): 8B-S4096, 8B-mixed8."""
    sizes = seqlens(grids)
    return f"{prefix}-S{sizes[0]}" if len(sizes) == 1 else f"{prefix}-mixed{len(sizes)}"


def _key(name: str) -> str:
    """An implementation or case name as a ``-k``-friendly id: 'hf gather+add' -> 'hf_gather_add'."""
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")


def _build(builders: dict[str, Callable[[], Any]], name: str) -> Any:
    ready, skipped = harness.peers({name: builders[name]})
    if name in skipped:
        pytest.skip(skipped[name])
    return ready[name]


def _run(benchmark, calls: Sequence[Callable[[], Any]]) -> None:
    step = harness.cycling(calls)

    def timed() -> None:
        step()
        if DEVICE.is_cuda:
            torch.cuda.synchronize(DEVICE.torch_device)

    timed()  # compilation and first-call caches stay out of the rounds
    benchmark(timed)


def _run_memory_bound(benchmark, module, grids: Sequence[Grid], bind) -> None:
    """Time ``bind`` on ``module``'s inputs for ``grids`` (rotary and pos_embed share their input API)."""
    count = harness.rotation_count(module.set_bytes(grids, DTYPE), DEVICE)
    sets = module.make_inputs(grids, DEVICE, DTYPE, count)
    benchmark.extra_info["bytes"] = module.min_bytes(sets[0])
    _run(benchmark, [bind(s) for s in sets])


ATTENTION_IMPLS = {
    name: partial(build, DEVICE) for name, build in {**bench_attention.QVL_VARIANTS, **bench_attention.PEERS}.items()
}


@pytest.mark.parametrize("impl", list(ATTENTION_IMPLS))
@pytest.mark.parametrize("case", bench_attention.cases(DEVICE, quick=False), ids=lambda c: _id(c.dims.name, c.grids))
def test_attention(benchmark, case: bench_attention.Case, impl: str) -> None:
    bind = _build(ATTENTION_IMPLS, impl)
    count = harness.rotation_count(bench_attention.set_bytes(case, DTYPE), DEVICE)
    sets = bench_attention.make_inputs(case, DEVICE, DTYPE, count)
    benchmark.extra_info["flop"] = harness.attention_flops(case.dims.num_heads, case.dims.head_dim, sets[0].seqlens)
    _run(benchmark, [bind(s) for s in sets])


ROTARY_IMPLS = {
    "qvl": partial(bench_rotary.qvl_rotary, DEVICE),
    "qvl_in_place": partial(bench_rotary.qvl_rotary, DEVICE, in_place=True),
    **{_key(name): partial(build, DEVICE) for name, build in bench_rotary.PEERS.items()},
}


@pytest.mark.parametrize("impl", list(ROTARY_IMPLS))
@pytest.mark.parametrize("grids", bench_rotary.cases(DEVICE, quick=False), ids=lambda g: _id("rope", g))
def test_rotary(benchmark, grids, impl: str) -> None:
    _run_memory_bound(benchmark, bench_rotary, grids, _build(ROTARY_IMPLS, impl))


POS_EMBED_IMPLS = {
    "qvl": partial(bench_pos_embed.qvl_add, DEVICE),
    "qvl_metadata": partial(bench_pos_embed.qvl_add, DEVICE, with_metadata=True),
    **{_key(name): partial(build, DEVICE) for name, build in bench_pos_embed.PEERS.items()},
}


@pytest.mark.parametrize("impl", list(POS_EMBED_IMPLS))
@pytest.mark.parametrize("grids", bench_pos_embed.cases(DEVICE, quick=False), ids=lambda g: _id("pos", g))
def test_pos_embed(benchmark, grids, impl: str) -> None:
    _run_memory_bound(benchmark, bench_pos_embed, grids, _build(POS_EMBED_IMPLS, impl))


MERGER_IMPLS = {
    "qvl": partial(bench_merger.qvl_op, DEVICE),
    "qvl_in_place": partial(bench_merger.qvl_op, DEVICE, in_place=True),
    **{_key(name): partial(build, DEVICE) for name, build in bench_merger.PEERS.items()},
}


@pytest.mark.parametrize("impl", list(MERGER_IMPLS))
@pytest.mark.parametrize("case", bench_merger.cases(DEVICE, quick=False), ids=lambda c: _key(c.name))
def test_merger(benchmark, case: bench_merger.Case, impl: str) -> None:
    if impl == "qvl_in_place" and case.op != "bias_gelu":
        pytest.skip("only bias_gelu has an in-place variant")
    bind = _build(MERGER_IMPLS, impl)
    count = harness.rotation_count(bench_merger.set_bytes(case, DTYPE), DEVICE)
    sets = bench_merger.make_inputs(case, DEVICE, DTYPE, count)
    work, metric = bench_merger.min_work(sets[0])
    benchmark.extra_info["flop" if metric == "flops" else "bytes"] = work
    _run(benchmark, [bind(s) for s in sets])
