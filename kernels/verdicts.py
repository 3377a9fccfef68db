"""Which kernel variants qvl takes on a GPU: a faster variant only where a device run recorded it right, the
conservative one everywhere else.

A variant is right on a GPU when it ran there and its results were within the tolerance rule
(:mod:`.tolerance`) on the layouts that failed before (:data:`.verify.ATTENTION_CASES`). Two sources of verdicts:

* the package's table (``device_verdicts.json`` beside this module), written from device runs committed with the
  project, each entry naming its run: a verdict holds for a GPU architecture and a Triton minor version (the
  compiler that made the kernels);
* a per-user cache that ``qvl check`` writes on the user's own machine (:func:`record_verdicts`), one file per
  machine: GPU name, compute capability, driver, torch, Triton and qvl versions. A verdict from any other machine
  or version is not used. A verdict the machine recorded overrides the package's.

What a process takes, for each choice (:data:`CHOICES`): the value an environment variable sets (it always wins);
else on Triton's interpreter the fastest (the test suite checks every variant there); else the first faster
variant with a "right" verdict for the GPU; else the conservative one. :func:`decision` says which and why, and is
logged once per process and GPU.

Variants that have not run on a GPU and have no alternative in the package (:data:`UNVERIFIED_WITHOUT_ALTERNATIVE`)
are listed too: ``qvl check`` exercises them, and the README says they have not run on a GPU yet.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import torch
import triton
from triton.backends.compiler import GPUTarget

__all__ = [
    "CHOICES",
    "PACKAGED_VERDICTS_PATH",
    "UNVERIFIED_WITHOUT_ALTERNATIVE",
    "Choice",
    "Decision",
    "Machine",
    "cache_dir",
    "decision",
    "generation",
    "machine_of",
    "machine_verdicts",
    "packaged_verdicts",
    "qvl_version",
    "record_verdicts",
    "reset",
    "verdict_for",
]

logger = logging.getLogger("qvl")

PACKAGED_VERDICTS_PATH = Path(__file__).parent / "device_verdicts.json"
CACHE_VARIABLE = "QVL_CACHE_DIR"


class Choice(NamedTuple):
    """One way a kernel can be run, with its variants: ``faster`` (in order of preference, each taken only with a
    "right" verdict), ``conservative`` (taken otherwise), ``interpreter`` (taken on Triton's interpreter), and the
    environment ``variable`` that sets it outright."""

    name: str
    faster: tuple[str, ...]
    conservative: str
    interpreter: str
    variable: str


CHOICES = {
    # How attention tiles head dims that are not a power of two (72, 80): split (64 + a 16-wide tail), split32
    # (64 + 32) or padded (one tile of the next power of two).
    "head_dim": Choice("head_dim", ("split", "split32"), "padded", "split", "QVL_ATTENTION_HEAD_DIM"),
    # How kernels are launched: fast (the compiled kernel's launcher called directly) or triton (kernel[grid]).
    "launch": Choice("launch", ("fast",), "triton", "fast", "QVL_FAST_LAUNCH"),
}

# What every GPU path runs that no device run has checked yet and that has no alternative in the package.
UNVERIFIED_WITHOUT_ALTERNATIVE = {
    "rope table": "the fused rotary's cos/sin scratch table, written by the kernel rotating k, read as q loads",
    "half-head rotary": "the rotary kernel's half-head tiles (a dim and its partner from one load each)",
    "launch plans": "attention launches built once per shape, strides and alignment and looked up after",
    "CUDA graphs": "the tower runner's captured graphs (TowerRunner.capture; vLLM's V2 runner's encoder graphs)",
}


class Machine(NamedTuple):
    """What a verdict of ``qvl check`` holds for: one GPU model and driver with one set of versions."""

    gpu: str
    arch: int
    driver: str
    torch: str
    triton: str
    qvl: str

    def file_name(self) -> str:
        digest = hashlib.sha256(json.dumps(self._asdict(), sort_keys=True).encode()).hexdigest()[:16]
        name = "".join(c if c.isalnum() else "-" for c in self.gpu).strip("-").lower()
        return f"{name}-sm{self.arch}-{digest}.json"


def qvl_version() -> str:
    try:
        return importlib.metadata.version("qvl")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _driver_version() -> str:
    """The NVIDIA driver's version as the kernel module states it (Linux), else "unknown"."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return "unknown"
    for word in text.split():
        if word.count(".") >= 1 and word.replace(".", "").isdigit():
            return word
    return "unknown"


def machine_of(device_index: int) -> Machine:
    """The :class:`Machine` of CUDA device ``device_index`` in this process."""
    major, minor = torch.cuda.get_device_capability(device_index)
    return Machine(
        torch.cuda.get_device_name(device_index),
        major * 10 + minor,
        _driver_version(),
        torch.__version__,
        triton.__version__,
        qvl_version(),
    )


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


@functools.cache
def packaged_verdicts() -> tuple[dict, ...]:
    """The package's table: entries ``{variant, arch, triton, verdict, device, date, run, commit}``."""
    return tuple(json.loads(PACKAGED_VERDICTS_PATH.read_text())["verdicts"])


def cache_dir() -> Path:
    """Where ``qvl check`` records verdicts: ``$QVL_CACHE_DIR``, else ``$XDG_CACHE_HOME/qvl``, else
    ``~/.cache/qvl``; the verdicts in its ``verdicts`` folder."""
    if os.environ.get(CACHE_VARIABLE):
        return Path(os.environ[CACHE_VARIABLE])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "qvl"


def _verdicts_file(machine: Machine) -> Path:
    return cache_dir() / "verdicts" / machine.file_name()


def machine_verdicts(machine: Machine) -> dict[str, dict]:
    """The verdicts ``qvl check`` recorded for ``machine``: ``{"head_dim:split": {"verdict": "right", ...}}``. A
    file that cannot be read or parsed, or that records another machine, gives none, with a warning."""
    path = _verdicts_file(machine)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as error:
        warnings.warn(f"qvl: cannot read the verdicts in {path} ({error}); using the package's defaults", stacklevel=2)
        return {}
    try:
        record = json.loads(text)
        recorded = Machine(**record["machine"])
        verdicts = record["verdicts"]
        if not isinstance(verdicts, dict) or not all(isinstance(v, dict) for v in verdicts.values()):
            raise TypeError("verdicts must map variants to records")
    except (ValueError, TypeError, KeyError) as error:
        warnings.warn(
            f"qvl: ignoring the corrupt verdict file {path} ({type(error).__name__}: {error}); run qvl check again",
            stacklevel=2,
        )
        return {}
    return verdicts if recorded == machine else {}


def record_verdicts(machine: Machine, verdicts: Mapping[str, Mapping]) -> Path | None:
    """Merge ``verdicts`` (``{"head_dim:split": {"verdict": "right" or "wrong", ...}}``) into ``machine``'s file,
    written atomically (a temporary file renamed over it, under a lock: several ranks may check at once, and a
    reader sees the old file or the new one, never a part). Returns the path, or None with a warning where it
    cannot be written (a read-only home): the package's defaults then stay. A process keeps the decisions it made
    (:func:`decision`): new verdicts count from the next process on."""
    path = _verdicts_file(machine)
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # One writer at a time merges (ranks checking at once each add their own verdicts); readers take no lock:
        # they see the file before or after a rename.
        with open(path.parent / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            merged = {**machine_verdicts(machine), **{name: dict(record) for name, record in verdicts.items()}}
            text = json.dumps({"machine": machine._asdict(), "verdicts": merged}, indent=1, sort_keys=True)
            descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
            with os.fdopen(descriptor, "w") as file:
                file.write(text + "\n")
            os.replace(temporary, path)
    except OSError as error:
        if temporary is not None and os.path.exists(temporary):
            os.unlink(temporary)
        warnings.warn(f"qvl: cannot record verdicts in {path.parent} ({error}); the defaults stay", stacklevel=2)
        return None
    return path


def verdict_for(variant: str, target: GPUTarget, machine: Machine | None = None) -> tuple[str, str] | None:
    """``(verdict, source)`` for ``variant`` (``"head_dim:split"``) on ``target``: the one ``machine`` recorded
    (``qvl check`` on it), else the package's for the target's architecture and the installed Triton's minor
    version; None where there is none."""
    if machine is not None:
        record = machine_verdicts(machine).get(variant)
        if record is not None and record.get("verdict") in ("right", "wrong"):
            return record["verdict"], f"qvl check on this machine, {record.get('date', 'undated')}"
    version = _minor(triton.__version__)
    for entry in packaged_verdicts():
        if entry["variant"] == variant and entry["arch"] == target.arch and entry["triton"] == version:
            return entry["verdict"], f"{entry['device']}, {entry['date']} ({entry['run']})"
    return None


class Decision(NamedTuple):
    """The variant a process takes for a choice on a target, and why."""

    choice: str
    variant: str
    reason: str


_resolved: dict[tuple, Decision] = {}


def decision(choice: str, target: GPUTarget, device_index: int | None = None) -> Decision:
    """The variant of ``choice`` (a key of :data:`CHOICES`) a launch for ``target`` takes when its environment
    variable is unset: the interpreter's on Triton's interpreter; on a GPU the first faster variant with a "right"
    verdict (:func:`verdict_for`; the machine's own where ``device_index`` names the live device), else the
    conservative one. Decided once per choice and target (:func:`reset` forgets), and logged once."""
    key = (choice, target, device_index)
    made = _resolved.get(key)
    if made is None:
        made = _resolved[key] = _decide(CHOICES[choice], target, device_index)
        if target.backend == "cuda" and device_index is not None:
            logger.info("qvl: %s %s on sm_%d: %s", choice, made.variant, target.arch, made.reason)
    return made


def _decide(choice: Choice, target: GPUTarget, device_index: int | None) -> Decision:
    if target.backend != "cuda":
        return Decision(choice.name, choice.interpreter, "Triton's interpreter (the test suite checks every variant)")
    machine = machine_of(device_index) if device_index is not None else None
    wrong = []
    for variant in choice.faster:
        found = verdict_for(f"{choice.name}:{variant}", target, machine)
        if found is not None and found[0] == "right":
            return Decision(choice.name, variant, f"verified right: {found[1]}")
        if found is not None:
            wrong.append(f"{variant} wrong ({found[1]})")
    unverified = ", ".join(wrong) or f"no device run verified {' or '.join(choice.faster)}"
    return Decision(
        choice.name,
        choice.conservative,
        f"the conservative variant: {unverified} on sm_{target.arch} with Triton {_minor(triton.__version__)}"
        f" (qvl check verifies them on this machine; {choice.variable} sets one)",
    )


_generation = 0


def generation() -> int:
    """How many times :func:`reset` ran: callers that keep decisions key them on it."""
    return _generation


def reset() -> None:
    """Forget the decisions made (after the verdicts changed: a test, ``qvl check``)."""
    global _generation
    _generation += 1
    _resolved.clear()
    packaged_verdicts.cache_clear()
