"""The encode job's shared core, below both ways of running it (:mod:`.job` in this process and its ranks,
:mod:`.ray` in Ray Data's actors): :class:`Encoder`, the loop from prepared pieces through token-budget batches and the
tower to each input's features; :func:`entry`, an input's index entry; :func:`constants`, the run's constants every
shard carries."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Callable, Sequence

import torch

from .invariance import fixed_row_products
from .loader import Packer, Piece
from .options import EncodeOptions
from .prepare import Preparer
from .progress import Progress, Timings
from .writer import ShardWriter

__all__ = ["Encoder", "Log", "constants", "entry"]

Log = Callable[[str], None]


def constants(options: EncodeOptions, dtype: torch.dtype, backend: str, config, processing) -> dict[str, str]:
    """The run's constants written into every shard (:data:`~qvl.vit.encode.writer.RUN_FIELDS`), which a resumed
    run must match."""
    return {
        "format": "qvl-encode/1",
        "model": options.model or "embedded-random",
        "dtype": str(dtype).removeprefix("torch."),
        "backend": backend,
        "deepstack_visual_indexes": json.dumps(list(config.deepstack_visual_indexes)),
        "processing": json.dumps(dataclasses.asdict(processing)),
    }


def entry(piece: Piece, keys: Sequence[str] = (), grid: list[int] | None = None, error: str | None = None) -> dict:
    """The index entry of ``piece``'s input: its identity (number, source, key, kind, file size and time), the keys of
    its features (none where it was skipped), its grid and the error that skipped it (None)."""
    identity = piece.stamp or {}
    return {
        "input": piece.item.number,
        "source": piece.item.source,
        "key": piece.item.key,
        "kind": piece.item.kind,
        "keys": list(keys),
        "grid_thw": grid,
        "sampling": piece.sampling,
        "size": identity.get("size"),
        "mtime_ns": identity.get("mtime_ns"),
        "error": error,
    }


class Encoder:
    """One rank's loop: pieces -> (prepared on the device where they come unprepared) -> batches -> the tower ->
    each input's features, a video's chunks joined, -> the writer (None: a rank that does not write)."""

    def __init__(
        self, tower, writer: ShardWriter | None, processing, device: torch.device, invariant: bool, fold_images: bool
    ):
        self.tower, self.writer, self.device = tower, writer, device
        self.preparer = None if device.type == "cpu" else Preparer(processing, device, fold_images)
        # Fixed-height product tiles make features independent of the batch on the CPU paths (eager only).
        self.invariant = invariant and device.type == "cpu"
        self.merge = tower.config.spatial_merge_size**2
        self.names = ["merged"] + [f"deepstack.{j}" for j in range(len(tower.config.deepstack_visual_indexes))]
        self.timings = Timings()
        self.parts: dict[int, list[dict[str, torch.Tensor]]] = {}  # a video's features so far, per chunk
        self.failed: set[int] = set()

    def encode(self, pieces, options: EncodeOptions, progress: Progress, log: Log) -> None:
        packer = Packer(options.budget, options.batch_size)
        self.progress, self.log = progress, log
        waited = time.perf_counter()
        for piece in pieces:
            self.timings.waiting += time.perf_counter() - waited
            self.timings.decode += piece.decode_s
            self.timings.prepare += piece.prepare_s
            if piece.failure is not None:
                self._skip(piece)
            else:
                if piece.rows is None:
                    piece = self._prepare(piece)
                for batch in packer.add(piece):
                    self._run(batch)
            waited = time.perf_counter()
        for batch in packer.flush():
            self._run(batch)

    def _prepare(self, piece: Piece) -> Piece:
        start = time.perf_counter()
        if piece.item.kind == "image":
            rows, grid = self.preparer.image(piece.pixels)
        else:
            rows, grid = self.preparer.video(piece.pixels, piece.size)
        self.timings.prepare += time.perf_counter() - start
        return dataclasses.replace(piece, rows=rows, grid=grid, pixels=None)

    def _skip(self, piece: Piece) -> None:
        number = piece.item.number
        self.failed.add(number)
        self.parts.pop(number, None)
        self.log(f"skipped {piece.item.source}: {piece.failure}")
        if self.writer is not None:
            self.writer.add(entry(piece, error=piece.failure), {})
        self.progress.update(1, 0)

    def _run(self, batch: list[Piece]) -> None:
        start = time.perf_counter()
        rows = torch.cat([piece.rows for piece in batch]) if len(batch) > 1 else batch[0].rows
        grids = [piece.grid for piece in batch]
        with fixed_row_products() if self.invariant else contextlib.nullcontext():
            merged, deepstack = self.tower(rows, grids)
        counts = [piece.patches // self.merge for piece in batch]
        # One device-to-host copy per output; clones so that no two written tensors share storage.
        split = [output.cpu().split(counts) for output in (merged, *deepstack)]
        outputs = [{name: parts[index].clone() for name, parts in zip(self.names, split, strict=True)}
                   for index in range(len(batch))]  # fmt: skip
        self.timings.tower += time.perf_counter() - start
        for piece, features in zip(batch, outputs, strict=True):
            if piece.item.number not in self.failed:
                self._collect(piece, features)

    def _collect(self, piece: Piece, features: dict[str, torch.Tensor]) -> None:
        number = piece.item.number
        chunks = self.parts.setdefault(number, [])
        chunks.append(features)
        if not piece.last:
            return
        del self.parts[number]
        tensors = {f"image.{number}.{name}": torch.cat([chunk[name] for chunk in chunks]) if len(chunks) > 1
                   else chunks[0][name] for name in self.names}  # fmt: skip
        _, height, width = piece.grid
        steps = sum(chunk["merged"].shape[0] for chunk in chunks) * self.merge // (height * width)
        if self.writer is not None:
            self.writer.add(entry(piece, sorted(tensors), [steps, height, width]), tensors)
        self.progress.update(1, steps * height * width)
