"""bench/device_check.sh, the one prepared call of a GPU lease, run here with stand-ins for python3, nvidia-smi and
compute-sanitizer on PATH: every mode's steps in order, the head-dim layout its first check prints exported to every
later step (padded without a verdict), every step's time limit within the call's budget, and at most 8 files shipped
to the device tool's $OUT. What the steps measure needs the GPU; that the script runs them, in this order, with this
layout and these limits, does not."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PYTHON3 = """#!/usr/bin/env bash
echo "$* | ${QVL_ATTENTION_HEAD_DIM:-unset}" >> "$CALLS"
[ -n "$HANG_ON" ] && case "$*" in *"$HANG_ON"*) exec sleep 600 ;; esac
case "$*" in
  *qvl.kernels.check*)
    [ -n "$FAKE_VERDICT" ] && echo "from the next process on: head_dim $FAKE_VERDICT (a reason)"
    # With FAKE_CHECK_JSON, the check writes its --json file (what the diagnosis step reads).
    previous=
    for word in "$@"; do
      [ -n "$FAKE_CHECK_JSON" ] && [ "$previous" = --json ] && echo '{}' > "$word"
      previous="$word"
    done ;;
  -) cat > /dev/null ;;
esac
exit 0
"""
NVIDIA_SMI = '#!/usr/bin/env bash\necho "Stand-in GPU, 0.0, 1 MiB, 1 MHz"\n'
SANITIZER = '#!/usr/bin/env bash\necho "compute-sanitizer | $QVL_ATTENTION_HEAD_DIM" >> "$CALLS"\nshift 4\n"$@"\n'


def run_script(
    tmp_path: Path,
    mode: str,
    verdict: str,
    preset: str = "",
    budget_s: int | None = None,
    hang_on: str = "",
    check_json: bool = False,
) -> tuple[list[str], Path, Path]:
    """The script's python3 calls (``arguments | layout``), its run folder and the tool's $OUT; ``preset``: the
    caller's QVL_ATTENTION_HEAD_DIM (none by default); ``budget_s``: DEVICE_CHECK_BUDGET_S (the mode's own by
    default); ``hang_on``: the python3 call containing this string hangs until its timeout kills it; ``check_json``:
    the layout check writes its JSON file."""
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
    env.update(OUT=str(out), HANG_ON=hang_on, FAKE_CHECK_JSON="1" if check_json else "")
    env.pop("QVL_ATTENTION_HEAD_DIM", None)
    env.pop("DEVICE_CHECK_BUDGET_S", None)
    if budget_s is not None:
        env["DEVICE_CHECK_BUDGET_S"] = str(budget_s)
    if preset:
        env["QVL_ATTENTION_HEAD_DIM"] = preset
    result = subprocess.run(
        ["bash", str(tree / "bench" / "device_check.sh"), *([mode] if mode else [])],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (run,) = (tree / "bench" / "results").iterdir()
    return calls.read_text().splitlines(), run, out


def phases(run: Path) -> list[tuple[str, int, int | None]]:
    """phases.txt as (step, seconds into the call at its start, its time limit or None); skipped steps left out."""
    rows = []
    for line in (run / "phases.txt").read_text().splitlines():
        match = re.fullmatch(r"=== (.+) \(at (\d+) s(?:, up to (\d+) s)?\)", line)
        if match:
            rows.append((match[1], int(match[2]), int(match[3]) if match[3] else None))
    return rows


def skipped(run: Path) -> list[str]:
    return [line for line in (run / "phases.txt").read_text().splitlines() if " skipped: " in line]


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
    assert check.startswith(f"-m qvl.kernels.check --head-dims {head_dims} --timeout ") and check.endswith("| unset")
    assert " --no-memcheck --json " in check
    later = calls[2:]
    assert later and all(call.endswith(f"| {layout}") for call in later), later
    assert calls[-2].startswith("-m bench.plot ") and calls[-1].startswith("-m bench.goals ")
    steps = [call.split(" | ")[0] for call in later]
    if mode == "--tower":
        assert not any("tune_attention" in step or step.startswith("compute-sanitizer") for step in steps)
        assert any(step.startswith("-m bench.tune_rows") for step in steps)
        assert f"-m bench.bench_encode --device cuda --rounds 2 --json bench/results/{run.name}/encode.json" in steps
        ray_step = "-m bench.bench_encode --device cuda --ray 8 24 --ray-cpus 4 15 --towers demo --rounds 1 --json"
        assert f"{ray_step} bench/results/{run.name}/encode_ray.json" in steps
    else:
        assert steps[0].startswith("-m bench.tune_attention")
        assert any(step.startswith("compute-sanitizer") for step in steps)
        # Issue 30's goals: attention forward, forward + backward and Qwen2.5-VL's windows, in every mode but --tower.
        benches = {step.split("--only ")[1].split()[0]: step for step in steps if "--only " in step}
        attention = ("attention", "attention_backward", "window")
        assert set(attention) <= set(benches), benches
        # flex_attention compiles per shape: its compiles would spend these steps' limits before any row.
        assert all(benches[name].endswith("--skip flex_attention") for name in attention), benches
    last_line = (run / "device.txt").read_text().splitlines()[-1]
    why = "chosen by qvl check" if verdict else "qvl check gave no verdict"
    assert last_line == f"attention head-dim layout: {layout} ({why})"
    phases = [line.split(" (at ")[0] for line in (run / "phases.txt").read_text().splitlines()]
    assert phases[:2] == ["=== device", "=== head-dim layout check"] and phases[-2:] == ["=== goals", "=== done"]
    shipped = sorted(p.name for p in out.iterdir())
    assert len(shipped) <= 8 and "device.txt" in shipped and "check-tail.log" in shipped, shipped
    assert [name for name in shipped if name.endswith(".tar.gz")] == [f"{run.name}.tar.gz"]


@pytest.mark.parametrize("preset", ["split", "split32", "padded"])
def test_a_layout_the_caller_set_skips_the_check(tmp_path, preset):
    """QVL_ATTENTION_HEAD_DIM from an earlier run's verdict (a second mode on the same lease): no layout check, every
    step in that layout, device.txt says where it came from. The verdict the stand-in would print is the other one,
    so a check that ran anyway would show."""
    other = "padded" if preset == "split" else "split"
    calls, run, _ = run_script(tmp_path, "--tower", other, preset=preset)
    assert calls[0].startswith("-c import torch, triton, transformers")
    assert not any("qvl.kernels.check" in call for call in calls)
    assert all(call.endswith(f"| {preset}") for call in calls[1:]), calls
    last_line = (run / "device.txt").read_text().splitlines()[-1]
    assert (
        last_line
        == f"attention head-dim layout: {preset} (given by the caller: QVL_ATTENTION_HEAD_DIM, no check in this run)"
    )


@pytest.mark.parametrize("mode, cap", [("", 60), ("--attention", 75)])
def test_the_diagnosis_reads_the_checks_file_right_after_it(tmp_path, mode, cap):
    """Where the layout check wrote its JSON, the diagnosis step comes next and reads it (it finds there whether a
    split layout was wrong), under the step's limit, the rest of the run unchanged; --tower has no diagnosis."""
    calls, run, _ = run_script(tmp_path, mode, "padded", check_json=True)
    diagnosis, folder = calls[2].split(" | ")[0], f"bench/results/{run.name}"
    assert diagnosis.startswith(f"-m bench.diagnose_attention --from-check {folder}/check.json --timeout-s {cap - 10} ")
    assert diagnosis.endswith(f"--sanitizer --json {folder}/diagnose.json")
    assert phases(run)[2][0::2] == ("split-layout diagnosis", cap)
    assert calls[3].startswith("-m bench.tune_attention")
    calls, run, _ = run_script(tmp_path / "tower", "--tower", "padded", check_json=True)
    assert not any("diagnose_attention" in call for call in calls)


