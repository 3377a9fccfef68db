"""Inputs to pixel values at the device's pace: decoding (:func:`decode_image`), run where the files are read (a data
loader's worker processes), and preparation (:class:`Preparer`): uint8 pixels copied to the device, then resized,
rescaled, normalized and laid out in patches there, in torch, as transformers' processors prepare them for the
checkpoint (:class:`~qvl.vit.processing.Processing`).

On a GPU the host only decodes: the uint8 pixels (a quarter of the float32 values, half again for an image's two
temporal slots) travel asynchronously from pinned memory, and the rest is a few kernels. On a CPU the same torch code
runs (vectorised, on torch's threads), in a loader's workers or in the encoding process.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from ..processing import Processing

__all__ = ["MAX_ASPECT_RATIO", "Preparer", "decode_image"]

# Qwen's processors refuse images more elongated than this (their smart_resize raises).
MAX_ASPECT_RATIO = 200


def decode_image(path: str | Path | BinaryIO) -> np.ndarray:
    """The image file at ``path`` (or an open binary file: a data-set sample's bytes) as transformers' processors
    see it: ``(H, W, 3)`` uint8 RGB, upright (its EXIF
    orientation applied, as transformers' ``load_image`` does), and an image with transparency (an alpha band, or a
    palette or grey image with a transparent colour) laid over white exactly as transformers' ``convert_to_rgb`` lays
    it (PIL's ``alpha_composite`` onto opaque white).

    Raises OSError where the file cannot be opened (FileNotFoundError, IsADirectoryError, PermissionError, ...) and
    ValueError, whose message is the reason, where it is not an image PIL can decode (unidentified, corrupt or
    truncated data, past PIL's decompression-bomb limit).
    """
    from PIL import Image, ImageOps, UnidentifiedImageError

    opened = open(path, "rb") if isinstance(path, (str, Path)) else contextlib.nullcontext(path)
    with opened as file:
        try:
            # Images past PIL's decompression-bomb threshold (89M pixels) but under its hard limit decode fine; PIL's
            # warning about them would print a site-packages path beside a run that succeeds.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                with Image.open(file) as image:
                    image.load()
                    image = ImageOps.exif_transpose(image)
        except UnidentifiedImageError:
            raise ValueError("not an image file PIL can read") from None
        except Image.DecompressionBombError as error:
            raise ValueError(str(error)) from None
        # PIL's decoders fail with many exception types on corrupt data (OSError, SyntaxError, ValueError,
        # struct.error, ...); any of them means this file cannot be used.
        except Exception as error:  # noqa: BLE001
            raise ValueError(f"unreadable image ({type(error).__name__}: {error})") from None
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        image = Image.alpha_composite(background, image.convert("RGBA"))
    return np.array(image.convert("RGB"))


class Preparer:
    """Decoded pixels -> ``(pixel_values rows on device, [t, h, w])`` for one checkpoint's ``processing`` (its patch
    sizes resolved: :meth:`Processing.for_checkpoint`), computed on ``device``.

    The pixel values are those of transformers' torchvision-backed processors for the checkpoint
    (``Qwen2VLImageProcessor``, the family's video processor) run on the same device: on a CPU bit for bit (the same
    torch kernels), on a GPU by the same float32 resize recipe torchvision runs there. Against the PIL-backed image
    processor (``Qwen2VLImageProcessorPil``) they differ by the resize's last-bit rounding: both round PIL's bicubic
    resampling to uint8, with different fixed-point arithmetic (torch's kernel of PIL's algorithm on a CPU), so a
    resized pixel may differ by one or two levels of 255 (tests/vit/encode/test_prepare.py holds each backend to a
    float64 resize).

    ``fold_images``: images give rows of ``C * patch_size**2`` values, written once instead of once per temporal
    slot, for the towers' folded patch embedding (whose temporal slices are summed); videos are never folded.

    A Preparer holds only its parameters, so it pickles into a data loader's worker processes (there with a CPU
    ``device``). Nothing reads the device back to the host.
    """

    def __init__(self, processing: Processing, device: torch.device | str, fold_images: bool = False):
        if None in (processing.patch_size, processing.temporal_patch_size, processing.merge_size):
            raise ValueError("Preparer: processing needs its patch sizes (Processing.for_checkpoint resolves them)")
        self.processing = processing
        self.device = torch.device(device)
        self.fold_images = fold_images

    def image(self, pixels: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """One image: ``pixels`` ``(H, W, C)`` uint8 RGB (on the CPU, pinned for an asynchronous copy to a GPU, or
        already on the device) -> ``(rows, [1, h, w])``, rows ``(h * w, C * t * p * p)`` float32 on the device
        (``(h * w, C * p * p)`` with ``fold_images``). Raises ValueError naming ``pixels`` for a tensor that is not
        such an image, or one more elongated than Qwen's processors take (:data:`MAX_ASPECT_RATIO`)."""
        self._check(pixels, "pixels", 3)
        height, width = pixels.shape[:2]
        if max(height, width) > MAX_ASPECT_RATIO * min(height, width):
            raise ValueError(f"pixels: {width}x{height} is more elongated than {MAX_ASPECT_RATIO}:1 (Qwen's limit)")
        pixels = pixels.to(self.device, non_blocking=True)
        return self.processing.image_pixel_values(pixels, fold=self.fold_images)

    def video(self, frames: torch.Tensor, size: tuple[int, int] | None = None) -> tuple[torch.Tensor, list[int]]:
        """One video, or whole temporal patches of one: ``frames`` ``(T, H, W, C)`` uint8 RGB (placed as for
        :meth:`image`) resized to ``size`` ``(h, w)`` (default: :meth:`Processing.video_size` of these frames) ->
        ``(rows, [t, h / p, w / p])``, rows ``(t * h * w / p**2, C * t_p * p * p)`` float32 on the device; a frame
        count short of whole temporal patches is padded by repeating the last frame.

        Frames are prepared one by one, so a chunk of whole temporal patches of a long video, given the whole video's
        ``size`` (:meth:`Processing.video_size` of its sampled frame count), gives exactly the rows of that slice of
        the whole video: a video can be prepared and encoded chunk by chunk. Raises ValueError naming ``frames`` or
        ``size`` where they cannot be used."""
        self._check(frames, "frames", 4)
        if size is not None:
            factor = self.processing.patch_size * self.processing.merge_size
            if len(size) != 2 or any(not isinstance(n, int) or n < factor or n % factor for n in size):
                raise ValueError(f"size: must be (height, width), positive multiples of {factor}, got {size!r}")
        frames = frames.to(self.device, non_blocking=True)
        return self.processing.video_pixel_values(frames, None if size is None else tuple(size))

    def _check(self, pixels: torch.Tensor, name: str, dims: int) -> None:
        if not isinstance(pixels, torch.Tensor) or pixels.dtype != torch.uint8 or pixels.dim() != dims:
            shape = "(H, W, C)" if dims == 3 else "(T, H, W, C)"
            got = f"{pixels.dtype} {tuple(pixels.shape)}" if isinstance(pixels, torch.Tensor) else type(pixels).__name__
            raise ValueError(f"{name}: must be a uint8 tensor {shape}, got {got}")
        channels = len(self.processing.image_mean)
        if pixels.shape[-1] != channels or 0 in pixels.shape:
            raise ValueError(f"{name}: must hold {channels} channels and at least one pixel, got {tuple(pixels.shape)}")

    def __repr__(self) -> str:
        return f"Preparer(device={self.device}, fold_images={self.fold_images})"
