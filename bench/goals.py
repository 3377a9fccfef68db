"""Which of the attention and tower goals a GPU run meets: ``python -m bench.goals RUN [--goals attention|tower]``.

Reads the run's JSON reports and prints one line per goal with what the run measured and whether it meets the goal:
``met``, ``missed``, or ``not measured`` where a report or a row is absent (a benchmark cut by its timeout, a peer
left out, a case the quick run has not). Nothing is timed here; the exit status is 0 whatever the verdicts (it
reports, it does not gate). ``--goals attention`` or ``--goals tower`` keeps one set (default: both).

Attention (``bench_attention``, ``bench_attention_backward``, ``bench_window``; H200 bf16; the best peer of a case is
its fastest non-qvl row):

* head dims 72 and 80 in the split tiling (1.11x the useful dot work at D 72, none extra at D 80) agree with float64
  on the device, forward and backward (``check.json``: qvl check, the run's first step);
* D 72 (Qwen3-VL 8B) with rope (``qvl+rope``, the towers' call): >= 1.15x the best peer at S 4,096 and 16,384, on
  the 8 mixed images and on the 16-frame video; >= 1.0x on one 1,024-token image; >= 420 TFLOP/s at S 16,384;
* rope at no cost: ``qvl+rope`` within 5 % of ``qvl``'s time in every D 72 case;
* D 64 (Qwen3-VL 2B): ``qvl`` >= 1.0x the best peer in every case;
* Qwen2.5-VL windows (D 80, 64-token windows): ``qvl`` >= 1.5x ``varlen_attn``;
* forward + backward on single images of S >= 4,096: >= 1.2x the best peer (``qvl+rope`` at D 72, ``qvl`` at D 64).

Tower (``bench_host``, ``bench_tower``, ``bench_merger``, ``bench_rotary``, ``bench_pos_embed``, ``bench_encode``:
the ``--tower`` run of ``bench/device_check.sh`` writes them all; Qwen3-VL 8B's tower):

* host time per call: ``vision_attn`` <= 30 µs, every other op <= 20 µs (``bench_host``'s ``qvl`` row: the op as a
  user calls it; the ``qvl direct`` row, what the towers' layers call in eager inference, is shown beside it);
* the tower against transformers + SDPA with the same weights: eager >= 1.4x on one 1024x1024 image, 1.6x on the 8
  mixed images, 1.5x on the 16-frame video and on 4 x 448x448; the one-image forward's GPU time <= 13 ms; a training
  step >= 1.3x; peak memory no higher in any case; replay never slower than eager and >= 1.3x eager on the 4 small
  images; qvl's best (eager, compiled or replayed) >= 1.3x transformers under ``torch.compile`` in every case;
* bandwidth kernels: each >= 85 % of a copy of its bytes at the tower's sizes (16,384 x 1,152; 4,096 x 4,608;
  16,384 x 4,304), never slower than eager torch or its ``torch.compile`` at any benchmarked size; the mergers >=
  eager at 1,024 tokens; the rotary and the position table >= 85 % of a copy from 4,096 tokens on and never slower
  than transformers' eager or compiled code; ``qvl encode`` on the device (``bench_encode --device``: its own count,
  decoding and preparation included) within 1.2x of the same tower alone on the same inputs. The kernel goals judge
  the kernels, so they compare GPU time alone (the rows'
  ``device_ms``) where both rows have it: a few-µs kernel's do_bench time is the host's launch time, which the
  host-time goals judge. The wall-time ratio is printed beside it; a run without device times is judged on wall.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from .workloads import MIXED_8, VIDEO_16, label, square

MODEL = "8B"
HOST_LIMIT_US = {"vision_attn": 30.0}
HOST_LIMIT_DEFAULT_US = 20.0
TOWER_EAGER = {"1 img 1024x1024": 1.4, "8 imgs mixed": 1.6, "video 16 frames 512x512": 1.5, "4 imgs 448x448": 1.5}
ONE_IMAGE = "1 img 1024x1024"
SMALL_IMAGES = "4 imgs 448x448"
ONE_IMAGE_GPU_MS = 13.0
# qvl encode's own count on a GPU over the same tower alone on the same inputs (bench_encode --device).
ENCODE_VS_TOWER = 1.2
TRAINING = 1.3
REPLAY_SMALL = 1.3
VS_COMPILED = 1.3
QVL_TOWERS = ("qvl", "qvl compiled", "qvl replayed")
COPY_SHARE = 0.85
TOWER_SIZES = ("16384x1152", "4096x4608", "16384x4304")
MERGER_TOKENS = 1024
TOWER_TOKENS = 4096  # the rotary's and the position table's cases from here on are at the tower's sizes
# The attention benchmarks' case names (model, then workloads.label of the batch) and their goals.
QVL_ROWS = ("qvl", "qvl+rope", "rotary_2d+qvl", "rotary_2d_+qvl")  # bench_attention.QVL_VARIANTS: not peers
D72_WITH_ROPE = {label(square(1024)): 1.0, **{label(g): 1.15 for g in (square(4096), square(16384), MIXED_8, VIDEO_16)}}
D72_RATE_CASE, D72_RATE = label(square(16384)), 420.0
ROPE_COST = 1.05
D64_MODEL = "2B"
WINDOWS = 1.5
TRAINING_VS_BEST = 1.2
TRAINING_MIN_S = 4096


@dataclass(frozen=True)
class Verdict:
    goal: str
    measured: str
    met: bool | None  # None: not measured

    @property
    def status(self) -> str:
        return "not measured" if self.met is None else ("met" if self.met else "missed")


class Run:
    """A run folder's reports, by benchmark name (the newest file of each where a folder holds several)."""

    def __init__(self, folder: Path):
        self.reports: dict[str, dict] = {}
        for path in sorted(folder.glob("*.json")):
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(data, dict) and "bench" in data and "records" in data:
                self.reports[data["bench"]] = data
        # qvl check's results (device_check.sh's first step), None where the run has none.
        self.check = None
        if (folder / "check.json").is_file():
            try:
                self.check = json.loads((folder / "check.json").read_text())
            except ValueError:
                pass

    def rows(self, bench: str) -> dict[tuple[str, str], dict]:
        """``{(case, impl): record}`` of one benchmark (empty where the run has no such report)."""
        return {(r["case"], r["impl"]): r for r in self.reports.get(bench, {}).get("records", [])}


