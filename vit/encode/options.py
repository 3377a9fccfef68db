"""The encode job's options (:class:`EncodeOptions`) and their defaults. Imports no torch: the command line builds its
help and checks its arguments from here before anything heavy loads."""

from __future__ import annotations

import dataclasses
import os
import re

__all__ = [
    "DEFAULT_BUDGET",
    "DEFAULT_RAY_GROUP",
    "DEFAULT_SHARD_BYTES",
    "FORMATS",
    "EMBEDDED_MAX_PIXELS",
    "EncodeOptions",
    "VIDEO_EXTENSIONS",
    "default_workers",
    "parse_size",
]

# The embedded demo tower's cap on a resized image: 4096^2 pixels (Qwen3-VL's own) are 65536 patches per image,
# minutes of CPU time each for a tower whose features mean nothing. A checkpoint's images take its own cap.
EMBEDDED_MAX_PIXELS = 512 * 512
# Patches per batch: a 1920x1080 photo at Qwen3-VL's settings is 8,160; larger inputs run alone.
DEFAULT_BUDGET = 16384
DEFAULT_SHARD_BYTES = 256 * 2**20
# Under Ray a shard is one group of this many inputs (--shard-inputs), decided before any is read.
DEFAULT_RAY_GROUP = 32
# The shard formats of --format; an output named *.safetensors or *.parquet is one file of that format.
FORMATS = ("safetensors", "parquet")
# Files with these suffixes are videos (decoded with PyAV); --video takes a file of any name.
VIDEO_EXTENSIONS = frozenset({".mp4", ".webm", ".mkv", ".mov", ".avi", ".m4v"})

_SIZE_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}


def parse_size(text: str) -> int:
    """A byte count written as ``N``, ``Nk``, ``NM`` or ``NG`` (powers of 1024; a trailing ``B``/``iB`` allowed), at
    least 1. Raises ValueError naming ``text`` otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?)(?:i?b)?\s*", text, re.IGNORECASE)
    if match is None:
        raise ValueError(f"not a size: {text!r} (e.g. 256M, 1G, 1000000)")
    size = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])
    if size < 1:
        raise ValueError(f"must be at least 1 byte, got {text!r}")
    return size


def default_workers(device_type: str, tower_threads: int, cores: int | None = None) -> int:
    """Decoding processes for a run on ``device_type`` whose tower runs on ``tower_threads`` torch threads, with
    ``cores`` CPUs to run on (default: this process's).

    On a GPU, enough to keep it fed (the host only decodes, the tower takes no CPU threads): ``cores - 1``, at most 8.
    On a CPU the workers decode and prepare on the cores the tower computes on: one worker per core its threads leave
    free, at most 4, and none where they take every core (torch's default, one thread per core). There a worker
    takes a core from one of the tower's threads whenever it runs (its decoding and preparation, on one torch thread,
    and its queue's thread copying the rows into shared memory), and every parallel region of the tower waits at its
    end for that thread: the tower loses about the worker's whole CPU time, more than decoding between batches costs
    (preparation there runs on all the tower's threads, and nothing is copied)."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if device_type == "cuda":
        return max(1, min(8, cores - 1))
    return max(0, min(4, cores - tower_threads))


@dataclasses.dataclass(frozen=True)
class EncodeOptions:
    """What one ``qvl encode`` run does (the command line's options, by the same names).

    Attributes:
        inputs: image and video files, folders (searched recursively), glob patterns.
        videos: videos given as such: video files of any name, or folders of frame images (one video each).
        lists: files of input paths, one a line (``-``: standard input).
        image_column: the image column of Parquet files and datasets folders (None: ``image``, else their only
            binary or image column).
        output: a path ending in ``.safetensors`` or ``.parquet`` (one file, written at the end), else a folder of
            shards and an index, written as features arrive.
        format: the shards' format, ``"safetensors"`` or ``"parquet"`` (None: by the output's suffix, else
            safetensors).
        model: checkpoint directory or Hugging Face Hub id; None: the embedded random-weight tower.
        dtype, device: torch names; None: the defaults for the device (:func:`qvl.vit.encode.tower.default_dtype`).
        compile: torch.compile the tower.
        fps, max_frames, min_pixels, max_pixels, video_min_pixels, video_max_pixels: overrides of the checkpoint's
            preparation (None: its own).
        parallel: None, ``"data"`` (each rank encodes its share of the inputs and writes its own shards) or
            ``"weights"`` (the tower's layers split over the ranks).
        budget: patches per batch; an input larger than the budget runs alone, a video in chunks within it.
        batch_size: most inputs per batch (None: as many as the budget holds).
        workers: decoding processes (0: decode in this process; None: :func:`default_workers`).
        shard_bytes, shard_inputs: a shard is written once it holds this many bytes of features, or inputs.
        resume: continue the run whose shards are in ``output``, skipping the inputs already written.
        progress: draw the progress bar (on a terminal only).
        ray: run on Ray Data (:mod:`qvl.vit.encode.ray`): a cluster's address (``auto``, ``ray://HOST:10001``), or
            ``""`` for a Ray started for the run on this machine; None: this process (and its loader workers).
        ray_cpus: the CPUs of the Ray started for the run (None: every core); not with an address.
        ray_actors: tower actors (None: one per GPU of the cluster; on a CPU, one).
        ray_actor_cpus: CPUs each tower actor holds, its torch threads on a CPU (None: 1 with a GPU; on a CPU, half
            the cluster's CPUs over the actors, at least 1); the rest decode and prepare.
    """

    inputs: tuple[str, ...] = ()
    videos: tuple[str, ...] = ()
    lists: tuple[str, ...] = ()
    image_column: str | None = None
    output: str = "features.safetensors"
    format: str | None = None
    model: str | None = None
    dtype: str | None = None
    device: str | None = None
    compile: bool = False
    fps: float | None = None
    max_frames: int | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    video_min_pixels: int | None = None
    video_max_pixels: int | None = None
    parallel: str | None = None
    budget: int = DEFAULT_BUDGET
    batch_size: int | None = None
    workers: int | None = None
    shard_bytes: int = DEFAULT_SHARD_BYTES
    shard_inputs: int | None = None
    resume: bool = False
    progress: bool = True
    ray: str | None = None
    ray_cpus: int | None = None
    ray_actors: int | None = None
    ray_actor_cpus: int | None = None

    @property
    def single_file(self) -> bool:
        """Whether the output is one file (``.safetensors`` or ``.parquet``; else a folder of shards)."""
        return self.output.lower().endswith((".safetensors", ".parquet"))

    @property
    def output_format(self) -> str:
        """The shards' format: ``format``, else the output file's suffix, else safetensors."""
        suffix = next((name for name in FORMATS if self.output.lower().endswith("." + name)), None)
        return self.format or suffix or "safetensors"
