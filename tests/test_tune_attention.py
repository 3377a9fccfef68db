"""bench/tune_attention.py without a GPU: the sweep's candidates and order, the choice of the fastest correct
candidate, the table it writes (which launch_config then reads), and one sweep through the interpreter with a
stand-in timer. Nothing here measures speed."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import tune_attention as tune  # noqa: E402
from qvl.kernels import attention  # noqa: E402
from qvl.kernels.common import HOPPER  # noqa: E402


def test_candidates_cover_the_sweep_and_include_the_heuristic():
    long, short = tune.candidates("long"), tune.candidates("short")
    assert len(long) == len({tuple(c.items()) for c in long}) == 54
    assert len(short) == 12
    assert all(c["BLOCK_M"] == 128 for c in long if c["num_warps"] == 8)
    assert all(c["BLOCK_M"] == 64 and c["BLOCK_N"] <= 64 for c in short)
    assert {c["DESCRIPTORS"] for c in long} == {False, True}
    for head_dim in (64, 72, 80):
        for hint, found in ((None, long), (64, short)):
            heuristic = attention.launch_config(head_dim, torch.bfloat16, HOPPER, hint)
            assert any(tune.is_default(c, heuristic) for c in found), (head_dim, hint)


def test_cases_come_in_priority_order():
    names = [case.name for case in tune.cases([64, 72, 80], [torch.bfloat16])]
    assert names[:3] == ["D72 bfloat16 long", "D64 bfloat16 long", "D80 bfloat16 short"]
    assert len(names) == 6
    assert [c.name for c in tune.cases([96], [torch.float16])] == ["D96 float16 long", "D96 float16 short"]


def test_the_fastest_candidate_that_ran_becomes_the_entry():
    default = attention.launch_config(80, torch.bfloat16, HOPPER, 64)
    short = tune.candidates("short")
    heuristic = next(c for c in short if tune.is_default(c, default))
    tiles = [short[0], short[1], heuristic, short[3]]
    measured = [
        {**t, "ms": ms, "max_rel_err": 0.0, "skipped": None if ms else "why"}
        for t, ms in zip(tiles, (0.5, None, 0.3, 0.2), strict=True)
    ]
    entry = tune.table_entry(measured, default, flops=1e9)
    assert {k: entry[k] for k in attention.TILE_KEYS} == {k: short[3][k] for k in attention.TILE_KEYS}
    assert entry["ms"] == 0.2 and entry["heuristic_ms"] == 0.3
    assert entry["tflops"] == pytest.approx(1e9 / 0.2e-3 / 1e12, abs=0.1)
    assert tune.table_entry([{**r, "ms": None} for r in measured], default, flops=1e9) is None


def test_merged_table_is_what_launch_config_reads(tmp_path, monkeypatch):
    path = tmp_path / "tiles.json"
    path.write_text(attention.TILE_TABLE_PATH.read_text())
    entry = dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2, DESCRIPTORS=True, ms=1.0, tflops=1.0)
    key = attention.tile_key(HOPPER, 72, torch.bfloat16, None)
    run = {"device": "NVIDIA H200", "torch": "2.11", "triton": "3.6", "date": "2026-12-03"}
    table = tune.merge_table(path, {key: entry}, run)
    assert json.loads(path.read_text()) == table
    assert table["tiles"][key]["run"] == len(table["runs"]) - 1 and table["runs"][-1] == run
    monkeypatch.setattr(attention.config, "TILE_TABLE_PATH", path)
    attention.reload_tile_table()
    try:
        config = attention.launch_config(72, torch.bfloat16, HOPPER)
    finally:
        attention.reload_tile_table()
    assert {k: config[k] for k in attention.TILE_KEYS} == {k: entry[k] for k in attention.TILE_KEYS}


def test_a_sweep_writes_after_every_case_and_lists_its_run_once(tmp_path):
    """merge_table with the table the sweep started from: each write holds every entry so far (a sweep cut short
    keeps its finished cases) and the run once, and the keys of other runs stay."""
    path = tmp_path / "tiles.json"
    path.write_text(attention.TILE_TABLE_PATH.read_text())
    base = json.loads(path.read_text())
    run = {"device": "NVIDIA H100", "torch": "2.11", "triton": "3.6", "date": "2026-12-06"}
    entry = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, DESCRIPTORS=False, ms=1.0, tflops=1.0)
    keys = [attention.tile_key(HOPPER, 72, torch.bfloat16, None), attention.tile_key(HOPPER, 80, torch.bfloat16, 64)]
    entries = {}
    for key in keys:
        entries[key] = entry
        table = tune.merge_table(path, entries, run, base)
    assert json.loads(path.read_text()) == table and table["runs"] == [*base["runs"], run]
    assert all(table["tiles"][key]["run"] == len(base["runs"]) for key in keys)
    assert {key: table["tiles"][key] for key in base["tiles"] if key not in keys} == {
        key: value for key, value in base["tiles"].items() if key not in keys
    }


def test_sweep_through_the_interpreter(monkeypatch):
    """The sweep's own path on tiny segments: every candidate checked on the timed and the ragged batch (each segment
    within its bound), timed by the stand-in timer, one skipped by the compile step, the rest after the
    deadline."""
    monkeypatch.setitem(tune.LAYOUTS, "long", (40, 9))
    monkeypatch.setitem(tune.RAGGED, "long", (1, 0, 23))
    monkeypatch.setattr(tune, "NUM_HEADS", 1)
    case = tune.Case(72, torch.float16, "long")
    tiles_list = [c for c in tune.candidates("long") if c["num_stages"] == 2 and c["num_warps"] == 4][:4]
    calls = []

    def timer(call):
        call()
        calls.append(call)
        return float(len(calls))

    skip = [None, None, "shared memory 300000 B > 232448 B", None]
    measured = tune.tune_case(case, tiles_list, torch.device("cpu"), timer, skip)
    assert [r["ms"] for r in measured] == [1.0, 2.0, None, 3.0]
    assert measured[2]["skipped"] == skip[2]
    assert all(0 <= r["worst"] <= 1 for r in measured if r["ms"] is not None)
    late = tune.tune_case(case, tiles_list, torch.device("cpu"), timer, deadline=0.0)
    assert all(r["skipped"] == "budget spent" for r in late)


def test_a_candidate_wrong_in_one_segment_is_not_timed(monkeypatch):
    """The sweep judges each segment against float64 on its own (the rule of qvl check): a candidate whose result is
    off in the ragged batch's 23-token segment alone is skipped, saying where, and never becomes a table entry."""
    monkeypatch.setitem(tune.LAYOUTS, "long", (40, 9))
    monkeypatch.setitem(tune.RAGGED, "long", (1, 0, 23))
    monkeypatch.setattr(tune, "NUM_HEADS", 1)
    case = tune.Case(72, torch.float16, "long")
    tiles_list = [c for c in tune.candidates("long") if c["num_stages"] == 2 and not c["DESCRIPTORS"]][:2]
    wrong = tiles_list[1]
    assert wrong["BLOCK_N"] != tiles_list[0]["BLOCK_N"]
    real = tune.run_launches

    def one_segment_off(launches, device):
        real(launches, device)
        config, out = launches[-1].kwargs, launches[-1].args["Out"]
        if (config["BLOCK_M"], config["BLOCK_N"]) == (wrong["BLOCK_M"], wrong["BLOCK_N"]) and out.shape[0] == 24:
            out[1:] += 0.05

    monkeypatch.setattr(tune, "run_launches", one_segment_off)
    measured = tune.tune_case(case, tiles_list, torch.device("cpu"), lambda call: 1.0)
    assert measured[0]["ms"] == 1.0 and measured[0]["worst"] <= 1
    assert measured[1]["ms"] is None and measured[1]["worst"] > 1
    assert measured[1]["skipped"].startswith("wrong: attention [1:24) (off at rows 0..22 of 23, heads 0 of 1, columns")
    assert tune.best(measured) is measured[0]


def test_dry_run_lists_the_sweep_without_a_gpu(capsys):
    tune.main(["--dry-run", "--head-dims", "72"])
    out = capsys.readouterr().out.splitlines()
    assert out == ["D72 bfloat16 long: 54 candidates, 3 segments", "D72 bfloat16 short: 12 candidates, 144 segments"]


def test_compile_workers_take_the_head_dim_layout_in_use(use_head_dim_layout):
    """A padded sweep compiles the padded kernels it then times (the workers are spawned, not forked)."""
    use_head_dim_layout("padded")
    with tune.compile_pool(1) as pool:
        assert pool.submit(attention.head_dim_layout).result(timeout=120) == "padded"
