"""The encode job at data-set scale (qvl.vit.encode.job, .loader, .writer): features independent of the packing on both
CPU paths, ``kill -9`` then ``--resume``, peak memory independent of the input count, bad files listed, unwritable
outputs, long videos in chunks, ``--parallel data`` shards, folded images.

Tiny towers (tests/encoding.py's TINY_CONFIG) and images of a few patches keep every run to a fraction of a second;
the runs that must be processes of their own (killed, measured, launched on two ranks) start ``python -m qvl.vit`` on
the torch path with the thread count of the in-process runs they are compared with, bit for bit.
"""

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

from conftest import ON_GPU
from encoding import TINY_CONFIG, encode, make_video, random_picture, read_folder, read_output, save_checkpoint
from qvl.kernels import force_backend
from qvl.vit import VisionConfig, layers
from qvl.vit.encode import loader as encode_loader
from qvl.vit.encode import writer as encode_writer
from qvl.vit.encode.inputs import Input, VideoFile
from qvl.vit.encode.loader import PieceStream
from qvl.vit.encode.options import EncodeOptions
from qvl.vit.encode.prepare import Preparer, decode_image
from qvl.vit.encode.tower import model_kind, with_options
from tolerance import assert_error_within
from towers import float64_vision_outputs, hf_vision_model_of

# (height, width): 2x2 to 6x4 patches at --min-pixels 1024, none resized but the last two.
IMAGE_SHAPES = [(32, 32), (32, 64), (64, 32), (64, 64), (32, 96), (96, 64), (50, 70), (40, 40)]
# Triton's interpreter runs where the suite set it up (TRITON_INTERPRET=1: a machine without a GPU, or asked for).
INTERPRETER = pytest.param(
    "interpreter", marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="TRITON_INTERPRET=0")
)
# On the CPU (a GPU machine's default is its GPU), images and video frames kept at their size (rounded to whole merge
# blocks).
SMALL = ["--device", "cpu", "--min-pixels", 1024, "--max-pixels", 200_000, "--video-min-pixels", 1024]


