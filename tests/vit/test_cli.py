"""``qvl encode``: output layout, features against the tower run directly on transformers' preprocessing,
videos against transformers' Qwen3-VL video patch layout, video files against transformers' PyAV reading
and Qwen3-VL frame sampling, checkpoints, and one-line errors.

The command runs in-process on the torch path (the interpreter would take minutes for a whole tower);
one subprocess run of ``python -m qvl.vit`` proves the entry point.
"""

import contextlib
import dataclasses
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen2VLImageProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.video_utils import VideoMetadata, read_video_pyav

from encoding import TINY_CONFIG, encode, make_video, random_picture, read_output, save_checkpoint
from qvl.vit import VisionConfig, VisionTransformer, cli, families, processing
from qvl.vit.encode import tower as encode_tower
from qvl.vit.encode.errors import EncodeError
from qvl.vit.encode.inputs import VideoFile, frame_files
from qvl.vit.encode.options import EMBEDDED_MAX_PIXELS
from qvl.vit.encode.prepare import Preparer
from qvl.vit.encode.progress import Progress
from tolerance import assert_error_within, resolution
from towers import MODEL_STAGES, float64_vision_outputs, hf_vision_model_of, vision_outputs

IMAGE_SIZES = {"square.png": (64, 64), "wide.jpg": (96, 160), "tiny.png": (32, 32)}  # name: (height, width)
EMBEDDED_CONFIG = encode_tower.EMBEDDED_CONFIG


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> list[Path]:
    folder = tmp_path_factory.mktemp("images")
    paths = []
    for seed, (name, (height, width)) in enumerate(IMAGE_SIZES.items()):
        random_picture(height, width, seed).save(folder / name)
        paths.append(folder / name)
    return paths


@pytest.fixture(scope="module")
def embedded_tower() -> VisionTransformer:
    return VisionTransformer(EMBEDDED_CONFIG).init_random_weights(encode_tower.EMBEDDED_SEED)


def qwen3_vl_image_processor(config: VisionConfig, min_pixels: int, max_pixels: int) -> Qwen2VLImageProcessor:
    return Qwen2VLImageProcessor(
        patch_size=config.patch_size,
        temporal_patch_size=config.temporal_patch_size,
        merge_size=config.spatial_merge_size,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        min_pixels=min_pixels,
        max_pixels=max_pixels,
    )


def assert_features_match(tensors, index: int, tower: VisionTransformer, pixel_values, grid_thw) -> None:
    """Input ``index``'s features are the tower's on these pixels, by the suite's rule (tests/tolerance.py):
    their error against a float64 transformers model with the tower's weights is at most twice that
    model's own in the tower's dtype, plus two units of the dtype's resolution at the output's scale."""
    deepstack = [f"image.{index}.deepstack.{j}" for j in range(len(tower.config.deepstack_visual_indexes))]
    written = [tensors[name] for name in [f"image.{index}.merged", *deepstack]]
    hf = hf_vision_model_of(tower)
    truth = float64_vision_outputs(hf, pixel_values, grid_thw)
    assert_error_within(
        written, truth, vision_outputs(hf, pixel_values, grid_thw), what=f"input {index}", stages=MODEL_STAGES
    )


