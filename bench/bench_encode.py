"""``qvl encode`` against transformers: preparation alone, 16 photos end to end, and the time per photo once running.

    python -m bench.bench_encode [--threads 1] [--repeats 5] [--sizes NAME=WxH ...] [--video-seconds 30]
                                 [--photos 16] [--photo-size 1920x1080] [--towers tiny demo] [--rounds 3]
                                 [--steady-state 16 48 [--encode-workers 1]] [--json PATH]
    python -m bench.bench_encode --device cuda [--dtype bfloat16] [--photos 16] [--photo-size WxH] [--rounds 2]
                                 [--json PATH]
    python -m bench.bench_encode --ray 16 64 [--ray-cpus N ...] [--device cpu|cuda] [--photo-size WxH]
                                 [--towers tiny] [--rounds 2] [--json PATH]

**Preparation** (:func:`preparation_rows`): one photo (decoded pixels in, pixel values out; no decoding, no tower) at
1920x1080 and 4000x3000, with the Qwen3-VL checkpoints' processor settings (a 1920x1080 photo keeps its size: 68x120
patches), by

* ``qvl``: :class:`qvl.vit.encode.prepare.Preparer` on the CPU (torch), transformers' rows (each patch written once per
  temporal slot);
* ``qvl folded``: the same with ``fold_images``, each patch written once (the rows ``qvl encode`` gives the towers'
  folded patch embedding);
* ``transformers PIL``: ``Qwen2VLImageProcessorPil`` given the decoded PIL image (what ``qvl encode`` ran before);
* ``transformers torchvision``: ``Qwen2VLImageProcessor`` given the pixel array, where torchvision imports.

and (:func:`video_rows`) the frames Qwen3-VL samples from a ``--video-seconds`` 30 fps 1280x720 video (2 a second: 60
for 30 s), decoded, by ``qvl`` (``Preparer.video``) and ``transformers torchvision`` (``Qwen3VLVideoProcessor``, given
the frame array with its sampling off). torch runs on ``--threads`` threads (1: the time per core; transformers' PIL
path is single-threaded whatever the setting). Each implementation runs once to warm up, then ``--repeats`` times;
the median is reported, with its speed-up over the PIL processor (photos) or transformers' video processor.

**End to end** (:func:`end_to_end_rows`): ``--photos`` JPEG photos of ``--photo-size`` in a folder, and a checkpoint
directory (random weights; Qwen3-VL's preprocessor_config.json) per ``--towers`` shape: ``tiny`` (depth 2, hidden 64,
2 heads: the pipeline's cost, the tower's small beside it) and ``demo`` (``qvl encode``'s embedded tower, depth 4,
hidden 256: a 1920x1080 photo's 8,160-token attention dominates). ``qvl encode``: ``python -m qvl.vit encode FOLDER
--model DIR -o OUT`` on the torch path, timed from process start to exit (imports, loading, decoding in its worker,
writing the shards all included). transformers, in this process with the tower already built (its import and load not
timed): per photo, ``Image.open``, the processor (PIL, then torchvision backend) and ``Qwen3VLVisionModel`` (SDPA) on
the same weights under ``torch.inference_mode``, on torch's default threads as ``qvl encode``; and ``transformers
tower alone``, the same tower on the inputs the PIL processor prepared beforehand (not timed): the least any encode
whose tower costs the same can take, process start aside, and the ceiling on its speed-up. They take turns for
``--rounds`` rounds, each keeping its best time. Each row's ``qvl speed-up`` is its time over ``qvl encode``'s;
``max rel err`` is its first photo's merged features against qvl's; ``qvl encode``'s own count of its encoding (from
its first input to its last write) and where that time went are printed below the table.

**Steady state** (``--steady-state FEW MANY``, :func:`steady_state_rows`): the time per photo once running, what a
data set's run costs a photo: FEW, then MANY photos of ``--photo-size`` through ``qvl encode`` (a process, as above, on
its default ``--workers``, and with each ``--encode-workers N``) and through transformers' processors + tower (as
above, in this process), and ``(MANY's time - FEW's) / (MANY - FEW)``: the process start, imports, loading and
warm-up drop out. Each row's ``qvl speed-up`` is its time per photo over ``qvl encode``'s (at least 1: ``qvl
encode``'s steady rate is at least its). The runs take turns for ``--rounds`` rounds, each keeping its best.

**On a GPU** (``--device``, :func:`device_rows`): ``--photos`` photos through ``qvl encode --device`` (decoding in
its workers, preparation on the device) with a random-weight tower of Qwen3-VL 8B's shape, against the same tower
alone on the same inputs, prepared beforehand and packed into the same batches: whether preparation hides behind
the tower (the goal: ``qvl encode``'s own count at most 1.2x the tower alone's time), and images/s of each. Its
``--json`` is a report ``bench.goals`` reads.

**On Ray** (``--ray FEW MANY``, :func:`ray_rows`): FEW, then MANY photos through ``qvl encode`` in one process (its
default ``--workers``) and through ``qvl encode --ray --ray-cpus N`` (a local Ray of N CPUs started by the process:
decoding and preparation in Ray tasks, one tower actor), for each ``--ray-cpus`` N (default: every core), each a
process timed from start to exit, on ``--device`` (cpu by default; on a GPU the actor holds it and N - 1 CPUs
decode). As for the steady state, the time per photo is ``(MANY's time - FEW's) / (MANY - FEW)``; the rows also give
what Ray adds per photo over the single process and the time a run pays once (``FEW's time - FEW x the time per
photo``: process and Ray start, actor start and checkpoint load). Where Ray is not installed the rows are skipped
with one line (``pip install 'qvl[data]'``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from .goals import ENCODE_VS_TOWER

PHOTO_SIZES = {"1920x1080": (1080, 1920), "4000x3000": (3000, 4000)}


def synthetic_photo(height: int, width: int, seed: int = 0) -> np.ndarray:
    """A photo-like ``(height, width, 3)`` uint8 image: smooth colour gradients with sensor-like noise (resampling
    costs the same for any content; this keeps the values in a photo's range)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    channels = [127 + 100 * np.sin(x / (97 + 31 * c) + y / (131 + 17 * c) + c) for c in range(3)]
    image = np.stack(channels, axis=-1) + rng.normal(0, 6, (height, width, 3)).astype(np.float32)
    return np.clip(image, 0, 255).astype(np.uint8)


def _median_seconds(run: Callable[[], object], repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _qwen3_vl_processing(image: dict | None = None):
    """qvl's preparation of a Qwen3-VL checkpoint whose preprocessor_config.json is ``image`` (None: none, transformers'
    defaults)."""
    from qvl.vit import families

    family = next(f for f in families.FAMILIES if f.name == "Qwen3-VL")
    return family.processing.for_checkpoint(family.config_class.from_dict({}, **family.config_options), image)


def _torchvision_image_processor(options: dict):
    """transformers' torchvision-backed image processor, or None where torchvision does not import."""
    try:
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

        return Qwen2VLImageProcessor(**options)
    except (ImportError, RuntimeError):  # no torchvision, or one built for another torch
        return None


def _implementations(photo: np.ndarray) -> dict[str, Callable[[], object]]:
    from PIL import Image
    from transformers import Qwen2VLImageProcessorPil

    from qvl.vit.encode.prepare import Preparer

    processing = _qwen3_vl_processing()
    options = processing.image_processor_options()
    preparer, pixels = Preparer(processing, "cpu"), torch.from_numpy(photo)
    folding = Preparer(processing, "cpu", fold_images=True)
    pil_processor, pil_image = Qwen2VLImageProcessorPil(**options), Image.fromarray(photo)
    runs = {
        "qvl": lambda: preparer.image(pixels),
        "qvl folded": lambda: folding.image(pixels),
        "transformers PIL": lambda: pil_processor(images=[pil_image], return_tensors="pt"),
    }
    torchvision_processor = _torchvision_image_processor(options)
    if torchvision_processor is not None:
        runs["transformers torchvision"] = lambda: torchvision_processor(images=[photo], return_tensors="pt")
    return runs


def _timed_rows(cases: dict[str, dict[str, Callable[[], object]]], baseline: str, threads: int, repeats: int):
    """Rows of ``size``, ``implementation``, ``threads``, ``median_ms`` and ``speedup`` (``baseline``'s median over
    this one's) for each case's implementations, torch on ``threads`` threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    rows = []
    try:
        for name, runs in cases.items():
            medians = {implementation: _median_seconds(run, repeats) for implementation, run in runs.items()}
            for implementation, seconds in medians.items():
                rows.append(
                    dict(
                        size=name,
                        implementation=implementation,
                        threads=threads,
                        median_ms=seconds * 1e3,
                        speedup=medians[baseline] / seconds,
                    )
                )
    finally:
        torch.set_num_threads(previous)
    return rows


def preparation_rows(threads: int = 1, repeats: int = 5, sizes: dict[str, tuple[int, int]] = PHOTO_SIZES) -> list[dict]:
    """The preparation of one photo of each of ``sizes`` (name: (height, width)) by each implementation (see the module
    docstring), torch on ``threads`` threads; ``speedup`` is over transformers' PIL processor."""
    cases = {name: _implementations(synthetic_photo(height, width)) for name, (height, width) in sizes.items()}
    return _timed_rows(cases, "transformers PIL", threads, repeats)


def video_rows(threads: int = 1, repeats: int = 3, seconds: float = 30, frame_size: tuple[int, int] = (720, 1280)):
    """The preparation of the frames Qwen3-VL samples from a ``seconds`` long 30 fps video of ``frame_size`` (height,
    width), decoded: by qvl and by transformers' video processor; ``speedup`` is over the latter. Empty where
    torchvision (which the video processor needs) does not import."""
    from qvl.vit.encode.prepare import Preparer

    processing = _qwen3_vl_processing()
    try:
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

        options = processing.image_processor_options() | dict(min_pixels=None, max_pixels=None)
        size = {"shortest_edge": processing.video_min_pixels, "longest_edge": processing.video_max_pixels}
        options = {k: v for k, v in options.items() if v is not None} | dict(size=size)
        processor = Qwen3VLVideoProcessor(**options, cap_pixels_per_frame=processing.cap_pixels_per_frame)
    except (ImportError, RuntimeError):
        return []
    total = round(seconds * 30)
    indices = processing.sample(total, 30.0, processing.fps, processing.max_frames)
    frames = np.stack([synthetic_photo(*frame_size, seed) for seed in range(len(indices))])
    preparer = Preparer(processing, "cpu")
    expected = processor(videos=[frames], do_sample_frames=False, return_tensors="pt")["video_grid_thw"][0].tolist()
    _, grid = preparer.video(torch.from_numpy(frames))
    if grid != expected:
        raise AssertionError(f"qvl's video grid {grid} is not transformers' {expected}")
    name = f"{seconds:g} s {frame_size[1]}x{frame_size[0]} ({len(indices)} frames)"
    runs = {
        "qvl": lambda: preparer.video(torch.from_numpy(frames)),
        "transformers torchvision": lambda: processor(videos=[frames], do_sample_frames=False, return_tensors="pt"),
    }
    return _timed_rows({name: runs}, "transformers torchvision", threads, repeats)


# The end-to-end row of transformers' tower on inputs its PIL processor prepared beforehand (untimed): what any encode
# whose tower costs the same cannot go below.
TOWER_ALONE = "transformers tower alone"

# The end-to-end towers (module docstring): the test suite's tiny tower, and qvl encode's embedded demo tower.
E2E_TOWERS = {
    "tiny": dict(depth=2, hidden_size=64, num_heads=2, intermediate_size=128, out_hidden_size=96,
                 deepstack_visual_indexes=(0,), num_position_embeddings=64),
    "demo": dict(depth=4, hidden_size=256, num_heads=4, intermediate_size=1024, out_hidden_size=512,
                 deepstack_visual_indexes=(1, 3), num_position_embeddings=2304),
}  # fmt: skip
# Qwen3-VL's preprocessor_config.json (its image processor's settings).
QWEN3_VL_PREPROCESSOR = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


def _checkpoint(directory: Path, tower: str):
    """A random-weight checkpoint of ``E2E_TOWERS[tower]`` with Qwen3-VL's preprocessor config in ``directory``, and
    transformers' tower with the same weights."""
    from qvl.vit import VisionConfig, VisionTransformer
    from qvl.vit.checkpoint import save_vision_checkpoint

    from . import harness
    from .bench_tower import hf_tower
    from .workloads import randomize

    config = VisionConfig(**E2E_TOWERS[tower])
    reference = randomize(hf_tower(config, harness.get_device("cpu"), torch.float32, "sdpa"))
    directory.mkdir(parents=True)
    state = VisionTransformer.from_hf(reference).state_dict()
    save_vision_checkpoint(directory, dataclasses.asdict(config), state)
    (directory / "preprocessor_config.json").write_text(json.dumps(QWEN3_VL_PREPROCESSOR))
    return reference


def _qvl_features(folder: Path, number: int) -> torch.Tensor:
    """Input ``number``'s merged features in a ``qvl encode`` output folder."""
    from safetensors import safe_open

    entries = [json.loads(line) for line in (folder / "index.jsonl").read_text().splitlines()]
    with safe_open(str(folder / entries[number]["shard"]), framework="pt") as handle:
        return handle.get_tensor(f"image.{number}.merged")


def _photo_folder(root: Path, photos: int, size: tuple[int, int]) -> tuple[Path, list[Path]]:
    """``photos`` JPEG photos of ``size`` (height, width) in ``root / "photos"``: the folder and their paths."""
    from PIL import Image

    folder = root / "photos"
    folder.mkdir(parents=True)
    paths = [folder / f"{number:03d}.jpg" for number in range(photos)]
    for number, path in enumerate(paths):
        Image.fromarray(synthetic_photo(*size, seed=number)).save(path, quality=90)
    return folder, paths


def _qvl_encode(
    folder: Path, model: Path, outputs: Iterator[Path], *options: str, env: dict | None = None
) -> tuple[float, dict]:
    """``python -m qvl.vit encode folder --model model`` into the next of ``outputs`` with ``options``, timed from
    process start to exit: its seconds, and its own count of the encoding (``encoding_s``), where that time went
    (``split``) and its first input's merged features."""
    output = next(outputs)
    command = [sys.executable, "-m", "qvl.vit", "encode", str(folder), "--model", str(model), *options]
    # The interpreter is for tests: a run that inherited it would time Triton's CPU emulation.
    environment = {**os.environ, "TRITON_INTERPRET": "0", **(env or {})}
    start = time.perf_counter()
    result = subprocess.run([*command, "-o", str(output)], env=environment, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"qvl encode failed ({result.returncode}): {result.stderr[-2000:]}")
    lines = result.stderr.splitlines()
    encoded = next(line for line in lines if line.startswith("qvl: encoded "))
    split = next(line for line in lines if line.startswith("qvl: time: "))
    encoding_s = float(encoded.split(" in ", 1)[1].split(" s,", 1)[0])
    return seconds, dict(encoding_s=encoding_s, split=split[5:], features=_qvl_features(output, 0))


def _transformers_processors() -> dict:
    """transformers' image processors with Qwen3-VL's settings, by row name: PIL, and torchvision where it imports."""
    from transformers import Qwen2VLImageProcessorPil

    options = _qwen3_vl_processing(QWEN3_VL_PREPROCESSOR).image_processor_options()
    processors = {"transformers PIL": Qwen2VLImageProcessorPil(**options)}
    torchvision_processor = _torchvision_image_processor(options)
    if torchvision_processor is not None:
        processors["transformers torchvision"] = torchvision_processor
    return processors


def _transformers_encode(model, processor, paths: Sequence[Path]) -> tuple[float, dict]:
    """``paths`` through transformers in this process, one photo at a time (``Image.open``, ``processor``, ``model``
    under ``torch.inference_mode``): its seconds and its first photo's merged features."""
    from PIL import Image

    first = None
    start = time.perf_counter()
    with torch.inference_mode():
        for path in paths:
            batch = processor(images=[Image.open(path)], return_tensors="pt")
            merged = model(batch["pixel_values"], grid_thw=batch["image_grid_thw"]).pooler_output
            first = merged if first is None else first
    return time.perf_counter() - start, dict(features=first)


def _best_of(runs: dict[str, Callable[[], tuple[float, dict]]], rounds: int) -> dict[str, tuple[float, dict]]:
    """``runs`` taking turns for ``rounds`` rounds (the machine's other load hits them alike): each one's best
    seconds and the facts of that run."""
    best: dict[str, tuple[float, dict]] = {}
    for _ in range(rounds):
        for name, run in runs.items():
            seconds, facts = run()
            if name not in best or seconds < best[name][0]:
                best[name] = seconds, facts
    return best


def end_to_end_rows(
    photos: int = 16,
    size: tuple[int, int] = (1080, 1920),
    towers: Sequence[str] = ("tiny",),
    rounds: int = 3,
    root: Path | None = None,
) -> list[dict]:
    """``photos`` photos of ``size`` (height, width) through ``qvl encode`` and through transformers' processors and
    tower, per tower shape of ``towers`` (see the module docstring), in ``rounds`` rounds of turns, each keeping its
    best time (the machine's other load hits them alike): rows of ``tower``, ``implementation``, ``seconds``,
    ``images_per_s``, ``qvl_speedup`` and ``max_rel_err``; ``qvl encode``'s row also has ``encoding_s`` (its own
    count, from its first input to its last write: the process's start and the tower's load left out) and its
    ``split`` of that time. Files go under ``root`` (default: a temporary folder)."""
    from PIL import Image

    from .harness import max_rel_err

    with contextlib.ExitStack() as stack:
        root = root or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-encode-")))
        folder, paths = _photo_folder(root, photos, size)
        processors = _transformers_processors()
        rows = []
        for tower in towers:
            model = _checkpoint(root / tower, tower)
            outputs = iter(root / f"{tower}-features-{run}" for run in range(rounds))
            qvl_encode = functools.partial(_qvl_encode, folder, root / tower, outputs)
            with torch.inference_mode():
                prepared = [
                    processors["transformers PIL"](images=[Image.open(path)], return_tensors="pt") for path in paths
                ]

            def tower_alone(model=model, prepared=prepared) -> tuple[float, dict]:
                start = time.perf_counter()
                with torch.inference_mode():
                    merged = [model(batch["pixel_values"], grid_thw=batch["image_grid_thw"]).pooler_output
                              for batch in prepared]  # fmt: skip
                return time.perf_counter() - start, dict(features=merged[0])

            runs = {"qvl encode": qvl_encode}
            runs |= {name: functools.partial(_transformers_encode, model, processor, paths)
                     for name, processor in processors.items()}  # fmt: skip
            runs[TOWER_ALONE] = tower_alone
            best = _best_of(runs, rounds)
            qvl_seconds, reference = best["qvl encode"][0], best["qvl encode"][1]["features"]
            for name, (seconds, facts) in best.items():
                features = facts.pop("features")
                row = dict(tower=tower, implementation=name, seconds=seconds, images_per_s=photos / seconds)
                row |= dict(qvl_speedup=seconds / qvl_seconds, **facts)
                if name != "qvl encode":
                    row["max_rel_err"] = max_rel_err(features, reference)
                rows.append(row)
        return rows


# The steady-state rows' photo counts: the per-photo time is the difference of their runs' times over theirs.
STEADY_PHOTOS = (16, 48)


def steady_state_rows(
    photos: tuple[int, int] = STEADY_PHOTOS,
    size: tuple[int, int] = (1080, 1920),
    towers: Sequence[str] = ("tiny",),
    rounds: int = 3,
    workers: Sequence[int] = (),
    root: Path | None = None,
) -> list[dict]:
    """The time per photo once running, where what a run pays once (process start, imports, loading, warm-up) has
    dropped out: ``(seconds for many photos - seconds for few) / (many - few)`` with ``photos = (few, many)``, for
    ``qvl encode`` (a process, as :func:`end_to_end_rows` runs it: on its default ``--workers``, then with each of
    ``workers``) and for transformers' processors + tower in this process (as :func:`end_to_end_rows`), per tower
    shape of ``towers``; every run takes turns in ``rounds`` rounds, each keeping its best. Rows of ``tower``,
    ``implementation``, ``photos``, ``few_s``, ``many_s``, ``seconds_per_photo``, ``images_per_s`` and
    ``qvl_speedup`` (its time per photo over ``qvl encode``'s: at least 1 where ``qvl encode``'s steady rate is at
    least its); ``qvl encode``'s rows also the ``split`` of the many photos' run. Files go under ``root`` (default: a
    temporary folder)."""
    few, many = photos
    with contextlib.ExitStack() as stack:
        root = root or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-encode-")))
        folders = {count: _photo_folder(root / f"{count}-photos", count, size) for count in photos}
        processors = _transformers_processors()
        variants = {"qvl encode": ()} | {f"qvl encode --workers {n}": ("--workers", str(n)) for n in workers}
        rows = []
        for tower in towers:
            model = _checkpoint(root / tower, tower)
            outputs = (root / f"{tower}-steady-{run}" for run in itertools.count())
            runs = {}
            for count, (folder, paths) in folders.items():
                for name, options in variants.items():
                    runs[name, count] = functools.partial(_qvl_encode, folder, root / tower, outputs, *options)
                for name, processor in processors.items():
                    runs[name, count] = functools.partial(_transformers_encode, model, processor, paths)
            best = _best_of(runs, rounds)
            names = [*variants, *processors]
            per_photo = {name: (best[name, many][0] - best[name, few][0]) / (many - few) for name in names}
            for name in names:
                row = dict(tower=tower, implementation=name, photos=[few, many], few_s=best[name, few][0])
                row |= dict(many_s=best[name, many][0], seconds_per_photo=per_photo[name])
                row |= dict(images_per_s=1 / per_photo[name], qvl_speedup=per_photo[name] / per_photo["qvl encode"])
                if name in variants:
                    row["split"] = best[name, many][1]["split"]
                rows.append(row)
        return rows


# The --ray rows' photo counts.
RAY_PHOTOS = (16, 64)


def ray_rows(
    photos: tuple[int, int] = RAY_PHOTOS,
    size: tuple[int, int] = (1080, 1920),
    towers: Sequence[str] = ("tiny",),
    rounds: int = 2,
    ray_cpus: Sequence[int | None] = (None,),
    device: str = "cpu",
    root: Path | None = None,
) -> list[dict]:
    """``qvl encode`` in one process against ``qvl encode --ray`` (a local Ray of each of ``ray_cpus`` CPUs; None:
    every core) on ``device``, FEW and MANY photos (``photos``) of ``size`` each, every run a process timed from start
    to exit, taking turns for ``rounds`` rounds (best kept), per tower shape of ``towers``. Rows of ``tower``,
    ``implementation``, ``photos``, ``few_s``, ``many_s``, ``seconds_per_photo``, ``images_per_s``, ``once_s`` (what
    a run pays once: ``few_s - FEW x seconds_per_photo``), ``overhead_ms`` (its time per photo over the single
    process's, in ms), ``encoding_s`` (the MANY run's own count) and ``split``. On a CPU a second single-process row
    runs the tower on the threads of the Ray rows' tower actor (``OMP_NUM_THREADS``: half the cores, as
    ``--ray-actor-cpus`` defaults; with the cores that leaves, it decodes in a worker), so that Ray's own cost
    shows apart from the thread count's (on a loaded machine two threads can be slower than one)."""
    few, many = photos
    device_options = ("--device", device)
    with contextlib.ExitStack() as stack:
        root = root or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-encode-ray-")))
        folders = {count: _photo_folder(root / f"{count}-photos", count, size) for count in photos}
        variants, environments = {"qvl encode": device_options}, {}
        if device == "cpu":
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            threads = max(1, cores // 2)
            variants[f"qvl encode OMP_NUM_THREADS={threads}"] = device_options
            environments[f"qvl encode OMP_NUM_THREADS={threads}"] = {"OMP_NUM_THREADS": str(threads)}
        for cpus in ray_cpus:
            name = "qvl encode --ray" + ("" if cpus is None else f" --ray-cpus {cpus}")
            variants[name] = (*device_options, "--ray", *(() if cpus is None else ("--ray-cpus", str(cpus))))
        rows = []
        for tower in towers:
            _checkpoint(root / tower, tower)
            outputs = (root / f"{tower}-ray-{run}" for run in itertools.count())
            runs = {(name, count): functools.partial(_qvl_encode, folder, root / tower, outputs, *options,
                                                     env=environments.get(name))
                    for count, (folder, _) in folders.items() for name, options in variants.items()}  # fmt: skip
            best = _best_of(runs, rounds)
            per_photo = {name: (best[name, many][0] - best[name, few][0]) / (many - few) for name in variants}
            for name in variants:
                row = dict(tower=tower, implementation=name, device=device, photos=[few, many])
                row |= dict(few_s=best[name, few][0], many_s=best[name, many][0], seconds_per_photo=per_photo[name])
                row |= dict(images_per_s=1 / per_photo[name], once_s=best[name, few][0] - few * per_photo[name])
                row |= dict(overhead_ms=(per_photo[name] - per_photo["qvl encode"]) * 1e3)
                row |= dict(encoding_s=best[name, many][1]["encoding_s"], split=best[name, many][1]["split"])
                rows.append(row)
        return rows


def format_ray_rows(rows: Sequence[dict]) -> str:
    few, many = rows[0]["photos"]
    lines = [
        f"{'tower':<6} {'implementation':<32} {f'{few} photos':>10} {f'{many} photos':>10} {'s/photo':>8}"
        f" {'images/s':>9} {'once s':>7} {'+ms/photo':>10}"
    ]
    for row in rows:
        lines.append(
            f"{row['tower']:<6} {row['implementation']:<32} {row['few_s']:>10.2f} {row['many_s']:>10.2f}"
            f" {row['seconds_per_photo']:>8.3f} {row['images_per_s']:>9.2f} {row['once_s']:>7.2f}"
            f" {row['overhead_ms']:>10.1f}"
        )
    for row in rows:
        lines.append(f"{row['tower']}: {row['implementation']}, {many} photos: own count {row['encoding_s']:.2f} s,"
                     f" {row['split']}")  # fmt: skip
    return "\n".join(lines)


# The device rows' tower: Qwen3-VL 8B's (bench_tower.TOWERS), the GPU time preparation has to hide behind.
DEVICE_TOWER = "8B"


def device_rows(
    photos: int = 16,
    size: tuple[int, int] = (1080, 1920),
    device: str = "cuda",
    dtype: str = "bfloat16",
    rounds: int = 2,
    root: Path | None = None,
    config=None,
) -> list[dict]:
    """``photos`` photos of ``size`` through ``qvl encode --device device --dtype dtype`` and through the same
    tower alone on the same inputs (prepared beforehand, packed into the batches ``qvl encode`` forms, each batch's
    outputs copied to the host as ``qvl encode`` does; the preparation and the load not timed), in ``rounds``
    rounds of turns, best kept: rows of ``implementation``, ``seconds``, ``images_per_s``; ``qvl encode``'s also
    ``encoding_s`` (its own count: from its first input to its last write), its ``split``, ``max_rel_err`` (its first
    photo's merged features against the tower alone's) and ``vs_tower_alone`` (its own count over the tower alone's
    time; near 1 where decoding and preparation hide behind the tower; :data:`bench.goals.ENCODE_VS_TOWER` the
    goal), its images/s from its own count. The tower: ``config`` (default: Qwen3-VL 8B's shape, random weights)."""
    from PIL import Image

    from qvl.vit import VisionTransformer
    from qvl.vit.checkpoint import save_vision_checkpoint
    from qvl.vit.encode.loader import Packer, Piece
    from qvl.vit.encode.options import DEFAULT_BUDGET
    from qvl.vit.encode.prepare import Preparer
    from qvl.vit.encode.tower import DTYPES, load_tower, model_kind

    from .bench_tower import TOWERS
    from .harness import max_rel_err

    config = TOWERS[DEVICE_TOWER] if config is None else config
    target = torch.device(device)
    with contextlib.ExitStack() as stack:
        root = root or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-encode-")))
        folder, paths = _photo_folder(root, photos, size)
        model = root / "tower"
        state = VisionTransformer(config).init_random_weights(0).state_dict()
        save_vision_checkpoint(model, dataclasses.asdict(config), {k: v.to(DTYPES[dtype]) for k, v in state.items()})
        (model / "preprocessor_config.json").write_text(json.dumps(QWEN3_VL_PREPROCESSOR))
        kind, _, _, processing = model_kind(model)
        tower = load_tower(model, DTYPES[dtype], target, None, kind)
        preparer = Preparer(processing, target, fold_images=tower.config.temporal_patch_size > 1)
        packer, batches = Packer(DEFAULT_BUDGET), []
        for path in paths:
            rows, grid = preparer.image(torch.from_numpy(np.asarray(Image.open(path).convert("RGB"))))
            batches += packer.add(Piece(item=None, grid=grid, rows=rows))
        batches += packer.flush()

        def synchronize() -> None:
            if target.type == "cuda":
                torch.cuda.synchronize(target)

        def tower_alone() -> tuple[float, dict]:
            synchronize()
            start = time.perf_counter()
            merged_on_host = []
            with torch.no_grad():
                for batch in batches:
                    rows = torch.cat([piece.rows for piece in batch]) if len(batch) > 1 else batch[0].rows
                    merged, deepstack = tower(rows, [piece.grid for piece in batch])
                    on_host = [output.cpu() for output in (merged, *deepstack)]  # every output, as qvl encode
                    merged_on_host.append(on_host[0])
            synchronize()
            first = batches[0][0].patches // tower.config.spatial_merge_size**2
            return time.perf_counter() - start, dict(features=merged_on_host[0][:first])

        outputs = iter(root / f"features-{run}" for run in range(rounds))
        encode = functools.partial(_qvl_encode, folder, model, outputs, "--device", device, "--dtype", dtype)
        best = _best_of({"qvl encode": encode, "qvl tower alone": tower_alone}, rounds)
        (seconds, facts), (alone, alone_facts) = best["qvl encode"], best["qvl tower alone"]
        encoding_s = facts["encoding_s"]
        error = max_rel_err(facts["features"].float(), alone_facts["features"].float())
        return [
            dict(implementation="qvl encode", seconds=seconds, images_per_s=photos / encoding_s, encoding_s=encoding_s,
                 split=facts["split"], vs_tower_alone=encoding_s / alone, max_rel_err=error),
            dict(implementation="qvl tower alone", seconds=alone, images_per_s=photos / alone),
        ]  # fmt: skip


def format_device_rows(rows: Sequence[dict], device: str) -> str:
    encode, alone = rows
    return "\n".join([
        f"{'implementation':<18} {'seconds':>8} {'images/s':>9}",
        f"{'qvl encode':<18} {encode['encoding_s']:>8.2f} {encode['images_per_s']:>9.2f}  its own count"
        f" ({encode['seconds']:.2f} s from process start to exit), {encode['split']}",
        f"{'qvl tower alone':<18} {alone['seconds']:>8.2f} {alone['images_per_s']:>9.2f}",
        f"{device}: qvl encode takes {encode['vs_tower_alone']:.2f}x the tower alone's time on the same inputs"
        f" (goal: at most {ENCODE_VS_TOWER:g}x); features {encode['max_rel_err']:.1e} from the tower alone's",
    ])  # fmt: skip


def format_rows(rows: Sequence[dict], baseline: str) -> str:
    lines = [f"{'input':<28} {'implementation':<26} {'threads':>7} {'median ms':>10} {'vs ' + baseline:>10}"]
    for row in rows:
        lines.append(
            f"{row['size']:<28} {row['implementation']:<26} {row['threads']:>7} {row['median_ms']:>10.1f}"
            f" {row['speedup']:>9.1f}x"
        )
    return "\n".join(lines)


def format_end_to_end(rows: Sequence[dict]) -> str:
    lines = [
        f"{'tower':<6} {'implementation':<26} {'seconds':>8} {'images/s':>9} {'qvl speed-up':>13} {'max rel err':>12}"
    ]
    for row in rows:
        error = f"{row['max_rel_err']:.1e}" if "max_rel_err" in row else "-"
        lines.append(
            f"{row['tower']:<6} {row['implementation']:<26} {row['seconds']:>8.2f} {row['images_per_s']:>9.2f}"
            f" {row['qvl_speedup']:>12.2f}x {error:>12}"
        )
    for row in rows:
        if "split" in row:
            start = row["seconds"] - row["encoding_s"]
            lines.append(f"{row['tower']}: qvl encode's own count {row['encoding_s']:.2f} s ({start:.2f} s more from"
                         f" process start to exit), {row['split']}")  # fmt: skip
    seconds = {(row["tower"], row["implementation"]): row["seconds"] for row in rows}
    for (tower, implementation), alone in seconds.items():
        whole = seconds.get((tower, "transformers PIL"))
        if implementation == TOWER_ALONE and whole is not None:
            lines.append(
                f"{tower}: the tower alone is {alone:.2f} s of transformers PIL's {whole:.2f} s: an encode whose tower"
                f" costs the same is at most {whole / alone:.2f}x faster than it, before its process start"
            )
    return "\n".join(lines)


def format_steady_state(rows: Sequence[dict]) -> str:
    few, many = rows[0]["photos"]
    lines = [
        f"{'tower':<6} {'implementation':<26} {f'{few} photos':>10} {f'{many} photos':>10} {'s/photo':>8}"
        f" {'images/s':>9} {'qvl speed-up':>13}"
    ]
    for row in rows:
        lines.append(
            f"{row['tower']:<6} {row['implementation']:<26} {row['few_s']:>10.2f} {row['many_s']:>10.2f}"
            f" {row['seconds_per_photo']:>8.3f} {row['images_per_s']:>9.2f} {row['qvl_speedup']:>12.2f}x"
        )
    for row in rows:
        if "split" in row:
            lines.append(f"{row['tower']}: {row['implementation']}, {many} photos: {row['split']}")
    qvl = {row["tower"]: row["seconds_per_photo"] for row in rows if row["implementation"] == "qvl encode"}
    for row in rows:
        if row["implementation"].startswith("transformers"):
            lines.append(
                f"{row['tower']}: steady state (({many} photos' time - {few} photos') / {many - few}): qvl encode"
                f" {qvl[row['tower']]:.3f} s a photo, {row['implementation']} processor + tower"
                f" {row['seconds_per_photo']:.3f} s: qvl encode at {row['qvl_speedup']:.2f}x its rate"
            )
    return "\n".join(lines)


def run_facts() -> dict:
    """When, where and on what this ran: date, CPU, cores, versions and the checkout's commit."""
    import transformers

    from . import harness

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        cpu=harness.cpu_name(),
        cores=cores,
        transformers=transformers.__version__,
        **harness._versions(),
    )


def _main_ray(args, parser) -> int:
    """The --ray rows alone: printed, and with --json written with the run's facts (Ray's version among them)."""
    try:
        import ray
    except ImportError:
        print("bench_encode --ray: Ray is not installed here: the Ray rows are skipped (pip install 'qvl[data]')")
        return 0
    device = args.device or "cpu"
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {device}: torch sees no CUDA device here")
    cpus = args.ray_cpus or [None]
    before = os.getloadavg()
    print(f"load average before: {' '.join(f'{load:.2f}' for load in before)}")
    rows = ray_rows(tuple(args.ray), args.photo_size, args.towers, args.rounds, cpus, device)
    after = os.getloadavg()
    print(format_ray_rows(rows))
    print(f"load average after: {' '.join(f'{load:.2f}' for load in after)}")
    if args.json:
        facts = run_facts() | dict(ray=ray.__version__, load_average_before=before, load_average_after=after)
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump(dict(facts=facts, ray=rows), file, indent=1)
    return 0


def _size(text: str) -> tuple[int, int]:
    width, height = (int(n) for n in text.split("x"))
    return height, width


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.bench_encode",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the preparation rows (default: 1)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per preparation (default: 5)")
    parser.add_argument(
        "--sizes",
        nargs="+",
        metavar="NAME=WxH",
        help="photo sizes (default: " + " ".join(f"{name}={w}x{h}" for name, (h, w) in PHOTO_SIZES.items()) + ")",
    )
    parser.add_argument("--video-seconds", type=float, default=30, help="video length; 0: no video (default: 30)")
    parser.add_argument("--photos", type=int, default=16, help="photos end to end; 0: none (default: 16)")
    parser.add_argument("--photo-size", type=_size, default=(1080, 1920), metavar="WxH", help="(default: 1920x1080)")
    parser.add_argument("--towers", nargs="+", choices=sorted(E2E_TOWERS), default=["tiny"], help="(default: tiny)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of turns, best kept (default: 3)")
    parser.add_argument(
        "--steady-state",
        nargs=2,
        type=int,
        metavar=("FEW", "MANY"),
        help="also the time per photo once running: FEW and MANY photos through qvl encode and through transformers,"
        f" (MANY's time - FEW's) / (MANY - FEW) (e.g. {STEADY_PHOTOS[0]} {STEADY_PHOTOS[1]})",
    )
    parser.add_argument(
        "--encode-workers", nargs="+", type=int, default=[], metavar="N",
        help="the steady-state rows also time qvl encode --workers N, each N (default: its default --workers only)",
    )  # fmt: skip
    parser.add_argument(
        "--ray", nargs=2, type=int, metavar=("FEW", "MANY"),
        help="only qvl encode in one process against qvl encode --ray, FEW and MANY photos, the time per photo and"
        f" what Ray adds (e.g. {RAY_PHOTOS[0]} {RAY_PHOTOS[1]}; on --device, cpu by default)",
    )  # fmt: skip
    parser.add_argument(
        "--ray-cpus", nargs="+", type=int, default=[], metavar="N",
        help="the --ray rows' local Ray CPUs, each N a row (default: every core)",
    )  # fmt: skip
    parser.add_argument("--json", metavar="PATH", help="also write the rows and the run's facts as JSON")
    parser.add_argument(
        "--device", help="a GPU (cuda, cuda:1): qvl encode on it against its tower alone, Qwen3-VL 8B's shape, instead"
    )
    parser.add_argument(
        "--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
        help="the tower's dtype with --device (default: bfloat16)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.steady_state is not None and not 0 < args.steady_state[0] < args.steady_state[1]:
        parser.error("--steady-state FEW MANY: 0 < FEW < MANY")
    if args.encode_workers and args.steady_state is None:
        parser.error("--encode-workers: only the steady-state rows take it (--steady-state FEW MANY)")
    if args.ray is not None and not 0 < args.ray[0] < args.ray[1]:
        parser.error("--ray FEW MANY: 0 < FEW < MANY")
    if args.ray_cpus and args.ray is None:
        parser.error("--ray-cpus: only the Ray rows take it (--ray FEW MANY)")
    if args.ray is not None:
        return _main_ray(args, parser)
    if args.steady_state is not None and args.device is not None:
        parser.error("--steady-state: the CPU rows' measurement, not --device's")
    if args.device is not None:
        if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
            parser.error(f"--device {args.device}: torch sees no CUDA device here")
        rows = device_rows(args.photos, args.photo_size, args.device, args.dtype, min(args.rounds, 2))
        print(format_device_rows(rows, args.device))
        if args.json:
            height, width = args.photo_size
            case = f"{args.photos} photos {width}x{height}, {DEVICE_TOWER} {args.dtype}"
            seconds = [rows[0]["encoding_s"], rows[1]["seconds"]]
            records = [dict(case=case, impl=row["implementation"], ms=s * 1e3) for row, s in zip(rows, seconds)]
            with open(args.json, "w", encoding="utf-8") as file:
                json.dump(dict(bench="encode", facts=run_facts(), rows=rows, records=records), file, indent=1)
        return 0
    sizes = PHOTO_SIZES
    if args.sizes:
        sizes = {}
        for item in args.sizes:
            name, _, shape = item.partition("=")
            sizes[name] = _size(shape)
    results = dict(facts=run_facts(), preparation=preparation_rows(args.threads, args.repeats, sizes))
    print(format_rows(results["preparation"], "PIL"))
    if args.video_seconds > 0:
        results["video"] = video_rows(args.threads, args.repeats, args.video_seconds)
        print(format_rows(results["video"], "transformers"))
    if args.photos > 0:
        results["end_to_end"] = end_to_end_rows(args.photos, args.photo_size, args.towers, args.rounds)
        print(format_end_to_end(results["end_to_end"]))
    if args.steady_state is not None:
        photos, workers = tuple(args.steady_state), args.encode_workers
        results["steady_state"] = steady_state_rows(photos, args.photo_size, args.towers, args.rounds, workers)
        print(format_steady_state(results["steady_state"]))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump(results, file, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
