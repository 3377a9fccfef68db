"""``qvl encode --ray``: the encode job's stages on Ray Data, for a data set on more than one machine (or one).

The stages are the single process's (:mod:`.loader`'s decoding and preparation, :mod:`.job`'s encoder with its
token-budget packing, :mod:`.writer`'s shards), each one ``map_batches`` call over a :class:`ray.data.Dataset` whose
rows are **groups** of inputs (:func:`read_inputs`): a group is decided by the driver before anything is read (the
remaining inputs, in order, ``--shard-inputs`` at a time), travels whole through every stage and becomes exactly one
shard, named after its inputs (:func:`group_name`). So:

- :func:`prepare` (CPU tasks, one CPU each): decodes a group's inputs and, for a CPU tower, prepares them (for a GPU
  tower the uint8 pixels go on, prepared on the device by the actor), as the loader's workers do;
- :class:`Tower` (an actor pool, ``concurrency`` actors: one per GPU with ``num_gpus=1``; on a CPU, actors of
  ``--ray-actor-cpus`` CPUs and as many torch threads): loads the checkpoint once in ``__init__`` and encodes each
  group with the single process's encoder (:class:`qvl.vit.encode.encoder.Encoder`): the same packing by ``--budget``
  and ``--batch-size``, the same fixed-height product tiles on a CPU (:mod:`.invariance`), so that every input's
  features are bitwise those of a single-process run on the same device, dtype and thread count, whatever groups and
  batches Ray forms;
- :func:`write` (CPU tasks): writes each group's shard atomically (:func:`qvl.vit.encode.writer.write_shard`: a
  temporary name, then a rename) under its group's name, and returns its index entries.

A lost worker is Ray's to recover: Ray Data retries a task whose process died (tasks' ``max_retries``) and restarts
an actor (``max_restarts``, ``max_task_retries``), Ray Data's defaults. A retried group is computed again to the same
bits and written again under the same name, so every input is written exactly once; the index (``index.jsonl``) is
built from the shard files at the end, and ``--resume`` reads the shards as it does for a single-process run, so a
rerun encodes only the inputs no shard holds.

For a Ray user: :func:`settings_for` (an :class:`~qvl.vit.encode.options.EncodeOptions` -> the stages' settings),
:func:`read_inputs`, and :func:`prepare_stage`, :func:`tower_stage`,
:func:`write_stage` (each one ``map_batches`` call, with :func:`prepare`, :class:`Tower` and :func:`write`), in
between which a pipeline may add its own. Ray comes with the ``data`` extra (``pip install 'qvl[data]'``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import pickle
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from ..processing import Processing
from .errors import EncodeError
from .inputs import Input
from .options import DEFAULT_RAY_GROUP, EncodeOptions

__all__ = [
    "RaySettings",
    "Tower",
    "connect",
    "group_name",
    "prepare",
    "prepare_stage",
    "read_inputs",
    "settings",
    "settings_for",
    "tower_stage",
    "write",
    "write_stage",
]


def _ray():
    try:
        import ray
        import ray.data
    except ImportError:
        raise EncodeError("--ray needs Ray Data; pip install 'qvl[data]'") from None
    return ray


def connect(address: str | None = None, num_cpus: int | None = None) -> None:
    """Join the Ray cluster at ``address`` (``auto``, ``ray://HOST:10001``, ``HOST:6379``), or start one on this
    machine with ``num_cpus`` CPUs (None: every core) where ``address`` is empty or None. A Ray already initialized
    in this process (a user's ``ray.init(...)``) is used as it is. Ray's and Ray Data's logs are kept to warnings; the
    job draws its own progress."""
    ray = _ray()
    if not ray.is_initialized():
        if address and num_cpus is not None:
            raise EncodeError(f"--ray-cpus: sets the CPUs of a Ray started here, not of the cluster at {address}")
        try:
            if address:
                ray.init(address=address, logging_level=logging.WARNING)
            else:
                ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING)
        except (ConnectionError, RuntimeError, ValueError) as error:
            where = f"the Ray cluster at {address}" if address else "a local Ray"
            raise EncodeError(f"--ray: cannot start or join {where} ({str(error).splitlines()[0]})") from None
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    context.print_on_execution_start = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)  # "progress bars disabled"


@dataclasses.dataclass(frozen=True)
class RaySettings:
    """What every stage needs, resolved once by the driver (:func:`settings`) and handed to each task and actor.

    Attributes:
        model: the checkpoint directory or Hub id (each actor resolves it: a Hub id is fetched into each node's
            cache); None: the embedded tower.
        dtype, device: the tower's (``"cpu"`` or ``"cuda"``: an actor's own GPU).
        backend: the qvl path the run's constants name (the driver's: :func:`qvl.kernels.backend_for`, or the one
            it forced); an actor whose own default differs runs under ``force_backend(backend)``.
        compile: torch.compile the tower in each actor.
        processing: the checkpoint's preparation with the run's overrides.
        fold: prepare images folded (the tower takes an image's frame once).
        budget, batch_size: the packing of each group's pieces into forwards (:class:`~qvl.vit.encode.loader.Packer`).
        threads: torch threads of each actor on a CPU (None: Ray's setting for the actor, its CPUs).
        folder: where the shards go; fmt: their format; run: the run's constants written into each; layout: the
            features' names, width and dtype (a Parquet shard's schema).
        group: inputs per group (per shard).
        cwd: the driver's working directory, which relative input paths are read from (their sources stay as
            given).
    """

    model: str | None
    dtype: str
    device: str
    backend: str
    compile: bool
    processing: Processing
    fold: bool
    budget: int
    batch_size: int | None
    threads: int | None
    folder: str
    fmt: str
    run: dict
    layout: object
    group: int = DEFAULT_RAY_GROUP
    cwd: str = ""


def settings(
    options: EncodeOptions, folder: Path, run: dict, processing: Processing, config, dtype: str, device: str
) -> RaySettings:
    """The stages' settings of a run of ``options`` writing into ``folder`` (the job's checks done: the checkpoint's
    ``config``, its ``processing`` with the overrides, the run's constants ``run``)."""
    from .writer import FeatureLayout

    names = ("merged", *(f"deepstack.{j}" for j in range(len(config.deepstack_visual_indexes))))
    layout = FeatureLayout(names, config.out_hidden_size, _torch_dtype(dtype))
    return RaySettings(
        model=options.model,
        dtype=dtype,
        device=device,
        backend=run["backend"],
        compile=options.compile,
        processing=processing,
        fold=config.temporal_patch_size > 1,
        budget=options.budget,
        batch_size=options.batch_size,
        threads=options.ray_actor_cpus if device == "cpu" else None,
        folder=str(Path(folder).resolve()),
        fmt=options.output_format,
        run=dict(run),
        layout=layout,
        group=options.shard_inputs or DEFAULT_RAY_GROUP,
        cwd=os.getcwd(),
    )