def test_images_match_the_tower_on_transformers_preprocessing(images, embedded_tower, tmp_path, capsys):
    output = tmp_path / "features.safetensors"
    # batch size 2 splits three images over two forwards; a low --min-pixels keeps the token counts
    # small (the default bounds are checked by the subprocess test)
    assert encode(*images, "--output", output, "--batch-size", 2, "--min-pixels", 1024) == 0
    tensors, metadata = read_output(output)

    processor = qwen3_vl_image_processor(EMBEDDED_CONFIG, 1024, EMBEDDED_MAX_PIXELS)
    grids = []
    for index, path in enumerate(images):
        batch = processor(images=[Image.open(path).convert("RGB")], return_tensors="pt")
        grid = batch["image_grid_thw"]
        t, h, w = grid[0].tolist()
        grids.append([t, h, w])
        assert tensors[f"image.{index}.merged"].shape == (t * h * w // 4, EMBEDDED_CONFIG.out_hidden_size)
        assert_features_match(tensors, index, embedded_tower, batch["pixel_values"], grid)
    assert len(tensors) == 3 * (1 + len(EMBEDDED_CONFIG.deepstack_visual_indexes))
    assert grids == [[1, 4, 4], [1, 6, 10], [1, 2, 2]]  # sides already multiples of 32: no resize

    assert json.loads(metadata["sources"]) == [str(path) for path in images]
    assert json.loads(metadata["kinds"]) == ["image"] * 3
    assert json.loads(metadata["grid_thw"]) == grids
    assert json.loads(metadata["deepstack_visual_indexes"]) == [1, 3]
    assert (metadata["model"], metadata["dtype"], metadata["backend"]) == ("embedded-random", "float32", "torch")

    err = capsys.readouterr().err
    assert "embedded random default" in err and "torch CPU path" in err
    assert "inputs/s" in err and "patches/s" in err and "images/s" not in err and "compilation" not in err
    assert [p.name for p in tmp_path.iterdir()] == ["features.safetensors"]  # no temporary file left


def test_video_folder_pairs_frames_like_transformers_video_processor(images, embedded_tower, tmp_path):
    folder = tmp_path / "clip"
    folder.mkdir()
    # Three frames: padded to four by repeating the last, so t = 2; named so that only a numeric sort
    # gets them in order.
    frames = [random_picture(64, 96, seed) for seed in (10, 11, 12)]
    for number, frame in zip((1, 2, 10), frames):
        frame.save(folder / f"frame{number}.png")
    (folder / "notes.txt").write_text("not a frame")

    # video min_pixels below 3*64*96 so the frames keep their size and the reference can skip resizing
    video = [np.asarray(frame, dtype=np.float32).transpose(2, 0, 1) / 255 for frame in frames]
    video = (torch.from_numpy(np.stack(video))[None] - 0.5) / 0.5
    expected, grid_t, grid_h, grid_w = Qwen3VLVideoProcessor().patchify(
        video, patch_size=16, merge_size=2, temporal_patch_size=2
    )
    assert (grid_t, grid_h, grid_w) == (2, 4, 6)

    prepare = Preparer(dataclasses.replace(encode_tower.model_kind(None)[3], video_min_pixels=1024), "cpu")
    decoded = [np.asarray(Image.open(path)) for path in frame_files(str(folder))]
    rows, grid = prepare.video(torch.from_numpy(np.stack(decoded)))
    assert grid == [2, 4, 6]
    # Normalized in fp32 in another order than transformers' (values in [-1, 1]): a few roundings of one ulp apart.
    torch.testing.assert_close(rows, expected[0], rtol=0, atol=4 * resolution(torch.float32))

    output = tmp_path / "out.safetensors"
    assert encode(images[0], "--video", folder, "-o", output, "--min-pixels", 1024, "--video-min-pixels", 1024) == 0
    tensors, metadata = read_output(output)
    assert json.loads(metadata["kinds"]) == ["image", "video"]
    assert json.loads(metadata["grid_thw"])[1] == [2, 4, 6]
    assert tensors["image.1.merged"].shape == (2 * 4 * 6 // 4, EMBEDDED_CONFIG.out_hidden_size)
    assert_features_match(tensors, 1, embedded_tower, expected[0], [[2, 4, 6]])


def decode_all(path: Path) -> list[np.ndarray]:
    with av.open(str(path)) as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]


def test_sample_frame_indices_equal_qwen3_vl_video_processor():
    """processing.sample_frame_indices is transformers' Qwen3VLVideoProcessor.sample_frames (callable without
    torchvision) over frame counts, frame rates, --fps and --max-frames, edge cases included."""
    checked = 0
    for max_frames in (1, 3, 4, 5, 16, 768):
        processor = Qwen3VLVideoProcessor(max_frames=max_frames)
        for total in (1, 2, 3, 4, 5, 7, 16, 31, 100, 901, 5000):
            for video_fps in (1.0, 8.0, 23.976023976023978, 25.0, 29.97002997002997, 60.0):
                for fps in (0.5, 1.0, 2.0, 3.3, 30.0):
                    expected = processor.sample_frames(VideoMetadata(total_num_frames=total, fps=video_fps), fps=fps)
                    got = processing.sample_frame_indices(total, video_fps, fps, max_frames)
                    assert got == expected.tolist(), (total, video_fps, fps, max_frames)
                    checked += 1
    assert checked == 6 * 11 * 6 * 5
    # by hand: 16 frames at 8 fps are 2 s, 4 frames at 2 fps from frame 0 to 15; at least 4 frames
    # (min_frames) where there are that many; a stream with no rate counts as 24 fps, as in transformers
    assert processing.sample_frame_indices(16, 8.0) == [0, 5, 10, 15]
    assert processing.sample_frame_indices(16, 8.0, fps=4.0) == [0, 2, 4, 6, 9, 11, 13, 15]
    assert processing.sample_frame_indices(16, 8.0, max_frames=3) == [0, 8, 15]
    assert processing.sample_frame_indices(3, 30.0) == [0, 1, 2]
    fallback = processing.sample_frame_indices(240, None)  # 10 s: 20 frames, 0 to 239 in steps of 239/19
    assert fallback == processing.sample_frame_indices(240, 24.0) and len(fallback) == 20 and fallback[::19] == [0, 239]


@pytest.mark.parametrize("suffix", [".mp4", ".mov"])
def test_video_file_frames_equal_transformers_read_video_pyav(suffix, tmp_path):
    """Where the container states its frame count (transformers' reader trusts it; WebM and Matroska leave
    it 0), the frames the CLI decodes and samples are transformers' read_video_pyav's, bit for bit."""
    path = make_video(tmp_path / f"clip{suffix}", frames=30, fps=10)
    processor = Qwen3VLVideoProcessor()
    for fps in (2.0, 5.0):
        expected, metadata = read_video_pyav(path, sample_indices_fn=processor.sample_frames, fps=fps)
        video = VideoFile(str(path))
        count, rate = video.probe()
        indices = processing.sample_frame_indices(count, rate, fps)
        assert (count, rate, indices) == (30, 10.0, metadata.frames_indices.tolist())
        np.testing.assert_array_equal(np.stack(list(video.frames(indices))), expected)
    assert len(expected) == 15  # 3 s at --fps 5


@pytest.mark.parametrize(
    "suffix, frames, fps, options, indices",
    [
        (".mp4", 16, 8, [], [0, 5, 10, 15]),  # 2 s at 2 fps
        (".webm", 16, 8, ["--fps", "4"], [0, 2, 4, 6, 9, 11, 13, 15]),
        (".mkv", 16, 8, ["--max-frames", "3"], [0, 8, 15]),  # odd count: padded like a frame folder
        (".mov", 3, 8, [], [0, 1, 2]),  # shorter than min_frames: all frames
    ],
)
def test_video_file_equals_its_sampled_frames_as_a_folder(suffix, frames, fps, options, indices, tmp_path):
    """A video file is decoded, sampled, then encoded on the frame folders' path: its output is bit for bit
    that of a folder holding the frames at the sampled numbers (decoded here with PyAV)."""
    video = make_video(tmp_path / f"clip{suffix}", frames, fps, seed=frames)
    folder = tmp_path / "frames"
    folder.mkdir()
    decoded = decode_all(video)
    assert len(decoded) == frames
    for index in indices:
        Image.fromarray(decoded[index]).save(folder / f"{index}.png")

    from_file, from_folder = tmp_path / "file.safetensors", tmp_path / "folder.safetensors"
    # A low video min_pixels keeps the 64x64 frames at their size.
    assert encode(video, "-o", from_file, "--video-min-pixels", 1024, *options) == 0
    assert encode("--video", folder, "-o", from_folder, "--video-min-pixels", 1024) == 0
    tensors, metadata = read_output(from_file)
    expected, expected_metadata = read_output(from_folder)
    assert sorted(tensors) == sorted(expected)
    for name in expected:
        assert torch.equal(tensors[name], expected[name]), name
    grid = [(len(indices) + 1) // 2, 4, 4]
    assert json.loads(metadata["grid_thw"]) == json.loads(expected_metadata["grid_thw"]) == [grid]
    assert json.loads(metadata["kinds"]) == ["video"]
    assert json.loads(metadata["sampling"]) == [{"frames": frames, "fps": float(fps), "indices": indices}]
    assert json.loads(expected_metadata["sampling"]) == [None]


def test_video_files_mix_with_images_and_folders_in_order(images, embedded_tower, tmp_path):
    """Positional inputs keep their order (images and video files), then --video inputs (a video file of any
    name, a folder)."""
    clip = make_video(tmp_path / "clip.mp4", frames=8, fps=4)
    renamed = tmp_path / "clip.data"
    renamed.write_bytes(clip.read_bytes())
    folder = tmp_path / "frames"
    folder.mkdir()
    for number in range(2):
        random_picture(64, 64, number).save(folder / f"{number}.png")
    output = tmp_path / "out.safetensors"
    argv = [images[0], clip, images[2], "--video", renamed, "--video", folder, "-o", output]
    argv += ["--min-pixels", 1024, "--video-min-pixels", 1024]
    assert encode(*argv, "--batch-size", 2) == 0
    tensors, metadata = read_output(output)
    assert json.loads(metadata["sources"]) == [str(path) for path in (images[0], clip, images[2], renamed, folder)]
    assert json.loads(metadata["kinds"]) == ["image", "video", "image", "video", "video"]
    assert json.loads(metadata["grid_thw"]) == [[1, 4, 4], [2, 4, 4], [1, 2, 2], [2, 4, 4], [1, 4, 4]]
    sampling = json.loads(metadata["sampling"])
    assert sampling[1] == sampling[3] == {"frames": 8, "fps": 4.0, "indices": [0, 2, 5, 7]}
    assert sampling[0] is sampling[2] is sampling[4] is None
    # The same file under two names, in batches of different shapes: each name's features are the tower's on the
    # frames it sampled, by the suite's rule.
    prepare = Preparer(dataclasses.replace(encode_tower.model_kind(None)[3], video_min_pixels=1024), "cpu")
    rows, grid = prepare.video(torch.from_numpy(np.stack(list(VideoFile(str(clip)).frames(sampling[1]["indices"])))))
    assert grid == [2, 4, 4]
    for index in (1, 3):
        assert_features_match(tensors, index, embedded_tower, rows, [grid])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, VisionTransformer]:
    directory = tmp_path_factory.mktemp("ckpt")
    return directory, save_checkpoint(directory)


def test_model_directory_photo_gets_the_checkpoints_grid(checkpoint, tmp_path, capsys):
    """A 1920x1080 photo through --model DIR with Qwen3-VL's preprocessor_config.json: transformers' grid (68 x 120
    patches, not shrunk to a fixed cap), and the features of those pixels."""
    directory, tower = checkpoint
    model = tmp_path / "model"
    model.mkdir()
    for file in directory.iterdir():
        (model / file.name).symlink_to(file)
    stated = {
        "size": {"longest_edge": 16777216, "shortest_edge": 65536},
        "image_mean": [0.5] * 3,
        "image_std": [0.5] * 3,
    }
    (model / "preprocessor_config.json").write_text(json.dumps({**stated, "patch_size": 16, "merge_size": 2}))
    photo = tmp_path / "photo.jpg"
    random_picture(1080, 1920, 5).save(photo)
    output = tmp_path / "out.safetensors"
    assert encode(photo, "--model", model, "-o", output) == 0
    tensors, metadata = read_output(output)
    assert json.loads(metadata["grid_thw"]) == [[1, 68, 120]]

    processor = Qwen2VLImageProcessor(**stated, patch_size=16, merge_size=2)
    batch = processor(images=[Image.open(photo).convert("RGB")], return_tensors="pt")
    assert batch["image_grid_thw"].tolist() == [[1, 68, 120]]
    assert_features_match(tensors, 0, tower, batch["pixel_values"], batch["image_grid_thw"])


def test_model_directory(images, checkpoint, tmp_path):
    directory, tower = checkpoint
    output = tmp_path / "out.safetensors"
    assert encode(images[1], "--model", directory, "-o", output) == 0
    tensors, metadata = read_output(output)
    assert sorted(tensors) == ["image.0.deepstack.0", "image.0.merged"]
    assert metadata["model"] == str(directory)

    processor = qwen3_vl_image_processor(TINY_CONFIG, processing.QWEN3_VL_MIN_PIXELS, processing.QWEN3_VL_MAX_PIXELS)
    batch = processor(images=[Image.open(images[1]).convert("RGB")], return_tensors="pt")
    assert tensors["image.0.merged"].shape[1] == TINY_CONFIG.out_hidden_size
    assert_features_match(tensors, 0, tower, batch["pixel_values"], batch["image_grid_thw"])


def garbage_checkpoint(tmp_path: Path) -> Path:
    directory = tmp_path / "garbage"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(dataclasses.asdict(TINY_CONFIG)))
    (directory / "model.safetensors").write_bytes(b"\xff" * 64)
    return directory / "model.safetensors"


