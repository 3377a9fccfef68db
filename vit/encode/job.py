"""The encode job's wiring (:func:`run`): options -> checks made before any work -> inputs -> the loader's pieces ->
batches by patch budget -> the tower -> shards and the index.

Everything that can be known before encoding is checked first, each failure one :class:`EncodeError` naming the
option or file (exit status 2): the device, the output (written to once, by a probe file), the checkpoint, the input
paths named on the command line, a resumed folder's settings. Then the tower loads and the inputs stream through.
With ``--parallel data`` each rank encodes every ``world``-th remaining input with a whole tower and writes its own
shards; rank 0 writes the index of all of them. With ``--parallel weights`` every rank runs every batch on its share
of the weights and rank 0 writes. With ``--ray`` the same checks, resuming and index surround Ray Data's stages
(:mod:`.ray`) instead of this process's loader and encoder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from qvl.kernels import backend_for

from .errors import EXIT_RUNTIME, EncodeError
from .inputs import Input, discover, stamp
from .invariance import fixed_row_products
from .loader import Packer, Piece, load
from .options import FORMATS, EncodeOptions, default_workers
from .prepare import Preparer
from .progress import Progress, Timings, plural
from .tower import (
    BACKEND_NAMES,
    DTYPES,
    EMBEDDED_SEED,
    default_dtype,
    describe,
    load_tower,
    model_kind,
    resolve_checkpoint,
    resolve_device,
    with_options,
)
from .writer import (
    FeatureLayout,
    ShardWriter,
    check_format,
    check_output,
    check_resumable,
    index_name,
    merge_into_file,
    open_folder,
    read_shards,
    write_index,
)

__all__ = ["log", "run"]

Log = Callable[[str], None]


def log(message: str) -> None:
    """The job's messages: ``qvl: ...`` lines on stderr."""
    print(f"qvl: {message}", file=sys.stderr, flush=True)


def _quiet(message: str) -> None:
    """Ranks other than 0 print nothing."""


def _check_extras() -> None:
    try:
        import PIL  # noqa: F401
        import tqdm  # noqa: F401
    except ImportError as error:
        raise EncodeError(f"qvl encode needs pillow and tqdm ({error}); pip install 'qvl[hf]'") from None


def _check_format(options: EncodeOptions) -> None:
    """The output's format: ``--format`` agrees with a single file's suffix; Parquet needs pyarrow."""
    named = next((fmt for fmt in FORMATS if options.output.lower().endswith("." + fmt)), None)
    if options.format is not None and named is not None and options.format != named:
        raise EncodeError(f"--format {options.format}: --output {options.output} is a {named} file")
    if options.output_format == "parquet":
        try:
            import pyarrow.parquet  # noqa: F401
        except ImportError:
            raise EncodeError("--format parquet needs pyarrow; pip install 'qvl[data]'") from None


def run(options: EncodeOptions, log: Log = log) -> int:
    """Run one ``qvl encode`` job; returns the exit status. Raises :class:`EncodeError` (its ``status`` the exit
    status) for what the job cannot use or a failure that ends it. With ``options.parallel`` the process joins the
    process group a launcher (torchrun) describes, and leaves it at the end if it joined it."""
    _check_extras()
    _check_format(options)
    if options.ray is not None:
        from .ray import run as run_on_ray

        return run_on_ray(options, log)
    if options.parallel is None:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            # Each rank a launcher started would encode every input and write the same output.
            raise EncodeError("started by a launcher with several ranks but without --parallel (data or weights)")
        return _guarded(options, resolve_device(options.device), log)
    from ..parallel import init_from_env

    if "WORLD_SIZE" not in os.environ:
        raise EncodeError("--parallel needs the ranks of a launcher: torchrun --nproc-per-node N -m qvl.vit encode ...")
    joined = not dist.is_initialized()
    device = init_from_env(resolve_device(options.device))
    try:
        return _guarded(options, device, log)
    finally:
        if joined:
            dist.destroy_process_group()