def settings_for(options: EncodeOptions, folder: Path | str, device: str = "cpu") -> RaySettings:
    """The stages' settings of a run of ``options`` (its model, preparation overrides, dtype, budget, format, group
    size) on ``device`` (``"cpu"`` or ``"cuda"``) writing into ``folder``, for a Ray user composing the stages: the
    checkpoint's config and preparation read (a Hub id fetched), the run's constants as ``qvl encode`` writes them
    (so that ``qvl encode --resume`` continues such a folder). The folder is not checked nor created here."""
    from qvl.kernels import backend_for

    from .encoder import constants
    from .tower import default_dtype, model_kind, resolve_checkpoint, with_options

    model = None if options.model is None else resolve_checkpoint(options.model, _quiet)
    _, config, _, processing = model_kind(model)
    processing = with_options(processing, options)
    dtype = options.dtype or (default_dtype(torch.device(device)) if device == "cpu" else "bfloat16")
    backend = backend_for(torch.device(device))
    run = constants(options, _torch_dtype(dtype), backend, config, processing)
    return settings(options, Path(folder), run, processing, config, dtype, device)


def _torch_dtype(name: str) -> torch.dtype:
    from .tower import DTYPES

    return DTYPES[name]


def group_name(numbers: Sequence[int]) -> str:
    """The shard name (without suffix) of the group of inputs ``numbers``: its first input, its size and a digest of
    all of them, so a group gets the same name on every attempt and two groups never share one."""
    digest = hashlib.sha1(",".join(map(str, numbers)).encode()).hexdigest()[:12]
    return f"shard-g{numbers[0]:09d}-{len(numbers)}-{digest}"


