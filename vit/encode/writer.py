"""Streamed, resumable output: features written into shards as they are produced, every file atomically.

A shard folder holds ``shard-<rank>-<run>-<n>.safetensors`` files (``.parquet`` with ``--format parquet``:
:mod:`.parquet`) and, once a run ends, ``index.jsonl``. Each shard is written beside its final name and renamed over
it (after an fsync), so a crash or ``kill -9`` at any moment leaves complete shards and at most a temporary file,
never a partial shard. A shard carries, in its metadata (a Parquet shard's: its schema's), the index entries of the
inputs it completes (:data:`ENTRY_FIELDS`; skipped inputs too, with their reason) and the run's constants
(:data:`RUN_FIELDS`): the shards alone are the index, which is what ``--resume`` reads, and ``index.jsonl`` is the
same entries gathered in input order for readers. Ranks in ``--parallel data`` write their own shards into the one
folder; under Ray (:mod:`.ray`) each group of inputs is one shard named after its inputs.

The single-file layout (``-o x.safetensors``, ``-o x.parquet``) is the same shards in a hidden folder beside the file,
merged into it at the end (:func:`merge_into_file`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .errors import EncodeError

__all__ = [
    "ENTRY_FIELDS",
    "FORMAT",
    "INDEX_NAME",
    "PARQUET_INDEX_NAME",
    "RUN_FIELDS",
    "FeatureLayout",
    "index_name",
    "ShardWriter",
    "check_format",
    "check_resumable",
    "check_output",
    "merge_into_file",
    "open_folder",
    "parts_folder",
    "read_shards",
    "shards",
    "write_atomically",
    "write_index",
    "write_shard",
]

FORMAT = "qvl-encode/1"
INDEX_NAME = "index.jsonl"
# A Parquet folder's index: a name Parquet readers skip (pyarrow, pandas and Spark leave out files starting with _ or
# .), so that the folder reads as a Parquet data set.
PARQUET_INDEX_NAME = "_index.jsonl"
SHARD_GLOB = "shard-*.safetensors"
# Shard files of each format, by their suffix.
SHARD_SUFFIXES = {"safetensors": ".safetensors", "parquet": ".parquet"}
# Each index entry: the input's number, path (or a data-set file's sample: shard.tar/KEY, file.parquet#ROW), its key
# in its container (else its path), kind, the shard holding its entry, its tensor keys (none when skipped), its patch
# grid, a video file's sampling, its (or its container's) size and modification time when read, and why it was
# skipped.
ENTRY_FIELDS = (
    "input", "source", "key", "kind", "shard", "keys", "grid_thw", "sampling", "size", "mtime_ns", "error"
)  # fmt: skip
# The run's constants, in every shard: a resumed run must match them (the backend may differ: another device).
RUN_FIELDS = ("format", "model", "dtype", "backend", "deepstack_visual_indexes", "processing")
_MATCHED_ON_RESUME = ("format", "model", "dtype", "deepstack_visual_indexes", "processing")


def _reason(error: Exception) -> str:
    return getattr(error, "strerror", None) or str(error).splitlines()[0] or type(error).__name__


@contextlib.contextmanager
def _file_errors(what: str) -> Iterator[None]:
    """A shard file's failure as an :class:`EncodeError` ``"{what} ({reason})"``: OSError, safetensors' own
    SafetensorError (its I/O failures are not OSErrors), or one of pyarrow's (ArrowException's subclasses: a Parquet
    shard's I/O or data); anything else as it is."""
    try:
        yield
    except Exception as error:
        if not isinstance(error, (OSError, SafetensorError)) and type(error).__module__.split(".")[0] != "pyarrow":
            raise
        raise EncodeError(f"{what} ({_reason(error)})") from None


def _replace_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """``write(temporary)`` beside ``path``, flushed to disk, then renamed over ``path``: readers and crashes see the
    old file or the new one. Raises :class:`EncodeError` naming ``path`` (exit status 2), the temporary removed."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with _file_errors(f"{path}: cannot write"):
            write(temporary)
            with open(temporary, "rb") as file:
                os.fsync(file.fileno())
            os.replace(temporary, path)
    finally:
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)


def write_atomically(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write a safetensors file at ``path`` atomically (see :func:`_replace_atomically`)."""
    _replace_atomically(path, lambda temporary: save_file(tensors, str(temporary), metadata=metadata))


@dataclasses.dataclass(frozen=True)
class FeatureLayout:
    """What a run's features are, for shard formats whose schema is fixed up front (Parquet): the feature names
    (``merged``, ``deepstack.0``, ...), the values a token, and the dtype they were computed in."""

    names: tuple[str, ...]
    width: int
    dtype: torch.dtype


def shards(folder: Path) -> list[Path]:
    """The shard files in ``folder``, of every format, in name order."""
    return sorted(path for suffix in SHARD_SUFFIXES.values() for path in folder.glob(f"shard-*{suffix}"))