def _guarded(options: EncodeOptions, device: torch.device, log: Log) -> int:
    try:
        return _Job(options, device, log).run()
    except torch.OutOfMemoryError:
        raise EncodeError(
            "out of memory (loading the tower or encoding); lower --budget or --max-pixels, or pick a 16-bit --dtype",
            status=EXIT_RUNTIME,
        ) from None


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


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _from_rank0(call: Callable[[], object], rank: int, world: int):
    """``call()`` run on rank 0 and its result (or its :class:`EncodeError`) handed to every rank, so that a failure
    there is raised everywhere instead of leaving the others waiting."""
    if world == 1:
        return call()
    box: list = [None]
    if rank == 0:
        try:
            box[0] = ("ok", call())
        except EncodeError as error:
            box[0] = ("error", (str(error), error.status))
    dist.broadcast_object_list(box, src=0)
    outcome, value = box[0]
    if outcome == "error":
        raise EncodeError(*value)
    return value


def _gathered(values: list, world: int) -> list:
    """Every rank's ``values``, concatenated in rank order."""
    if world == 1:
        return values
    every = [None] * world
    dist.all_gather_object(every, values)
    return [value for share in every for value in share]


def _entry(piece: Piece, keys: Sequence[str] = (), grid: list[int] | None = None, error: str | None = None) -> dict:
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


