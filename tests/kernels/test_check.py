"""qvl check (qvl.kernels.check) on a CPU: the command as a user runs it (Triton's interpreter, nothing recorded), a
worker that faults or hangs is a failed verdict within its time limit, and a variant made wrong on purpose is judged
wrong, recorded so, and not taken."""

import os
import subprocess
import sys
import time

import pytest

from qvl.kernels import check, verdicts
from qvl.kernels.common import HOPPER

PYTHON = [sys.executable, "-c"]


def user_environment(tmp_path):
    """A user's shell: no TRITON_INTERPRET (qvl check sets it for its workers on a CPU), a cache of its own."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "QVL_ATTENTION_HEAD_DIM")}
    return {**env, verdicts.CACHE_VARIABLE: str(tmp_path / "cache")}


def test_qvl_check_on_a_cpu_runs_every_op_and_records_nothing(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "qvl.vit", "check", "--layouts", "split", "--head-dims", "80", "--cases", "lone-33",
         "windows", "--json", str(tmp_path / "check.json")],
        env=user_environment(tmp_path), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("qvl check on CPU, Triton's interpreter")
    for layout in ("padded", "split"):
        for op in ("vision_attn D80", "vision_attn D80 backward", "vision_attn D80 rope backward"):
            assert any(line.split("  ")[0] == op and f"head_dim {layout}" in line and "right" in line for line in lines)
    for op in ("bias_gelu tanh", "add_layer_norm", "rms_norm", "bias_swiglu", "rotary_2d", "pos_embed_interp"):
        assert any(line.startswith(op) and "right" in line for line in lines), op
    assert "nothing recorded; GPU verdicts need a GPU" in result.stdout
    assert "with no alternative in the package" in result.stdout and "rope table" in result.stdout
    assert not (tmp_path / "cache").exists()
    assert (tmp_path / "check.json").stat().st_size > 0


def test_a_worker_that_faults_is_a_failed_verdict():
    outcome = check.run_worker([*PYTHON, 'import os; print(\'{"op": "x"\'); os.abort()'], dict(os.environ), 60)
    assert outcome.rows == [] and outcome.failure.startswith("crashed (signal 6)")
    found = check.verdicts_from({"head_dim:split": outcome}, {})
    assert found["head_dim:split"]["verdict"] == "wrong" and "crashed" in found["head_dim:split"]["why"]


def test_a_worker_that_hangs_is_killed_at_its_limit_and_keeps_its_rows():
    row = check.Row("vision_attn D72", "head_dim split", 1, 0.5, True)
    code = f"import json, time; print(json.dumps({row._asdict()!r}), flush=True); time.sleep(120)"
    start = time.monotonic()
    outcome = check.run_worker([*PYTHON, code], dict(os.environ), 3)
    assert time.monotonic() - start < 30
    assert outcome.rows == [row] and outcome.failure.startswith("hung")
    assert check.verdicts_from({"head_dim:split": outcome}, {})["head_dim:split"]["verdict"] == "wrong"


def test_verdicts_need_every_row_right_and_a_clean_memcheck():
    right = check.Outcome([check.Row("a", "head_dim split", 1, 0.2, True)], None)
    wrong = check.Outcome([*right.rows, check.Row("b", "head_dim split", 1, 3.0, False, "b: error 3 exceeds")], None)
    found = check.verdicts_from(
        {"head_dim:split": right, "head_dim:split32": wrong, "head_dim:padded": check.Outcome([], None)},
        {"head_dim:split": None},
    )
    assert found["head_dim:split"]["verdict"] == "right" and found["head_dim:split"]["memcheck"] == "clean"
    assert found["head_dim:split32"]["verdict"] == "wrong" and "b: error 3 exceeds" in found["head_dim:split32"]["why"]
    assert found["head_dim:padded"] == {**found["head_dim:padded"], "verdict": "wrong", "why": "no result"}
    found = check.verdicts_from({"head_dim:split": right}, {"head_dim:split": "ERROR SUMMARY: 2 errors"})
    assert found["head_dim:split"]["verdict"] == "wrong" and "memcheck" in found["head_dim:split"]["why"]


# A worker whose split layout drops the head-dim tail (the columns past the 64-wide main tile): wrong on purpose.
WRONG_SPLIT_WORKER = """
import sys
from qvl.kernels.attention import config

tiles = config.head_dim_tiles


