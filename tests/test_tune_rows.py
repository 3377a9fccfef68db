"""bench/tune_rows.py without a GPU: every case's candidates include its default launch, and a sweep through the
interpreter (shrunken sizes, a stand-in timer) checks each candidate against the default's outputs and prints the
table. Nothing here measures speed."""

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import tune_rows  # noqa: E402
from bench.harness import agrees  # noqa: E402
from qvl.kernels.common import triton_interpreting  # noqa: E402

CPU = torch.device("cpu")
needs_interpreter = pytest.mark.skipif(not triton_interpreting(), reason="runs the kernels: TRITON_INTERPRET=1")


@needs_interpreter
@pytest.mark.parametrize("case", tune_rows.CASES, ids=lambda case: case.name)
def test_candidates_hold_the_default_launch(case):
    setup = case.make(CPU, torch.float16, 1 / 4096)
    assert sum(tune_rows.is_default(config, setup.launch) for config in case.candidates) == 1
    assert len({tuple(sorted(c.items())) for c in case.candidates}) == len(case.candidates)


@needs_interpreter
def test_sweep_checks_and_tables_every_candidate():
    """Every candidate of every case at a tiny scale in fp16 runs and agrees with the default's outputs (the
    interpreter runs each launch as the GPU would, so a candidate the kernels cannot take fails here); each case
    has its default once, the copy row last, and the table ranks them."""
    timings = iter(range(1, 10_000))
    seen = []
    rows, left = tune_rows.sweep(
        tune_rows.CASES, CPU, torch.float16, lambda call: float(next(timings)), 1e9, 1 / 4096,
        after_case=lambda rows, unswept: seen.append((len(rows), unswept)),
    )  # fmt: skip
    assert left == []
    # After each case: the rows so far (what a call cut short keeps) and the cases still to come.
    names = [case.name for case in tune_rows.CASES]
    assert [unswept for _, unswept in seen] == [names[i + 1 :] for i in range(len(names))]
    assert seen[-1][0] == len(rows) and [n for n, _ in seen] == sorted({n for n, _ in seen})
    for case in tune_rows.CASES:
        mine = [r for r in rows if r.case == case.name]
        assert mine[0].default and sum(r.default for r in mine) == 1
        assert mine[-1].config == {"copy": True} and mine[-1].max_rel_err is None
        checked = mine[:-1]
        assert len(checked) == len(case.candidates) and all(r.note == "" for r in checked), checked
        assert all(math.isfinite(r.max_rel_err) and agrees(r.max_rel_err, torch.float16) for r in checked), checked
        assert all(r.gb_per_s > 0 for r in mine)
    table = tune_rows.table(rows, torch.float16)
    assert "(default)" in table and " !" not in table
    assert len(table.splitlines()) == 1 + len(rows)


def test_sweep_stops_at_its_budget():
    rows, left = tune_rows.sweep(tune_rows.CASES, CPU, torch.float16, lambda call: 1.0, budget_s=-1.0)
    assert rows == [] and left == [case.name for case in tune_rows.CASES]


def test_dry_run_lists_without_a_gpu(capsys):
    assert tune_rows.main(["--dry-run"]) == []
    out = capsys.readouterr().out
    assert all(case.name in out for case in tune_rows.CASES)