class _Job:
    def __init__(self, options: EncodeOptions, device: torch.device, log: Log):
        self.options, self.device = options, device
        self.rank, self.world = _world()
        self.log = log if self.rank == 0 else _quiet

    def run(self) -> int:
        options, device, log = self.options, self.device, self.log
        dtype = DTYPES[options.dtype or default_dtype(device)]
        try:
            backend = backend_for(device)
        except (RuntimeError, ValueError) as error:
            raise EncodeError(f"--device {device}: {error}") from None
        output = Path(options.output)
        folder = _from_rank0(lambda: check_output(output, options.single_file, options.resume), self.rank, self.world)
        model = None if options.model is None else resolve_checkpoint(options.model, log)
        kind, config, family, processing = model_kind(model)
        processing = with_options(processing, options)
        inputs = discover(options.inputs, options.videos, options.lists, options.image_column)
        if not inputs:
            raise EncodeError("no inputs (give image or video files, folders, --list FILE or --video PATH)")
        tower = None  # under --ray each tower actor loads its own
        if options.ray is None:
            tower = load_tower(model, dtype, device, "weights" if options.parallel == "weights" else None, kind)
            config = tower.config
        run_constants = constants(options, dtype, backend, config, processing)
        earlier = _from_rank0(lambda: self._resumed(folder, inputs, run_constants), self.rank, self.world)
        done = {entry["input"] for entry in earlier}
        remaining = [item for item in inputs if item.number not in done]
        share = remaining[self.rank :: self.world] if options.parallel == "data" else remaining

        if options.model is None:
            log(
                f"model: embedded random default ({describe(config, family)}; random weights, seed {EMBEDDED_SEED}: "
                "features carry no meaning; pass --model DIR or a Hub model id for a real checkpoint)"
            )
            log(f"images capped at {processing.max_pixels} pixels for the embedded tower (--max-pixels to change)")
        else:
            log(f"model: {options.model} ({describe(config, family)})")
        log(f"backend: {BACKEND_NAMES[backend]} on {device}, {run_constants['dtype']}")
        if earlier:
            log(f"resuming {folder}: {len(earlier)} of {plural(len(inputs), 'input')} already written")
        if options.compile and tower is not None:
            tower.compile()

        _from_rank0(lambda: open_folder(folder, options.single_file), self.rank, self.world)
        try:
            if tower is None:
                return self._encode_on_ray(config, processing, folder, inputs, share, earlier, run_constants)
            return self._encode(tower, processing, folder, inputs, share, earlier, run_constants)
        except BaseException:
            if options.single_file and self.rank == 0:  # its parts are of no use without the file
                shutil.rmtree(folder, ignore_errors=True)
            raise

    def _encode(self, tower, processing, folder, inputs, share, earlier, run_constants) -> int:
        """This rank's share through the loader, the tower and the writer, then the index (or the single file)."""
        options, device = self.options, self.device
        writes = self.rank == 0 or options.parallel == "data"
        writer = ShardWriter(folder, f"r{self.rank}", run_constants, options.shard_bytes, options.shard_inputs,
                             options.output_format, _layout(tower.config, tower_dtype(tower)))  # fmt: skip
        # The tower runs on torch's intra-op threads in this process (their count is never set here; DataLoader
        # sets its workers' to 1): the default leaves the tower the cores it runs on, on a CPU.
        workers = default_workers(device.type, torch.get_num_threads()) if options.workers is None else options.workers
        # An image fills every temporal slot with one frame: both tower kinds take it once (folded rows, their patch
        # embedding's temporal slices summed), half the pixel values and half the embedding's work.
        fold = tower.config.temporal_patch_size > 1
        encoder = _Encoder(tower, writer if writes else None, processing, device, not options.compile, fold)
        progress = Progress(len(share), enabled=options.progress and self.rank == 0)
        start = time.perf_counter()
        try:
            with torch.no_grad():
                pieces = load(share, processing, options.budget, device, workers, fold)
                encoder.encode(pieces, options, progress, self.log)
            writer.close()
        finally:
            progress.close()
        entries = _gathered(writer.entries if writes else [], self.world)
        elapsed = time.perf_counter() - start
        timings = encoder.timings
        timings.write += writer.seconds
        return self._finish(folder, inputs, earlier + entries, entries, elapsed, timings, workers)

    def _encode_on_ray(self, config, processing, folder, inputs, share, earlier, run_constants) -> int:
        """The remaining inputs through Ray Data's stages (:mod:`.ray`), then the index built from the shards."""
        from . import ray as on_ray

        options = self.options
        actors, actor_cpus = on_ray.sizing(options, self.device.type)
        options = dataclasses.replace(options, ray_actors=actors, ray_actor_cpus=actor_cpus)
        dtype = run_constants["dtype"]
        settings = on_ray.settings(options, folder, run_constants, processing, config, dtype, self.device.type)
        self.log(
            f"Ray: {plural(actors, 'tower actor')} ({plural(actor_cpus, 'CPU')}"
            f"{', 1 GPU' if self.device.type == 'cuda' else ''} each), decoding and preparation in tasks of 1 CPU,"
            f" shards of {plural(settings.group, 'input')}"
        )
        progress = Progress(len(share), enabled=options.progress)
        start = time.perf_counter()
        try:
            written, timings = on_ray.encode(settings, share, actors, actor_cpus, progress, self.log)
        finally:
            progress.close()
        elapsed = time.perf_counter() - start
        for leftover in folder.glob(".shard-*.tmp"):  # a killed writer's: its group was written again
            leftover.unlink(missing_ok=True)
        # The index is the shards': every input in exactly one of them.
        every, _ = read_shards(folder)
        numbers = [entry["input"] for entry in every]
        if len(numbers) != len(set(numbers)):
            twice = sorted({number for number in numbers if numbers.count(number) > 1})[:5]
            raise EncodeError(f"{folder}: inputs {twice} are in two shards (a folder two runs wrote into at once?)")
        written_numbers = {entry["input"] for entry in written}
        entries = [entry for entry in every if entry["input"] in written_numbers]
        where = "in Ray tasks"
        prepared = where if self.device.type == "cpu" else f"on {self.device} in the tower actors"
        note = f", on Ray: {plural(actors, 'tower actor')}"
        return self._finish(folder, inputs, every, entries, elapsed, timings, 0, (where, prepared), note)

    def _resumed(self, folder: Path, inputs: list[Input], run_constants: dict[str, str]) -> list[dict]:
        """The entries a resumed folder already holds (none without --resume), each checked against the input of
        its number: same path, same size and modification time."""
        if not self.options.resume or not folder.is_dir():
            return []
        check_format(folder, self.options.output_format)
        entries, constants = read_shards(folder)
        check_resumable(constants, run_constants, folder)
        for entry in entries:
            number = entry["input"]
            item = inputs[number] if number < len(inputs) else None
            if item is None or item.source != entry["source"]:
                raise EncodeError(
                    f"{folder}: its input {number} was {entry['source']}, this run's is"
                    f" {item.source if item else 'missing'} (--resume needs the same inputs in the same order)"
                )
            now = stamp(item)
            if entry["error"] is None and now is not None and entry["size"] is not None:
                if (now["size"], now["mtime_ns"]) != (entry["size"], entry["mtime_ns"]):
                    raise EncodeError(f"{item.source}: changed since it was encoded into {folder} (size or time)")
        return entries

    def _finish(self, folder, inputs, every, entries, elapsed, timings, workers, where=None, note="") -> int:
        """Rank 0 writes the index (or merges the single file) and reports; every rank raises where nothing at all
        could be encoded. ``where``: where decoding and preparation ran (default: the loader's ``workers``)."""
        options, log = self.options, self.log
        encoded = [entry for entry in entries if entry["error"] is None]
        skipped = [entry for entry in every if entry["error"] is not None]
        if self.rank == 0:
            if options.single_file:
                tensors = merge_into_file(folder, Path(options.output), len(inputs))
                unit = "row" if options.output_format == "parquet" else "tensor"
                wrote = f"wrote {options.output} ({plural(tensors, unit)})"
            else:
                write_index(folder, every, options.output_format)
                index = folder / index_name(options.output_format)
                wrote = f"wrote {folder}: {plural(len(every), 'input')} in the index ({index})"
            patches = sum(grid[0] * grid[1] * grid[2] for grid in (entry["grid_thw"] for entry in encoded))
            videos = sum(entry["kind"] == "video" for entry in encoded)
            included = "decoding and torch.compile's compilation included" if options.compile else "decoding included"
            rate = len(encoded) / elapsed if elapsed > 0 else 0.0
            log(
                f"encoded {plural(len(encoded) - videos, 'image')}, {plural(videos, 'video')} ({patches} patches) in"
                f" {elapsed:.2f} s, {included}: {rate:.2f} inputs/s, {patches / elapsed if elapsed else 0:.0f}"
                " patches/s"
            )
            if where is None:
                decoded = f"in {plural(workers, 'worker process')}" if workers else "in this process"
                where = decoded, decoded if self.device.type == "cpu" else f"on {self.device}"
            log(f"time: {timings.summary(*where)}")
            if skipped:
                log(f"skipped {plural(len(skipped), 'input')} (listed in the output with the reasons)")
            log(wrote + (f", {options.parallel}-parallel over {self.world} ranks" if options.parallel else "") + note)
        if not any(entry["error"] is None for entry in every):
            raise EncodeError(f"no input could be encoded ({plural(len(skipped), 'input')} skipped)")
        return 0


def _layout(config, dtype: torch.dtype) -> FeatureLayout:
    """The features of a tower of ``config`` computed in ``dtype`` (a Parquet shard's columns)."""
    names = ("merged", *(f"deepstack.{j}" for j in range(len(config.deepstack_visual_indexes))))
    return FeatureLayout(names, config.out_hidden_size, dtype)


def tower_dtype(tower) -> torch.dtype:
    """The dtype ``tower``'s weights (and so its features) are in."""
    return next(tower.parameters()).dtype


class _Encoder:
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
            self.writer.add(_entry(piece, error=piece.failure), {})
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
            self.writer.add(_entry(piece, sorted(tensors), [steps, height, width]), tensors)
        self.progress.update(1, steps * height * width)
