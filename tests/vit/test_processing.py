"""Inputs as a checkpoint's own processors prepare them: for each family, qvl's ``pixel_values`` and ``grid_thw`` equal
those of transformers' image and video processor classes built from the same processor config dicts (written here
as the released checkpoints' ``preprocessor_config.json`` / ``video_preprocessor_config.json`` state them; nothing is
downloaded).

transformers' video processors need torchvision; where it is missing, the tests that call them skip, and the video
sizes and patch layout are still checked against transformers' pure-Python ``smart_resize`` and ``patchify``.
"""

import importlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from test_cli import import_without_torchvision
from transformers import Qwen2VLImageProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.video_utils import VideoMetadata

from qvl.vit import families
from qvl.vit.checkpoint import read_processor_configs
from qvl.vit.encode.prepare import Preparer, decode_image

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
QWEN2_VIDEO_MODULE = "transformers.models.qwen2_vl.video_processing_qwen2_vl"
QWEN2_IMAGE = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": CLIP_MEAN,
    "image_std": CLIP_STD,
    "image_processor_type": "Qwen2VLImageProcessor",
}
# family name: (preprocessor_config.json, video_preprocessor_config.json or None, transformers' video processor
# module). Qwen2-VL's and Qwen2.5-VL's checkpoints have no video config: their video processor reads
# preprocessor_config.json.
FAMILY_PROCESSORS = {
    "Qwen3-VL": (
        {
            "size": {"longest_edge": 16777216, "shortest_edge": 65536},
            "patch_size": 16,
            "temporal_patch_size": 2,
            "merge_size": 2,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "image_processor_type": "Qwen2VLImageProcessorFast",
            "processor_class": "Qwen3VLProcessor",
        },
        {
            "size": {"longest_edge": 25165824, "shortest_edge": 4096},
            "patch_size": 16,
            "temporal_patch_size": 2,
            "merge_size": 2,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "video_processor_type": "Qwen3VLVideoProcessor",
            "processor_class": "Qwen3VLProcessor",
        },
        "transformers.models.qwen3_vl.video_processing_qwen3_vl",
    ),
    "Qwen2.5-VL": ({**QWEN2_IMAGE, "processor_class": "Qwen2_5_VLProcessor"}, None, QWEN2_VIDEO_MODULE),
    "Qwen2-VL": ({**QWEN2_IMAGE, "processor_class": "Qwen2VLProcessor"}, None, QWEN2_VIDEO_MODULE),
}
# (height, width): tiny (scaled up to the smallest size), elongated, past 512^2 (the old fixed cap), a 1080p photo.
IMAGE_SHAPES = [(20, 30), (37, 301), (600, 700), (1080, 1920)]
# The grid transformers gives a 1920x1080 photo: 32-px merge blocks (Qwen3-VL) or 28-px ones, no downscaling.
GRID_1080P = {"Qwen3-VL": [1, 68, 120], "Qwen2.5-VL": [1, 78, 138], "Qwen2-VL": [1, 78, 138]}
# (frames, height, width): an odd count (padded by the last frame), an elongated clip, one smaller than a patch.
VIDEO_SHAPES = [(5, 90, 130), (4, 40, 300), (2, 12, 20)]


def has_torchvision() -> bool:
    try:
        import torchvision  # noqa: F401
    except ImportError:
        return False
    return True


def video_module(name: str, monkeypatch):
    """transformers' video processor module of family ``name``; one that imports torchvision at the top is imported
    past it where torchvision is missing (only its pure-Python parts are then called)."""
    module_name = FAMILY_PROCESSORS[name][2]
    if has_torchvision():
        return importlib.import_module(module_name)
    return import_without_torchvision(module_name, monkeypatch)


def video_processor_class(name: str, monkeypatch) -> type:
    module = video_module(name, monkeypatch)
    return module.Qwen3VLVideoProcessor if name == "Qwen3-VL" else module.Qwen2VLVideoProcessor


def family(name: str) -> families.Family:
    return next(f for f in families.FAMILIES if f.name == name)


def tower_config(name: str):
    return family(name).config_class.from_dict({}, **family(name).config_options)


