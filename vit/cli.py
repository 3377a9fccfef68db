"""The ``qvl`` command line (also ``python -m qvl.vit``).

``qvl encode INPUT... [--video PATH]...`` runs the vision tower over image files, video files (decoded
with PyAV) and videos given as folders of frame images, and writes the features to one safetensors file
(layout in ``ENCODE_EPILOG``).

Inputs are prepared as the checkpoint's own processors prepare them: every parameter (pixel bounds, patch and
merge sizes, mean and std, video sampling) comes from its processor configs (``preprocessor_config.json``,
``video_preprocessor_config.json``), over the model family's transformers defaults
(:meth:`~qvl.vit.processing.Processing.for_checkpoint`); the family and the tower class come from the checkpoint's
config.json (:mod:`qvl.vit.families`, :func:`qvl.vit.towers.tower_class_of`). Images go through transformers' Qwen2-VL
PIL image processor (the fast one needs torchvision); videos through :meth:`~qvl.vit.processing.Processing.
video_pixel_values`, which is the family's transformers video processor in plain torch (that one needs torchvision
too). Video files are decoded with PyAV, as transformers' ``read_video_pyav`` does, and sampled as the family's video
processor samples (:func:`sample_frame_indices`, or :func:`sample_frame_indices_qwen2` for the Qwen2 family); their
sampled frames then take the frame folders' path. ``--model`` also takes a Hugging Face Hub model id
(:func:`qvl.vit.hub.resolve_model`).

Every input is opened and decoded before the model is loaded, and the output is written to a temporary
file beside the target and renamed over it at the end, so a bad input or a failed run fails early with
one line naming the file and never leaves a partial output behind.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from qvl.kernels import backend_for

from .checkpoint import CheckpointError, read_config, read_processor_configs
from .config import VisionConfig
from .families import DEFAULT_FAMILY, Family, family_of_config
from .hub import resolve_model
from .model import VisionTransformer
from .processing import QWEN3_VL_MAX_FRAMES, QWEN3_VL_VIDEO_FPS, Processing, sample_frame_indices
from .towers import tower_class_of

__all__ = ["EMBEDDED_CONFIG", "build_parser", "main", "sample_frame_indices"]

EXIT_USAGE = 2
EXIT_RUNTIME = 1

# The embedded demo tower's cap on a resized image: 4096^2 pixels (Qwen3-VL's own) are 65536 patches per image,
# minutes of CPU time each for a tower whose features mean nothing. A checkpoint's images take its own cap.
EMBEDDED_MAX_PIXELS = 512 * 512
# Qwen's processors refuse images more elongated than this (smart_resize); checked up front instead.
MAX_ASPECT_RATIO = 200

# Positional inputs with these suffixes are video files; --video takes a file of any name.
VIDEO_EXTENSIONS = frozenset({".mp4", ".webm", ".mkv", ".mov", ".avi", ".m4v"})

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_BACKEND_NAMES = {
    "triton": "Triton compiled",
    "interpreter": "Triton interpreter",
    "torch": "torch CPU path (fused SDPA attention)",
    "reference": "torch reference",
}

ENCODE_EPILOG = f"""\
output (safetensors), for each input i, numbered over the positional inputs in the order given and then
the --video inputs in the order given (videos are inputs like images; their rows cover all used frames):
  image.{{i}}.merged          (n_i, out_hidden)  main merger output; n_i = t*h*w / merge_size**2
  image.{{i}}.deepstack.{{j}}   (n_i, out_hidden)  deepstack merger j (layer deepstack_visual_indexes[j])
metadata (safetensors string metadata; lists are JSON):
  sources    input paths as given          kinds      "image" or "video" per input
  sampling   per input: null, or for a video file {{"frames": decoded count, "fps": its frame rate,
             "indices": the sampled frame numbers (0-based)}}
  grid_thw   [t, h, w] patch grid per input (t = frames / temporal_patch_size, padded up)
  model      checkpoint dir or "embedded-random"   dtype, backend, deepstack_visual_indexes