def groups(inputs: Sequence[Input], size: int) -> list[list[Input]]:
    """``inputs`` (in order) ``size`` at a time."""
    return [list(inputs[start : start + size]) for start in range(0, len(inputs), size)]


def read_inputs(inputs: Sequence[Input], group: int = DEFAULT_RAY_GROUP):
    """A :class:`ray.data.Dataset` of ``inputs`` (:func:`qvl.vit.encode.inputs.discover`'s records, numbered) in
    groups of ``group``: one row, and one block, per group: ``{"group": its shard name, "inputs": the pickled
    records}``."""
    ray = _ray()
    rows = [{"group": group_name([item.number for item in share]), "inputs": pickle.dumps(share)}
            for share in groups(inputs, group)]  # fmt: skip
    return ray.data.from_items(rows, override_num_blocks=max(1, len(rows)))


def _each(batch: dict, column: str):
    return [batch[column][index] for index in range(len(batch["group"]))]


def _absolute(item: Input, cwd: str) -> Input:
    """``item`` with its files' paths made absolute from ``cwd`` (a task's working directory may be another)."""
    if not cwd:
        return item

    def full(path: str) -> str:
        return path if os.path.isabs(path) else os.path.join(cwd, path)

    member = item.member and dataclasses.replace(item.member, path=full(item.member.path))
    source = item.source if item.member is not None else full(item.source)
    return dataclasses.replace(item, source=source, frames=tuple(map(full, item.frames)), member=member)


def prepare(batch: dict, settings: RaySettings) -> dict:
    """``map_batches`` function: each group's inputs decoded and (for a CPU tower) prepared, as the loader's workers
    do it (:class:`~qvl.vit.encode.loader.PieceStream`): ``{"group", "pieces": the pickled pieces, "seconds":
    [decoding, preparation]}``."""
    from .loader import PieceStream
    from .prepare import Preparer

    preparer = Preparer(settings.processing, "cpu", settings.fold) if settings.device == "cpu" else None
    stream = PieceStream([], settings.processing, settings.budget, preparer)
    pieces_out, seconds = [], []
    for payload in _each(batch, "inputs"):
        pieces = [dataclasses.replace(piece, item=item) for item in pickle.loads(payload)
                  for piece in stream.pieces(_absolute(item, settings.cwd))]  # fmt: skip
        seconds.append([sum(piece.decode_s for piece in pieces), sum(piece.prepare_s for piece in pieces)])
        pieces_out.append(pickle.dumps(pieces, protocol=5))
    return {"group": batch["group"], "pieces": np.array(pieces_out, dtype=object), "seconds": np.array(seconds)}


class _Collected:
    """The encoder's writer in an actor: the entries and features it would write, kept for the write stage."""

    def __init__(self):
        self.items: list[tuple[dict, dict[str, torch.Tensor]]] = []

    def add(self, entry: dict, tensors: dict[str, torch.Tensor]) -> None:
        self.items.append((entry, tensors))


def _quiet(message: str) -> None:
    """An actor prints nothing: the driver reports the skipped inputs from the index entries."""


class Tower:
    """``map_batches`` callable class (an actor pool): the tower, loaded once per actor, encoding each group's
    pieces with the single process's encoder and packing: ``{"group", "features": the pickled (entry, tensors) per
    input, "seconds": [decoding, preparation, tower]}``; ``settings`` given as ``fn_constructor_kwargs``."""

    def __init__(self, settings: RaySettings):
        from qvl.kernels import backend_for

        from .tower import load_tower, model_kind, resolve_checkpoint

        if settings.threads is not None:
            torch.set_num_threads(settings.threads)
        self.settings = settings
        self.device = torch.device(settings.device)
        model = None if settings.model is None else resolve_checkpoint(settings.model, _quiet)
        kind = model_kind(model)[0]
        self.tower = load_tower(model, _torch_dtype(settings.dtype), self.device, None, kind)
        if settings.compile:
            self.tower.compile()
        # The encoder's options: its packing (budget, batch size).
        self.options = EncodeOptions(budget=settings.budget, batch_size=settings.batch_size, progress=False)
        self.backend = None if backend_for(self.device) == settings.backend else settings.backend

    def __call__(self, batch: dict) -> dict:
        from qvl.kernels import force_backend

        from .encoder import Encoder
        from .progress import Progress

        settings = self.settings
        features, seconds = [], []
        for payload, (decode_s, prepare_s) in zip(_each(batch, "pieces"), _each(batch, "seconds"), strict=True):
            collected = _Collected()
            encoder = Encoder(self.tower, collected, settings.processing, self.device, not settings.compile,
                               settings.fold)  # fmt: skip
            progress = Progress(0, enabled=False)
            with torch.no_grad(), force_backend(self.backend) if self.backend else contextlib.nullcontext():
                encoder.encode(iter(pickle.loads(payload)), self.options, progress, _quiet)
            progress.close()
            timings = encoder.timings
            features.append(pickle.dumps(collected.items, protocol=5))
            seconds.append([decode_s, prepare_s + timings.prepare, timings.tower])
        return {"group": batch["group"], "features": np.array(features, dtype=object), "seconds": np.array(seconds)}