def test_unknown_mode_is_refused(tmp_path):
    result = subprocess.run(["bash", str(ROOT / "bench" / "device_check.sh"), "--fast"], capture_output=True, text=True)
    assert result.returncode == 2 and "usage: bash bench/device_check.sh" in result.stderr


@pytest.mark.parametrize("mode, budget_s", [("", 420), ("--attention", 300), ("--tower", 300)])
def test_every_step_ends_within_the_calls_budget(tmp_path, mode, budget_s):
    """Each mode's own budget (--attention and --tower fit one lease together, issue 30 item 5): no step's limit
    reaches past it, and with steps this fast none is skipped."""
    calls, run, _ = run_script(tmp_path, mode, "split")
    assert f"mode: {mode or 'default'}, budget {budget_s} s" in (run / "device.txt").read_text()
    limited = [(step, at, limit) for step, at, limit in phases(run) if limit is not None]
    assert len(limited) >= 6 and not skipped(run)
    assert all(at + limit <= budget_s for _, at, limit in limited), limited


def test_a_short_budget_cuts_the_first_step_before_the_later_ones_floors(tmp_path):
    """With 240 s for --attention the layout check gets less than its cap (what the budget keeps back for the steps
    after it is not its to spend), the later steps still their caps while the earlier ones are quick."""
    _, run, _ = run_script(tmp_path, "--attention", "split", budget_s=240)
    (check, at, limit), (sweep, _, sweep_limit) = phases(run)[1:3]
    assert check == "head-dim layout check" and 60 <= limit < 160, (at, limit)
    assert sweep == "tile sweep" and sweep_limit == 55
    assert all(at + limit <= 240 for _, at, limit in phases(run) if limit is not None)