def write_checkpoint_configs(directory: Path, name: str) -> Path:
    image, video, _ = FAMILY_PROCESSORS[name]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "preprocessor_config.json").write_text(json.dumps(image))
    if video is not None:
        (directory / "video_preprocessor_config.json").write_text(json.dumps(video))
    return directory


def checkpoint_processing(tmp_path: Path, name: str):
    directory = write_checkpoint_configs(tmp_path / name, name)
    return family(name).processing.for_checkpoint(tower_config(name), *read_processor_configs(directory))


def transformers_config(values: dict) -> dict:
    return {k: v for k, v in values.items() if not k.endswith(("_type", "_class"))}


def random_pixels(shape, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (*shape, 3), dtype=np.uint8)


@pytest.mark.parametrize("name", FAMILY_PROCESSORS)
def test_images_equal_the_checkpoints_image_processor(name, tmp_path):
    """Decoded from a file and prepared as qvl encode does, bit for bit the torchvision-backed image processor's rows
    (the PIL-backed one: tests/vit/encode/test_prepare.py)."""
    processing = checkpoint_processing(tmp_path, name)
    expected_processor = Qwen2VLImageProcessor(**transformers_config(FAMILY_PROCESSORS[name][0]))
    prepare = Preparer(processing, "cpu")
    for seed, (height, width) in enumerate(IMAGE_SHAPES):
        path = tmp_path / f"{height}x{width}.png"
        Image.fromarray(random_pixels((height, width), seed)).save(path)
        expected = expected_processor(images=[Image.open(path).convert("RGB")], return_tensors="pt")
        pixel_values, grid = prepare.image(torch.from_numpy(decode_image(path)))
        assert grid == expected["image_grid_thw"][0].tolist(), (height, width)
        assert torch.equal(pixel_values, expected["pixel_values"]), (height, width)
    assert grid == GRID_1080P[name]


@pytest.mark.parametrize("name", FAMILY_PROCESSORS)
def test_video_sizes_equal_the_video_processors_smart_resize(name, tmp_path, monkeypatch):
    """Without torchvision too: qvl's video sizes are those of the transformers module's own smart_resize, with the
    video processor's bounds (Qwen3-VL's over frames x area, Qwen2-VL's per frame)."""
    processing = checkpoint_processing(tmp_path, name)
    factor = processing.patch_size * processing.merge_size
    low, high = processing.video_min_pixels, processing.video_max_pixels
    smart_resize = video_module(name, monkeypatch).smart_resize
    for frames, height, width in [*VIDEO_SHAPES, (8, 1080, 1920), (64, 720, 1280)]:
        if name == "Qwen3-VL":
            expected = smart_resize(frames, height, width, 2, factor, low, high)
        else:
            expected = smart_resize(height, width, factor, low, high)
        assert processing.video_size(frames, height, width) == expected, (frames, height, width)


@pytest.mark.parametrize("name", FAMILY_PROCESSORS)
@pytest.mark.skipif(not has_torchvision(), reason="transformers' video processors need torchvision")
@pytest.mark.parametrize("cap", [False, True], ids=["uncapped", "cap_pixels_per_frame"])
def test_videos_equal_the_checkpoints_video_processor(name, cap, tmp_path, monkeypatch):
    """Pixel for pixel, with the video processor's bounds; with cap_pixels_per_frame (qwen-vl-utils' cap, here at 4
    tokens a frame so that it bites) read from the config too."""
    image, video, _ = FAMILY_PROCESSORS[name]
    stated = {**(video or image), "cap_pixels_per_frame": cap, "max_video_tokens": 4}
    processing = family(name).processing.for_checkpoint(tower_config(name), image, stated)
    processor = video_processor_class(name, monkeypatch)(**transformers_config(stated))
    for seed, shape in enumerate(VIDEO_SHAPES):
        frames = random_pixels(shape, seed)
        expected = processor(videos=[frames], do_sample_frames=False, return_tensors="pt")
        pixel_values, grid = processing.video_pixel_values(torch.from_numpy(frames))
        assert grid == expected["video_grid_thw"][0].tolist(), shape
        assert torch.equal(pixel_values, expected["pixel_values_videos"]), shape


