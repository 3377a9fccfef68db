"""Streamed, resumable output: features written into shards as they are produced, every file atomically.

A shard folder holds ``shard-<rank>-<run>-<n>.safetensors`` files and, once a run ends, ``index.jsonl``. Each shard
is written beside its final name and renamed over it (after an fsync), so a crash or ``kill -9`` at any moment leaves
complete shards and at most a temporary file, never a partial shard. A shard carries, in its safetensors metadata,
the index entries of the inputs it completes (:data:`ENTRY_FIELDS`; skipped inputs too, with their reason) and the
run's constants (:data:`RUN_FIELDS`): the shards alone are the index, which is what ``--resume`` reads, and
``index.jsonl`` is the same entries gathered in input order for readers. Ranks in ``--parallel data`` write their own
shards into the one folder.

The single-file layout (``-o x.safetensors``) is the same shards in a hidden folder beside the file, merged into it
at the end (:func:`merge_into_file`).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .errors import EncodeError

__all__ = [
    "ENTRY_FIELDS",
    "FORMAT",
    "INDEX_NAME",
    "RUN_FIELDS",
    "ShardWriter",
    "check_resumable",
    "check_output",
    "merge_into_file",
    "open_folder",
    "parts_folder",
    "read_shards",
    "write_atomically",
    "write_index",
]

FORMAT = "qvl-encode/1"
INDEX_NAME = "index.jsonl"
SHARD_GLOB = "shard-*.safetensors"
# Each index entry: the input's number, path, kind, the shard holding its entry, its tensor keys (none when skipped),
# its patch grid, a video file's sampling, its size and modification time when read, and why it was skipped.
ENTRY_FIELDS = ("input", "source", "kind", "shard", "keys", "grid_thw", "sampling", "size", "mtime_ns", "error")
# The run's constants, in every shard: a resumed run must match them (the backend may differ: another device).
RUN_FIELDS = ("format", "model", "dtype", "backend", "deepstack_visual_indexes", "processing")
_MATCHED_ON_RESUME = ("format", "model", "dtype", "deepstack_visual_indexes", "processing")


def _reason(error: Exception) -> str:
    return getattr(error, "strerror", None) or str(error).splitlines()[0] or type(error).__name__


def _replace_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """``write(temporary)`` beside ``path``, flushed to disk, then renamed over ``path``: readers and crashes see the
    old file or the new one. Raises :class:`EncodeError` naming ``path`` (exit status 2), the temporary removed."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(temporary)
        with open(temporary, "rb") as file:
            os.fsync(file.fileno())
        os.replace(temporary, path)
    # safetensors reports its own I/O failures as SafetensorError, not OSError.
    except (OSError, SafetensorError) as error:
        raise EncodeError(f"{path}: cannot write ({_reason(error)})") from None
    finally:
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)


