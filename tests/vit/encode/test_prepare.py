"""qvl.vit.encode.prepare: files decoded as transformers' processors see them, and pixel values prepared in torch equal
to transformers' own processors for the same checkpoint config, for both families' settings (Qwen3-VL's, Qwen2-VL's):

* the torchvision-backed processors (``Qwen2VLImageProcessor``, the video processors) bit for bit on a CPU, where
  both run the same torch kernels;
* the PIL-backed image processor (``Qwen2VLImageProcessorPil``) within the tolerance rule, against a float64 truth of
  PIL's algorithm: bicubic, antialiased resampling in two passes, each clipped to the 8-bit range. Both sides round
  each pass to 8 bits with their own fixed-point arithmetic (PIL's, torch's port of it), so they may differ by a
  level of 255 at a pixel; the rule's ``eps`` counts those roundings at the resolution they are made in (one level,
  in normalized units ``1 / (255 * std)``), as it counts a float dtype's in its ulps. Torch resamples horizontally
  first; Pillow 13 takes some sizes (a height that shrinks, a width that grows, ...) vertically first, and then the
  two differ by what the intermediate clip cuts in each order (bicubic overshoots at sharp edges: up to ~25 levels
  on random noise, far less on photos): bounded by the two orders' float64 results;
* the float32 recipe that runs on a GPU (torchvision's there, which has no uint8 kernel), forced on the CPU in both,
  bit for bit against torchvision's own.
"""

import pickle

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from transformers.image_transforms import convert_to_rgb
from transformers.image_utils import load_image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

from qvl.kernels import force_backend
from qvl.vit import cli, families
from qvl.vit.encode.prepare import Preparer, decode_image
from qvl.vit.processing import patch_rows, resize_frames
from tolerance import DEFAULT_ULPS, assert_error_within, default_eps, max_error

FAMILY_NAMES = ["Qwen3-VL", "Qwen2-VL"]
# (height, width): scaled up to the smallest size, elongated, scaled in both directions.
IMAGE_SHAPES = [(20, 30), (37, 301), (450, 700)]


def processing_of(name: str):
    family = next(f for f in families.FAMILIES if f.name == name)
    return family.processing.for_checkpoint(family.config_class.from_dict({}, **family.config_options))


def video_processor(name: str, processing):
    """The family's transformers video processor with ``processing``'s bounds (Qwen3-VL's over frames x area)."""
    options = dict(processing.image_processor_options(), min_pixels=None, max_pixels=None)
    size = {"shortest_edge": processing.video_min_pixels, "longest_edge": processing.video_max_pixels}
    options = {k: v for k, v in options.items() if v is not None} | {"size": size}
    if name == "Qwen3-VL":
        return Qwen3VLVideoProcessor(**options, cap_pixels_per_frame=False)
    return Qwen2VLVideoProcessor(**options)


def random_pixels(shape, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (*shape, 3), dtype=np.uint8)


def bicubic64(pixels: torch.Tensor, size) -> torch.Tensor:
    return F.interpolate(pixels.double(), size=size, mode="bicubic", align_corners=False, antialias=True)


def pil_resize64(pixels: np.ndarray, size, vertical_first: bool = False) -> torch.Tensor:
    """PIL's bicubic resize in float64 without its roundings: one pass along each axis that changes, each clipped to
    [0, 255], horizontal first unless ``vertical_first`` (``(1, C, h, w)``)."""
    image = torch.from_numpy(pixels).permute(2, 0, 1)[None].double()
    steps = [(image.shape[2], size[1]), size]
    if vertical_first:
        steps = [(size[0], image.shape[3]), size]
    for step in steps:
        if tuple(step) != tuple(image.shape[2:]):
            image = bicubic64(image, step).clamp(0, 255)
    return image