def write(batch: dict, settings: RaySettings) -> dict:
    """``map_batches`` function: each group's shard written atomically under its group's name (the same name on a
    retry: written once, whatever Ray retried): ``{"group", "entries": their JSON, "seconds": [decoding,
    preparation, tower, writing]}``."""
    from .writer import SHARD_SUFFIXES, write_shard

    folder, suffix = Path(settings.folder), SHARD_SUFFIXES[settings.fmt]
    entries_out, seconds = [], []
    for name, payload, earlier in zip(_each(batch, "group"), _each(batch, "features"), _each(batch, "seconds"),
                                      strict=True):  # fmt: skip
        start = time.perf_counter()
        items = pickle.loads(payload)
        tensors = {key: tensor for _, features in items for key, tensor in features.items()}
        entries = write_shard(folder / f"{name}{suffix}", [entry for entry, _ in items], tensors, settings.run,
                              settings.layout)  # fmt: skip
        entries_out.append(json.dumps(entries))
        seconds.append([*earlier, time.perf_counter() - start])
    return {"group": batch["group"], "entries": np.array(entries_out, dtype=object), "seconds": np.array(seconds)}


def prepare_stage(dataset, settings: RaySettings, num_cpus: float = 1):
    """``dataset`` (:func:`read_inputs`) -> decoded and prepared groups: :func:`prepare` as tasks of ``num_cpus``
    CPUs each, one group a call (Ray runs as many at once as CPUs are free)."""
    return dataset.map_batches(prepare, fn_kwargs={"settings": settings}, batch_size=1, num_cpus=num_cpus)


def tower_stage(dataset, settings: RaySettings, actors: int = 1, num_cpus: float = 1, num_gpus: float | None = None):
    """Prepared groups -> encoded groups: :class:`Tower` in a pool of ``actors`` actors of ``num_cpus`` CPUs and
    ``num_gpus`` GPUs each (default: 1 GPU each where ``settings.device`` is cuda), one group a call.

    The actors' environment sets their OpenMP threads (a CPU tower's torch threads, ``settings.threads``, else their
    CPUs); being other remote arguments than the preparation's, it also keeps Ray Data from fusing the preparation
    into the actors (which it does with a task stage of the same resources): decoding stays in CPU tasks."""
    ray = _ray()
    gpus = (1 if settings.device == "cuda" else 0) if num_gpus is None else num_gpus
    threads = settings.threads or max(1, int(num_cpus))
    environment = {"env_vars": {"OMP_NUM_THREADS": str(threads), "QVL_ENCODE_STAGE": "tower"}}
    return dataset.map_batches(Tower, fn_constructor_kwargs={"settings": settings}, batch_size=1,
                               compute=ray.data.ActorPoolStrategy(size=actors), num_cpus=num_cpus, num_gpus=gpus,
                               runtime_env=environment)  # fmt: skip


def write_stage(dataset, settings: RaySettings, num_cpus: float = 1):
    """Encoded groups -> their shards written, one row of index entries per group: :func:`write` as tasks."""
    return dataset.map_batches(write, fn_kwargs={"settings": settings}, batch_size=1, num_cpus=num_cpus)