def _ratio(numerator: dict | None, denominator: dict | None) -> float | None:
    """``numerator["ms"] / denominator["ms"]``: how many times faster the denominator's implementation is."""
    if numerator is None or denominator is None:
        return None
    return numerator["ms"] / denominator["ms"]


def _at_least(goal: str, value: float | None, target: float, unit: str = "x") -> Verdict:
    if value is None:
        return Verdict(goal, "-", None)
    return Verdict(goal, f"{value:.3f}{unit}", value >= target)


def host_goals(run: Run) -> Iterator[Verdict]:
    rows = run.rows("host")
    ops = dict.fromkeys(case for case, _ in rows)
    if not ops:
        yield Verdict("host time per call <= torch's figures (bench_host)", "-", None)
    for op in ops:
        limit = HOST_LIMIT_US.get(op, HOST_LIMIT_DEFAULT_US)
        mine, direct = rows.get((op, "qvl")), rows.get((op, "qvl direct"))
        goal = f"host: {op} <= {limit:g} us per call"
        if mine is None:
            yield Verdict(goal, "-", None)
            continue
        us = mine["ms"] * 1e3
        beside = f" (direct {direct['ms'] * 1e3:.1f} us)" if direct else ""
        yield Verdict(goal, f"{us:.1f} us{beside}", us <= limit)


def _gpu_ms(record: dict | None) -> float | None:
    found = re.search(r"GPU ([0-9.eE+-]+) ms", record["note"]) if record else None
    return float(found.group(1)) if found else None


