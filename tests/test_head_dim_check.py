"""bench/head_dim_check.py, the first step of a device run, through the interpreter: the head-dim layouts checked
against float64, the choice it prints (which bench/device_check.sh exports for the run's later steps), and the
fallbacks, to split32 and then to the padded layout, when a split check disagrees or raises."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import head_dim_check  # noqa: E402
from qvl.kernels import attention  # noqa: E402


def test_both_layouts_agree_in_the_interpreter(tmp_path, capsys, use_head_dim_layout):
    """fp16 (the interpreter multiplies bf16 dots wrongly); the process's layout is left as it was."""
    use_head_dim_layout("split")
    path = tmp_path / "head_dim.json"
    results = head_dim_check.main(["--quick", "--dtype", "fp16", "--head-dims", "72", "--json", str(path)])
    out = capsys.readouterr().out.splitlines()
    # The verdict right after the split rows; the padded row, for comparison, after it.
    assert [line.split(" (")[0] for line in out[-3:]] == ["D 72 split", "head-dim layout: split", "D 72 padded"]
    assert [(row["layout"], row["tiles"], row["agrees"]) for row in results["rows"]] == [
        ("split", "64+16", True),
        ("padded", "128+0", True),
    ]
    assert set(results["rows"][0]["errors"]) == {f"forward {name}" for name in head_dim_check.LENGTHS} | {
        "rope fwd+bwd ragged"
    }
    assert set(results["rows"][0]["torch_errors"]) == set(results["rows"][0]["errors"])
    assert "timings" not in results["rows"][0]  # nothing timed on CPU
    assert json.loads(path.read_text())["layout"] == "split"
    assert attention.head_dim_layout() == "split"


def wrong_in(*wrong_layouts):
    """A stand-in for head_dim_check.checks: NaN in ``wrong_layouts`` (D 80 raising an illegal address in split)."""

    def checks(head_dim, dtype, device, quick):
        layout = attention.head_dim_layout()
        if head_dim == 80 and layout == "split":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return {"forward short": (math.nan if layout in wrong_layouts else 1e-3, 1e-3)}

    return checks


def test_a_wrong_split_layout_falls_back_to_split32(monkeypatch, capsys):
    monkeypatch.setattr(head_dim_check, "checks", wrong_in("split"))
    results = head_dim_check.run([72, 80], torch.float16, torch.device("cpu"), quick=True)
    assert [(row["head_dim"], row["layout"], row["tiles"], row["agrees"]) for row in results["rows"]] == [
        (72, "split", "64+16", False), (80, "split", "64+16", False), (72, "split32", "64+32", True),
        (80, "split32", "64+32", True), (72, "padded", "128+0", True), (80, "padded", "128+0", True),
    ]  # fmt: skip
    assert results["layout"] == "split32"
    out = capsys.readouterr().out
    assert out.count("head-dim layout:") == 1 and out.index("head-dim layout: split32") < out.index("D 72 padded")


def test_wrong_split_layouts_fall_back_to_padded(monkeypatch, capsys):
    """The verdict is printed before the padded rows, so a device run cut short while timing them keeps it."""
    monkeypatch.setattr(head_dim_check, "checks", wrong_in("split", "split32"))
    results = head_dim_check.run([72, 80], torch.float16, torch.device("cpu"), quick=True)
    assert [(row["head_dim"], row["layout"], row["agrees"]) for row in results["rows"]] == [
        (72, "split", False), (80, "split", False), (72, "split32", False), (80, "split32", False),
        (72, "padded", True), (80, "padded", True),
    ]  # fmt: skip
    assert results["rows"][1]["error"] == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert results["layout"] == "padded"
    out = capsys.readouterr().out
    assert "D 80 split (64+16): WRONG (RuntimeError: CUDA error" in out
    assert out.index("head-dim layout: padded") < out.index("D 72 padded")
    only_72 = {"rows": [{**row, "errors": {"x": 1e-3}} if row["layout"] == "split" else row for row in results["rows"]]}
    assert head_dim_check.choose(only_72, torch.float16) == "split"
    assert head_dim_check.choose({"rows": results["rows"][:2]}, torch.float16) is None  # split32 still to check