def test_video_patches_are_laid_out_as_the_video_processor_patchifies(tmp_path):
    """Without torchvision too: frames already at their size (no resize) are normalized, padded to whole temporal
    patches and laid out as Qwen3VLVideoProcessor.patchify lays them out."""
    processing = checkpoint_processing(tmp_path, "Qwen3-VL")
    frames = random_pixels((3, 64, 96), 7)
    video = (torch.from_numpy(frames).permute(0, 3, 1, 2).float() - 127.5) / 127.5
    expected, *grid = Qwen3VLVideoProcessor().patchify(video[None], patch_size=16, merge_size=2, temporal_patch_size=2)
    pixel_values, got_grid = processing.video_pixel_values(torch.from_numpy(frames))
    assert got_grid == grid == [2, 4, 6]
    torch.testing.assert_close(pixel_values, expected[0], rtol=0, atol=0)


@pytest.mark.parametrize("name", FAMILY_PROCESSORS)
def test_frame_sampling_follows_the_video_config(name, tmp_path, monkeypatch):
    """fps, min_frames and max_frames come from the video processor config; samples equal transformers' own
    sample_frames (callable without torchvision) built from that config."""
    image, video, _ = FAMILY_PROCESSORS[name]
    stated = {**(video or image), "fps": 3, "min_frames": 6, "max_frames": 40}
    directory = tmp_path / name
    directory.mkdir()
    (directory / "preprocessor_config.json").write_text(json.dumps(image if video else stated))
    if video is not None:
        (directory / "video_preprocessor_config.json").write_text(json.dumps(stated))
    processing = family(name).processing.for_checkpoint(tower_config(name), *read_processor_configs(directory))
    assert (processing.fps, processing.min_frames, processing.max_frames) == (3.0, 6, 40)
    reference = video_processor_class(name, monkeypatch)(**transformers_config(stated))
    for total, video_fps in [(10, 30.0), (300, 24.0), (1000, 10.0), (7, 2.0)]:
        expected = reference.sample_frames(VideoMetadata(total_num_frames=total, fps=video_fps), fps=3)
        got = processing.sample(total, video_fps, processing.fps, processing.max_frames)
        assert got == list(np.asarray(expected)), (total, video_fps)


def test_processor_configs_are_found_as_transformers_finds_them(tmp_path):
    """processor_config.json's nested sections first, then the video config, then preprocessor_config.json for
    both; a checkpoint without any keeps the family's transformers defaults."""
    assert read_processor_configs(tmp_path) == (None, None)
    defaults = family("Qwen2.5-VL").processing.for_checkpoint(tower_config("Qwen2.5-VL"))
    assert (defaults.min_pixels, defaults.max_pixels, defaults.patch_size) == (56 * 56, 28 * 28 * 1280, 14)
    assert (defaults.video_min_pixels, defaults.video_max_pixels) == (128 * 28 * 28, 768 * 28 * 28)

    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"max_pixels": 5000}))
    assert read_processor_configs(tmp_path) == ({"max_pixels": 5000}, {"max_pixels": 5000})
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({"fps": 1}))
    assert read_processor_configs(tmp_path) == ({"max_pixels": 5000}, {"fps": 1})
    nested = {"image_processor": {"max_pixels": 7000}, "video_processor": {"fps": 4}}
    (tmp_path / "processor_config.json").write_text(json.dumps(nested))
    assert read_processor_configs(tmp_path) == ({"max_pixels": 7000}, {"fps": 4})


def test_a_processor_config_that_does_not_fit_the_tower_is_refused():
    qwen3 = family("Qwen3-VL")
    with pytest.raises(ValueError, match=r"patch_size.*\(14, 2, 2\).*\(16, 2, 2\)"):
        qwen3.processing.for_checkpoint(tower_config("Qwen3-VL"), {"patch_size": 14})
    with pytest.raises(ValueError, match="image_mean and image_std need 3 values"):
        qwen3.processing.for_checkpoint(tower_config("Qwen3-VL"), {"image_mean": [0.5]})
    with pytest.raises(ValueError, match="min_pixels 5000 is larger than its max_pixels 1000"):
        qwen3.processing.for_checkpoint(tower_config("Qwen3-VL"), {"min_pixels": 5000, "max_pixels": 1000})
    with pytest.raises(ValueError, match="size must be an object"):
        qwen3.processing.for_checkpoint(tower_config("Qwen3-VL"), None, {"size": 5})
