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

import dataclasses
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from qvl.kernels import backend_for

from .encoder import Encoder, Log, constants
from .errors import EXIT_RUNTIME, EncodeError, require_pyarrow
from .inputs import Input, discover, stamp
from .loader import load
from .options import FORMATS, EncodeOptions, default_workers
from .progress import Progress, plural
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
        require_pyarrow("--format parquet")


def run(options: EncodeOptions, log: Log = log) -> int:
    """Run one ``qvl encode`` job; returns the exit status. Raises :class:`EncodeError` (its ``status`` the exit
    status) for what the job cannot use or a failure that ends it. With ``options.parallel`` the process joins the
    process group a launcher (torchrun) describes, and leaves it at the end if it joined it."""
    _check_extras()
    _check_format(options)
    if options.ray is not None:
        return _run_on_ray(options, log)
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


def _run_on_ray(options: EncodeOptions, log: Log) -> int:
    """``qvl encode --ray``: Ray joined or started, the device and dtype found on the cluster, then the job's checks,
    index and report with Ray Data's stages as its encoder (:mod:`.ray`)."""
    from . import ray as on_ray

    if options.parallel is not None:
        raise EncodeError("--ray and --parallel: Ray runs the tower actors itself (give one of them)")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise EncodeError("--ray: started by a launcher with several ranks; start it once, Ray places the work")
    on_ray.connect(options.ray or None, options.ray_cpus)
    device = on_ray.cluster_device(options)
    options = dataclasses.replace(options, dtype=on_ray.dtype_on(device, options.dtype))
    return _guarded(options, torch.device(device), log)


def _guarded(options: EncodeOptions, device: torch.device, log: Log) -> int:
    try:
        return _Job(options, device, log).run()
    except torch.OutOfMemoryError:
        raise EncodeError(
            "out of memory (loading the tower or encoding); lower --budget or --max-pixels, or pick a 16-bit --dtype",
            status=EXIT_RUNTIME,
        ) from None


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
        encoder = Encoder(tower, writer if writes else None, processing, device, not options.compile, fold)
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