def write_atomically(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write a safetensors file at ``path`` atomically (see :func:`_replace_atomically`)."""
    _replace_atomically(path, lambda temporary: save_file(tensors, str(temporary), metadata=metadata))


def parts_folder(path: Path) -> Path:
    """The hidden shard folder beside single-file output ``path``."""
    return path.with_name(f".{path.name}.parts")


def check_output(path: Path, single_file: bool, resume: bool) -> Path:
    """Check output ``path`` before any work, changing nothing, and return the folder its shards go to: ``path``
    itself, or the hidden one beside a single file (:func:`parts_folder`). Raises :class:`EncodeError` (exit status 2)
    for an output that cannot be written there (tried with a file created and removed: permission bits say nothing on
    a read-only file system, or to root), a folder that holds another run's shards without ``resume``, and ``resume``
    of a single file."""
    option = f"--output {path}"
    if single_file:
        if resume:
            raise EncodeError(f"{option}: --resume continues a folder of shards; give --output a folder")
        if path.is_dir():
            raise EncodeError(f"{path}: is a directory (a .safetensors --output is one file)")
        if not path.parent.is_dir():
            raise EncodeError(f"{path.parent}: no such directory (for {option})")
        folder = parts_folder(path)
    else:
        if path.exists() and not path.is_dir():
            raise EncodeError(f"{path}: not a directory (an --output not ending in .safetensors is a folder)")
        if not resume and path.is_dir() and any(path.glob(SHARD_GLOB)):
            raise EncodeError(
                f"{path}: holds the shards of an earlier run (--resume continues it; or give another --output)"
            )
        folder = path
    existing = next(parent for parent in (folder, *folder.parents) if parent.exists())
    if not existing.is_dir():
        raise EncodeError(f"{existing}: not a directory (for {option})")
    probe = existing / f".qvl-write-probe-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise EncodeError(f"{existing}: cannot write there ({_reason(error)}; for {option})") from None
    return folder


def open_folder(folder: Path, single_file: bool) -> None:
    """Create the shard ``folder`` (with its parents) and clear what a crashed run left in it: the temporary file of a
    shard being written, and the whole of a single file's hidden parts folder."""
    if single_file:
        shutil.rmtree(folder, ignore_errors=True)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise EncodeError(f"{folder}: cannot create ({_reason(error)})") from None
    for leftover in folder.glob(".shard-*.tmp"):
        leftover.unlink(missing_ok=True)


def read_shards(folder: Path) -> tuple[list[dict], dict[str, str] | None]:
    """The index entries and run constants of every shard in ``folder`` (None where it holds none). Raises
    :class:`EncodeError` for a shard that cannot be read or that another kind of run wrote."""
    entries, run = [], None
    for path in sorted(folder.glob(SHARD_GLOB)):
        try:
            with safe_open(str(path), framework="pt") as handle:
                metadata = handle.metadata() or {}
        except (OSError, SafetensorError) as error:
            raise EncodeError(f"{path}: unreadable shard ({_reason(error)})") from None
        if metadata.get("format") != FORMAT:
            raise EncodeError(f"{path}: not a shard of qvl encode ({FORMAT})")
        shard_run = {name: metadata.get(name) for name in RUN_FIELDS}
        if run is not None and any(shard_run[name] != run[name] for name in _MATCHED_ON_RESUME):
            raise EncodeError(f"{path}: written by a run with other settings than the folder's other shards")
        run = run or shard_run
        entries += json.loads(metadata["entries"])
    return entries, run


def check_resumable(run: dict[str, str] | None, current: dict[str, str], folder: Path) -> None:
    """Raise :class:`EncodeError` where the shards in ``folder`` were written with other settings than ``current``."""
    if run is None:
        return
    for name in _MATCHED_ON_RESUME:
        if run[name] != current[name]:
            raise EncodeError(
                f"{folder}: its shards were written with {name} {run[name]}, this run has {current[name]} (--resume"
                " continues a run with the same model, dtype and preparation)"
            )


class ShardWriter:
    """Features to shards in ``folder`` as they come: :meth:`add` one input's entry (:data:`ENTRY_FIELDS` but
    ``shard``) and tensors; a shard is written once it holds ``shard_bytes`` of tensors or ``shard_inputs`` inputs,
    and by :meth:`close`. ``run``: the run's constants (:data:`RUN_FIELDS`), written into every shard. Shard names
    start with ``shard-{tag}-`` and a random part of their own, so runs and ranks never overwrite each other's."""

    def __init__(self, folder: Path, tag: str, run: dict[str, str], shard_bytes: int, shard_inputs: int | None = None):
        self.folder, self.run = folder, run
        self.prefix = f"shard-{tag}-{secrets.token_hex(3)}"
        self.shard_bytes, self.shard_inputs = shard_bytes, shard_inputs
        self.entries: list[dict] = []  # every entry written so far, for the run's index
        self.shards = self.tensors = 0
        self.seconds = 0.0
        self._pending: list[dict] = []
        self._tensors: dict[str, torch.Tensor] = {}
        self._bytes = 0

    def add(self, entry: dict, tensors: dict[str, torch.Tensor]) -> None:
        """Queue one input (its tensors on the host, each its own storage); writes a shard once it is full."""
        self._pending.append(entry)
        self._tensors.update(tensors)
        self._bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        inputs_full = self.shard_inputs is not None and len(self._pending) >= self.shard_inputs
        if self._bytes >= self.shard_bytes or inputs_full:
            self.flush()

    def flush(self) -> None:
        """Write what is queued as one shard (nothing when nothing is queued)."""
        if not self._pending:
            return
        start = time.perf_counter()
        name = f"{self.prefix}-{self.shards:05d}.safetensors"
        entries = [{**entry, "shard": name} for entry in self._pending]
        write_atomically(self.folder / name, self._tensors, {**self.run, "entries": json.dumps(entries)})
        self.entries += entries
        self.shards += 1
        self.tensors += len(self._tensors)
        self._pending, self._tensors, self._bytes = [], {}, 0
        self.seconds += time.perf_counter() - start

    close = flush


def write_index(folder: Path, entries: list[dict]) -> None:
    """``index.jsonl`` in ``folder``: one JSON object per input (:data:`ENTRY_FIELDS`), in input order."""
    lines = "".join(json.dumps({name: entry.get(name) for name in ENTRY_FIELDS}) + "\n"
                    for entry in sorted(entries, key=lambda entry: entry["input"]))  # fmt: skip
    _replace_atomically(folder / INDEX_NAME, lambda temporary: temporary.write_text(lines, encoding="utf-8"))


def merge_into_file(folder: Path, path: Path, count: int) -> int:
    """The shards in ``folder`` (a run of ``count`` inputs) as one safetensors file at ``path``, written atomically,
    then the folder removed; returns the number of tensors. The file's metadata: the run's constants and, per input
    in order, ``sources``, ``kinds``, ``sampling``, ``grid_thw`` and ``errors`` (JSON lists; a skipped input has its
    reason in ``errors`` and no tensors)."""
    entries, run = read_shards(folder)
    by_number = {entry["input"]: entry for entry in entries}
    tensors = {}
    for shard in sorted(folder.glob(SHARD_GLOB)):
        with safe_open(str(shard), framework="pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
    ordered = [by_number.get(number, {}) for number in range(count)]
    metadata = {name: value for name, value in (run or {}).items() if name not in ("format", "processing")}
    for key, field in (("sources", "source"), ("kinds", "kind"), ("sampling", "sampling"), ("grid_thw", "grid_thw"),
                       ("errors", "error")):  # fmt: skip
        metadata[key] = json.dumps([entry.get(field) for entry in ordered])
    write_atomically(path, tensors, metadata)
    shutil.rmtree(folder, ignore_errors=True)
    return len(tensors)