# ---------------------------------------------------------------------------------------------------------------
# The command line's run (qvl encode --ray): the job's checks and index around the stages above.


def cluster_device(options: EncodeOptions) -> str:
    """The run's device: ``--device`` (cpu, or cuda: each actor's own GPU), else cuda where the cluster has GPUs."""
    ray = _ray()
    gpus = ray.cluster_resources().get("GPU", 0)
    if options.device is None:
        return "cuda" if gpus > 0 else "cpu"
    if options.device not in ("cpu", "cuda"):
        raise EncodeError(f"--device {options.device}: under --ray, cpu or cuda (each tower actor gets its own GPU)")
    if options.device == "cuda" and gpus == 0:
        raise EncodeError("--device cuda: the Ray cluster has no GPU")
    return options.device


def sizing(options: EncodeOptions, device: str) -> tuple[int, int]:
    """``(actors, CPUs per actor)`` for the cluster: ``--ray-actors`` (default: one per GPU; on a CPU, one) and
    ``--ray-actor-cpus`` (default: 1 beside a GPU; on a CPU, half the cluster's CPUs over the actors, at least 1).
    Raises :class:`EncodeError` where the actors would leave no CPU for decoding or want more GPUs than there are."""
    resources = _ray().cluster_resources()
    cpus, gpus = int(resources.get("CPU", 0)), int(resources.get("GPU", 0))
    actors = options.ray_actors or (gpus if device == "cuda" else 1)
    if device == "cuda" and actors > gpus:
        raise EncodeError(f"--ray-actors {actors}: the Ray cluster has {gpus} GPUs (one tower actor per GPU)")
    per_actor = options.ray_actor_cpus or (1 if device == "cuda" else max(1, cpus // 2 // actors))
    if actors * per_actor >= cpus:
        raise EncodeError(
            f"--ray-actors {actors} x --ray-actor-cpus {per_actor}: the Ray cluster has {cpus} CPUs, none left to"
            " decode and prepare (lower either)"
        )
    return actors, per_actor


def encode(
    stage_settings: RaySettings,
    share: Sequence[Input],
    actors: int,
    actor_cpus: int,
    progress,
    log: Callable[[str], None],
):
    """``share`` through the stages; returns the index entries written and the seconds per stage (summed over the
    groups: decoding, preparation, tower, writing). Each skipped input is logged as the single process logs it."""
    from .progress import Timings

    timings, entries = Timings(), []
    if not share:  # a resumed run with nothing left
        return entries, timings
    dataset = read_inputs(share, stage_settings.group)
    dataset = prepare_stage(dataset, stage_settings)
    dataset = tower_stage(dataset, stage_settings, actors=actors, num_cpus=actor_cpus)
    dataset = write_stage(dataset, stage_settings)
    for row in _rows(dataset):
        written = json.loads(row["entries"])
        decode_s, prepare_s, tower_s, write_s = (float(value) for value in row["seconds"])
        timings.decode += decode_s
        timings.prepare += prepare_s
        timings.tower += tower_s
        timings.write += write_s
        for entry in written:
            if entry["error"] is not None:
                log(f"skipped {entry['source']}: {entry['error']}")
        patches = sum(t * h * w for t, h, w in (entry["grid_thw"] for entry in written if entry["grid_thw"]))
        progress.update(len(written), patches)
        entries += written
    return entries, timings


def _rows(dataset):
    """The rows of ``dataset`` as they are written; a stage's own :class:`EncodeError` (a checkpoint an actor could
    not load, an output that cannot be written) raised as it is."""
    ray = _ray()
    try:
        yield from dataset.iter_rows()
    except ray.exceptions.RayError as error:
        cause = error
        while cause is not None and not isinstance(cause, EncodeError):
            cause = getattr(cause, "cause", None) or cause.__cause__
        if isinstance(cause, EncodeError):
            raise EncodeError(str(cause), cause.status) from None
        raise


def dtype_on(device: str, dtype: str | None) -> str:
    """``--dtype``, else the device's default: a GPU's is asked of one of the cluster's GPUs."""
    if dtype is not None:
        return dtype
    if device == "cpu":
        return "float32"
    from .tower import default_dtype

    probe = _ray().remote(num_gpus=1)(lambda: default_dtype(torch.device("cuda")))
    return _ray().get(probe.remote())