def write_shard(path: Path, entries: list[dict], tensors: dict[str, torch.Tensor], run: dict[str, str],
                layout: FeatureLayout | None = None) -> list[dict]:  # fmt: skip
    """Write one shard at ``path`` atomically, its format by its suffix: ``tensors`` and ``entries`` (each given
    ``shard``, the file's name) with the run's constants ``run``; ``layout`` for Parquet. Returns the entries as
    written."""
    entries = [{**entry, "shard": path.name} for entry in entries]
    metadata = {**run, "entries": json.dumps(entries)}
    if path.suffix == SHARD_SUFFIXES["parquet"]:
        from . import parquet

        def write(temporary: Path) -> None:
            parquet.write_part(temporary, entries, tensors, metadata, list(layout.names), layout.width, layout.dtype)

        _replace_atomically(path, write)
    else:
        write_atomically(path, tensors, metadata)
    return entries


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
            raise EncodeError(f"{path}: is a directory (a {path.suffix} --output is one file)")
        if not path.parent.is_dir():
            raise EncodeError(f"{path.parent}: no such directory (for {option})")
        folder = parts_folder(path)
    else:
        if path.exists() and not path.is_dir():
            raise EncodeError(
                f"{path}: not a directory (an --output not ending in .safetensors or .parquet is a folder)"
            )
        if not resume and path.is_dir() and shards(path):
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
    for path in shards(folder):
        metadata = _shard_metadata(path)
        if metadata.get("format") != FORMAT:
            raise EncodeError(f"{path}: not a shard of qvl encode ({FORMAT})")
        shard_run = {name: metadata.get(name) for name in RUN_FIELDS}
        if run is not None and any(shard_run[name] != run[name] for name in _MATCHED_ON_RESUME):
            raise EncodeError(f"{path}: written by a run with other settings than the folder's other shards")
        run = run or shard_run
        entries += json.loads(metadata["entries"])
    return entries, run


def _shard_metadata(path: Path) -> dict[str, str]:
    with _file_errors(f"{path}: unreadable shard"):
        if path.suffix == SHARD_SUFFIXES["parquet"]:
            from . import parquet

            return parquet.read_metadata(path)
        with safe_open(str(path), framework="pt") as handle:
            return handle.metadata() or {}


def check_format(folder: Path, fmt: str) -> None:
    """Raise :class:`EncodeError` where ``folder`` holds shards of another format than ``fmt``."""
    for other, suffix in SHARD_SUFFIXES.items():
        if other != fmt and any(folder.glob(f"shard-*{suffix}")):
            raise EncodeError(
                f"{folder}: holds {other} shards, this run writes {fmt} (--resume continues a run in its --format)"
            )


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

    def __init__(
        self,
        folder: Path,
        tag: str,
        run: dict[str, str],
        shard_bytes: int,
        shard_inputs: int | None = None,
        fmt: str = "safetensors",
        layout: FeatureLayout | None = None,
    ):
        self.folder, self.run = folder, run
        self.suffix, self.layout = SHARD_SUFFIXES[fmt], layout
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
        name = f"{self.prefix}-{self.shards:05d}{self.suffix}"
        self.entries += write_shard(self.folder / name, self._pending, self._tensors, self.run, self.layout)
        self.shards += 1
        self.tensors += len(self._tensors)
        self._pending, self._tensors, self._bytes = [], {}, 0
        self.seconds += time.perf_counter() - start

    close = flush


def index_name(fmt: str) -> str:
    """The index file of a folder of ``fmt`` shards: ``index.jsonl``, ``_index.jsonl`` beside Parquet shards."""
    return PARQUET_INDEX_NAME if fmt == "parquet" else INDEX_NAME


def write_index(folder: Path, entries: list[dict], fmt: str = "safetensors") -> None:
    """``index.jsonl`` (``_index.jsonl`` beside ``fmt`` parquet shards) in ``folder``: one JSON object per input
    (:data:`ENTRY_FIELDS`), in input order."""
    lines = "".join(json.dumps({name: entry.get(name) for name in ENTRY_FIELDS}) + "\n"
                    for entry in sorted(entries, key=lambda entry: entry["input"]))  # fmt: skip
    _replace_atomically(folder / index_name(fmt), lambda temporary: temporary.write_text(lines, encoding="utf-8"))


def merge_into_file(folder: Path, path: Path, count: int) -> int:
    """The shards in ``folder`` (a run of ``count`` inputs) as one file at ``path``, written atomically, then the
    folder removed; returns the number of tensors. The file's metadata: the run's constants and, per input in order,
    ``sources``, ``kinds``, ``sampling``, ``grid_thw`` and ``errors`` (JSON lists; a skipped input has its reason in
    ``errors`` and no tensors). A ``.parquet`` file gets its shards' rows in input order (the number of rows is
    returned), its metadata the run's constants and every input's index entry (``entries``)."""
    entries, run = read_shards(folder)
    if path.suffix == SHARD_SUFFIXES["parquet"]:
        from . import parquet

        ordered = sorted(entries, key=lambda entry: entry["input"])
        metadata = {**(run or {}), "entries": json.dumps(ordered)}
        parts, rows = shards(folder), []
        _replace_atomically(path, lambda temporary: rows.append(parquet.merge_parts(parts, temporary, metadata)))
        shutil.rmtree(folder, ignore_errors=True)
        return rows[0]
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
