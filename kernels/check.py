"""``qvl check``: whether qvl's kernels compute right on this machine, and which faster variants it may take.

Every op runs forward and backward against its float64 truth and is judged by the package's one rule
(:mod:`.tolerance`, :mod:`.verify`, :mod:`.op_cases`): attention at head dims 64, 72 and 80, with and without rope,
on the layouts that computed wrong results on a GPU before (:data:`.verify.ATTENTION_CASES`: a lone 33-token
segment, segments ending inside key blocks, windows with edge windows shorter than a block, zero-length segments),
in each head-dim layout (padded, split, split32); the other ops once. Each layout runs in a process of its own: a
kernel that faults leaves the CUDA context unusable, so a crash, or no answer within the time limit, is that
layout's verdict ("wrong"), not the end of the check. The fast launch path runs the same calls as Triton's own
launch and must give the same bits. Where ``compute-sanitizer`` is on the PATH, each faster layout that computed
right also runs a small forward and backward under its memcheck.

On a GPU the verdicts are recorded for this machine (:func:`.verdicts.record_verdicts`: GPU, driver, torch, Triton
and qvl versions) and the next process takes the faster variants that were right here
(:func:`.verdicts.decision`). On a CPU the same checks run through Triton's interpreter on small shapes and nothing
is recorded: GPU verdicts need a GPU.

The table gives, per op and variant, the worst error as a share of its bound (at most 1 passes), the verdict, and
on a GPU the forward's microseconds per call beside torch's equivalent (SDPA for attention).

    qvl check [--layouts padded split split32] [--head-dims 64 72 80] [--cases NAME ...] [--timeout SECONDS]
              [--no-memcheck] [--json FILE]

Exit status 0 when every check of the variants the package takes by default on this machine passed, 1 otherwise
(a faster variant that is wrong here is a verdict, not a failure: it stays off).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

__all__ = ["Outcome", "Row", "main", "run_check", "run_worker", "start_worker", "verdicts_from", "worker_output"]

LAYOUTS = ("padded", "split", "split32")
# The attention cases by name (qvl.kernels.verify.ATTENTION_CASES; the interpreter's sizes on a CPU).
CASES = ("ragged", "lone-33", "300", "inside-blocks", "windows", "aligned")
HEAD_DIMS = (64, 72, 80)
# Head dims the layouts tile alike (powers of two): checked in the first layout only.
_ONE_TILE = (64,)
DEFAULT_TIMEOUT = 600
MEMCHECK_TIMEOUT = 300


class Row(NamedTuple):
    """One line of the table: an op (or a call) in a variant, the worst error against its bound over its cases
    (``ratio`` = error / bound, NaN where a result was NaN), whether every case passed, and timings (µs per call,
    None where not timed)."""

    op: str
    variant: str
    cases: int
    ratio: float
    passed: bool
    note: str = ""
    qvl_us: float | None = None
    torch_us: float | None = None


class Outcome(NamedTuple):
    """What a worker process gave: its rows, and why it failed where it did (None: it finished)."""

    rows: list[Row]
    failure: str | None


# --------------------------------------------------------------------------------------------------------------
# Workers: run in their own processes (python -m qvl.kernels.check --worker ...), print one JSON row a line.
# --------------------------------------------------------------------------------------------------------------
def _device_and_size():
    import torch

    from .common import triton_interpreting

    if triton_interpreting() or not torch.cuda.is_available():
        return torch.device("cpu"), True
    return torch.device("cuda"), False


def _attention_inputs(lengths, num_heads, head_dim, rope, device, seed):
    import torch

    from .verify import cu_seqlens_of

    generator = torch.Generator().manual_seed(seed)
    num_tokens = sum(lengths)
    dtype = torch.bfloat16
    qkv = torch.randn(num_tokens, 3, num_heads, head_dim, generator=generator).to(device, dtype)
    grad_out = torch.randn(num_tokens, num_heads, head_dim, generator=generator).to(device, dtype)
    positions = torch.randint(0, 40, (num_tokens, 2), generator=generator, dtype=torch.int32) if rope else None
    positions = None if positions is None else positions.to(device)
    return qkv, cu_seqlens_of(lengths, device), positions, grad_out


def _attention_call(qkv, cu_seqlens, max_seqlen, positions, grad_out):
    """vision_attn through autograd on a packed qkv leaf (the towers' layout): the output and dq, dk, dv."""
    import torch

    leaf = qkv.detach().requires_grad_()
    with torch.enable_grad():
        out = torch.ops.qvl.vision_attn(*leaf.unbind(1), cu_seqlens, max_seqlen, positions=positions)
        (grad,) = torch.autograd.grad(out, leaf, grad_out)
    return out.detach(), grad.unbind(1)


def _emit(row: Row) -> None:
    print(json.dumps(row._asdict()), flush=True)


def _attention_rows(layout: str, head_dims: Sequence[int], names: Sequence[str], timed: bool) -> Iterable[Row]:
    """Forward and backward of the cases ``names`` at each head dim, with and without rope, in the process's
    layout."""
    from .common import device_target
    from .tolerance import worst_of
    from .verify import ATTENTION_CASES, INTERPRETER_ATTENTION_CASES, AttentionProblem

    device, small = _device_and_size()
    target = device_target(device)
    cases, num_heads = (INTERPRETER_ATTENTION_CASES, 2) if small else (ATTENTION_CASES, 16)
    cases = [case for case in cases if case.name in names]
    for head_dim in head_dims:
        for rope in (False, True):
            forward, backward = [], []
            for index, case in enumerate(cases):
                qkv, cu, positions, grad_out = _attention_inputs(
                    case.lengths, num_heads, head_dim, rope, device, seed=head_dim * 100 + index
                )
                out, grads = _attention_call(qkv, cu, case.max_seqlen, positions, grad_out)
                q, k, v = qkv.unbind(1)
                problem = AttentionProblem(q, k, v, cu, target, case.max_seqlen, positions=positions, grad_out=grad_out)
                forward += [c._replace(what=f"{case.name}: {c.what}") for c in problem.check(out)]
                backward += [c._replace(what=f"{case.name}: {c.what}") for c in problem.check_gradients(grads)]
            op = f"vision_attn D{head_dim}{' rope' if rope else ''}"
            timing = _attention_timing(head_dim, rope, device) if timed else (None, None)
            for name, comparisons, times in ((op, forward, timing), (f"{op} backward", backward, (None, None))):
                ratio, passed, note = worst_of(comparisons)
                yield Row(name, f"head_dim {layout}", len(cases), ratio, passed, note, *times)


def _time_us(call: Callable[[], object]) -> float:
    """Median microseconds per call on a CUDA device (events around each of 20 calls after 3 warm-ups)."""
    import torch

    for _ in range(3):
        call()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return sorted(times)[len(times) // 2]


def _attention_timing(head_dim: int, rope: bool, device) -> tuple[float | None, float | None]:
    """The forward on one 4,096-token image of 16 heads, qvl's op against torch's SDPA (rotary first where rope)."""
    if device.type != "cuda":
        return None, None
    import torch
    import torch.nn.functional as F

    from .verify import rotary_in_fp32

    qkv, cu, positions, _ = _attention_inputs((4096,), 16, head_dim, rope, device, seed=1)
    q, k, v = qkv.unbind(1)

    def qvl_call():
        return torch.ops.qvl.vision_attn(q, k, v, cu, positions=positions)

    def torch_call():
        rotated = rotary_in_fp32(q, k, positions) if rope else (q, k)
        heads = [x.transpose(0, 1)[None] for x in (*rotated, v)]
        return F.scaled_dot_product_attention(*heads)

    return _time_us(qvl_call), _time_us(torch_call)


def _op_rows(timed: bool) -> Iterable[Row]:
    import torch

    from .op_cases import OP_CASES
    from .tolerance import worst_of

    device, small = _device_and_size()
    for case in OP_CASES:
        ratio, passed, note = worst_of(case.check(device, torch.bfloat16, small))
        times = tuple(_time_us(call) for call in case.timed(device, torch.bfloat16)) if timed else (None, None)
        yield Row(case.op, "-", 1, ratio, passed, note, *times)


def _launch_rows() -> Iterable[Row]:
    """The same calls through the fast launch path and through Triton's own launch: equal bit for bit."""
    import torch

    from . import common
    from .op_cases import OP_CASES
    from .verify import ATTENTION_CASES, INTERPRETER_ATTENTION_CASES

    device, small = _device_and_size()
    case, num_heads = (INTERPRETER_ATTENTION_CASES[0], 2) if small else (ATTENTION_CASES[0], 16)
    calls = {}
    for head_dim in (72, 80):
        qkv, cu_seqlens, positions, grad_out = _attention_inputs(case.lengths, num_heads, head_dim, True, device, 1)
        calls[f"vision_attn D{head_dim} rope"] = functools.partial(
            _attention_call, qkv, cu_seqlens, None, positions, grad_out
        )
    # The other ops at the towers' sizes: on a GPU only (the interpreter launches every kernel through Triton).
    for op_case in () if small else OP_CASES:
        calls[op_case.op] = op_case.timed(device, torch.bfloat16)[0]

    def flat(result):
        if isinstance(result, torch.Tensor):
            return [result]
        return [t for item in result for t in flat(item)]

    for name, call in calls.items():
        common.set_fast_launch(False)
        expected = flat(call())
        common.set_fast_launch(True)
        results = [flat(call()) for _ in range(2)]  # the first compiles through Triton, the second launches fast
        equal = all(len(got) == len(expected) and all(map(torch.equal, got, expected)) for got in results)
        yield Row(name, "launch fast", 1, 0.0 if equal else float("inf"), equal, "" if equal else "bits differ")
    common.set_fast_launch(None)


def _memcheck_run(head_dims: Sequence[int]) -> None:
    """A small forward and backward with rope on the ragged case, for compute-sanitizer to watch."""
    from .verify import INTERPRETER_ATTENTION_CASES

    case = INTERPRETER_ATTENTION_CASES[0]
    device, _ = _device_and_size()
    for head_dim in head_dims:
        qkv, cu_seqlens, positions, grad_out = _attention_inputs(case.lengths, 2, head_dim, True, device, head_dim)
        _attention_call(qkv, cu_seqlens, None, positions, grad_out)


def worker_main(argv: Sequence[str]) -> int:
    """A worker's body: ``layout LAYOUT [--ops] [--timed]``, ``launch`` or ``memcheck``, with ``--head-dims``."""
    parser = argparse.ArgumentParser(prog="python -m qvl.kernels.check --worker")
    parser.add_argument("kind", choices=("layout", "launch", "memcheck"))
    parser.add_argument("layout", nargs="?")
    parser.add_argument("--head-dims", type=int, nargs="+", default=list(HEAD_DIMS))
    parser.add_argument("--cases", nargs="+", default=list(CASES))
    parser.add_argument("--ops", action="store_true")
    parser.add_argument("--timed", action="store_true")
    args = parser.parse_args(argv)
    if args.kind == "layout":
        for row in _attention_rows(args.layout, args.head_dims, args.cases, args.timed):
            _emit(row)
        if args.ops:
            for row in _op_rows(args.timed):
                _emit(row)
    elif args.kind == "launch":
        for row in _launch_rows():
            _emit(row)
    else:
        _memcheck_run(args.head_dims)
    return 0


# --------------------------------------------------------------------------------------------------------------
# The parent: starts the workers, reads their rows, decides and records the verdicts, prints the table.
# --------------------------------------------------------------------------------------------------------------
def start_worker(command: Sequence[str], env: dict[str, str]) -> subprocess.Popen:
    """Start a worker ``command`` with ``env`` (its rows come on stdout, one JSON object a line)."""
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def worker_output(process: subprocess.Popen, deadline: float) -> tuple[str, str | None]:
    """A started worker's stdout, and its failure where it exited non-zero (a fault: the signal or status and its
    last error line) or was still running at ``deadline`` (``time.monotonic()``; then killed)."""
    try:
        stdout, stderr = process.communicate(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, _ = process.communicate()
        return stdout, "hung: no end within the time limit (killed)"
    if process.returncode == 0:
        return stdout, None
    code = process.returncode
    status = f"signal {-code}" if code < 0 else f"exit status {code}"
    last = next((line for line in reversed(stderr.splitlines()) if line.strip()), "no message")
    return stdout, f"crashed ({status}): {last.strip()[:300]}"


def finish_worker(process: subprocess.Popen, deadline: float) -> Outcome:
    """The rows of a started worker and its failure (:func:`worker_output`)."""
    stdout, failure = worker_output(process, deadline)
    rows = []
    for line in stdout.splitlines():
        with contextlib.suppress(ValueError, TypeError):  # a worker that died mid-line leaves part of one
            rows.append(Row(**json.loads(line)))
    return Outcome(rows, failure)


def run_worker(command: Sequence[str], env: dict[str, str], timeout: float) -> Outcome:
    """:func:`start_worker` then :func:`finish_worker` within ``timeout`` seconds."""
    return finish_worker(start_worker(command, env), time.monotonic() + timeout)


def verdicts_from(outcomes: dict[str, Outcome], memchecks: dict[str, str | None]) -> dict[str, dict]:
    """The verdict of each variant checked: ``{"head_dim:split": {"verdict": "right" or "wrong", "why": ...}}``.
    ``outcomes`` by variant name (``"head_dim:padded"``, ``"launch:fast"``), ``memchecks`` a layout variant's
    memcheck failure (None: clean; absent: not run). Right only where the worker finished and every row passed."""
    found = {}
    for variant, outcome in outcomes.items():
        failed = [row for row in outcome.rows if not row.passed]
        if outcome.failure is not None:
            why = outcome.failure
        elif not outcome.rows:
            why = "no result"
        elif failed:
            why = f"{failed[0].op}: {failed[0].note or 'outside its bound'}"
        elif memchecks.get(variant):
            why = f"compute-sanitizer memcheck: {memchecks[variant]}"
        else:
            why = None
        worst = max((row.ratio for row in outcome.rows), default=float("nan"))
        found[variant] = {
            "verdict": "right" if why is None else "wrong",
            "why": why or f"every check within its bound (worst {worst:.2f} of it)",
            "date": datetime.date.today().isoformat(),
            "memcheck": "not run"
            if variant not in memchecks
            else ("clean" if memchecks[variant] is None else "errors"),
        }
    return found


def _python() -> list[str]:
    return [sys.executable, "-m", "qvl.kernels.check", "--worker"]


def _memchecks(sanitizer: str, layouts: Sequence[str], head_dims, env, timeout: float, python) -> dict[str, str | None]:
    """compute-sanitizer's memcheck over a small run in each of ``layouts``, all at once: by variant, None where
    clean, else what it found."""
    processes = {}
    for layout in layouts:
        command = [sanitizer, "--tool", "memcheck", "--error-exitcode", "9", *python, "memcheck", "--head-dims",
                   *map(str, head_dims)]  # fmt: skip
        processes[f"head_dim:{layout}"] = start_worker(command, {**env, "QVL_ATTENTION_HEAD_DIM": layout})
    deadline, found = time.monotonic() + timeout, {}
    for variant, process in processes.items():
        try:
            stdout, _ = process.communicate(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            found[variant] = f"no end within {timeout:.0f} s"
            continue
        summary = [line.strip() for line in stdout.splitlines() if "ERROR SUMMARY" in line]
        found[variant] = None if process.returncode == 0 else (summary or [f"exit status {process.returncode}"])[-1]
    return found


def run_check(
    layouts: Sequence[str] = LAYOUTS,
    head_dims: Sequence[int] = HEAD_DIMS,
    cases: Sequence[str] = CASES,
    timeout: float = DEFAULT_TIMEOUT,
    memcheck: bool = True,
    python: Sequence[str] | None = None,
    out=print,
) -> tuple[list[Row], dict[str, dict], bool]:
    """Run every worker (padded and each head-dim layout of ``layouts`` on ``head_dims`` and the attention ``cases``
    by name, the other ops in padded's, and on a GPU the launch paths), print the table through ``out``, record the
    verdicts on a GPU. ``timeout``: seconds for all workers together, which run at once. Returns (rows, verdicts,
    whether every check of the first layout, the conservative one, passed). ``python``: the worker command
    (default: this module with ``--worker``)."""
    import torch

    from . import verdicts
    from .attention import config
    from .common import device_target, triton_interpreting

    python = list(python or _python())
    layouts = list(dict.fromkeys(["padded", *layouts]))  # the conservative layout first: its worker runs the other ops
    on_gpu = not triton_interpreting() and torch.cuda.is_available()
    env = dict(os.environ)
    env.pop("QVL_ATTENTION_HEAD_DIM", None)
    env["QVL_FAST_LAUNCH"] = "0"
    if not on_gpu:
        env["TRITON_INTERPRET"] = "1"
    out(_machine_line(on_gpu))
    # Every worker at once, each in its own process: on a GPU they share it; their Triton compiles share the CPUs.
    workers = {}
    for index, layout in enumerate(layouts):
        dims = [d for d in head_dims if index == 0 or d not in _ONE_TILE]
        extra = ["--ops"] if index == 0 else []
        command = [*python, "layout", layout, "--head-dims", *map(str, dims), "--cases", *cases, *extra]
        command += ["--timed"] if on_gpu else []
        workers[f"head_dim:{layout}"] = start_worker(command, {**env, "QVL_ATTENTION_HEAD_DIM": layout})
    if on_gpu:
        workers["launch:fast"] = start_worker([*python, "launch"], {**env, "QVL_ATTENTION_HEAD_DIM": "padded"})
    start = time.monotonic()
    outcomes = {variant: finish_worker(process, start + timeout) for variant, process in workers.items()}
    out(f"checked in {time.monotonic() - start:.0f} s")
    sanitizer = shutil.which("compute-sanitizer") if on_gpu and memcheck else None
    # The faster layouts that computed right: memcheck decides whether they read or write out of bounds.
    candidates = [
        layout
        for layout in layouts[1:]
        if outcomes[f"head_dim:{layout}"].failure is None and all(r.passed for r in outcomes[f"head_dim:{layout}"].rows)
    ]
    memchecks = _memchecks(sanitizer, candidates, head_dims, env, MEMCHECK_TIMEOUT, python) if sanitizer else {}
    rows = [row for outcome in outcomes.values() for row in outcome.rows]
    found = verdicts_from(outcomes, memchecks)
    out(_table(rows, outcomes, found))
    out(
        "on every GPU, with no alternative in the package (exercised by the checks above): "
        + "; ".join(f"{name} ({about})" for name, about in verdicts.UNVERIFIED_WITHOUT_ALTERNATIVE.items())
    )
    # The conservative layout's worker also ran every other op: what the package takes where nothing is verified.
    defaults_right = found["head_dim:padded"]["verdict"] == "right"
    if on_gpu:
        index = torch.cuda.current_device()
        machine = verdicts.machine_of(index)
        path = verdicts.record_verdicts(machine, found)
        if path is not None:
            out(f"verdicts recorded in {path}")
        target = device_target(torch.device("cuda", index))
        verdicts.reset()
        taken = [verdicts.decision(choice, target, index) for choice in verdicts.CHOICES]
        out("from the next process on: " + "; ".join(f"{d.choice} {d.variant} ({d.reason})" for d in taken))
    else:
        out(
            "Triton's interpreter on the CPU (small shapes): nothing recorded; GPU verdicts need a GPU "
            f"(this process's layout: {config.head_dim_layout()})."
        )
    return rows, found, defaults_right


def _machine_line(on_gpu: bool) -> str:
    import torch
    import triton

    from . import verdicts

    if on_gpu:
        machine = verdicts.machine_of(torch.cuda.current_device())
        where = f"{machine.gpu} (sm_{machine.arch}, driver {machine.driver})"
    else:
        where = "CPU, Triton's interpreter"
    return f"qvl check on {where}: torch {torch.__version__}, Triton {triton.__version__}, qvl {verdicts.qvl_version()}"


def _table(rows: list[Row], outcomes: dict[str, Outcome], found: dict[str, dict]) -> str:
    def number(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    lines = [f"{'op':<34} {'variant':<17} {'error/bound':>11} {'verdict':<8} {'qvl us':>8} {'torch us':>8}"]
    for row in rows:
        verdict = "right" if row.passed else "WRONG"
        lines.append(
            f"{row.op:<34} {row.variant:<17} {row.ratio:>11.3f} {verdict:<8} {number(row.qvl_us):>8}"
            f" {number(row.torch_us):>8}"
        )
        if not row.passed and row.note:
            lines.append(f"    {row.note}")
    for variant, outcome in outcomes.items():
        if outcome.failure is not None:
            lines.append(f"{variant}: {outcome.failure}")
    lines.append("verdicts: " + "; ".join(f"{v} {r['verdict']} ({r['why']})" for v, r in found.items()))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``qvl check``'s options and run (the ``qvl`` command calls it with its arguments)."""
    parser = argparse.ArgumentParser(prog="qvl check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--head-dims", type=int, nargs="+", default=list(HEAD_DIMS))
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES), help="attention cases by name")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds for the checks, all at once")
    parser.add_argument("--no-memcheck", action="store_true", help="skip compute-sanitizer even where it is found")
    parser.add_argument("--json", help="also write the rows and verdicts to this file")
    args = parser.parse_args(argv)
    rows, found, defaults_right = run_check(
        args.layouts, args.head_dims, args.cases, args.timeout, memcheck=not args.no_memcheck
    )
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"rows": [r._asdict() for r in rows], "verdicts": found}, file, indent=1)
    return 0 if defaults_right else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        sys.exit(worker_main(sys.argv[2:]))
    sys.exit(main(sys.argv[1:]))