def test_exif_orientation_is_applied(tmp_path):
    path = tmp_path / "rotated.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # stored 96 wide x 64 high, shown rotated by 90 degrees: 64 wide x 96 high
    random_picture(64, 96, 20).save(path, exif=exif)
    output = tmp_path / "out.safetensors"
    assert encode(path, "-o", output, "--min-pixels", 1024) == 0
    assert json.loads(read_output(output)[1]["grid_thw"]) == [[1, 6, 4]]


def test_progress_bar_draws_only_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal, log = Terminal(), io.StringIO()
    for stream in (terminal, log):
        progress = Progress(4, stream)
        progress.update(2, 96)
        progress.close()
    drawn = terminal.getvalue()
    assert "2/4" in drawn and "input/s" in drawn and "patches/s" in drawn and drawn.endswith("\n")
    assert log.getvalue() == ""


@pytest.mark.parametrize(
    "case, reason",
    [
        ("missing image", "no such file"),
        ("missing video file", "no such file"),
        ("missing --video path", "no such file or directory"),
        ("empty --model directory", "not found"),
        ("garbage safetensors", "safetensors"),
    ],
)
def test_usage_errors_are_one_line_naming_the_file_and_write_nothing(case, reason, images, tmp_path, capsys):
    """What is wrong before any input is read (a path named on the command line that does not exist, a checkpoint
    that does not load): one line naming it, exit status 2, nothing written."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    argv = [images[0]]
    if case == "missing image":
        culprit = tmp_path / "nope.png"
        argv.append(culprit)
    elif case == "missing video file":
        culprit = tmp_path / "clip.mkv"
        argv.append(culprit)
    elif case == "missing --video path":
        culprit = tmp_path / "nothing"
        argv += ["--video", culprit]
    elif case == "empty --model directory":
        (tmp_path / "empty").mkdir()
        culprit = tmp_path / "empty" / "config.json"
        argv += ["--model", tmp_path / "empty"]
    else:
        # named by its directory or by the file itself (both start with the directory's path)
        culprit = garbage_checkpoint(tmp_path).parent
        argv += ["--model", culprit]

    assert encode(*argv, "--output", out_dir / "features.safetensors") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"qvl: error: {culprit}") and reason in err, err
    assert list(out_dir.iterdir()) == []


def audio_only(path: Path, with_empty_video_stream: bool) -> Path:
    """A Matroska file with an AAC track and, if asked, a video stream that holds no frames."""
    with av.open(str(path), "w") as container:
        if with_empty_video_stream:
            video = container.add_stream("mpeg4", rate=8)
            video.width = video.height = 64
        audio = container.add_stream("aac", rate=48000, layout="mono")
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 4800), dtype=np.float32), format="fltp", layout="mono")
        frame.sample_rate = 48000
        for packet in [*audio.encode(frame), *audio.encode()]:
            container.mux(packet)
    return path


def test_unreadable_inputs_are_skipped_with_their_reasons(images, tmp_path, capsys):
    """Inputs that cannot be read (not images, corrupt or frameless videos, frame folders without frames or of two
    frame sizes) are each reported on one line with the reason, skipped and listed in the output's errors; the
    readable one is encoded and the run succeeds."""
    bad = {}
    fake_png = tmp_path / "fake.png"
    fake_png.write_text("hello, not a PNG")
    bad[fake_png] = "not an image file"
    fake_mp4 = tmp_path / "fake.mp4"
    fake_mp4.write_text("hello, not a video")
    bad[fake_mp4] = "not a video file PyAV can decode"
    corrupt = make_video(tmp_path / "corrupt.mp4", frames=8, fps=8)  # the container opens; the frames do not decode
    data = bytearray(corrupt.read_bytes())
    for offset in range(2000, len(data) - 2000, 7):
        data[offset] ^= 0x55
    corrupt.write_bytes(bytes(data))
    bad[corrupt] = "not a video file PyAV can decode"
    bad[audio_only(tmp_path / "audio.mkv", with_empty_video_stream=False)] = "no video stream"
    bad[audio_only(tmp_path / "frameless.mkv", with_empty_video_stream=True)] = "no video frames"
    text = tmp_path / "clip.txt"
    text.write_text("hello, not a video")
    empty_folder = tmp_path / "empty_clip"
    empty_folder.mkdir()
    two_sizes = tmp_path / "two_sizes"
    two_sizes.mkdir()
    random_picture(64, 64, 0).save(two_sizes / "1.png")
    random_picture(64, 96, 1).save(two_sizes / "2.png")
    videos = {text: "not a video file PyAV can decode", empty_folder: "no frame images",
              two_sizes: "all frames of a video must have one size"}  # fmt: skip
    argv = [images[0], *bad, *[arg for path in videos for arg in ("--video", path)]]
    output = tmp_path / "out.safetensors"
    assert encode(*argv, "-o", output, "--min-pixels", 1024) == 0
    err = capsys.readouterr().err
    tensors, metadata = read_output(output)
    expected = {**bad, **videos}
    errors = json.loads(metadata["errors"])
    assert json.loads(metadata["sources"]) == [str(path) for path in (images[0], *expected)]
    assert errors[0] is None and sorted(tensors) == ["image.0.deepstack.0", "image.0.deepstack.1", "image.0.merged"]
    for error, (path, reason) in zip(errors[1:], expected.items(), strict=True):
        assert reason in error, (path, error)
        assert f"qvl: skipped {path}: {error}\n" in err
    assert f"skipped {len(expected)} inputs" in err


def test_without_pyav_video_files_are_skipped_saying_so(images, tmp_path, capsys, monkeypatch):
    clip = make_video(tmp_path / "clip.mp4", frames=8, fps=8)
    monkeypatch.setitem(sys.modules, "av", None)  # import av raises ImportError
    output = tmp_path / "out.safetensors"
    assert encode(images[2], clip, "-o", output, "--min-pixels", 1024) == 0
    assert "pip install av" in json.loads(read_output(output)[1]["errors"])[1]
    assert f"qvl: skipped {clip}: " in capsys.readouterr().err


def test_without_pyav_images_and_folders_still_encode(images, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "av", None)
    folder = tmp_path / "frames"
    folder.mkdir()
    random_picture(64, 64, 0).save(folder / "0.png")
    assert encode(images[2], "--video", folder, "-o", tmp_path / "out.safetensors", "--min-pixels", 1024) == 0


@pytest.mark.parametrize(
    "argv",
    [
        [],  # no inputs
        ["x.png", "--batch-size", "0"],
        ["x.png", "--budget", "0"],
        ["x.png", "--workers", "-1"],
        ["x.png", "--shard-size", "12Q"],
        ["x.png", "--min-pixels", "4096", "--max-pixels", "1024"],
        ["x.png", "--video-min-pixels", "4096", "--video-max-pixels", "1024"],
        ["x.png", "--no-such-option"],  # the subcommand's own usage, not the top-level one
        ["x.png", "--dtype", "float64"],
        ["x.mp4", "--fps", "0"],
        ["x.mp4", "--fps", "nan"],
        ["x.mp4", "--fps", "two"],
        ["x.mp4", "--max-frames", "0"],
    ],
)
def test_usage_errors_exit_2(argv, capsys):
    assert encode(*argv) == 2
    assert "usage: qvl encode" in capsys.readouterr().err


def test_cuda_devices_and_dtypes_are_checked_before_loading(monkeypatch):
    """On a machine with one GPU (faked): --device cuda:7 is a usage error, and the default dtype is bf16 where the
    GPU computes in it, fp16 on an older one."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(EncodeError, match=r"--device cuda:7: this machine has 1 CUDA device"):
        encode_tower.resolve_device("cuda:7")
    assert encode_tower.resolve_device("cuda:0") == torch.device("cuda:0")
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    for supported, dtype in ((True, "bfloat16"), (False, "float16")):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True, s=supported: s)
        assert encode_tower.default_dtype(torch.device("cuda")) == dtype
    assert encode_tower.default_dtype(torch.device("cpu")) == "float32"