def normalized_patches64(resized: torch.Tensor, processing, slots: int | None = None) -> torch.Tensor:
    """Resized pixels (``(1, C, h, w)`` float64) normalized in float64 and laid out by transformers' own patchify."""
    mean = torch.tensor(processing.image_mean, dtype=torch.float64).view(1, -1, 1, 1)
    std = torch.tensor(processing.image_std, dtype=torch.float64).view(1, -1, 1, 1)
    values = (resized / 255 - mean) / std
    slots = slots or processing.temporal_patch_size
    patches, _, _ = Qwen2VLImageProcessor().patchify(values, processing.patch_size, processing.merge_size, slots)
    return patches[0]


def resize_eps(processing, truth: torch.Tensor) -> float:
    """The rule's default eps at the resolution the resize rounds to (one level of 255, in normalized units), plus
    float32's for the normalization."""
    level = 1 / (255 * min(processing.image_std))
    return DEFAULT_ULPS * level + default_eps(torch.float32, truth)


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P", "RGB", "L"])
def test_decode_lays_transparency_over_white_as_transformers(mode, tmp_path):
    """Alpha bands and a palette's transparent colour are composited onto white exactly as transformers'
    convert_to_rgb does; opaque images are plain RGB conversions."""
    pixels = np.random.default_rng(3).integers(0, 256, (23, 31, 4), dtype=np.uint8)
    image = Image.fromarray(pixels).convert(mode) if mode != "RGBA" else Image.fromarray(pixels)
    path = tmp_path / f"{mode}.png"
    image.save(path, **({"transparency": 7} if mode == "P" else {}))
    expected = convert_to_rgb(Image.open(path), return_numpy=True)
    decoded = decode_image(path)
    assert decoded.dtype == np.uint8 and decoded.shape == (23, 31, 3)
    np.testing.assert_array_equal(decoded, expected)
    if mode in ("RGBA", "LA", "P"):  # the alpha really mattered
        assert not np.array_equal(decoded, np.asarray(Image.open(path).convert("RGB")))


def test_decode_applies_the_exif_orientation(tmp_path):
    path = tmp_path / "rotated.png"
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    Image.fromarray(random_pixels((20, 30), 4)).save(path, exif=exif)
    decoded = decode_image(path)
    assert decoded.shape == (30, 20, 3)
    np.testing.assert_array_equal(decoded, np.asarray(load_image(str(path))))


