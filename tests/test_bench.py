"""Smoke test of the benchmarks' CPU mode: each module runs in-process on its torch paths and reports
the rows it should, with finite positive numbers. Nothing here asserts on speed."""

import json
import math
import re
import sys
from pathlib import Path

import pytest

# bench/ is a plain directory run from the repository root, not an installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import bench_attention, bench_rotary, harness  # noqa: E402

CPU = harness.get_device("cpu")


def run_cpu(module, tmp_path: Path, capsys) -> tuple[dict, str]:
    path = tmp_path / "results.json"
    module.main(["--device", "cpu", "--json", str(path)])
    return json.loads(path.read_text()), capsys.readouterr().out


def check_records(data: dict, expected: set[tuple[str, str]], baseline: str) -> None:
    assert {(r["case"], r["impl"]) for r in data["records"]} == expected
    for r in data["records"]:
        for key in ("ms", "ms_lo", "ms_hi", "work", "rate", "speedup"):
            assert isinstance(r[key], float) and math.isfinite(r[key]) and r[key] > 0, (key, r)
        assert r["ms_lo"] <= r["ms"] <= r["ms_hi"]
        assert r["baseline"] == baseline
        assert r["share"] is None  # no peaks for a CPU
        assert r["agrees"], r
        if r["impl"] == "qvl":
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
    impls = ("qvl", "qvl+rope", "sdpa/image")
    check_records(data, {(c, i) for c in names for i in impls}, baseline="sdpa/image")
    for peer in ("varlen_attn", "flex_attention", "flash_attn"):
        assert data["skipped"][peer] == "CPU run: torch paths only"
    rope_rows = [r for r in data["records"] if r["impl"] == "qvl+rope"]
    assert all(r["note"].startswith("fused rope ") for r in rope_rows)
    check_table_last(out, names[-1], "sdpa/image")


def test_rotary_cpu(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    data, out = run_cpu(bench_rotary, tmp_path, capsys)
    check_meta(data, "rotary")
    names = [f"T={sum(h * w for h, w in grids)}" for grids in bench_rotary.cases(CPU, quick=True)]
    check_records(data, {(c, i) for c in names for i in ("qvl", "qvl in-place", "hf eager")}, baseline="hf eager")
    assert data["skipped"]["hf compiled"] == "CPU run: torch paths only"
    for r in data["records"]:
        tokens = int(r["case"].removeprefix("T="))
        assert r["work"] == 2 * (2 * tokens * 16 * 72 * 2) + tokens * 2 * 4  # q, k (bf16) read and written; positions
    check_table_last(out, names[-1], "hf eager")