def test_help_documents_the_output_layout(capsys):
    assert cli.main(["encode", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "image.{i}.merged" in out and "image.{i}.deepstack.{j}" in out and "index.jsonl" in out
    assert "--fps F" in out and "--max-frames N" in out and ".webm" in out and "linspace" in out
    # The help's defaults, written without importing torch, are the processing module's.
    assert f"4096^2 ({processing.QWEN3_VL_MAX_PIXELS}) pixels" in out and f"{EMBEDDED_MAX_PIXELS} (512^2)" in out
    assert f"else {processing.QWEN3_VL_VIDEO_FPS:g}, Qwen3-VL's" in out
    assert f"transformers' default {processing.QWEN3_VL_MAX_FRAMES};" in out


def test_help_and_usage_errors_answer_without_importing_torch():
    code = (
        "import sys; from qvl.vit import cli; "
        "codes = [cli.main(['encode', '--help']), cli.main(['encode', 'x.png', '--budget', '0'])]; "
        "print(codes, 'torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.splitlines()[-1] == "[0, 2] False", result.stdout + result.stderr


def test_python_dash_m_entry_point_with_default_pixel_bounds(images, tmp_path):
    output = tmp_path / "features.safetensors"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    command = [sys.executable, "-m", "qvl.vit", "encode", str(images[2]), "-o", str(output)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "torch CPU path (fused SDPA attention)" in result.stderr
    tensors, metadata = read_output(output)
    # Qwen3-VL's min_pixels (256*256) scales the 32x32 image up to 256x256: 16x16 patches, 64 merged rows
    assert json.loads(metadata["grid_thw"]) == [[1, 16, 16]]
    assert tensors["image.0.merged"].shape == (64, EMBEDDED_CONFIG.out_hidden_size)


def test_torchrun_weights_parallel_equals_single_process(images, embedded_tower, tmp_path):
    """`torchrun --nproc-per-node 2 -m qvl.vit encode --parallel weights`: rank 0 writes what one process would."""
    single, sharded = tmp_path / "single.safetensors", tmp_path / "sharded.safetensors"
    assert encode(images[0], images[2], "-o", single) == 0
    env = {**os.environ, "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "qvl.vit",
        "encode",
        str(images[0]),
        str(images[2]),
        "--parallel",
        "weights",
        "-o",
        str(sharded),
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stderr.count("qvl: wrote") == 1 and "weights-parallel" in result.stderr
    expected, _ = read_output(single)
    got, _ = read_output(sharded)
    assert sorted(got) == sorted(expected)
    # The shards' split sums round differently, so the two need not be bit-equal: each is held to the
    # tower's rounding, hence both to each other's.
    processor = qwen3_vl_image_processor(EMBEDDED_CONFIG, processing.QWEN3_VL_MIN_PIXELS, EMBEDDED_MAX_PIXELS)
    for index, path in enumerate((images[0], images[2])):
        batch = processor(images=[Image.open(path).convert("RGB")], return_tensors="pt")
        for tensors in (expected, got):
            assert_features_match(tensors, index, embedded_tower, batch["pixel_values"], batch["image_grid_thw"])


def test_parallel_without_a_launcher_exits_2(images, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert encode(images[0], "--parallel", "data", "-o", tmp_path / "x.safetensors") == 2
    assert "torchrun" in capsys.readouterr().err
    assert not (tmp_path / "x.safetensors").exists()
    # The other way round: ranks of a launcher without --parallel would each encode everything into one file.
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert encode(images[0], "-o", tmp_path / "x.safetensors") == 2
    assert "without --parallel" in capsys.readouterr().err
    assert not (tmp_path / "x.safetensors").exists()


def import_without_torchvision(module_name: str, monkeypatch):
    """A transformers module that imports torchvision at the top but whose code under test never calls it:
    torchvision does not import next to the CPU torch here, so empty modules stand in for it during the import."""
    import importlib
    import types

    for name in (
        "torchvision",
        "torchvision.transforms",
        "torchvision.transforms.v2",
        "torchvision.transforms.v2.functional",
    ):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.delitem(sys.modules, module_name, raising=False)
    return importlib.import_module(module_name)


def test_sample_frame_indices_qwen2_equal_qwen2_vl_video_processor(monkeypatch):
    """processing.sample_frame_indices_qwen2 is transformers' Qwen2VLVideoProcessor.sample_frames with fps
    (Qwen2-VL's and Qwen2.5-VL's): whole temporal patches. Where transformers fails, a video shorter than one
    patch is kept whole, and a max_frames below one patch takes one patch's frames (never the whole video)."""
    module = import_without_torchvision("transformers.models.qwen2_vl.video_processing_qwen2_vl", monkeypatch)
    Qwen2VLVideoProcessor = module.Qwen2VLVideoProcessor  # noqa: N806
    checked = 0
    for max_frames in (1, 3, 4, 5, 16, 768):
        processor = Qwen2VLVideoProcessor(max_frames=max_frames)
        for total in (1, 2, 3, 4, 5, 7, 16, 31, 100, 901, 5000):
            for video_fps in (1.0, 8.0, 23.976023976023978, 29.97002997002997, 60.0):
                for fps in (0.5, 2.0, 3.3, 30.0):
                    got = processing.sample_frame_indices_qwen2(total, video_fps, fps, max_frames)
                    metadata = VideoMetadata(total_num_frames=total, fps=video_fps)
                    try:
                        expected = processor.sample_frames(metadata, fps=fps).tolist()
                    except ZeroDivisionError:  # no whole temporal patch fits
                        assert min(total, max_frames) < 2
                        assert got == (list(range(total)) if total < 2 else [0, total // 2]), (total, max_frames)
                        continue
                    assert got == expected and len(got) % 2 == 0, (total, video_fps, fps, max_frames)
                    checked += 1
    assert checked > 900


@pytest.fixture(scope="module")
def qwen2_checkpoints(tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    """Tiny random full Qwen2.5-VL and Qwen2-VL models saved as transformers saves them, and their vision towers."""
    from test_qwen2_towers import qwen2_5_full_config, qwen2_full_config
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

    from towers import randomize

    root = tmp_path_factory.mktemp("qwen2")
    checkpoints = {}
    for name, config, model_class in (
        ("qwen2_5_vl", qwen2_5_full_config(), Qwen2_5_VLForConditionalGeneration),
        ("qwen2_vl", qwen2_full_config(), Qwen2VLForConditionalGeneration),
    ):
        model = randomize(model_class(config), seed=17).eval()
        model.save_pretrained(root / name)
        visual = model.model.visual
        visual.config._attn_implementation = "sdpa"
        checkpoints[name] = root / name, visual
    return checkpoints


@pytest.mark.parametrize("name", ["qwen2_5_vl", "qwen2_vl"])
def test_qwen2_checkpoints_encode_with_their_family_preprocessing(name, qwen2_checkpoints, images, tmp_path, capsys):
    """--model DIR of a Qwen2.5-VL / Qwen2-VL checkpoint: the tower kind from config.json, transformers' Qwen2-VL
    image processor with its own settings (patch 14, CLIP mean and std, 56x56 smallest image), no deepstack
    outputs, and a video file sampled in whole temporal patches; features within rounding of transformers."""
    from test_hf_patch import float64_run
    from test_qwen2_towers import FAMILIES

    checkpoint, visual = qwen2_checkpoints[name]
    video = make_video(tmp_path / "clip.mp4", frames=7, fps=4, size=56)
    output = tmp_path / "out.safetensors"
    assert encode(images[0], images[2], video, "--model", checkpoint, "-o", output) == 0
    log = capsys.readouterr().err
    assert f"{families.family_of(name).name} tower" in log and "patch 14" in log
    assert ("windows of 16 tokens" in log) == (name == "qwen2_5_vl")
    tensors, metadata = read_output(output)
    assert sorted(tensors) == ["image.0.merged", "image.1.merged", "image.2.merged"]
    assert json.loads(metadata["deepstack_visual_indexes"]) == []
    # 7 frames at 4 fps are 1.75 s: 3.5 frames at 2 fps, at least 4, rounded down to whole temporal patches.
    assert json.loads(metadata["sampling"])[2]["indices"] == [0, 1, 3, 5]

    # The checkpoints have no processor configs: transformers' defaults, which are Qwen2-VL's.
    processor = Qwen2VLImageProcessor()
    assert processor.patch_size == 14 and processor.size["shortest_edge"] == processing.QWEN2_VL_MIN_PIXELS
    assert (
        tuple(processor.image_mean) == processing.QWEN2_VL_IMAGE_MEAN
        and tuple(processor.image_std) == processing.QWEN2_VL_IMAGE_STD
    )
    for index, path in enumerate((images[0], images[2])):
        batch = processor(images=[Image.open(path).convert("RGB")], return_tensors="pt")
        pixels, grid = batch["pixel_values"], batch["image_grid_thw"]

        def run(model, pixels=pixels, grid=grid):
            return model(pixels.to(model.dtype), grid_thw=grid).pooler_output

        with torch.no_grad():
            baseline = run(visual)
        truth = float64_run(visual, run, *FAMILIES[name][3])
        assert_error_within(
            tensors[f"image.{index}.merged"], truth, baseline, what=f"{name} input {index}", stages=MODEL_STAGES
        )