def test_decode_reports_unusable_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        decode_image(tmp_path / "missing.png")
    with pytest.raises(IsADirectoryError):
        decode_image(tmp_path)
    (tmp_path / "notes.png").write_text("not an image")
    with pytest.raises(ValueError, match="not an image file PIL can read"):
        decode_image(tmp_path / "notes.png")
    Image.fromarray(random_pixels((64, 64), 5)).save(tmp_path / "whole.png")
    (tmp_path / "cut.png").write_bytes((tmp_path / "whole.png").read_bytes()[:400])
    with pytest.raises(ValueError, match="unreadable image"):
        decode_image(tmp_path / "cut.png")


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_images_equal_the_torchvision_image_processor(name):
    processing = processing_of(name)
    processor = Qwen2VLImageProcessor(**processing.image_processor_options())
    prepare = Preparer(processing, "cpu")
    shapes = IMAGE_SHAPES + ([(1080, 1920)] if name == "Qwen3-VL" else [])
    for seed, shape in enumerate(shapes):
        pixels = random_pixels(shape, seed)
        expected = processor(images=[pixels], return_tensors="pt")
        rows, grid = prepare.image(torch.from_numpy(pixels))
        assert grid == expected["image_grid_thw"][0].tolist(), shape
        assert torch.equal(rows, expected["pixel_values"]), shape


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_images_are_within_the_rule_of_the_pil_image_processor(name):
    """Where PIL resamples in torch's order, the rule against the float64 truth of that order; where it takes the
    vertical pass first (its result agrees with that order's truth), each side is within its 8-bit roundings of its
    own order's truth, so the two differ by the two orders' float64 results' difference and those roundings."""
    processing = processing_of(name)
    processor = Qwen2VLImageProcessorPil(**processing.image_processor_options())
    prepare = Preparer(processing, "cpu")
    orders = set()
    for seed, shape in enumerate(IMAGE_SHAPES):
        pixels = random_pixels(shape, seed)
        baseline = processor(images=[pixels], return_tensors="pt")["pixel_values"]
        rows, grid = prepare.image(torch.from_numpy(pixels))
        size = (grid[1] * processing.patch_size, grid[2] * processing.patch_size)
        horizontal, vertical = (
            normalized_patches64(pil_resize64(pixels, size, vertical_first), processing) for vertical_first in (0, 1)
        )
        eps = resize_eps(processing, horizontal)
        pil_order = "vertical" if max_error(baseline, vertical) < max_error(baseline, horizontal) else "horizontal"
        orders.add(pil_order)
        if pil_order == "horizontal":
            assert_error_within(rows, horizontal, baseline, eps=eps, what=f"{name} {shape}")
        else:  # each side within its roundings of its own order's truth: they differ by what the two clips cut
            assert max_error(baseline, vertical) <= eps, (name, shape, max_error(baseline, vertical), eps)
            assert max_error(rows, horizontal) <= eps, (name, shape, max_error(rows, horizontal), eps)
    assert orders == {"horizontal", "vertical"}  # both cases were seen


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_the_gpu_recipe_equals_torchvisions_own(name, monkeypatch):
    """torchvision's resize on a GPU (float32, clipped and rounded to uint8 once, at the end: it has no uint8 kernel
    there), run on the CPU by both: torchvision's switch to its uint8 kernel turned off."""
    import torchvision.transforms.v2.functional._geometry as geometry

    monkeypatch.setattr(geometry, "_do_native_uint8_resize_on_cpu", lambda interpolation: False)
    processing = processing_of(name)
    processor = Qwen2VLImageProcessor(**processing.image_processor_options())
    mean = torch.tensor(processing.image_mean) * 255
    std = torch.tensor(processing.image_std) * 255
    slots = processing.temporal_patch_size
    for seed, shape in enumerate(IMAGE_SHAPES):
        pixels = random_pixels(shape, seed)
        expected = processor(images=[pixels], return_tensors="pt")["pixel_values"]
        frames = torch.from_numpy(pixels).permute(2, 0, 1)[None]
        resized = resize_frames(frames, processing.image_size(*shape), uint8_kernel=False)
        rows, _ = patch_rows(resized, mean, std, processing.patch_size, processing.merge_size, 1, slots)
        assert torch.equal(rows, expected), shape
        assert not torch.equal(rows, Preparer(processing, "cpu").image(torch.from_numpy(pixels))[0]), shape


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_images_on_a_gpu_equal_the_torchvision_image_processor_there(name):
    processing = processing_of(name)
    processor = Qwen2VLImageProcessor(**processing.image_processor_options())
    prepare = Preparer(processing, "cuda")
    for seed, shape in enumerate([*IMAGE_SHAPES, (1080, 1920)]):
        pixels = random_pixels(shape, seed)
        expected = processor(images=[pixels], device="cuda", return_tensors="pt")
        rows, grid = prepare.image(torch.from_numpy(pixels).pin_memory())
        assert grid == expected["image_grid_thw"][0].tolist(), shape
        assert torch.equal(rows, expected["pixel_values"]), shape