def tower_goals(run: Run) -> Iterator[Verdict]:
    rows = run.rows("tower")
    peaks = run.reports.get("tower", {}).get("peak_memory_bytes", {})

    def row(workload: str, impl: str, training: bool = False) -> dict | None:
        return rows.get((f"{MODEL} {workload}" + (" training" if training else ""), impl))

    for workload, target in TOWER_EAGER.items():
        ratio = _ratio(row(workload, "hf sdpa"), row(workload, "qvl"))
        yield _at_least(f"tower eager vs hf sdpa, {workload}: >= {target}x", ratio, target)
    gpu = _gpu_ms(row(ONE_IMAGE, "qvl"))
    yield Verdict(
        f"tower GPU time, {ONE_IMAGE}: <= {ONE_IMAGE_GPU_MS:g} ms",
        "-" if gpu is None else f"{gpu:.3g} ms",
        None if gpu is None else gpu <= ONE_IMAGE_GPU_MS,
    )
    for workload in TOWER_EAGER:
        ratio = _ratio(row(workload, "hf sdpa", True), row(workload, "qvl", True))
        yield _at_least(f"training step vs hf sdpa, {workload}: >= {TRAINING}x", ratio, TRAINING)
    for case, by_impl in peaks.items():
        mine, theirs = by_impl.get("qvl"), by_impl.get("hf sdpa")
        goal = f"peak memory, {case}: qvl <= hf sdpa"
        if mine is None or theirs is None:
            yield Verdict(goal, "-", None)
        else:
            yield Verdict(goal, f"{mine / theirs:.2f}x", mine <= theirs)
    for workload in TOWER_EAGER:
        target = REPLAY_SMALL if workload == SMALL_IMAGES else 1.0
        ratio = _ratio(row(workload, "qvl"), row(workload, "qvl replayed"))
        yield _at_least(f"replay vs eager, {workload}: >= {target}x", ratio, target)
    for workload in TOWER_EAGER:
        compiled = row(workload, "hf sdpa compiled")
        ratios = [r for r in (_ratio(compiled, row(workload, impl)) for impl in QVL_TOWERS) if r is not None]
        best = max(ratios) if ratios and compiled is not None else None
        yield _at_least(f"qvl's best vs hf sdpa compiled, {workload}: >= {VS_COMPILED}x", best, VS_COMPILED)
    encode = run.rows("encode")
    goal = f"qvl encode vs its tower alone: <= {ENCODE_VS_TOWER}x"
    cases = dict.fromkeys(case for case, _ in encode)
    if not cases:
        yield Verdict(f"{goal} (bench_encode --device)", "-", None)
    for case in cases:
        ratio = _ratio(encode.get((case, "qvl encode")), encode.get((case, "qvl tower alone")))
        measured, met = ("-", None) if ratio is None else (f"{ratio:.3f}x", ratio <= ENCODE_VS_TOWER)
        yield Verdict(f"{goal}, {case}", measured, met)


def _kernel_verdict(goal: str, mine: dict | None, theirs: dict | None, target: float) -> Verdict:
    """How many times faster ``mine`` runs than ``theirs`` (rows of one case, so of the same work: for a copy row,
    ``mine``'s share of its rate) against ``target``: on the GPU time alone where both rows have it (``device_ms``:
    harness.device_time), else on do_bench's times. The measured column says which, the wall ratio beside a device
    one."""
    if mine is None or theirs is None:
        return Verdict(goal, "-", None)
    wall = theirs["ms"] / mine["ms"]
    if mine.get("device_ms") and theirs.get("device_ms"):
        device = theirs["device_ms"] / mine["device_ms"]
        return Verdict(goal, f"{device:.3f} device, wall {wall:.3f}", device >= target)
    return Verdict(goal, f"{wall:.3f} wall", wall >= target)


