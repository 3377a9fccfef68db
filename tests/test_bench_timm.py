"""bench.bench_timm's quick mode: timm's qwen3_vit training step under AMP, timm eager and compiled against the
patched model eager and compiled, each row timed and checked against timm's logits, and the JSON it writes."""

import json
import math

import pytest

from bench import bench_timm

pytest.importorskip("timm")


def test_quick_mode_times_and_checks_every_row(tmp_path, capsys):
    path = tmp_path / "timm.json"
    report = bench_timm.main(["--quick", "--device", "cpu", "--json", str(path)])
    data = json.loads(path.read_text())
    assert data["bench"] == "timm" and data["dtype"] == "bfloat16" and data["timings_meaningful"] is False
    records = data["records"]
    assert [(r["case"], r["impl"]) for r in records] == [("2 x 64px", impl) for impl in bench_timm.IMPLS]
    for r in records:
        assert all(math.isfinite(r[key]) and r[key] > 0 for key in ("ms", "ms_lo", "ms_hi", "work", "rate")), r
        assert r["ms_lo"] <= r["ms"] <= r["ms_hi"] and r["baseline"] == bench_timm.BASELINE and r["agrees"], r
        assert (r["max_rel_err"] is None) == (r["impl"] == bench_timm.BASELINE), r
        assert "peak" in r["note"], r
    assert report.records[0].impl == bench_timm.BASELINE
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1].startswith("2 x 64px  qvl compiled")


def test_rows_can_be_skipped(tmp_path):
    path = tmp_path / "timm.json"
    bench_timm.main(["--quick", "--device", "cpu", "--skip", "timm compiled,qvl compiled", "--json", str(path)])
    data = json.loads(path.read_text())
    assert [r["impl"] for r in data["records"]] == ["timm", "qvl"]
    assert data["skipped"] == {"timm compiled": "left out (--skip)", "qvl compiled": "left out (--skip)"}