def test_a_hanging_step_is_cut_and_the_later_steps_keep_their_floors(tmp_path):
    """The layout check hangs: its timeout ends it (the run goes on padded, no verdict), every later step still runs
    within the budget (but the diagnosis, which keeps no floor: it yields to them), and the tile sweep's own budget
    shrinks with its limit."""
    calls, run, _ = run_script(tmp_path, "--attention", "split", budget_s=180, hang_on="qvl.kernels.check")
    rows = phases(run)
    check = next(row for row in rows if row[0] == "head-dim layout check")
    assert check[2] <= 20, check
    assert (run / "device.txt").read_text().splitlines()[-1] == (
        "attention head-dim layout: padded (qvl check gave no verdict)"
    )
    assert [line.split()[1] for line in skipped(run)] in ([], ["diagnose"])
    names = [step for step, _, _ in rows]
    for step in ("tile sweep", "CUDA tests and memcheck", "benchmark attention", "benchmark attention_backward",
                 "benchmark window", "plots", "goals"):  # fmt: skip
        assert step in names, names
    assert all(at + limit <= 180 for _, at, limit in rows if limit is not None), rows
    sweep_limit = next(limit for step, _, limit in rows if step == "tile sweep")
    (sweep_call,) = [call for call in calls if "bench.tune_attention" in call]
    assert f"--budget-s {min(35, sweep_limit - 20)} " in sweep_call, (sweep_limit, sweep_call)


def test_no_budget_skips_every_step_and_says_so(tmp_path):
    calls, run, _ = run_script(tmp_path, "--attention", "split", budget_s=0)
    assert len(calls) == 1 and calls[0].startswith("-c import torch, triton, transformers")
    assert (run / "device.txt").read_text().splitlines()[-1] == (
        "attention head-dim layout: padded (the budget left qvl check no time)"
    )
    steps = [line.split()[1] for line in skipped(run)]
    assert steps[:2] == ["layout_check", "diagnose"] and steps[-2:] == ["plots", "goals"] and len(steps) == 9, steps


def test_a_budget_that_is_not_seconds_is_refused(tmp_path):
    env = {**os.environ, "DEVICE_CHECK_BUDGET_S": "5m"}
    result = subprocess.run(
        ["bash", str(ROOT / "bench" / "device_check.sh"), "--tower"], capture_output=True, text=True, env=env
    )
    assert result.returncode == 2 and "DEVICE_CHECK_BUDGET_S must be a whole number of seconds" in result.stderr


@pytest.mark.parametrize(
    "mode, preset, budget_s, sweep",
    [("--attention", "", 150, "bench.tune_attention"), ("--tower", "split", 60, "bench.tune_rows")],
)
def test_a_sweep_left_less_than_its_overhead_still_gets_a_budget(tmp_path, mode, preset, budget_s, sweep):
    """A budget below the floors (steps skipped before the sweep): the sweep's limit is under its start-up
    allowance, and its own budget stays one second, not negative."""
    calls, run, _ = run_script(tmp_path, mode, "split", preset=preset, budget_s=budget_s)
    assert skipped(run)
    (call,) = [call for call in calls if sweep in call]
    assert "--budget-s 1 " in call, call
