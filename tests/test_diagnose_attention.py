"""bench/diagnose_attention.py without a GPU: the variants it runs, what it reads from a qvl check file, and a run of
two variants through Triton's interpreter, one of which its worker cannot compile (a crash is that variant's result,
the others still report)."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import diagnose_attention as diagnose  # noqa: E402

BASE = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, DESCRIPTORS=False)


def test_variants_change_one_setting_at_a_time_from_the_layouts_own():
    found = diagnose.variants(BASE, tma=True)
    assert found[0] == BASE and len(found) == len({tuple(t.items()) for t in found})
    changed = [{key for key in diagnose.TILE_KEYS if tiles[key] != BASE[key]} for tiles in found[1:]]
    assert changed == [{"num_stages"}, {"num_stages"}, {"BLOCK_M", "num_warps"}, {"BLOCK_N"}, {"BLOCK_N"},
                       {"DESCRIPTORS"}]  # fmt: skip
    assert {t["num_stages"] for t in found} == {1, 2, 3} and {t["BLOCK_N"] for t in found} == {32, 64, 128}
    assert all(not t["DESCRIPTORS"] for t in diagnose.variants(BASE, tma=False))


def test_the_layouts_a_check_found_wrong(tmp_path):
    path = tmp_path / "check.json"
    rows = [
        dict(op=f"vision_attn D{d}{rope}", variant=f"head_dim {layout}")
        for layout in ("padded", "split", "split32")
        for d in (72, 80)
        for rope in ("", " rope")
    ]
    verdicts = {"head_dim:padded": {"verdict": "right"}, "head_dim:split": {"verdict": "wrong"}}
    path.write_text(json.dumps(dict(rows=rows, verdicts={**verdicts, "head_dim:split32": {"verdict": "right"}})))
    assert diagnose.from_check(str(path)) == (["split"], [72, 80])
    path.write_text(json.dumps(dict(rows=rows, verdicts=verdicts | {"head_dim:split": {"verdict": "right"}})))
    assert diagnose.from_check(str(path))[0] == []


def test_nothing_to_diagnose_after_a_check_that_found_the_split_layouts_right(tmp_path, capsys):
    path = tmp_path / "check.json"
    path.write_text(json.dumps(dict(rows=[], verdicts={"head_dim:split": {"verdict": "right"}})))
    assert diagnose.main(["--from-check", str(path)]) == 0
    assert capsys.readouterr().out.startswith("nothing to diagnose")


def test_each_variant_in_its_own_process_through_the_interpreter(tmp_path):
    """The split layout's own tiles at D 72 compute right on every case; a key block of 24 (no power of two) does not
    compile: its worker's crash is its result."""
    base, _ = diagnose.base_tiles("split", 72)
    plans = {("split", 72): [base, {**base, "BLOCK_N": 24}]}
    right, crashed = diagnose.diagnose(["split"], [72], timeout_s=600, plans=plans)
    assert right.failure is None and sorted(right.cases) == sorted(diagnose.CASES)
    assert all(passed and 0 <= worst <= 1 and not failure for worst, passed, failure in right.cases.values())
    assert crashed.cases == {} and crashed.failure.startswith("crashed (exit status 1)")
    text = diagnose.table([right, crashed])
    assert f"split     72 {diagnose.tiles_name(base)}" in text and "right" in text and "crashed" in text


def test_main_runs_every_variant_of_a_layout_and_writes_json(tmp_path, capsys, monkeypatch):
    """Every variant of split32 at D 80 (the interpreter's sizes here), the table, the JSON; the sanitizer step says
    why it did not run where compute-sanitizer is not on the PATH."""
    monkeypatch.setattr(diagnose.shutil, "which", lambda name: None)
    path = tmp_path / "diagnosis.json"
    argv = ["--layouts", "split32", "--head-dims", "80", "--sanitizer", "--json", str(path)]
    assert diagnose.main(argv) == 0
    out = capsys.readouterr().out
    saved = json.loads(path.read_text())
    base, tma = diagnose.base_tiles("split32", 80)
    assert [r["tiles"] for r in saved["results"]] == diagnose.variants(base, tma)
    assert all(r["failure"] is None and all(case[1] for case in r["cases"].values()) for r in saved["results"])
    assert out.count("split32   80 ") == len(saved["results"]) and "WRONG" not in out
    assert saved["sanitizers"] == {"split32": dict.fromkeys(("racecheck", "synccheck"), "compute-sanitizer not found")}