def test_layouts_after_one_raised_on_the_device_are_checked_in_fresh_processes(monkeypatch):
    """An illegal address leaves CUDA unusable in its process: the layouts checked after it get processes of their
    own (here stand-ins; the checks themselves touch no device)."""
    fresh = []

    def in_fresh_process(layout, head_dims, dtype, device, quick):
        fresh.append(layout)
        return head_dim_check.layout_rows(layout, head_dims, dtype, device, quick)

    monkeypatch.setattr(head_dim_check, "checks", wrong_in("split"))
    monkeypatch.setattr(head_dim_check, "rows_in_fresh_process", in_fresh_process)
    results = head_dim_check.run([72, 80], torch.float16, torch.device("cuda"), quick=True)
    assert fresh == ["split32", "padded"] and results["layout"] == "split32"
    fresh.clear()
    head_dim_check.run([72], torch.float16, torch.device("cuda"), quick=True)
    assert fresh == []  # split wrong at D 72, but nothing raised: one process
    head_dim_check.run([72, 80], torch.float16, torch.device("cpu"), quick=True)
    assert fresh == []  # D 80 raised, but the interpreter has no device state to lose


def test_a_fresh_process_checks_split32_in_the_interpreter(use_head_dim_layout):
    """What a device run does after split raised, here through Triton's interpreter in a spawned process (fp16)."""
    use_head_dim_layout("split")
    (row,) = head_dim_check.rows_in_fresh_process("split32", [72], torch.float16, torch.device("cpu"), quick=True)
    assert (row["layout"], row["tiles"], row["agrees"]) == ("split32", "64+32", True), row
    assert set(row["errors"]) == {f"forward {name}" for name in head_dim_check.LENGTHS} | {"rope fwd+bwd ragged"}
    assert attention.head_dim_layout() == "split"  # the parent's layout is its own


def test_a_check_is_judged_against_torchs_own_error_in_the_dtype():
    """bf16 rounding alone never fails a check (an error a few times torch's own passes, even over the harness's
    bound), a wrong tiling's order-one error or a NaN always does."""
    tolerance = head_dim_check.TOLERANCE[torch.bfloat16]

    def row(err, torch_err):
        return {"errors": {"dq": err}, "torch_errors": {"dq": torch_err}}

    assert head_dim_check.agreed(row(3 * tolerance, tolerance), torch.bfloat16)
    assert head_dim_check.agreed(row(tolerance, 1e-5), torch.bfloat16)
    assert not head_dim_check.agreed(row(1.07, 4e-3), torch.bfloat16)
    assert not head_dim_check.agreed(row(math.nan, 4e-3), torch.bfloat16)


def test_refuses_to_check_the_torch_path():
    """Without Triton's interpreter on a CPU the op runs torch's attention: no tiling to check."""
    result = subprocess.run(
        [sys.executable, "-m", "bench.head_dim_check", "--quick"],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": ""},
    )
    assert result.returncode == 2 and "no Triton kernel runs here" in result.stderr, result.stderr


def test_a_run_cut_short_while_timing_padded_keeps_its_verdict(monkeypatch, tmp_path):
    """The JSON is rewritten after every row and the verdict: a timeout during the padded rows leaves both."""

    def checked_row(head_dim, layout, dtype, device, quick):
        if layout == "padded":
            raise KeyboardInterrupt  # what the device check's timeout would end it with
        errors = {"errors": {"x": 1e-3}, "torch_errors": {"x": 1e-3}}
        return {"head_dim": head_dim, "layout": layout, "tiles": "64+16", **errors, "agrees": True}

    monkeypatch.setattr(head_dim_check, "checked_row", checked_row)
    path = tmp_path / "head_dim.json"
    try:
        head_dim_check.run([72], torch.float16, torch.device("cpu"), quick=True, json_path=path)
    except KeyboardInterrupt:
        pass
    saved = json.loads(path.read_text())
    assert saved["layout"] == "split" and [row["layout"] for row in saved["rows"]] == ["split"]