def bandwidth_goals(run: Run) -> Iterator[Verdict]:
    rows = run.rows("merger")
    cases = dict.fromkeys(case for case, _ in rows)
    for case in cases:
        mine = rows.get((case, "qvl"))
        if "merger" in case:
            if f"T={MERGER_TOKENS} " in case:
                yield _kernel_verdict(f"{case}: >= eager", mine, rows.get((case, "eager")), 1.0)
            continue
        if case.endswith(TOWER_SIZES):
            yield _kernel_verdict(f"{case}: >= {COPY_SHARE:.0%} of copy", mine, rows.get((case, "copy")), COPY_SHARE)
        for peer in ("eager", "compiled"):
            yield _kernel_verdict(f"{case}: >= {peer}", mine, rows.get((case, peer)), 1.0)
    if not cases:
        yield Verdict("bandwidth kernels (bench_merger)", "-", None)
    for bench, peers in (
        ("rotary", ("hf eager", "hf compiled")),
        ("pos_embed", ("hf gather+add", "hf compiled gather+add")),
    ):
        rows = run.rows(bench)
        cases = dict.fromkeys(case for case, _ in rows)
        if not cases:
            yield Verdict(f"{bench} (bench_{bench})", "-", None)
        for case in cases:
            mine = rows.get((case, "qvl"))
            if _tokens(case) >= TOWER_TOKENS:
                copy = rows.get((case, "copy"))
                yield _kernel_verdict(f"{bench} {case}: >= {COPY_SHARE:.0%} of copy", mine, copy, COPY_SHARE)
            for peer in peers:
                yield _kernel_verdict(f"{bench} {case}: >= {peer}", mine, rows.get((case, peer)), 1.0)


def _best_peer(rows: dict[tuple[str, str], dict], case: str) -> dict | None:
    """The fastest peer row of ``case``, among those whose output agreed with qvl's where any did (a peer that
    computed something else is no yardstick; where none agrees, qvl is the likelier one wrong, and all count)."""
    peers = [r for (c, impl), r in rows.items() if c == case and impl not in QVL_ROWS]
    peers = [r for r in peers if r.get("agrees", True)] or peers
    return min(peers, key=lambda r: r["ms"], default=None)


def _cases(rows: dict[tuple[str, str], dict], prefix: str) -> list[str]:
    return [case for case in dict.fromkeys(c for c, _ in rows) if case.startswith(prefix)]


def head_dim_goals(run: Run) -> Iterator[Verdict]:
    """Per head dim: every split-layout row of qvl check (forward and backward, with and without rope) within its
    bound, and the split layout's worker finished (its verdict)."""
    rows = [] if run.check is None else run.check["rows"]
    split = [row for row in rows if row["variant"] == "head_dim split"]
    verdict = (run.check or {}).get("verdicts", {}).get("head_dim:split", {})
    for head_dim in dict.fromkeys(int(row["op"].split()[1][1:]) for row in split):
        goal = f"head dim {head_dim}, split tiling: forward and backward agree with float64 on the device"
        mine = [row for row in split if int(row["op"].split()[1][1:]) == head_dim]
        worst = max(float(row["ratio"]) for row in mine)
        right = all(row["passed"] for row in mine) and verdict.get("verdict") == "right"
        yield Verdict(goal, f"worst error {worst:.2f} of its bound", right)
    if not split:
        yield Verdict("head-dim tiling on the device (check.json)", verdict.get("why", "-"), None)