def test_folded_images_are_one_temporal_slot_of_the_rows():
    processing = processing_of("Qwen3-VL")
    pixels = torch.from_numpy(random_pixels((50, 70), 6))
    rows, grid = Preparer(processing, "cpu").image(pixels)
    folded, folded_grid = Preparer(processing, "cpu", fold_images=True).image(pixels)
    assert folded_grid == grid
    slots, values = processing.temporal_patch_size, 3 * processing.patch_size**2
    assert folded.shape == (rows.shape[0], values)
    slices = rows.view(rows.shape[0], 3, slots, -1)
    for slot in range(slots):
        assert torch.equal(slices[:, :, slot].reshape(-1, values), folded)


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_videos_equal_the_video_processor_whole_and_in_chunks(name):
    """A video equals the family's video processor's pixel values; its whole temporal patches prepared apart, at the
    whole video's size, give exactly their slice of the whole video's rows (an odd count padded at the end)."""
    processing = processing_of(name)
    frames = random_pixels((7, 90, 130), 8)
    expected = video_processor(name, processing)(videos=[frames], do_sample_frames=False, return_tensors="pt")
    prepare = Preparer(processing, "cpu")
    rows, grid = prepare.video(torch.from_numpy(frames))
    assert grid == expected["video_grid_thw"][0].tolist()
    assert torch.equal(rows, expected["pixel_values_videos"])
    size = processing.video_size(7, 90, 130)
    chunks = [prepare.video(torch.from_numpy(frames[first : first + 4]), size) for first in range(0, 7, 4)]
    assert [chunk_grid[0] for _, chunk_grid in chunks] == [2, 2]
    assert all(chunk_grid[1:] == grid[1:] for _, chunk_grid in chunks)
    assert torch.equal(torch.cat([chunk for chunk, _ in chunks]), rows)


def worker_rows(item):
    preparer, pixels = item
    return preparer.image(pixels)


def test_a_preparer_runs_in_data_loader_workers():
    processing = processing_of("Qwen2-VL")
    preparer = pickle.loads(pickle.dumps(Preparer(processing, "cpu")))
    images = [torch.from_numpy(random_pixels(shape, seed)) for seed, shape in enumerate(IMAGE_SHAPES[:2])]
    loader = torch.utils.data.DataLoader(
        [(preparer, pixels) for pixels in images], batch_size=None, num_workers=1, collate_fn=worker_rows
    )
    for (rows, grid), pixels in zip(loader, images, strict=True):
        expected_rows, expected_grid = preparer.image(pixels)
        assert grid == expected_grid and torch.equal(rows, expected_rows)


def test_arguments_are_checked():
    processing = processing_of("Qwen3-VL")
    prepare = Preparer(processing, "cpu")
    with pytest.raises(ValueError, match=r"pixels: must be a uint8 tensor \(H, W, C\), got torch.float32"):
        prepare.image(torch.zeros(32, 32, 3))
    with pytest.raises(ValueError, match="pixels: must hold 3 channels"):
        prepare.image(torch.zeros(32, 32, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="pixels: 401x2 is more elongated than 200:1"):
        prepare.image(torch.zeros(2, 401, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"frames: must be a uint8 tensor \(T, H, W, C\)"):
        prepare.video(torch.zeros(32, 32, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="size: must be .* multiples of 32"):
        prepare.video(torch.zeros(2, 32, 32, 3, dtype=torch.uint8), (48, 64))
    family = next(f for f in families.FAMILIES if f.name == "Qwen3-VL")
    with pytest.raises(ValueError, match="patch sizes"):
        Preparer(family.processing, "cpu")


def test_qvl_encode_reads_a_transparent_image_as_transformers_does(tmp_path):
    """qvl encode of an RGBA and an LA PNG writes the features of the image transformers sees (laid over white by
    its convert_to_rgb), not of the image with its alpha dropped."""
    pixels = np.random.default_rng(9).integers(0, 256, (48, 64, 4), dtype=np.uint8)
    for mode in ("RGBA", "LA"):
        transparent = tmp_path / f"{mode}.png"
        Image.fromarray(pixels).convert(mode).save(transparent)
        seen = tmp_path / f"{mode}-as-transformers-sees-it.png"
        Image.fromarray(convert_to_rgb(Image.open(transparent), return_numpy=True)).save(seen)
        features = []
        for path in (transparent, seen):
            output = tmp_path / f"{path.stem}.safetensors"
            with force_backend("torch"):
                assert cli.main(["encode", str(path), "-o", str(output)]) == 0
            from safetensors.torch import load_file

            features.append(load_file(output))
        assert features[0].keys() == features[1].keys()
        for key in features[0]:
            assert torch.equal(features[0][key], features[1][key]), (mode, key)
