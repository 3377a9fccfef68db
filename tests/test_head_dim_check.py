"""bench/head_dim_check.py, the first step of a device run, through the interpreter: both head-dim layouts checked
against float64, the choice it prints (which bench/device_check.sh exports for the run's later steps), and the
fallback to the padded layout when a split check disagrees or raises."""

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
    assert out[-1] == "head-dim layout: split"
    assert [(row["layout"], row["tiles"], row["agrees"]) for row in results["rows"]] == [
        ("split", "64+16", True),
        ("padded", "128+0", True),
    ]
    assert set(results["rows"][0]["errors"]) == {f"forward {name}" for name in head_dim_check.LENGTHS} | {
        "rope fwd+bwd ragged"
    }
    assert "timings" not in results["rows"][0]  # nothing timed on CPU
    assert json.loads(path.read_text())["layout"] == "split"
    assert attention.head_dim_layout() == "split"


def test_a_wrong_or_failing_split_layout_falls_back_to_padded(monkeypatch, capsys):
    def checks(head_dim, dtype, device, quick):
        layout = attention.head_dim_layout()
        if head_dim == 80 and layout == "split":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return {"forward short": math.nan if layout == "split" else 1e-3}

    monkeypatch.setattr(head_dim_check, "checks", checks)
    results = head_dim_check.run([72, 80], torch.float16, torch.device("cpu"), quick=True)
    assert [row["agrees"] for row in results["rows"]] == [False, True, False, True]
    assert results["rows"][2]["error"] == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert results["layout"] == "padded"
    assert "D 80 split (64+16): WRONG (RuntimeError: CUDA error" in capsys.readouterr().out
    only_72 = {"rows": [{**row, "errors": {"x": 1e-3}} if row["layout"] == "split" else row for row in results["rows"]]}
    assert head_dim_check.choose(only_72, torch.float16) == "split"


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
