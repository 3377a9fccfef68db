"""``qvl encode``: output layout, features against the tower run directly on transformers' preprocessing,
videos against transformers' Qwen3-VL video patch layout, checkpoints, and one-line errors.

The command runs in-process on the torch path (the interpreter would take minutes for a whole tower);
one subprocess run of ``python -m qvl.vit`` proves the entry point.
"""

import dataclasses
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

from qvl.kernels import force_backend
from qvl.vit import VisionConfig, VisionTransformer, cli
from qvl.vit.checkpoint import save_vision_checkpoint
from tolerance import assert_error_within
from towers import float64_vision_outputs, hf_vision_model_of, vision_outputs

IMAGE_SIZES = {"square.png": (64, 64), "wide.jpg": (96, 160), "tiny.png": (32, 32)}  # name: (height, width)
TINY_CONFIG = VisionConfig(
    depth=2,
    hidden_size=64,
    num_heads=2,
    intermediate_size=128,
    out_hidden_size=96,
    deepstack_visual_indexes=(0,),
    num_position_embeddings=64,
)


def random_picture(height: int, width: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


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
    return VisionTransformer(cli.EMBEDDED_CONFIG).init_random_weights(cli.EMBEDDED_SEED)


def encode(*argv) -> int:
    with force_backend("torch"):
        return cli.main(["encode", *map(str, argv)])


def read_output(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}, handle.metadata()


def qwen3_vl_image_processor(config: VisionConfig, min_pixels: int, max_pixels: int) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(
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
    assert_error_within(written, truth, vision_outputs(hf, pixel_values, grid_thw), what=f"input {index}")


def test_images_match_the_tower_on_transformers_preprocessing(images, embedded_tower, tmp_path, capsys):
    output = tmp_path / "features.safetensors"
    # batch size 2 splits three images over two forwards; a low --min-pixels keeps the token counts
    # small (the default bounds are checked by the subprocess test)
    assert encode(*images, "--output", output, "--batch-size", 2, "--min-pixels", 1024) == 0
    tensors, metadata = read_output(output)

    processor = qwen3_vl_image_processor(cli.EMBEDDED_CONFIG, 1024, cli.DEFAULT_MAX_PIXELS)
    grids = []
    for index, path in enumerate(images):
        batch = processor(images=[Image.open(path).convert("RGB")], return_tensors="pt")
        grid = batch["image_grid_thw"]
        t, h, w = grid[0].tolist()
        grids.append([t, h, w])
        assert tensors[f"image.{index}.merged"].shape == (t * h * w // 4, cli.EMBEDDED_CONFIG.out_hidden_size)
        assert_features_match(tensors, index, embedded_tower, batch["pixel_values"], grid)
    assert len(tensors) == 3 * (1 + len(cli.EMBEDDED_CONFIG.deepstack_visual_indexes))
    assert grids == [[1, 4, 4], [1, 6, 10], [1, 2, 2]]  # sides already multiples of 32: no resize

    assert json.loads(metadata["sources"]) == [str(path) for path in images]
    assert json.loads(metadata["kinds"]) == ["image"] * 3
    assert json.loads(metadata["grid_thw"]) == grids
    assert json.loads(metadata["deepstack_visual_indexes"]) == [1, 3]
    assert (metadata["model"], metadata["dtype"], metadata["backend"]) == ("embedded-random", "float32", "torch")

    err = capsys.readouterr().err
    assert "embedded random default" in err and "torch reference" in err
    assert "images/s" in err and "patches/s" in err
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

    # min_pixels below 64*96 so the frames keep their size and the reference can skip resizing
    video = [np.asarray(frame, dtype=np.float32).transpose(2, 0, 1) / 255 for frame in frames]
    video = (torch.from_numpy(np.stack(video))[None] - 0.5) / 0.5
    expected, grid_t, grid_h, grid_w = Qwen3VLVideoProcessor().patchify(
        video, patch_size=16, merge_size=2, temporal_patch_size=2
    )
    assert (grid_t, grid_h, grid_w) == (2, 4, 6)

    prepare = cli._Preparer(cli.EMBEDDED_CONFIG, min_pixels=1024, max_pixels=cli.DEFAULT_MAX_PIXELS)
    item = cli._Input("video", str(folder), cli._frame_files(folder))
    rows, grid = prepare(item)
    assert grid == [2, 4, 6]
    torch.testing.assert_close(rows, expected[0], rtol=0, atol=1e-6)

    output = tmp_path / "out.safetensors"
    assert encode(images[0], "--video", folder, "-o", output, "--min-pixels", 1024) == 0
    tensors, metadata = read_output(output)
    assert json.loads(metadata["kinds"]) == ["image", "video"]
    assert json.loads(metadata["grid_thw"])[1] == [2, 4, 6]
    assert tensors["image.1.merged"].shape == (2 * 4 * 6 // 4, cli.EMBEDDED_CONFIG.out_hidden_size)
    assert_features_match(tensors, 1, embedded_tower, expected[0], [[2, 4, 6]])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, VisionTransformer]:
    tower = VisionTransformer(TINY_CONFIG).init_random_weights(3)
    directory = tmp_path_factory.mktemp("ckpt")
    save_vision_checkpoint(directory, dataclasses.asdict(TINY_CONFIG), tower.state_dict())
    return directory, tower


def test_model_directory(images, checkpoint, tmp_path):
    directory, tower = checkpoint
    output = tmp_path / "out.safetensors"
    assert encode(images[1], "--model", directory, "-o", output) == 0
    tensors, metadata = read_output(output)
    assert sorted(tensors) == ["image.0.deepstack.0", "image.0.merged"]
    assert metadata["model"] == str(directory)

    processor = qwen3_vl_image_processor(TINY_CONFIG, cli.QWEN3_VL_MIN_PIXELS, cli.DEFAULT_MAX_PIXELS)
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
        progress = cli._Progress(4, stream)
        progress.update(2, 96)
        progress.close()
    drawn = terminal.getvalue()
    assert "2/4" in drawn and "input/s" in drawn and "patches/s" in drawn and drawn.endswith("\n")
    assert log.getvalue() == ""


@pytest.mark.parametrize(
    "case, reason",
    [
        ("missing image", "no such file"),
        ("text file named .png", "not an image file"),
        ("empty --model directory", "not found"),
        ("garbage safetensors", "safetensors"),
        ("empty --video folder", "no frame images"),
        ("video frames of two sizes", "all frames of a video must have one size"),
    ],
)
def test_errors_are_one_line_naming_the_file_and_write_nothing(case, reason, images, tmp_path, capsys):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    argv = [images[0]]
    if case == "missing image":
        culprit = tmp_path / "nope.png"
        argv.append(culprit)
    elif case == "text file named .png":
        culprit = tmp_path / "fake.png"
        culprit.write_text("hello, not a PNG")
        argv.append(culprit)
    elif case == "empty --model directory":
        (tmp_path / "empty").mkdir()
        culprit = tmp_path / "empty" / "config.json"
        argv += ["--model", tmp_path / "empty"]
    elif case == "garbage safetensors":
        # named by its directory or by the file itself (both start with the directory's path)
        culprit = garbage_checkpoint(tmp_path).parent
        argv += ["--model", culprit]
    elif case == "empty --video folder":
        culprit = tmp_path / "clip"
        culprit.mkdir()
        argv += ["--video", culprit]
    else:
        (tmp_path / "clip").mkdir()
        random_picture(64, 64, 0).save(tmp_path / "clip" / "1.png")
        culprit = tmp_path / "clip" / "2.png"
        random_picture(64, 96, 1).save(culprit)
        argv += ["--video", tmp_path / "clip"]

    assert encode(*argv, "--output", out_dir / "features.safetensors") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"qvl: error: {culprit}") and reason in err, err
    assert list(out_dir.iterdir()) == []


@pytest.mark.parametrize(
    "argv",
    [
        [],  # no inputs
        ["x.png", "--batch-size", "0"],
        ["x.png", "--min-pixels", "4096", "--max-pixels", "1024"],
        ["x.png", "--dtype", "float64"],
    ],
)
def test_usage_errors_exit_2(argv, capsys):
    assert encode(*argv) == 2
    assert "usage: qvl encode" in capsys.readouterr().err


def test_help_documents_the_output_layout(capsys):
    assert cli.main(["encode", "--help"]) == 0
    out = capsys.readouterr().out
    assert "image.{i}.merged" in out and "image.{i}.deepstack.{j}" in out and str(cli.QWEN3_VL_MAX_PIXELS) in out


def test_python_dash_m_entry_point_with_default_pixel_bounds(images, tmp_path):
    output = tmp_path / "features.safetensors"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    command = [sys.executable, "-m", "qvl.vit", "encode", str(images[2]), "-o", str(output)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "torch reference" in result.stderr
    tensors, metadata = read_output(output)
    # Qwen3-VL's min_pixels (256*256) scales the 32x32 image up to 256x256: 16x16 patches, 64 merged rows
    assert json.loads(metadata["grid_thw"]) == [[1, 16, 16]]
    assert tensors["image.0.merged"].shape == (64, cli.EMBEDDED_CONFIG.out_hidden_size)


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
    processor = qwen3_vl_image_processor(cli.EMBEDDED_CONFIG, cli.QWEN3_VL_MIN_PIXELS, cli.DEFAULT_MAX_PIXELS)
    for index, path in enumerate((images[0], images[2])):
        batch = processor(images=[Image.open(path).convert("RGB")], return_tensors="pt")
        for tensors in (expected, got):
            assert_features_match(tensors, index, embedded_tower, batch["pixel_values"], batch["image_grid_thw"])


def test_parallel_without_a_launcher_exits_2(images, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert encode(images[0], "--parallel", "data", "-o", tmp_path / "x.safetensors") == 2
    assert "torchrun" in capsys.readouterr().err
    assert not (tmp_path / "x.safetensors").exists()