def attention_goals(run: Run) -> Iterator[Verdict]:
    rows = run.rows("attention")

    def vs_best(case: str, impl: str) -> float | None:
        best = _best_peer(rows, case)
        return _ratio(best, rows.get((case, impl))) if best is not None else None

    for workload, target in D72_WITH_ROPE.items():
        case = f"{MODEL} {workload}"
        yield _at_least(f"attention D 72 with rope, {case}: >= {target}x best peer", vs_best(case, "qvl+rope"), target)
    rate_row = rows.get((f"{MODEL} {D72_RATE_CASE}", "qvl+rope"))
    yield _at_least(
        f"attention D 72 with rope, {MODEL} {D72_RATE_CASE}: >= {D72_RATE:g} TFLOP/s",
        None if rate_row is None else rate_row["rate"],
        D72_RATE,
        unit=" TFLOP/s",
    )
    for case in _cases(rows, f"{MODEL} "):
        plain, rope = rows.get((case, "qvl")), rows.get((case, "qvl+rope"))
        goal = f"rope cost, {case}: qvl+rope <= {ROPE_COST:g}x qvl's time"
        if plain is None or rope is None:
            yield Verdict(goal, "-", None)
        else:
            yield Verdict(goal, f"{100 * (rope['ms'] / plain['ms'] - 1):+.1f}%", rope["ms"] <= ROPE_COST * plain["ms"])
    d64 = _cases(rows, f"{D64_MODEL} ")
    for case in d64:
        yield _at_least(f"attention D 64, {case}: >= 1.0x best peer", vs_best(case, "qvl"), 1.0)
    if not d64:
        yield Verdict(f"attention D 64 ({D64_MODEL} cases): >= 1.0x best peer", "-", None)
    if not rows:
        yield Verdict("attention forward (bench_attention)", "-", None)
    windows = run.rows("window")
    window_cases = _cases(windows, "window ")
    for case in window_cases:
        ratio = _ratio(windows.get((case, "varlen_attn")), windows.get((case, "qvl")))
        yield _at_least(f"{case}: >= {WINDOWS}x varlen_attn", ratio, WINDOWS)
    if not window_cases:
        yield Verdict("window attention (bench_window)", "-", None)
    training = run.rows("attention_backward")
    long_cases = [
        case
        for case in dict.fromkeys(c for c, _ in training)
        if (found := re.search(r" S=(\d+)$", case)) and int(found.group(1)) >= TRAINING_MIN_S
    ]
    for case in long_cases:
        impl = "qvl" if case.startswith(f"{D64_MODEL} ") else "qvl+rope"
        best = _best_peer(training, case)
        ratio = _ratio(best, training.get((case, impl))) if best is not None else None
        yield _at_least(
            f"forward + backward, {case} ({impl}): >= {TRAINING_VS_BEST}x best peer", ratio, TRAINING_VS_BEST
        )
    if not long_cases:
        yield Verdict("forward + backward (bench_attention_backward)", "-", None)


GOALS = {"attention": (head_dim_goals, attention_goals), "tower": (host_goals, tower_goals, bandwidth_goals)}


def _tokens(case: str) -> int:
    """The token count in a rotary (``T=4096``) or position-table (``S=4096``, ``8 imgs 256..4096 (16016)``) case."""
    found = re.search(r"(?:[TS]=(\d+)|\((\d+)\))$", case)
    return int(found.group(1) or found.group(2)) if found else 0


def verdicts(run: Run, sets: Sequence[str] = tuple(GOALS)) -> list[Verdict]:
    return [verdict for name in sets for goals in GOALS[name] for verdict in goals(run)]


def table(found: Sequence[Verdict]) -> str:
    width = max((len(v.goal) for v in found), default=4)
    lines = [f"{'goal':<{width}}  {'measured':>28}  status"]
    lines += [f"{v.goal:<{width}}  {v.measured:>28}  {v.status}" for v in found]
    counts = {status: sum(v.status == status for v in found) for status in ("met", "missed", "not measured")}
    lines.append(", ".join(f"{count} {status}" for status, count in counts.items()))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[Verdict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="a run's results folder (bench/results/run-...)")
    parser.add_argument("--goals", choices=list(GOALS), action="append", help="one set of goals (default: both)")
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        parser.error(f"not a folder: {args.folder}")
    run = Run(args.folder)
    sets = args.goals or list(GOALS)
    found = verdicts(run, sets)
    names = " and ".join(sets)
    print(f"the {names} goals in {args.folder} ({', '.join(sorted(run.reports)) or 'no reports'}):")
    print(table(found))
    return found


if __name__ == "__main__":
    main()