read back with safetensors.safe_open(path, "pt"): .get_tensor("image.0.merged"), .metadata()

preparation is the checkpoint's: every parameter (min/max pixels, patch, temporal patch and merge size,
mean/std, video fps and min/max frames) comes from --model's processor configs (processor_config.json,
preprocessor_config.json, video_preprocessor_config.json, read as transformers reads them), else from the family's
transformers defaults; the tower kind is read from its config.json. Images: transformers' Qwen2-VL image
processor, bicubic resize to multiples of patch*merge within the image bounds (--min-pixels, --max-pixels
override them). Videos: the family's video processor, within the video bounds (--video-min-pixels,
--video-max-pixels override them; Qwen3-VL counts frames x frame area, Qwen2-VL and Qwen2.5-VL each frame);
frames must all be the same size; an odd frame count is padded by repeating the last frame. Family defaults:
Qwen3-VL (Qwen3.5, Qwen3-Omni): mean = std = 0.5, images 256^2 to 4096^2 pixels; Qwen2-VL and Qwen2.5-VL: OpenAI
CLIP's mean and std, images 56^2 to 1280 * 28^2 pixels.

video files (.mp4 .webm .mkv .mov .avi .m4v as positional inputs; any file with --video) are decoded
with PyAV (pip install av) to RGB and sampled as the family's video processor samples (Qwen2-VL's and
Qwen2.5-VL's as theirs do with do_sample_frames on; they keep every frame by default): n = frames / video_fps
* --fps, clamped to [min_frames, --max-frames] and to the frame count; Qwen3-VL: int(n) frames at
round(linspace(0, frames - 1, n)); Qwen2-VL / Qwen2.5-VL: n rounded down to whole temporal patches, frames at
arange(0, frames, frames / n) truncated. Frame folders are used whole (they have no frame rate).

--model takes a checkpoint directory or a Hugging Face Hub model id (Qwen/Qwen3-VL-8B-Instruct): only config.json,
the processor configs and the safetensors shards holding the vision tower are downloaded, into the Hugging Face
cache (HF_HOME, HF_HUB_CACHE); with HF_HUB_OFFLINE=1 only that cache is read.

without --model the embedded default runs: a small Qwen3-VL-shaped tower with random weights (seed 0),
for trying the pipeline on a machine with no checkpoint; its features carry no meaning, and its images are
capped at {EMBEDDED_MAX_PIXELS} (512^2) pixels to keep CPU runs short.

the features are kept in host memory until the file is written (about 32 MB per 1024^2 image in bf16 for
Qwen3-VL-8B): split very large input sets over several calls.

