"""The ``qvl`` command line (also ``python -m qvl.vit``): argument parsing and wiring.

``qvl encode`` is the encode job (:mod:`qvl.vit.encode`): this module turns its arguments into
:class:`~qvl.vit.encode.options.EncodeOptions` and runs :func:`qvl.vit.encode.job.run`. Parsing imports no torch
(nor anything that does), so ``--help`` and argument errors answer at once; each subcommand's ``run`` imports what it
needs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .encode.errors import EncodeError
from .encode.options import (
    DEFAULT_BUDGET,
    DEFAULT_RAY_GROUP,
    DEFAULT_SHARD_BYTES,
    EMBEDDED_MAX_PIXELS,
    FORMATS,
    EncodeOptions,
    parse_size,
)

__all__ = ["ENCODE_EPILOG", "build_parser", "main"]

ENCODE_EPILOG = f"""\
inputs: files (any image format PIL reads; video files .mp4 .webm .mkv .mov .avi .m4v), folders (searched
recursively for both), glob patterns ('photos/**/*.jpg', quoted), --list files of paths (one a line, '-' for
stdin) and --video (a video file of any name, or a folder of frame images ordered by name, frame2 before frame10).
They are numbered in that order: the positional inputs as given (a folder's files and a pattern's matches in
natural order), then the --list files' lines, then the --video inputs. A path named on the command line must
exist; an input that cannot be read (corrupt, unreadable, not an image) is reported with its reason, skipped and
listed in the output, and the run goes on (exit status 2 when no input at all could be encoded).
data-set files are inputs too, one per sample: WebDataset tar shards (.tar, uncompressed; a sample's image is its
member with an image extension, its key the member name up to the first dot: source shard.tar/KEY), Parquet files
and datasets save_to_disk folders (a row's --image-column: raw bytes or datasets' {{bytes, path}}; source
file.parquet#ROW); brace ranges such as 'data-{{000000..000099}}.tar' expand like globs.

output: -o PATH ending in .safetensors is one file, written at the end (for small jobs; the features are held
until then); any other PATH is a folder of shards written as features arrive (--shard-size, --shard-inputs),
each atomically, plus index.jsonl at the end. Tensors, for each input i:
  image.{{i}}.merged          (n_i, out_hidden)  main merger output; n_i = t*h*w / merge_size**2
  image.{{i}}.deepstack.{{j}}   (n_i, out_hidden)  deepstack merger j (layer deepstack_visual_indexes[j])
one file's metadata (safetensors string metadata; lists are JSON, one item per input):
  sources    input paths        kinds   "image" or "video"      errors   null, or why the input was skipped
  sampling   per input: null, or for a video file {{"frames": decoded count, "fps": its frame rate,
             "indices": the sampled frame numbers (0-based)}}
  grid_thw   [t, h, w] patch grid per input (t = frames / temporal_patch_size, padded up; null if skipped)
  model      checkpoint dir or "embedded-random"   dtype, backend, deepstack_visual_indexes
read back with safetensors.safe_open(path, "pt"): .get_tensor("image.0.merged"), .metadata()
--format parquet (or -o OUT.parquet): one row per encoded input: input, key, source, kind, grid_thw, merged,
deepstack_0, ... (a list of out_hidden-long float lists per token; float32 for fp32 and bf16 runs): read with
pyarrow, pandas or datasets.load_dataset("parquet", data_files="OUT/*.parquet").
a shard folder's index.jsonl: one JSON object per input, in order: input (its i), source, kind, shard (the file
holding its tensors), keys, grid_thw, sampling, size and mtime_ns (the file's when read), error.
--resume continues a folder: the inputs in its complete shards are skipped (same inputs, same order, same model,
dtype and preparation; a changed file is an error). A crash or kill -9 loses at most the inputs not yet in a
written shard.

--ray [ADDRESS] runs the stages on Ray Data (pip install 'qvl[data]'): decoding and preparation in CPU tasks, the
tower in --ray-actors actors (one per GPU by default) that load the checkpoint once, each group of --shard-inputs
inputs (default {DEFAULT_RAY_GROUP}) written as one shard named after its inputs, so a retried task or restarted
actor writes it once; the features are the single process's, bit for bit on a CPU for one thread count. ADDRESS:
auto, HOST:PORT or ray://HOST:PORT (a cluster), none or local (a Ray started here with --ray-cpus CPUs).

batches: inputs are packed up to --budget patches per forward; a larger input runs alone, and a video runs in
chunks of whole temporal patches within the budget (decoded, prepared and encoded chunk by chunk: any length
fits in memory), with the features of encoding it whole. An input's features do not depend on what shares its
batch: on a CPU (eager) they are bit-identical under any packing, budget or rank count, for one thread count.

preparation is the checkpoint's: every parameter (min/max pixels, patch, temporal patch and merge size,
mean/std, video fps and min/max frames) comes from --model's processor configs (processor_config.json,
preprocessor_config.json, video_preprocessor_config.json, read as transformers reads them), else from the family's
transformers defaults; the tower kind is read from its config.json. Images: bicubic resize to multiples of
patch*merge within the image bounds (--min-pixels, --max-pixels override them), as transformers' Qwen2-VL image
processor; an image with transparency is laid over white, as transformers does. Videos: the family's video
processor, within the video bounds (--video-min-pixels, --video-max-pixels override them; Qwen3-VL counts frames x
frame area, Qwen2-VL and Qwen2.5-VL each frame); frames must all be the same size; an odd frame count is padded by
repeating the last frame. Family defaults: Qwen3-VL (Qwen3.5, Qwen3-Omni): mean = std = 0.5, images 256^2 to
4096^2 (16777216) pixels; Qwen2-VL and Qwen2.5-VL: OpenAI CLIP's mean and std, images 56^2 to 1280 * 28^2 pixels.
Decoding (and, on a CPU, preparation) runs in --workers processes beside the tower; on a GPU the uint8 pixels go
to the device and are prepared there. On a CPU the default is no worker where the tower's torch threads take
every core (torch's default): a worker would take a core from one of them, and every parallel region of the
tower would wait for that thread; inputs are then decoded between batches and prepared on the tower's threads.
With fewer threads (OMP_NUM_THREADS=N, N below the cores) one worker runs per core left, at most 4.

video files are decoded with PyAV (pip install av) to RGB and sampled as the family's video processor samples
(Qwen2-VL's and Qwen2.5-VL's as theirs do with do_sample_frames on; they keep every frame by default): n = frames /
video_fps * --fps, clamped to [min_frames, --max-frames] and to the frame count; Qwen3-VL: int(n) frames at
round(linspace(0, frames - 1, n)); Qwen2-VL / Qwen2.5-VL: n rounded down to whole temporal patches, frames at
arange(0, frames, frames / n) truncated. Frame folders are used whole (they have no frame rate).

--model takes a checkpoint directory or a Hugging Face Hub model id (Qwen/Qwen3-VL-8B-Instruct): only config.json,
the processor configs and the safetensors shards holding the vision tower are downloaded, into the Hugging Face
cache (HF_HOME, HF_HUB_CACHE); with HF_HUB_OFFLINE=1 only that cache is read.

without --model the embedded default runs: a small Qwen3-VL-shaped tower with random weights (seed 0),
for trying the pipeline on a machine with no checkpoint; its features carry no meaning, and its images are
capped at {EMBEDDED_MAX_PIXELS} (512^2) pixels to keep CPU runs short.

exit status: 0 success, 2 bad arguments, a checkpoint or output that cannot be used, or no input that could be
encoded (one line naming the file or option on stderr), 1 failure while encoding (e.g. out of memory).
"""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _add_encode(commands) -> None:
    encode = commands.add_parser(
        "encode",
        help="encode images and videos to vision features (a safetensors file or a folder of shards)",
        description="Encode images and videos (files, folders, lists, globs; video files or folders of frame "
        "images) with the vision tower and write the merged and deepstack features.",
        epilog=ENCODE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    inputs = encode.add_argument_group("inputs")
    inputs.add_argument(
        "images",
        nargs="*",
        metavar="INPUT",
        help="image and video files, folders (searched recursively) and glob patterns",
    )
    inputs.add_argument(
        "--list",
        action="append",
        default=[],
        dest="lists",
        metavar="FILE",
        help="a file of input paths, one a line ('-': standard input); repeatable",
    )
    inputs.add_argument(
        "--image-column",
        metavar="NAME",
        help="the image column of Parquet files and datasets folders (default: 'image', else their only column of "
        "image bytes)",
    )
    inputs.add_argument(
        "--video",
        action="append",
        default=[],
        metavar="PATH",
        help="a video: a video file of any name PyAV decodes, or a folder of frame images ordered by name "
        "(frame2 before frame10); repeatable",
    )
    preparation = encode.add_argument_group("model and preparation")
    preparation.add_argument(
        "--model",
        metavar="DIR_OR_HUB_ID",
        help="checkpoint directory (config.json + safetensors), or a Hugging Face Hub model id such as "
        "Qwen/Qwen3-VL-8B-Instruct (only the vision tower's files are downloaded, into the Hugging Face cache; "
        "HF_HUB_OFFLINE=1 reads only the cache); default: the embedded random-weight tower",
    )
    preparation.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32"),
        help="compute dtype (default: bfloat16 on a GPU with bf16 math, Ampere on; float16 on an older one; "
        "float32 on CPU)",
    )
    preparation.add_argument("--device", help="torch device, e.g. cpu, cuda, cuda:1 (default: cuda if available)")
    preparation.add_argument("--compile", action="store_true", help="torch.compile the tower's forward")
    preparation.add_argument(
        "--fps",
        type=_positive_float,
        metavar="F",
        help="frames sampled per second of a video file (default: the checkpoint's video processor's, else 2, "
        "Qwen3-VL's video processor's default, for every family)",
    )
    preparation.add_argument(
        "--max-frames",
        type=_positive_int,
        metavar="N",
        help="most frames sampled from a video file (default: the checkpoint's video processor's; transformers' "
        "default 768; at least its min_frames are sampled where the video has them, unless N is smaller)",
    )
    preparation.add_argument(
        "--min-pixels",
        type=_positive_int,
        metavar="N",
        help="smallest resized image, in pixels (default: the checkpoint's image processor's)",
    )
    preparation.add_argument(
        "--max-pixels",
        type=_positive_int,
        metavar="N",
        help="largest resized image, in pixels (default: the checkpoint's image processor's, e.g. Qwen3-VL's "
        f"16777216; the embedded tower's {EMBEDDED_MAX_PIXELS})",
    )
    preparation.add_argument(
        "--video-min-pixels",
        type=_positive_int,
        metavar="N",
        help="smallest resized video as its video processor counts it (Qwen3-VL: frames x frame area; Qwen2-VL, "
        "Qwen2.5-VL: each frame); default: the checkpoint's video processor's",
    )
    preparation.add_argument(
        "--video-max-pixels",
        type=_positive_int,
        metavar="N",
        help="largest resized video, counted as --video-min-pixels is (default: the checkpoint's video processor's)",
    )
    output = encode.add_argument_group("output")
    output.add_argument(
        "--output",
        "-o",
        default="features.safetensors",
        metavar="PATH",
        help="a .safetensors file, or a folder of shards (any other path) (default: %(default)s)",
    )
    output.add_argument(
        "--format",
        choices=FORMATS,
        help="the shards' format (default: an --output ending in .parquet or .safetensors is one file of that "
        "format; a folder gets safetensors shards)",
    )
    output.add_argument(
        "--shard-size",
        type=_size,
        default=DEFAULT_SHARD_BYTES,
        metavar="SIZE",
        help="a shard is written once it holds this many bytes of features, e.g. 64M, 1G (default: 256M)",
    )
    output.add_argument(
        "--shard-inputs",
        type=_positive_int,
        metavar="N",
        help="a shard is written once it holds N inputs (default: by --shard-size alone)",
    )
    output.add_argument(
        "--resume", action="store_true", help="continue the run whose shards are in the --output folder"
    )
    running = encode.add_argument_group("running")
    running.add_argument(
        "--budget",
        type=_positive_int,
        default=DEFAULT_BUDGET,
        metavar="PATCHES",
        help="patches per forward (default: %(default)s; a 1920x1080 photo is 8160 at Qwen3-VL's settings)",
    )
    running.add_argument(
        "--batch-size", type=_positive_int, metavar="N", help="most inputs per forward (default: no limit)"
    )
    running.add_argument(
        "--workers",
        type=_non_negative_int,
        metavar="N",
        help="decoding processes beside the tower; 0 decodes in the main process (default on a CPU: one per core "
        "the tower's torch threads leave free, at most 4: 0 with torch's default threads, one per core; for a "
        "GPU: cores - 1, at most 8)",
    )
    running.add_argument(
        "--parallel",
        choices=("data", "weights"),
        help="run across the ranks torchrun starts (torchrun --nproc-per-node N -m qvl.vit encode ...): 'data': "
        "each rank encodes its share of the inputs and writes its own shards (rank 0 the index); 'weights' "
        "shards the layers, rank 0 writes",
    )
    ray = encode.add_argument_group("Ray (pip install 'qvl[data]')")
    ray.add_argument(
        "--ray",
        nargs="?",
        const="",
        metavar="ADDRESS",
        help="run on Ray Data: a cluster's ADDRESS (auto, HOST:PORT, ray://HOST:PORT), or none (or local) for a Ray "
        "started on this machine",
    )
    ray.add_argument(
        "--ray-cpus", type=_positive_int, metavar="N", help="CPUs of the Ray started here (default: every core)"
    )
    ray.add_argument(
        "--ray-actors",
        type=_positive_int,
        metavar="N",
        help="tower actors (default: one per GPU of the cluster; on a CPU, one)",
    )
    ray.add_argument(
        "--ray-actor-cpus",
        type=_positive_int,
        metavar="N",
        help="CPUs each tower actor holds, its torch threads on a CPU (default: 1 beside a GPU; on a CPU, half the "
        "cluster's CPUs over the actors); the other CPUs decode and prepare",
    )
    encode.set_defaults(run=_run_encode, check=_check_encode_args, subparser=encode)


def build_parser() -> argparse.ArgumentParser:
    """The ``qvl`` parser: one subparser per command, each with defaults ``run`` (the command, given the parsed
    arguments, returning the exit status), ``check`` (checks argparse cannot express, exiting through the
    subcommand's usage) and ``subparser``."""
    parser = argparse.ArgumentParser(
        prog="qvl",
        description="Qwen vision towers (Qwen3-VL, Qwen3.5, Qwen3-Omni, Qwen2.5-VL, Qwen2-VL) on qvl's Triton kernels.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_encode(commands)
    _add_check(commands)
    return parser


def _add_check(commands) -> None:
    # Listed here for qvl --help; main hands qvl check's arguments to qvl.kernels.check, which parses them.
    commands.add_parser(
        "check",
        help="check qvl's kernels on this machine against float64 and record which faster variants are right here"
        " (qvl check --help)",
        add_help=False,
    )


def _is_ray_address(text: str) -> bool:
    return text in ("", "auto", "local") or ":" in text


def _check_encode_args(args: argparse.Namespace) -> None:
    if args.ray is not None and not _is_ray_address(args.ray):
        # Not an address (auto, local, HOST:PORT, ray://...): the first input, which --ray's optional value took.
        args.images = [args.ray, *args.images]
        args.ray = ""
    if args.ray == "local":
        args.ray = ""
    if args.ray_cpus is not None and args.ray:
        args.subparser.error(f"--ray-cpus: sets the CPUs of a Ray started here, not of the cluster at {args.ray}")
    for name in ("ray_cpus", "ray_actors", "ray_actor_cpus"):
        if getattr(args, name) is not None and args.ray is None:
            args.subparser.error(f"--{name.replace('_', '-')}: only with --ray")
    if not args.images and not args.video and not args.lists:
        args.subparser.error("no inputs (give image or video files, folders, --list FILE or --video PATH)")
    for low, high in (("min_pixels", "max_pixels"), ("video_min_pixels", "video_max_pixels")):
        low_value, high_value = getattr(args, low), getattr(args, high)
        if low_value is not None and high_value is not None and low_value > high_value:
            args.subparser.error(
                f"--{low.replace('_', '-')} {low_value} is larger than --{high.replace('_', '-')} {high_value}"
            )


def _encode_options(args: argparse.Namespace) -> EncodeOptions:
    return EncodeOptions(
        inputs=tuple(args.images),
        videos=tuple(args.video),
        lists=tuple(args.lists),
        image_column=args.image_column,
        output=args.output,
        format=args.format,
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        compile=args.compile,
        fps=args.fps,
        max_frames=args.max_frames,
        min_pixels=args.min_pixels,
        max_pixels=args.max_pixels,
        video_min_pixels=args.video_min_pixels,
        video_max_pixels=args.video_max_pixels,
        parallel=args.parallel,
        budget=args.budget,
        batch_size=args.batch_size,
        workers=args.workers,
        shard_bytes=args.shard_size,
        shard_inputs=args.shard_inputs,
        resume=args.resume,
        ray=args.ray,
        ray_cpus=args.ray_cpus,
        ray_actors=args.ray_actors,
        ray_actor_cpus=args.ray_actor_cpus,
    )


def _run_encode(args: argparse.Namespace) -> int:
    from .encode.job import run

    return run(_encode_options(args))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``qvl`` command; returns the exit status (argparse's own exits included)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["check"]:
        from qvl.kernels.check import main as check_main

        try:
            return check_main(argv[1:])
        except SystemExit as stop:
            return int(stop.code or 0)
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
    except EncodeError as error:
        print(f"qvl: error: {str(error).replace(chr(10), ' ')}", file=sys.stderr)
        return error.status
