"""How each model family's processors prepare images and videos for its tower: image normalization, the smallest
resized image, and how frames are sampled from a video file (:class:`Processing`, which
:mod:`qvl.vit.families` declares per family and ``qvl encode`` follows)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

__all__ = [
    "QWEN2_VL_PROCESSING",
    "QWEN3_VL_PROCESSING",
    "Processing",
    "sample_frame_indices",
    "sample_frame_indices_qwen2",
]

# Qwen3-VL's preprocessor_config.json bounds the resized image to [256*256, 4096*4096] pixels.
QWEN3_VL_MIN_PIXELS = 256 * 256
QWEN3_VL_MAX_PIXELS = 4096 * 4096
QWEN3_VL_IMAGE_MEAN = (0.5, 0.5, 0.5)
QWEN3_VL_IMAGE_STD = (0.5, 0.5, 0.5)
# Qwen2-VL's and Qwen2.5-VL's image processor: OpenAI CLIP's mean and std, and its smallest image (56x56 pixels).
QWEN2_VL_IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
QWEN2_VL_IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)
QWEN2_VL_MIN_PIXELS = 56 * 56
# Qwen3-VL's video processor (Qwen2-VL's samples with the same defaults): frames sampled per second of video, and
# bounds on the sampled count.
QWEN3_VL_VIDEO_FPS = 2.0
QWEN3_VL_MIN_FRAMES = 4
QWEN3_VL_MAX_FRAMES = 768
# transformers' fallback when a video stream states no frame rate.
FALLBACK_VIDEO_FPS = 24.0


def sample_frame_indices(
    total_frames: int,
    video_fps: float | None,
    fps: float = QWEN3_VL_VIDEO_FPS,
    max_frames: int = QWEN3_VL_MAX_FRAMES,
    min_frames: int = QWEN3_VL_MIN_FRAMES,
) -> list[int]:
    """The frame numbers Qwen3-VL's video processor samples from a video of ``total_frames`` frames at
    ``video_fps`` (transformers' ``Qwen3VLVideoProcessor.sample_frames`` with ``fps``).

    ``int(total_frames / video_fps * fps)`` frames, at least ``min_frames`` and at most ``max_frames`` and
    ``total_frames``, spread evenly from the first frame to the last. The count need not be a multiple of
    the temporal patch size: the processor pads by repeating the last frame (so does ``qvl encode``).
    """
    count = int(total_frames / (video_fps or FALLBACK_VIDEO_FPS) * fps)
    count = min(max(count, min_frames), max_frames, total_frames)
    return np.linspace(0, total_frames - 1, count).round().astype(int).tolist()


def sample_frame_indices_qwen2(
    total_frames: int,
    video_fps: float | None,
    fps: float = QWEN3_VL_VIDEO_FPS,
    max_frames: int = QWEN3_VL_MAX_FRAMES,
    min_frames: int = QWEN3_VL_MIN_FRAMES,
    temporal_patch_size: int = 2,
) -> list[int]:
    """The frame numbers Qwen2-VL's video processor (Qwen2.5-VL's too) samples from a video of ``total_frames``
    frames at ``video_fps`` (transformers' ``Qwen2VLVideoProcessor.sample_frames`` with ``fps``).

    ``total_frames / video_fps * fps`` frames, at least ``min_frames``, at most ``max_frames`` and ``total_frames``
    (both first rounded down to a multiple of ``temporal_patch_size``), then rounded down to a multiple of
    ``temporal_patch_size``, at ``arange(0, total_frames, total_frames / count)`` truncated. A video shorter than
    one temporal patch, where that count is 0 (transformers raises), keeps all its frames (the last one repeated
    to fill the patch, as for frame folders).
    """
    limit = min(max_frames, total_frames) // temporal_patch_size * temporal_patch_size
    count = min(max(total_frames / (video_fps or FALLBACK_VIDEO_FPS) * fps, min_frames), limit, total_frames)
    count = int(count // temporal_patch_size) * temporal_patch_size
    if count == 0:
        return list(range(total_frames))
    return torch.arange(0, total_frames, total_frames / count).int().tolist()


@dataclasses.dataclass(frozen=True)
class Processing:
    """How a model family's processors prepare its inputs: image normalization, the smallest resized image, and
    how video files are sampled (Qwen3-VL's any frame count, Qwen2-VL's whole temporal patches). The patch,
    temporal patch and merge sizes come from the tower's config."""

    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    min_pixels: int
    whole_temporal_patches: bool

    def sample(self, total_frames: int, video_fps: float | None, fps: float, max_frames: int, config) -> list[int]:
        """The frame numbers sampled from a video file (see :func:`sample_frame_indices` and
        :func:`sample_frame_indices_qwen2`); ``config`` gives the temporal patch size."""
        if self.whole_temporal_patches:
            return sample_frame_indices_qwen2(
                total_frames, video_fps, fps, max_frames, temporal_patch_size=config.temporal_patch_size
            )
        return sample_frame_indices(total_frames, video_fps, fps, max_frames)


QWEN3_VL_PROCESSING = Processing(QWEN3_VL_IMAGE_MEAN, QWEN3_VL_IMAGE_STD, QWEN3_VL_MIN_PIXELS, False)
QWEN2_VL_PROCESSING = Processing(QWEN2_VL_IMAGE_MEAN, QWEN2_VL_IMAGE_STD, QWEN2_VL_MIN_PIXELS, True)