@contextlib.contextmanager
def torch_threads(count: int):
    """torch on ``count`` threads inside: the features are bit-identical across runs of one thread count (a BLAS
    product's summation order may change with it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def subprocess_env() -> dict[str, str]:
    """A ``python -m qvl.vit`` process on the torch path, on one thread (as the in-process runs it is compared with,
    under :func:`torch_threads`)."""
    return {**os.environ, "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1"}


def module_encode(*argv) -> list[str]:
    """The arguments of ``python`` (or a launcher) that run ``qvl encode ARGV``."""
    return ["-m", "qvl.vit", "encode", *map(str, argv)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny")
    return directory, save_checkpoint(directory)


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("photos")
    for number, (height, width) in enumerate(IMAGE_SHAPES):
        random_picture(height, width, number).save(folder / f"{number:02d}.png")
    return folder


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> Path:
    """A video file of 10 sampled 32x32 frames (at --fps 8): five temporal patches of 2x2 patches."""
    return make_video(tmp_path_factory.mktemp("clip") / "clip.mp4", frames=10, fps=8, size=32)


def by_source(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    """A single-file output's tensors per input path, by their names without the input's number."""
    tensors, metadata = read_output(path)
    sources = json.loads(metadata["sources"])
    features = {source: {} for source in sources}
    for name, tensor in tensors.items():
        _, number, rest = name.split(".", 2)
        features[sources[int(number)]][rest] = tensor
    return features


def assert_same_features(got: dict, expected: dict, what: str) -> None:
    assert got.keys() == expected.keys(), what
    for name in expected:
        assert torch.equal(got[name], expected[name]), f"{what}: {name}"


@pytest.mark.parametrize(
    "backend",
    [
        "torch",
        INTERPRETER,
        # Not yet run on a GPU: there the GEMM library may pick kernels by batch size (the fixed row tiles are the
        # CPU paths'), and a device run says whether features still do not depend on the packing.
        pytest.param("triton", marks=pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")),
    ],
)
def test_features_do_not_depend_on_the_packing(backend, checkpoint, photos, clip, tmp_path):
    """Random packings (input orders, --budget, --batch-size; the video in chunks of other sizes) give every input
    the features it gets alone, bit for bit. On the torch path a larger image (672 patches) takes batches past one
    product tile (qvl.vit.encode.invariance's 512 rows) at other offsets."""
    directory, _ = checkpoint
    paths = sorted(str(path) for path in photos.iterdir())
    if backend == "interpreter":  # each batch costs seconds of interpreted kernels: fewer inputs and packings
        paths, budgets, trials = paths[:5], [12, 24, 64], 2
    else:
        large = tmp_path / "large.png"
        random_picture(384, 448, 99).save(large)
        paths.append(str(large))
        budgets, trials = [12, 64, 1500, 4000], 3
    device = ["--device", "cuda"] if backend == "triton" else []
    common = ["--model", directory, "--video", clip, "--fps", 8, *SMALL, *device]
    listed = tmp_path / "inputs.txt"
    listed.write_text("\n".join(paths))
    alone = tmp_path / "alone.safetensors"
    with torch_threads(2):
        alone_options = ["--batch-size", 1, "--budget", 10**6]  # each input alone, the video in one chunk
        assert encode("--list", listed, *common, *alone_options, "-o", alone, backend=backend) == 0
        expected = by_source(alone)
        # Seed 2 packs the large image behind five others in one batch, and the interpreter's inputs by threes.
        rng = random.Random(2)
        for trial, budget in enumerate(rng.sample(budgets, trials)):
            order = rng.sample(paths, len(paths))
            listed.write_text("\n".join(order))
            batch_size = rng.choice([None, 2, 3])
            output = tmp_path / f"trial{trial}.safetensors"
            sizes = [] if batch_size is None else ["--batch-size", batch_size]
            assert encode("--list", listed, *common, "--budget", budget, *sizes, "-o", output, backend=backend) == 0
            got = by_source(output)
            assert got.keys() == expected.keys()
            for source in expected:
                assert_same_features(got[source], expected[source], f"{source}, budget {budget}, order {order}")


def test_kill_9_mid_run_then_resume_equals_an_uninterrupted_run(checkpoint, photos, tmp_path, capsys):
    """A run killed with SIGKILL once its first shard is written, then ``--resume``d: the folder's features are those
    of an uninterrupted run bit for bit, every input in exactly one shard, and the resumed run encodes exactly the
    inputs the killed one had not written.

    Input 6 is a named pipe until the kill: reading it blocks, so the killed run is certainly mid-run however fast or
    slow this machine is: one shard written (inputs 0-3; a shard holds four), inputs 4 and 5 in flight (read or
    encoded, never written) and lost with the process. Then input 6 becomes a photo."""
    directory, _ = checkpoint
    folder = tmp_path / "photos"
    folder.mkdir()
    for path in sorted(photos.iterdir()):
        (folder / path.name).symlink_to(path)
    held = folder / "06.png"
    held.unlink()
    os.mkfifo(held)
    argv = [folder, "--model", directory, *SMALL, "--budget", 20, "--shard-inputs", 4, "--workers", 0]
    output = tmp_path / "out"
    log = tmp_path / "killed.log"
    with open(log, "w") as stderr:
        command = [sys.executable, *module_encode(*argv, "-o", output)]
        process = subprocess.Popen(command, env=subprocess_env(), stderr=stderr)
    try:
        deadline = time.monotonic() + 120
        while not list(output.glob("shard-*.safetensors")) and process.poll() is None:
            assert time.monotonic() < deadline, "no shard within 120 s"
            time.sleep(0.01)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert process.returncode == -signal.SIGKILL, log.read_text()
    held.unlink()
    random_picture(48, 80, 6).save(held)

    # What the kill left is readable: whole shards (a temporary file at most, which --resume clears).
    written, _ = encode_writer.read_shards(output)
    done = sorted(entry["input"] for entry in written)
    assert done == [0, 1, 2, 3]
    count = len(IMAGE_SHAPES)
    with torch_threads(1):
        assert encode(*argv, "-o", output, "--resume") == 0
        resumed = capsys.readouterr().err
        assert encode(*argv, "-o", tmp_path / "uninterrupted") == 0
    assert f"{len(done)} of {count} inputs already written" in resumed
    assert f"qvl: encoded {count - len(done)} images," in resumed
    tensors, entries = read_folder(output)
    expected, expected_entries = read_folder(tmp_path / "uninterrupted")
    assert_same_features(tensors, expected, "resumed")
    assert [entry["input"] for entry in entries] == list(range(count))
    assert [entry["source"] for entry in entries] == [entry["source"] for entry in expected_entries]
    assert not list(output.glob(".*.tmp"))


# Peak resident memory of this process and of its waited-for children (the loader's workers), in KiB (Linux).
PEAK_RSS_SCRIPT = """
import resource, sys
from qvl.vit import cli
status = cli.main(["encode", *sys.argv[1:]])
print(status, *(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))
"""
# Wide outputs (2 x 2048 fp32 values a merged token: 64 KiB for a 64x64 image), so that features held in memory
# instead of streamed out would show far above the allocator's noise.
WIDE_CONFIG = VisionConfig(
    depth=1,
    hidden_size=32,
    num_heads=1,
    intermediate_size=64,
    out_hidden_size=2048,
    deepstack_visual_indexes=(0,),
    num_position_embeddings=64,
)


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss is in KiB on Linux (bytes on macOS)")
def test_peak_memory_does_not_grow_with_the_input_count(photos, tmp_path):
    """2,000 small inputs encode with the peak RSS of 200 (the encoding process and its loader worker): the features
    stream out to shards, so ten times the inputs add a fraction of what holding their features would."""
    directory = tmp_path / "wide"
    save_checkpoint(directory, WIDE_CONFIG)
    image = photos / "03.png"  # 64x64: 4 merged tokens
    peaks, written = {}, {}
    for count in (200, 2000):
        listed = tmp_path / f"{count}.txt"
        listed.write_text(f"{image}\n" * count)
        output = tmp_path / f"out{count}"
        argv = ["--list", listed, "--model", directory, *SMALL, "--budget", 256, "--shard-size", "2M", "--workers", 1]
        command = [sys.executable, "-c", PEAK_RSS_SCRIPT, *map(str, argv), "-o", str(output)]
        result = subprocess.run(command, env=subprocess_env(), capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
        status, main_kib, worker_kib = map(int, result.stdout.split())
        assert status == 0
        peaks[count] = main_kib * 1024, worker_kib * 1024
        written[count] = sum(path.stat().st_size for path in output.glob("shard-*.safetensors"))
    added = written[2000] - written[200]
    assert added > 100 * 2**20  # what holding the features of the 1,800 more inputs would cost
    for process, small, large in zip(("encoding process", "loader worker"), peaks[200], peaks[2000], strict=True):
        assert large - small < added / 4, f"{process}: peak RSS {small / 2**20:.0f} MiB -> {large / 2**20:.0f} MiB"


def write_bad_files(folder: Path, photo: Path) -> dict[Path, str]:
    """A truncated PNG (in a subfolder), text named .jpg, an empty file and a dangling link, written into ``folder``:
    ``{their paths: what their reason says}``."""
    (folder / "nested").mkdir(parents=True, exist_ok=True)
    data = photo.read_bytes()
    (folder / "nested" / "truncated.png").write_bytes(data[: len(data) // 2])
    (folder / "text.jpg").write_text("not a photo")
    (folder / "empty.png").write_bytes(b"")
    (folder / "dangling.png").symlink_to(folder / "gone.png")
    return {
        folder / "nested" / "truncated.png": "unreadable image",
        folder / "text.jpg": "not an image file PIL can read",
        folder / "empty.png": "not an image file PIL can read",
        folder / "dangling.png": "no such file",
    }


def test_a_folder_with_corrupt_and_unreadable_files_finishes_listing_them(checkpoint, photos, tmp_path, capsys):
    """A folder (searched recursively) with corrupt and unreadable files among its photos: the photos are encoded,
    each bad file is reported and listed in index.jsonl with its reason, and the run succeeds. A run with only bad
    files lists them too and exits 2."""
    directory, _ = checkpoint
    folder = tmp_path / "photos"
    folder.mkdir()
    for name in ("00.png", "03.png"):
        (folder / name).write_bytes((photos / name).read_bytes())
    reasons = write_bad_files(folder, photos / "05.png")
    output = tmp_path / "out"
    assert encode(folder, "--model", directory, *SMALL, "-o", output) == 0
    log = capsys.readouterr().err
    tensors, entries = read_folder(output)
    listed = {Path(entry["source"]): entry for entry in entries}
    assert sorted(listed) == sorted([folder / "00.png", folder / "03.png", *reasons])
    for path, reason in reasons.items():
        entry = listed[path]
        assert reason in entry["error"] and entry["keys"] == [], entry
        assert f"qvl: skipped {path}: {entry['error']}\n" in log
    for name in ("00.png", "03.png"):
        entry = listed[folder / name]
        assert entry["error"] is None and entry["keys"] and set(entry["keys"]) <= tensors.keys()
    assert "skipped 4 inputs" in log

    bad = tmp_path / "bad"
    reasons = write_bad_files(bad, photos / "05.png")
    only_bad = tmp_path / "only-bad"
    assert encode(bad, "--model", directory, *SMALL, "-o", only_bad) == 2
    assert capsys.readouterr().err.endswith("qvl: error: no input could be encoded (4 inputs skipped)\n")
    tensors, entries = read_folder(only_bad)
    assert tensors == {} and sorted(Path(entry["source"]) for entry in entries) == sorted(reasons)
    assert all(reasons[Path(entry["source"])] in entry["error"] for entry in entries)


@pytest.mark.parametrize("name", ["features", "features.safetensors"])
def test_an_output_known_unwritable_fails_in_one_line_before_encoding(name, checkpoint, photos, capsys):
    """An output on a file system that takes no new files (/proc; permission bits would not stop root): one line
    naming it, exit status 2, before the checkpoint or any input is read."""
    directory, _ = checkpoint
    assert encode(photos, "--model", directory, *SMALL, "-o", f"/proc/{name}") == 2
    [line] = capsys.readouterr().err.splitlines()
    assert re.fullmatch(rf"qvl: error: /proc: cannot write there \(.+; for --output /proc/{name}\)", line), line


# What safetensors raises where the disk fills up (not an OSError).
DISK_FULL = 'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'


def fail_writing(monkeypatch, when) -> None:
    """safetensors' writes in qvl.vit.encode.writer fail as on a full disk where ``when(path of the file being
    written)`` is true (the writer writes ``.NAME.PID.tmp`` beside each file NAME, then renames it)."""
    save_file = encode_writer.save_file

    def failing(tensors, path, metadata=None):
        if when(Path(path)):
            Path(path).write_bytes(b"partial")  # a write that started, as the real one would leave it
            raise SafetensorError(DISK_FULL)
        save_file(tensors, path, metadata=metadata)

    monkeypatch.setattr(encode_writer, "save_file", failing)


def test_an_output_failing_mid_run_fails_in_one_line_leaving_nothing_half_written(
    checkpoint, photos, tmp_path, capsys, monkeypatch
):
    """Where the output fails only while encoding (a full disk): one line naming the file, exit status 2, no
    traceback. A folder keeps its complete shards (readable: --resume continues), and no partial file; a single file
    is not written at all, nor is anything left beside it."""
    directory, _ = checkpoint
    argv = [photos, "--model", directory, *SMALL, "--budget", 20, "--shard-inputs", 2]
    folder = tmp_path / "out"
    shards = []  # the shards written to, by their final names

    def second_shard(temporary: Path) -> bool:
        shards.append(temporary.name[1:].rsplit(".", 2)[0])
        return len(shards) == 2

    fail_writing(monkeypatch, second_shard)
    assert encode(*argv, "-o", folder) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1] == f"qvl: error: {folder / shards[1]}: cannot write ({DISK_FULL})"
    assert not any("Traceback" in line for line in lines)
    entries, _ = encode_writer.read_shards(folder)
    assert sorted(entry["input"] for entry in entries) == [0, 1]
    assert [path.name for path in folder.iterdir()] == [shards[0]]

    single = tmp_path / "single" / "features.safetensors"
    single.parent.mkdir()
    fail_writing(monkeypatch, lambda path: path.name.startswith(f".{single.name}"))
    assert encode(*argv, "-o", single) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1] == f"qvl: error: {single}: cannot write ({DISK_FULL})"
    assert list(single.parent.iterdir()) == []


@pytest.fixture(scope="module")
def long_video(tmp_path_factory) -> Path:
    """64 frames of 32x32 noise at 8 fps (all of them sampled at --fps 8): 32 temporal patches of 2x2 patches."""
    return make_video(tmp_path_factory.mktemp("long") / "long.mp4", frames=64, fps=8, size=32)


def test_a_long_video_encodes_in_chunks_with_the_whole_videos_features(checkpoint, long_video, tmp_path, monkeypatch):
    """The video in chunks of one or two temporal patches (bounded by --budget, or by the loader's bytes of decoded
    frames) gives the features of the whole video encoded at once, bit for bit."""
    directory, _ = checkpoint
    argv = [long_video, "--model", directory, "--fps", 8, *SMALL]
    runs = {"whole": ["--budget", 10**6], "budget": ["--budget", 4], "bytes": ["--budget", 10**6]}
    features = {}
    for name, options in runs.items():
        if name == "bytes":  # two temporal patches' decoded frames a chunk
            monkeypatch.setattr(encode_loader, "CHUNK_BYTES", 4 * 32 * 32 * 3)
        output = tmp_path / f"{name}.safetensors"
        assert encode(*argv, *options, "-o", output) == 0
        features[name], metadata = read_output(output)
        assert json.loads(metadata["grid_thw"]) == [[32, 2, 2]]
    assert_same_features(features["budget"], features["whole"], "chunks by budget")
    assert_same_features(features["bytes"], features["whole"], "chunks by bytes")


def test_a_long_video_is_decoded_chunk_by_chunk(checkpoint, long_video, monkeypatch):
    """The loader holds one chunk of a video at a time: when a chunk comes out, exactly its frames and the earlier
    chunks' have been decoded (none ahead), and each is within the budget."""
    directory, _ = checkpoint
    _, _, _, processing = model_kind(directory)
    processing = with_options(processing, EncodeOptions(fps=8, video_min_pixels=1024))
    decoded = []
    frames = VideoFile.frames

    def counted(self, indices):
        for frame in frames(self, indices):
            decoded.append(frame)
            yield frame

    monkeypatch.setattr(VideoFile, "frames", counted)
    stream = PieceStream([], processing, budget=8, preparer=Preparer(processing, "cpu"))
    given = 0
    for part, piece in enumerate(stream.pieces(Input(0, "video", str(long_video)))):
        assert piece.failure is None and piece.part == part and piece.grid == [2, 2, 2] and piece.patches <= 8
        given += 2 * piece.grid[0]
        assert len(decoded) == given
    assert piece.last and given == 64


def test_data_parallel_ranks_write_shards_whose_union_is_the_single_process_run(checkpoint, photos, clip, tmp_path):
    """``torchrun --nproc-per-node 2 -m qvl.vit encode --parallel data`` (gloo): each rank encodes every second input
    and writes its own shards, rank 0 the index of all; the shards' union is the single-process run's features, bit
    for bit."""
    directory, _ = checkpoint
    argv = [photos, "--video", clip, "--model", directory, "--fps", 8, *SMALL, "--budget", 20, "--shard-inputs", 2]
    single, ranks = tmp_path / "single", tmp_path / "ranks"
    with torch_threads(1):
        assert encode(*argv, "-o", single) == 0
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command = [*launcher, *module_encode(*argv, "--parallel", "data", "-o", ranks)]
    result = subprocess.run(command, env=subprocess_env(), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("qvl: wrote") == 1 and "data-parallel over 2 ranks" in result.stderr

    expected, expected_entries = read_folder(single)
    tensors, entries = read_folder(ranks)
    assert_same_features(tensors, expected, "the ranks' shards")
    assert [entry["input"] for entry in entries] == [entry["input"] for entry in expected_entries]
    count = len(IMAGE_SHAPES) + 1
    assert [entry["input"] for entry in entries] == list(range(count))
    for entry in entries:
        assert entry["shard"].startswith(f"shard-r{entry['input'] % 2}-"), entry


@pytest.mark.parametrize("backend", ["torch", INTERPRETER])
def test_encode_folds_images_within_the_rule_of_the_unfolded_run(backend, checkpoint, photos, tmp_path, monkeypatch):
    """qvl encode gives the tower an image's frame once (folded rows, the patch embedding's temporal slices summed):
    its features are the unfolded run's (the tower on transformers' rows, each frame in both slots) within the
    tolerance rule against a float64 transformers model with the tower's weights."""
    directory, tower = checkpoint
    folds = []
    folded_patch_weight = layers.folded_patch_weight
    monkeypatch.setattr(layers, "folded_patch_weight", lambda proj: folds.append(proj) or folded_patch_weight(proj))
    names = ["00.png", "06.png"]  # as they are, and resized
    output = tmp_path / "out.safetensors"
    assert encode(*(photos / name for name in names), "--model", directory, *SMALL, "-o", output, backend=backend) == 0
    assert folds
    tensors, metadata = read_output(output)
    processing = with_options(model_kind(directory)[3], EncodeOptions(min_pixels=1024, max_pixels=200_000))
    hf = hf_vision_model_of(tower)
    for number, name in enumerate(names):
        rows, grid = Preparer(processing, "cpu").image(torch.from_numpy(decode_image(photos / name)))
        assert rows.shape[1] == TINY_CONFIG.patch_dim and json.loads(metadata["grid_thw"])[number] == grid
        with force_backend(backend), torch.no_grad():
            merged, deepstack = tower(rows, [grid])
        written = [tensors[f"image.{number}.merged"], tensors[f"image.{number}.deepstack.0"]]
        truth = float64_vision_outputs(hf, rows, [grid])
        assert_error_within(written, truth, [merged, *deepstack], what=f"{backend} {name}")