exit status: 0 success, 2 bad arguments or an input/checkpoint that cannot be used (one line naming the
file on stderr, no output written), 1 failure while encoding (e.g. out of memory).
"""


# A small tower of Qwen3-VL's shape (patch 16, merge 2, temporal 2, 48x48 position grid, two deepstack
# taps), so `qvl encode` runs on a fresh machine without downloading a checkpoint.
EMBEDDED_CONFIG = VisionConfig(
    depth=4,
    hidden_size=256,
    num_heads=4,
    intermediate_size=1024,
    out_hidden_size=512,
    deepstack_visual_indexes=(1, 3),
    patch_size=16,
    temporal_patch_size=2,
    spatial_merge_size=2,
    num_position_embeddings=2304,
)
EMBEDDED_SEED = 0


class CliError(Exception):
    """An input, checkpoint or option the command cannot use; the message starts with the file."""


@dataclasses.dataclass(frozen=True)
class _Input:
    """One encoder input: an image file, a video as its ordered frame files, or a video file (``source``,
    no ``frames``) with the frame numbers to decode from it and how they were chosen."""

    kind: str
    source: str
    frames: list[Path]
    sampling: dict | None = None


def _open_rgb(path: Path):
    """Decode ``path`` fully as an upright RGB PIL image, transparency laid over white as transformers lays it
    (:func:`~qvl.vit.encode.prepare.decode_image`), or raise :class:`CliError` naming it."""
    from PIL import Image

    from .encode.prepare import decode_image

    try:
        return Image.fromarray(decode_image(path))
    except FileNotFoundError:
        raise CliError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise CliError(f"{path}: is a directory (give frame folders with --video)") from None
    except PermissionError:
        raise CliError(f"{path}: permission denied") from None
    except (OSError, ValueError) as error:
        raise CliError(f"{path}: {error}") from None


def _check_image(path: Path) -> tuple[int, int]:
    """Decode ``path`` once to prove it usable; returns its upright (width, height)."""
    width, height = _open_rgb(path).size
    _check_aspect(path, width, height)
    return width, height


def _check_aspect(path: Path, width: int, height: int) -> None:
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        raise CliError(f"{path}: {width}x{height} is more elongated than {MAX_ASPECT_RATIO}:1 (Qwen's limit)")


def _import_av(path: Path):
    try:
        import av
    except ImportError:
        raise CliError(f"{path}: video files are decoded with PyAV, which is not installed; pip install av") from None
    return av


def _av_failure(path: Path, error: Exception) -> CliError:
    """What a PyAV failure on ``path`` means, as one line naming it."""
    if isinstance(error, FileNotFoundError):
        return CliError(f"{path}: no such file")
    if isinstance(error, IsADirectoryError):
        return CliError(f"{path}: is a directory (give frame folders with --video)")
    if isinstance(error, PermissionError):
        return CliError(f"{path}: permission denied")
    reason = getattr(error, "strerror", None) or str(error)
    return CliError(f"{path}: not a video file PyAV can decode ({type(error).__name__}: {reason})")


def _video_frames(path: Path, keep=None) -> tuple[int, float | None, list]:
    """Decode the first video stream of ``path``: ``(frame count, stream frame rate, RGB frames as (H, W, 3) uint8
    arrays)``, keeping the frames whose numbers are in ``keep`` (none when ``keep`` is None).

    Without ``keep`` every frame is still decoded, to prove the file usable and count its frames (the
    container's stated count is often missing, e.g. in WebM and Matroska). Frames are converted as
    transformers' ``read_video_pyav`` converts them (``to_ndarray(format="rgb24")``).
    """
    av = _import_av(path)
    frames, count, size = [], 0, None
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise CliError(f"{path}: no video stream")
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            rate = stream.average_rate or stream.guessed_rate
            for frame in container.decode(stream):
                if size is None:
                    size = (frame.width, frame.height)
                    _check_aspect(path, *size)
                elif (frame.width, frame.height) != size:
                    raise CliError(
                        f"{path}: frame {count} is {frame.width}x{frame.height} but frame 0 is {size[0]}x{size[1]}"
                        " (all frames of a video must have one size)"
                    )
                if keep is not None and count in keep:
                    frames.append(frame.to_ndarray(format="rgb24"))
                count += 1
    except CliError:
        raise
    # PyAV raises its FFmpegError subclasses (also OSError, ValueError, EOFError) on files it cannot
    # open or decode; any failure here means this file cannot be used.
    except Exception as error:  # noqa: BLE001
        raise _av_failure(path, error) from None
    if count == 0:
        raise CliError(f"{path}: no video frames")
    return count, None if rate is None else float(rate), frames


def _video_file(name: str, fps: float, max_frames: int, sample=sample_frame_indices) -> _Input:
    """A video file as an input: decoded once to count its frames, then sampled by ``sample(count, rate, fps,
    max_frames)``."""
    count, rate, _ = _video_frames(Path(name))
    indices = sample(count, rate, fps, max_frames)
    return _Input("video", name, [], {"frames": count, "fps": rate, "indices": indices})


def _natural_key(path: Path) -> list:
    # frame2 before frame10: digit runs compare by value, so unpadded frame numbers keep their order.
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.name)]


def _frame_files(directory: Path) -> list[Path]:
    from PIL import Image

    readable = {ext for ext, fmt in Image.registered_extensions().items() if fmt in Image.OPEN}
    try:
        entries = list(directory.iterdir())
    except FileNotFoundError:
        raise CliError(f"{directory}: no such directory") from None
    except NotADirectoryError:
        raise CliError(f"{directory}: not a directory (--video takes a folder of frame images)") from None
    except PermissionError:
        raise CliError(f"{directory}: permission denied") from None
    frames = [p for p in entries if p.suffix.lower() in readable and not p.name.startswith(".") and not p.is_dir()]
    if not frames:
        raise CliError(f"{directory}: no frame images (expected files such as 0001.png, 0002.png, ...)")
    return sorted(frames, key=_natural_key)


def _collect_inputs(
    images: Sequence[str],
    videos: Sequence[str],
    fps: float = QWEN3_VL_VIDEO_FPS,
    max_frames: int = QWEN3_VL_MAX_FRAMES,
    sample=sample_frame_indices,
) -> list[_Input]:
    inputs = []
    for name in images:
        if Path(name).suffix.lower() in VIDEO_EXTENSIONS:
            inputs.append(_video_file(name, fps, max_frames, sample))
            continue
        _check_image(Path(name))
        inputs.append(_Input("image", name, [Path(name)]))
    for name in videos:
        if not Path(name).exists():
            raise CliError(f"{name}: no such file or directory")
        if not Path(name).is_dir():
            inputs.append(_video_file(name, fps, max_frames, sample))
            continue
        frames = _frame_files(Path(name))
        first = _check_image(frames[0])
        for frame in frames[1:]:
            size = _check_image(frame)
            if size != first:
                raise CliError(
                    f"{frame}: frame is {size[0]}x{size[1]} but {frames[0].name} is {first[0]}x{first[1]}"
                    " (all frames of a video must have one size)"
                )
        inputs.append(_Input("video", name, frames))
    return inputs


class _Preparer:
    """Images and videos -> ``(pixel_values rows, [t, h, w])`` as the checkpoint's processors make them."""

    def __init__(self, processing: Processing):
        self.processing = processing
        self.image_processor = processing.image_processor()

    def __call__(self, item: _Input) -> tuple[torch.Tensor, list[int]]:
        if item.kind == "image":
            batch = self.image_processor(images=[_open_rgb(item.frames[0])], return_tensors="pt")
            return batch["pixel_values"], batch["image_grid_thw"][0].tolist()
        if item.sampling is None:
            frames = [np.asarray(_open_rgb(path)) for path in item.frames]
        else:
            indices = item.sampling["indices"]
            frames = _video_frames(Path(item.source), keep=set(indices))[2]
            if len(frames) != len(indices):  # the file changed since it was checked
                raise CliError(f"{item.source}: has fewer frames than when first decoded")
        return self.processing.video_pixel_values(torch.from_numpy(np.stack(frames)))


class _Progress:
    """tqdm's bar over the inputs on stderr with inputs/s and patches/s, drawn only on a terminal so that
    logs get no carriage returns."""

    def __init__(self, total: int, stream=None, enabled: bool = True):
        from tqdm import tqdm

        stream = sys.stderr if stream is None else stream
        self.patches = 0
        # Drawn before the first batch, which can be slow (compilation, warm-up).
        self.bar = tqdm(total=total, desc="qvl: encode", unit="input", file=stream,
                        disable=not (enabled and stream.isatty()), dynamic_ncols=True)  # fmt: skip

    def update(self, inputs: int, patches: int) -> None:
        """Count ``inputs`` more inputs of ``patches`` patches in all as done."""
        self.patches += patches
        elapsed = self.bar.format_dict["elapsed"]
        self.bar.set_postfix_str(f"{self.patches / elapsed if elapsed > 0 else 0.0:.0f} patches/s", refresh=False)
        self.bar.update(inputs)

    def close(self) -> None:
        self.bar.close()


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qvl",
        description="Qwen vision towers (Qwen3-VL, Qwen3.5, Qwen3-Omni, Qwen2.5-VL, Qwen2-VL) on qvl's Triton kernels.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    encode = commands.add_parser(
        "encode",
        help="encode images and videos to a safetensors file of vision features",
        description="Encode image files and videos (video files, or folders of frame images) with the "
        "vision tower and write the merged and deepstack features to a safetensors file.",
        epilog=ENCODE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    encode.add_argument(
        "images",
        nargs="*",
        metavar="INPUT",
        help="image files (any format PIL reads) and video files (.mp4 .webm .mkv .mov .avi .m4v; needs PyAV)",
    )
    encode.add_argument(
        "--video",
        action="append",
        default=[],
        metavar="PATH",
        help="a video: a video file of any name PyAV decodes, or a folder of frame images ordered by name "
        "(frame2 before frame10); repeatable",
    )
    encode.add_argument(
        "--fps",
        type=_positive_float,
        metavar="F",
        help="frames sampled per second of a video file (default: the checkpoint's video processor's, else "
        f"{QWEN3_VL_VIDEO_FPS:g}, Qwen3-VL's video processor's default, for every family)",
    )
    encode.add_argument(
        "--max-frames",
        type=_positive_int,
        metavar="N",
        help="most frames sampled from a video file (default: the checkpoint's video processor's; transformers' "
        f"default {QWEN3_VL_MAX_FRAMES}; at least its min_frames are sampled where the video has them, unless N "
        "is smaller)",
    )
    encode.add_argument(
        "--model",
        metavar="DIR_OR_HUB_ID",
        help="checkpoint directory (config.json + safetensors), or a Hugging Face Hub model id such as "
        "Qwen/Qwen3-VL-8B-Instruct (only the vision tower's files are downloaded, into the Hugging Face cache; "
        "HF_HUB_OFFLINE=1 reads only the cache); default: the embedded random-weight tower",
    )
    encode.add_argument(
        "--output", "-o", default="features.safetensors", metavar="PATH", help="output file (default: %(default)s)"
    )
    encode.add_argument(
        "--batch-size", type=_positive_int, default=8, metavar="N", help="inputs per forward (default: %(default)s)"
    )
    encode.add_argument("--compile", action="store_true", help="torch.compile the tower's forward")
    encode.add_argument(
        "--dtype",
        choices=sorted(_DTYPES),
        help="compute dtype (default: bfloat16 on a GPU with bf16 math, Ampere on; float16 on an older one; "
        "float32 on CPU)",
    )
    encode.add_argument("--device", help="torch device, e.g. cpu, cuda, cuda:1 (default: cuda if available)")
    encode.add_argument(
        "--min-pixels",
        type=_positive_int,
        metavar="N",
        help="smallest resized image, in pixels (default: the checkpoint's image processor's)",
    )
    encode.add_argument(
        "--max-pixels",
        type=_positive_int,
        metavar="N",
        help="largest resized image, in pixels (default: the checkpoint's image processor's, e.g. Qwen3-VL's "
        f"16777216; the embedded tower's {EMBEDDED_MAX_PIXELS})",
    )
    encode.add_argument(
        "--video-min-pixels",
        type=_positive_int,
        metavar="N",
        help="smallest resized video as its video processor counts it (Qwen3-VL: frames x frame area; Qwen2-VL, "
        "Qwen2.5-VL: each frame); default: the checkpoint's video processor's",
    )
    encode.add_argument(
        "--video-max-pixels",
        type=_positive_int,
        metavar="N",
        help="largest resized video, counted as --video-min-pixels is (default: the checkpoint's video processor's)",
    )
    encode.add_argument(
        "--parallel",
        choices=("data", "weights"),
        help="run across the ranks torchrun starts (torchrun --nproc-per-node N -m qvl.vit encode ...): "
        "'data' splits the batch over ranks, 'weights' shards the layers; rank 0 prints and writes the output",
    )
    encode.set_defaults(run=_run_encode, check=_check_encode_args, subparser=encode)
    return parser


def _check_encode_args(args: argparse.Namespace) -> None:
    """Checks argparse cannot express; they exit through the subcommand's usage like its own errors."""
    if not args.images and not args.video:
        args.subparser.error("no inputs (give image or video files and/or --video PATH)")
    for low, high in (("min_pixels", "max_pixels"), ("video_min_pixels", "video_max_pixels")):
        low_value, high_value = getattr(args, low), getattr(args, high)
        if low_value is not None and high_value is not None and low_value > high_value:
            args.subparser.error(
                f"--{low.replace('_', '-')} {low_value} is larger than --{high.replace('_', '-')} {high_value}"
            )


def _resolve_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise CliError(f"--device {name}: {error}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CliError(f"--device {name}: CUDA is not available on this machine")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise CliError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def _default_dtype(device: torch.device) -> str:
    """bf16 on a GPU that computes in it (Ampere and later), fp16 on an older one, fp32 on a CPU."""
    if device.type != "cuda":
        return "float32"
    with torch.cuda.device(device):  # the GPU the run uses, not the current one
        return "bfloat16" if torch.cuda.is_bf16_supported(including_emulation=False) else "float16"


def _check_output(path: Path) -> None:
    if path.is_dir():
        raise CliError(f"{path}: is a directory (--output takes a file path)")
    if not path.parent.is_dir():
        raise CliError(f"{path.parent}: no such directory (for --output {path})")


def _model_kind(model: str | None) -> tuple[type, object, Family, Processing]:
    """The tower class, config, family and input preparation of ``--model`` (from its config.json and processor
    configs alone, so that inputs are checked and sampled before any weight is read), or of the embedded default
    (the family's defaults, images capped at :data:`EMBEDDED_MAX_PIXELS`)."""
    if model is None:
        processing = DEFAULT_FAMILY.processing.for_checkpoint(EMBEDDED_CONFIG)
        processing = dataclasses.replace(processing, max_pixels=EMBEDDED_MAX_PIXELS)
        return VisionTransformer, EMBEDDED_CONFIG, DEFAULT_FAMILY, processing
    try:
        values = read_config(model)
        family = family_of_config(values)
        kind, config = tower_class_of(family), family.read_config(values)
        processing = family.processing.for_checkpoint(config, *read_processor_configs(model))
    except CheckpointError as error:
        raise CliError(str(error)) from None
    except (ValueError, TypeError) as error:
        raise CliError(f"{model}: {error}") from None
    return kind, config, family, processing


def _with_options(processing: Processing, args: argparse.Namespace) -> Processing:
    """The checkpoint's preparation with the command line's overrides. Where only a cap is given below the
    checkpoint's smallest size, the smallest size follows it down."""
    changes = {}
    for name in ("fps", "max_frames", "min_pixels", "max_pixels", "video_min_pixels", "video_max_pixels"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    processing = dataclasses.replace(processing, **changes)
    lowered = {}
    for low, high in (("min_pixels", "max_pixels"), ("video_min_pixels", "video_max_pixels")):
        if getattr(processing, low) > getattr(processing, high):
            if low in changes:
                raise CliError(
                    f"--{low.replace('_', '-')} {changes[low]} is larger than the checkpoint's {high}"
                    f" {getattr(processing, high)}"
                )
            lowered[low] = getattr(processing, high)
    return dataclasses.replace(processing, **lowered)


def _resolve_model(name: str, log) -> Path:
    try:
        return resolve_model(name, log)
    except CheckpointError as error:
        raise CliError(str(error)) from None


def _load_tower(
    model: Path | None,
    dtype: torch.dtype,
    device: torch.device,
    parallel: str | None = None,
    kind: type = VisionTransformer,
):
    """The tower of class ``kind`` from checkpoint directory ``model`` (None: the embedded one), in ``parallel``
    mode across the default process group."""
    if model is None:
        full = VisionTransformer(EMBEDDED_CONFIG).init_random_weights(EMBEDDED_SEED)
        if parallel is None:
            return full.to(dtype=dtype, device=device)
        try:
            tower = VisionTransformer(EMBEDDED_CONFIG, parallel=parallel, dtype=dtype, device=device)
        except (ValueError, RuntimeError) as error:
            raise CliError(f"--parallel {parallel}: {error}") from None
        tower.load_full_state_dict(full.state_dict())
        return tower
    try:
        tower = kind.from_pretrained(model, dtype=dtype, device=device, parallel=parallel)
    except CheckpointError as error:
        raise CliError(str(error)) from None
    # A readable checkpoint can still hold a config or tensors that do not make a tower.
    except (ValueError, TypeError) as error:
        raise CliError(f"{model}: {error}") from None
    return tower


def _describe(config, family: Family) -> str:
    if getattr(config, "windowed", False):
        extra = f"windows of {config.window_tokens} tokens, full attention in {list(config.fullatt_block_indexes)}"
    else:
        extra = f"deepstack {list(config.deepstack_visual_indexes)}"
    return (
        f"{family.name} tower: depth {config.depth}, hidden {config.hidden_size}, {config.num_heads} heads, "
        f"patch {config.patch_size}, out {config.out_hidden_size}, {extra}"
    )


def _write_atomically(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write beside ``path`` then rename over it, so readers never see a partial file."""
    from safetensors.torch import save_file

    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(temporary), metadata=metadata)
        os.replace(temporary, path)
    except OSError as error:
        raise CliError(f"{path}: cannot write ({error.strerror or error})") from None
    finally:
        temporary.unlink(missing_ok=True)


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _log(message: str) -> None:
    print(f"qvl: {message}", file=sys.stderr, flush=True)


def _quiet(message: str) -> None:
    """Ranks other than 0 print nothing."""


def _check_extras() -> None:
    try:
        import PIL  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as error:
        raise CliError(f"qvl encode needs pillow and transformers ({error}); pip install 'qvl[hf]'") from None


def _run_encode(args: argparse.Namespace) -> int:
    _check_extras()
    if args.parallel is None:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            # Each rank a launcher started would encode every input and write the same file.
            raise CliError("started by a launcher with several ranks but without --parallel (data or weights)")
        return _encode(args, _resolve_device(args.device))
    import torch.distributed as dist

    from .parallel import init_from_env

    if "WORLD_SIZE" not in os.environ:
        raise CliError("--parallel needs the ranks of a launcher: torchrun --nproc-per-node N -m qvl.vit encode ...")
    joined = not dist.is_initialized()
    device = init_from_env(_resolve_device(args.device))
    try:
        return _encode(args, device)
    finally:
        if joined:
            dist.destroy_process_group()


def _encode(args: argparse.Namespace, device: torch.device) -> int:
    from .parallel import is_main_rank

    log = _log if is_main_rank() else _quiet
    dtype = _DTYPES[args.dtype or _default_dtype(device)]
    try:
        backend = backend_for(device)
    except (RuntimeError, ValueError) as error:
        raise CliError(f"--device {device}: {error}") from None
    output = Path(args.output)
    _check_output(output)
    model = None if args.model is None else _resolve_model(args.model, log)
    kind, model_config, family, processing = _model_kind(model)
    processing = _with_options(processing, args)
    inputs = _collect_inputs(args.images, args.video, processing.fps, processing.max_frames, processing.sample)

    tower = _load_tower(model, dtype, device, args.parallel, kind)
    config = tower.config
    if args.model is None:
        log(
            f"model: embedded random default ({_describe(config, family)}; random weights, seed {EMBEDDED_SEED}: "
            "features carry no meaning; pass --model DIR or a Hub model id for a real checkpoint)"
        )
        log(f"images capped at {processing.max_pixels} pixels for the embedded tower (--max-pixels to change)")
    else:
        log(f"model: {args.model} ({_describe(config, family)})")
    log(f"backend: {_BACKEND_NAMES[backend]} on {device}, {str(dtype).removeprefix('torch.')}")
    if args.compile:
        tower.compile()
    prepare = _Preparer(processing)

    tensors: dict[str, torch.Tensor] = {}
    grids: list[list[int]] = []
    progress = _Progress(len(inputs), enabled=is_main_rank())
    start = time.perf_counter()
    with torch.no_grad():
        for first in range(0, len(inputs), args.batch_size):
            prepared = [prepare(item) for item in inputs[first : first + args.batch_size]]
            pixels = torch.cat([rows for rows, _ in prepared])
            batch_grids = [grid for _, grid in prepared]
            meta = tower.metadata(batch_grids)
            merged, deepstack = tower.encode(pixels, meta)
            counts = list(meta.merged_token_counts)
            # One device-to-host copy per output; clones so that no two saved tensors share storage.
            outputs = {"merged": merged} | {f"deepstack.{j}": d for j, d in enumerate(deepstack)}
            for name, features in outputs.items():
                for offset, part in enumerate(features.cpu().split(counts)):
                    tensors[f"image.{first + offset}.{name}"] = part.clone()
            grids.extend(batch_grids)
            progress.update(len(batch_grids), sum(t * h * w for t, h, w in batch_grids))
    elapsed = time.perf_counter() - start
    progress.close()

    metadata = {
        "sources": json.dumps([item.source for item in inputs]),
        "kinds": json.dumps([item.kind for item in inputs]),
        "sampling": json.dumps([item.sampling for item in inputs]),
        "grid_thw": json.dumps(grids),
        "model": args.model or "embedded-random",
        "dtype": str(dtype).removeprefix("torch."),
        "backend": backend,
        "deepstack_visual_indexes": json.dumps(list(config.deepstack_visual_indexes)),
    }
    if is_main_rank():
        _write_atomically(output, tensors, metadata)
    patches = sum(t * h * w for t, h, w in grids)
    videos = sum(item.kind == "video" for item in inputs)
    included = "decoding and torch.compile's compilation included" if args.compile else "decoding included"
    log(
        f"encoded {_plural(len(inputs) - videos, 'image')}, {_plural(videos, 'video')} ({patches} patches) in "
        f"{elapsed:.2f} s, {included}: {len(inputs) / elapsed:.2f} inputs/s, {patches / elapsed:.0f} patches/s"
    )
    log(f"wrote {output} ({len(tensors)} tensors)" + (f", {args.parallel}-parallel" if args.parallel else ""))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``qvl`` command; returns the exit status (argparse's own exits included)."""
    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:
            # Unknown options reach the top-level parser, whose usage would hide the subcommand's options.
            args.subparser.error(f"unrecognized arguments: {' '.join(unknown)}")
        args.check(args)
    except SystemExit as stop:  # argparse's --help and usage errors
        return int(stop.code or 0)
    try:
        return args.run(args)
    except CliError as error:
        print(f"qvl: error: {str(error).replace(chr(10), ' ')}", file=sys.stderr)
        return EXIT_USAGE
    except torch.OutOfMemoryError:
        print(
            "qvl: error: out of memory (loading the tower or encoding); lower --batch-size or --max-pixels, or pick a"
            " 16-bit --dtype",
            file=sys.stderr,
        )
        return EXIT_RUNTIME