def without_tail(head_dim, layout=None, target=None):
    found = tiles(head_dim, layout, target)
    return found._replace(tail=0) if found.tail else found


config.head_dim_tiles = without_tail
from qvl.kernels.check import worker_main

sys.exit(worker_main(sys.argv[1:]))
"""


def test_a_variant_made_wrong_on_purpose_is_judged_wrong_and_not_taken(tmp_path, monkeypatch, fresh_attention_plans):
    script = tmp_path / "wrong_worker.py"
    script.write_text(WRONG_SPLIT_WORKER)
    env = {**user_environment(tmp_path), "TRITON_INTERPRET": "1", "QVL_ATTENTION_HEAD_DIM": "split"}
    command = [sys.executable, str(script), "layout", "split", "--head-dims", "72", "--cases", "lone-33"]
    outcome = check.run_worker(command, env, 300)
    assert outcome.failure is None and outcome.rows
    assert not any(row.passed for row in outcome.rows)
    found = check.verdicts_from({"head_dim:split": outcome}, {})
    assert found["head_dim:split"]["verdict"] == "wrong"

    # Recorded for this (stand-in) machine, it keeps split off even where the package's table said right.
    machine = verdicts.Machine("NVIDIA H100 80GB HBM3", 90, "580.1", "2.11.0", "3.6.0", "0.1.0")
    monkeypatch.setenv(verdicts.CACHE_VARIABLE, str(tmp_path / "cache"))
    monkeypatch.setattr(verdicts, "machine_of", lambda index: machine)
    monkeypatch.setattr(verdicts, "verdict_for", _with_packaged_split_right(verdicts.verdict_for))
    verdicts.reset()
    try:
        assert verdicts.decision("head_dim", HOPPER, 0).variant == "split"
        verdicts.record_verdicts(machine, found)
        verdicts.reset()
        decision = verdicts.decision("head_dim", HOPPER, 0)
        assert decision.variant == "padded" and "split wrong (qvl check on this machine" in decision.reason
    finally:
        verdicts.reset()


def _with_packaged_split_right(verdict_for):
    """``verdict_for`` with a packaged "right" for split behind the machine's own verdicts."""

    def patched(variant, target, machine=None):
        found = verdict_for(variant, target, machine)
        if found is None and variant == "head_dim:split":
            return "right", "a stand-in packaged run"
        return found

    return patched


@pytest.mark.parametrize("argv", [["--layouts", "wide"], ["--cases", "nothing"]])
def test_bad_options_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as stop:
        check.main(argv)
    assert stop.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_the_launch_worker_compares_both_launch_paths_bit_for_bit(tmp_path):
    """Through the interpreter both paths are Triton's own launch: the worker's calls run and agree."""
    env = {**user_environment(tmp_path), "TRITON_INTERPRET": "1", "QVL_ATTENTION_HEAD_DIM": "padded"}
    outcome = check.run_worker([sys.executable, "-m", "qvl.kernels.check", "--worker", "launch"], env, 300)
    assert outcome.failure is None
    assert [row.op for row in outcome.rows] == ["vision_attn D72 rope", "vision_attn D80 rope"]
    assert all(row.passed and row.variant == "launch fast" for row in outcome.rows)


SANITIZER = """#!/usr/bin/env bash
if [ "$QVL_ATTENTION_HEAD_DIM" = split32 ]; then echo "========= ERROR SUMMARY: 2 errors"; exit 9; fi
echo "========= ERROR SUMMARY: 0 errors"
"""


def test_memcheck_errors_make_a_layout_wrong(tmp_path):
    """Each candidate layout under compute-sanitizer at once (a stand-in here): errors are that layout's verdict."""
    sanitizer = tmp_path / "compute-sanitizer"
    sanitizer.write_text(SANITIZER)
    sanitizer.chmod(0o755)
    found = check._memchecks(str(sanitizer), ["split", "split32"], [72], dict(os.environ), 30, ["python"])
    assert found == {"head_dim:split": None, "head_dim:split32": "========= ERROR SUMMARY: 2 errors"}
    right = check.Outcome([check.Row("a", "head_dim split", 1, 0.2, True)], None)
    verdicts_found = check.verdicts_from({"head_dim:split": right, "head_dim:split32": right}, found)
    assert verdicts_found["head_dim:split"]["verdict"] == "right"
    assert verdicts_found["head_dim:split32"]["verdict"] == "wrong"
