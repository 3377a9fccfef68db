"""bench/device_check.sh, the one prepared call of a GPU lease, run here with stand-ins for python3, nvidia-smi and
compute-sanitizer on PATH: every mode's steps in order, the head-dim layout its first check prints exported to every
later step (padded without a verdict), and at most 8 files shipped to the device tool's $OUT. What the steps measure
needs the GPU; that the script runs them, in this order, with this layout, does not."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PYTHON3 = """#!/usr/bin/env bash
echo "$* | ${QVL_ATTENTION_HEAD_DIM:-unset}" >> "$CALLS"
case "$*" in
  *bench.head_dim_check*) [ -n "$FAKE_VERDICT" ] && echo "head-dim layout: $FAKE_VERDICT" ;;
  -) cat > /dev/null ;;
esac
exit 0
"""
NVIDIA_SMI = '#!/usr/bin/env bash\necho "Stand-in GPU, 0.0, 1 MiB, 1 MHz"\n'
SANITIZER = '#!/usr/bin/env bash\necho "compute-sanitizer | $QVL_ATTENTION_HEAD_DIM" >> "$CALLS"\nshift 4\n"$@"\n'


def run_script(tmp_path: Path, mode: str, verdict: str, preset: str = "") -> tuple[list[str], Path, Path]:
    """The script's python3 calls (``arguments | layout``), its run folder and the tool's $OUT; ``preset``: the
    caller's QVL_ATTENTION_HEAD_DIM (none by default)."""
    tree, tools, out = tmp_path / "tree", tmp_path / "bin", tmp_path / "out"
    (tree / "bench").mkdir(parents=True)
    shutil.copy(ROOT / "bench" / "device_check.sh", tree / "bench")
    shutil.copytree(ROOT / "kernels", tree / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    (tree / "vit").mkdir()
    tools.mkdir()
    out.mkdir()
    for name, text in (("python3", PYTHON3), ("nvidia-smi", NVIDIA_SMI), ("compute-sanitizer", SANITIZER)):
        (tools / name).write_text(text)
        (tools / name).chmod(0o755)
    calls = tmp_path / "calls.log"
    env = {**os.environ, "PATH": f"{tools}:{os.environ['PATH']}", "CALLS": str(calls), "FAKE_VERDICT": verdict}
    env.update(OUT=str(out))
    env.pop("QVL_ATTENTION_HEAD_DIM", None)
    if preset:
        env["QVL_ATTENTION_HEAD_DIM"] = preset
    result = subprocess.run(
        ["bash", str(tree / "bench" / "device_check.sh"), *([mode] if mode else [])],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (run,) = (tree / "bench" / "results").iterdir()
    return calls.read_text().splitlines(), run, out


@pytest.mark.parametrize("mode", ["", "--attention", "--tower"])
@pytest.mark.parametrize(
    "verdict", ["split", "split32", "padded", ""], ids=["split", "split32", "padded", "no_verdict"]
)
def test_every_step_runs_in_the_layout_the_first_check_chose(tmp_path, mode, verdict):
    calls, run, out = run_script(tmp_path, mode, verdict)
    layout = verdict or "padded"
    # The device line, then the layout check (D 80 too where window attention is benchmarked) before anything else.
    assert calls[0].startswith("-c import torch, triton, transformers")
    check = calls[1]
    head_dims = "72 80" if mode == "--attention" else "72"
    assert check.startswith(f"-m bench.head_dim_check --head-dims {head_dims} --json ") and check.endswith("| unset")
    later = calls[2:]
    assert later and all(call.endswith(f"| {layout}") for call in later), later
    assert calls[-2].startswith("-m bench.plot ") and calls[-1].startswith("-m bench.goals ")
    steps = [call.split(" | ")[0] for call in later]
    if mode == "--tower":
        assert not any("tune_attention" in step or step.startswith("compute-sanitizer") for step in steps)
        assert any(step.startswith("-m bench.tune_rows") for step in steps)
    else:
        assert steps[0].startswith("-m bench.tune_attention")
        assert any(step.startswith("compute-sanitizer") for step in steps)
        # Issue 30's goals: attention forward, forward + backward and Qwen2.5-VL's windows, in every mode but --tower.
        benches = [step.split("--only ")[1].split()[0] for step in steps if "--only " in step]
        assert {"attention", "attention_backward", "window"} <= set(benches), benches
    last_line = (run / "device.txt").read_text().splitlines()[-1]
    why = "chosen by bench.head_dim_check" if verdict else "bench.head_dim_check gave no verdict"
    assert last_line == f"attention head-dim layout: {layout} ({why})"
    phases = [line.split(" (at ")[0] for line in (run / "phases.txt").read_text().splitlines()]
    assert phases[:2] == ["=== device", "=== head-dim layout check"] and phases[-2:] == ["=== goals", "=== done"]
    shipped = sorted(p.name for p in out.iterdir())
    assert len(shipped) <= 8 and "device.txt" in shipped and "head_dim-tail.log" in shipped, shipped
    assert [name for name in shipped if name.endswith(".tar.gz")] == [f"{run.name}.tar.gz"]


@pytest.mark.parametrize("preset", ["split", "split32", "padded"])
def test_a_layout_the_caller_set_skips_the_check(tmp_path, preset):
    """QVL_ATTENTION_HEAD_DIM from an earlier run's verdict (a second mode on the same lease): no layout check, every
    step in that layout, device.txt says where it came from. The verdict the stand-in would print is the other one,
    so a check that ran anyway would show."""
    other = "padded" if preset == "split" else "split"
    calls, run, _ = run_script(tmp_path, "--tower", other, preset=preset)
    assert calls[0].startswith("-c import torch, triton, transformers")
    assert not any("bench.head_dim_check" in call for call in calls)
    assert all(call.endswith(f"| {preset}") for call in calls[1:]), calls
    last_line = (run / "device.txt").read_text().splitlines()[-1]
    assert (
        last_line
        == f"attention head-dim layout: {preset} (given by the caller: QVL_ATTENTION_HEAD_DIM, no check in this run)"
    )


def test_unknown_mode_is_refused(tmp_path):
    result = subprocess.run(["bash", str(ROOT / "bench" / "device_check.sh"), "--fast"], capture_output=True, text=True)
    assert result.returncode == 2 and "usage: bash bench/device_check.sh" in result.stderr
