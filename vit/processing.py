"""How each model family's processors prepare images and videos for its tower (:class:`Processing`): normalization,
the bounds on a resized image or video, the patches, and how frames are sampled from a video file. A family declares
its defaults (:mod:`qvl.vit.families`); ``qvl encode`` reads a checkpoint's own processor configs over them
(:meth:`Processing.for_checkpoint`), so that its inputs are the ones transformers' processors make for that
checkpoint."""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "QWEN2_VL_PROCESSING",
    "QWEN3_VL_PROCESSING",
    "Processing",
    "patch_rows",
    "resize_frames",
    "sample_frame_indices",
    "sample_frame_indices_qwen2",
    "smart_resize",
]

# Qwen3-VL's preprocessor_config.json bounds the resized image to [256*256, 4096*4096] pixels (transformers has no
# Qwen3-VL image processor of its own: the checkpoints name Qwen2-VL's, with these values).
QWEN3_VL_MIN_PIXELS = 256 * 256
QWEN3_VL_MAX_PIXELS = 4096 * 4096
QWEN3_VL_IMAGE_MEAN = (0.5, 0.5, 0.5)
QWEN3_VL_IMAGE_STD = (0.5, 0.5, 0.5)
# Qwen3VLVideoProcessor's defaults: frames times frame area within [128, 768] merged 32-px blocks' worth of pixels.
QWEN3_VL_VIDEO_MIN_PIXELS = 128 * 32 * 32
QWEN3_VL_VIDEO_MAX_PIXELS = 768 * 32 * 32
# Qwen2VLImageProcessor's defaults (Qwen2-VL's and Qwen2.5-VL's): OpenAI CLIP's mean and std, images within
# [56*56, 1280 merged 28-px blocks] pixels; Qwen2VLVideoProcessor's: each frame within [128, 768] such blocks.
QWEN2_VL_IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
QWEN2_VL_IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)
QWEN2_VL_MIN_PIXELS = 56 * 56
QWEN2_VL_MAX_PIXELS = 1280 * 28 * 28
QWEN2_VL_VIDEO_MIN_PIXELS = 128 * 28 * 28
QWEN2_VL_VIDEO_MAX_PIXELS = 768 * 28 * 28
# Both families' video processors: frames sampled per second of video, and bounds on the sampled count.
QWEN3_VL_VIDEO_FPS = 2.0
QWEN3_VL_MIN_FRAMES = 4
QWEN3_VL_MAX_FRAMES = 768
# The per-frame token ceiling of cap_pixels_per_frame: Qwen3VLVideoProcessor's, and Qwen2VLVideoProcessor's
# context length from which it derives its own.
QWEN3_VL_MAX_VIDEO_TOKENS = 768
QWEN2_VL_MAX_VIDEO_TOKENS = 128000
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
    ``temporal_patch_size``, at ``arange(0, total_frames, total_frames / count)`` truncated. Where that count is 0
    (transformers raises): a video shorter than one temporal patch keeps all its frames (the last one repeated to
    fill the patch, as for frame folders), and a ``max_frames`` below one temporal patch takes one patch's frames,
    the fewest a video encodes to.
    """
    if total_frames < temporal_patch_size:
        return list(range(total_frames))
    limit = min(max_frames, total_frames) // temporal_patch_size * temporal_patch_size
    count = min(max(total_frames / (video_fps or FALLBACK_VIDEO_FPS) * fps, min_frames), limit, total_frames)
    count = max(int(count // temporal_patch_size), 1) * temporal_patch_size
    return torch.arange(0, total_frames, total_frames / count).int().tolist()


@dataclasses.dataclass(frozen=True)
class Processing:
    """Every parameter by which a model family's processors prepare its inputs, as transformers' image processor
    (``Qwen2VLImageProcessor``) and video processor (``Qwen3VLVideoProcessor``, ``Qwen2VLVideoProcessor``) read them.

    A family declares its defaults (:data:`QWEN3_VL_PROCESSING`, :data:`QWEN2_VL_PROCESSING`, without patch sizes:
    those come from the tower); :meth:`for_checkpoint` overrides them with what a checkpoint's processor configs
    state and fills in the patch sizes.

    Attributes:
        image_mean, image_std: per-channel normalization (of pixels scaled to [0, 1]).
        min_pixels, max_pixels: the image processor's bounds on a resized image (its ``size`` shortest and longest
            edge, or ``min_pixels`` / ``max_pixels``).
        video_min_pixels, video_max_pixels: the video processor's bounds: on a resized frame (Qwen2-VL's), or on
            frames times frame area (Qwen3-VL's, ``video_pixels_over_frames``).
        fps, min_frames, max_frames: how many frames are sampled from a video file (:meth:`sample`).
        whole_temporal_patches: sampling rounds the frame count down to whole temporal patches (Qwen2-VL's).
        video_pixels_over_frames: the video bounds count every frame (Qwen3-VL's), else each frame alone.
        cap_pixels_per_frame, max_video_tokens: the video processor's optional per-frame cap (qwen-vl-utils').
        patch_size, temporal_patch_size, merge_size: the patches (None in a family's defaults).
    """

    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    min_pixels: int
    max_pixels: int
    video_min_pixels: int
    video_max_pixels: int
    fps: float
    min_frames: int
    max_frames: int
    whole_temporal_patches: bool
    video_pixels_over_frames: bool
    max_video_tokens: int
    cap_pixels_per_frame: bool = False
    patch_size: int | None = None
    temporal_patch_size: int | None = None
    merge_size: int | None = None

    def for_checkpoint(self, config, image: dict | None = None, video: dict | None = None) -> Processing:
        """These defaults overridden by a checkpoint's image and video processor configs (dicts as in its
        ``preprocessor_config.json`` / ``video_preprocessor_config.json``; None: none), the patch sizes taken from
        them or else from the tower's ``config``. Raises ValueError naming a value that cannot be used."""
        image, video = image or {}, video or {}
        min_pixels, max_pixels = _pixel_bounds(image, self.min_pixels, self.max_pixels)
        video_min_pixels, video_max_pixels = _pixel_bounds(video, self.video_min_pixels, self.video_max_pixels)
        either = {**video, **image}
        resolved = dataclasses.replace(
            self,
            image_mean=tuple(float(v) for v in image.get("image_mean", self.image_mean)),
            image_std=tuple(float(v) for v in image.get("image_std", self.image_std)),
            min_pixels=min_pixels,
            max_pixels=max_pixels,
            video_min_pixels=video_min_pixels,
            video_max_pixels=video_max_pixels,
            fps=float(video.get("fps") or self.fps),
            min_frames=int(video.get("min_frames", self.min_frames)),
            max_frames=int(video.get("max_frames", self.max_frames)),
            cap_pixels_per_frame=bool(video.get("cap_pixels_per_frame", self.cap_pixels_per_frame)),
            max_video_tokens=int(video.get("max_video_tokens", self.max_video_tokens)),
            patch_size=int(either.get("patch_size", config.patch_size)),
            temporal_patch_size=int(either.get("temporal_patch_size", config.temporal_patch_size)),
            merge_size=int(either.get("merge_size", config.spatial_merge_size)),
        )
        resolved.check(config)
        return resolved

    def check(self, config) -> None:
        """Raise ValueError unless these parameters make the patches the tower of ``config`` takes."""
        sizes = (self.patch_size, self.temporal_patch_size, self.merge_size)
        wanted = (config.patch_size, config.temporal_patch_size, config.spatial_merge_size)
        if sizes != wanted:
            raise ValueError(
                f"the processor config's patch_size, temporal_patch_size, merge_size {sizes} differ from the"
                f" tower's {wanted}"
            )
        for name in ("min_pixels", "max_pixels", "video_min_pixels", "video_max_pixels", "min_frames", "max_frames"):
            if getattr(self, name) < 1:
                raise ValueError(f"the processor config's {name} must be positive, got {getattr(self, name)}")
        for low, high in (("min_pixels", "max_pixels"), ("video_min_pixels", "video_max_pixels")):
            if getattr(self, low) > getattr(self, high):
                raise ValueError(
                    f"the processor config's {low} {getattr(self, low)} is larger than its {high} {getattr(self, high)}"
                )
        if len(self.image_mean) != config.in_channels or len(self.image_std) != config.in_channels:
            raise ValueError(f"the processor config's image_mean and image_std need {config.in_channels} values")

    def sample(self, total_frames: int, video_fps: float | None, fps: float, max_frames: int) -> list[int]:
        """The frame numbers sampled from a video file of ``total_frames`` frames at ``video_fps``, ``fps`` per
        second and at most ``max_frames`` (see :func:`sample_frame_indices` and :func:`sample_frame_indices_qwen2`)."""
        if self.whole_temporal_patches:
            return sample_frame_indices_qwen2(
                total_frames, video_fps, fps, max_frames, self.min_frames, temporal_patch_size=self.temporal_patch_size
            )
        return sample_frame_indices(total_frames, video_fps, fps, max_frames, self.min_frames)

    def image_processor_options(self) -> dict:
        """These parameters as transformers' Qwen2-VL image processors take them (either backend)."""
        return dict(
            patch_size=self.patch_size,
            temporal_patch_size=self.temporal_patch_size,
            merge_size=self.merge_size,
            image_mean=list(self.image_mean),
            image_std=list(self.image_std),
            min_pixels=self.min_pixels,
            max_pixels=self.max_pixels,
        )

    def image_processor(self):
        """transformers' Qwen2-VL PIL image processor with these parameters (needs transformers and pillow)."""
        from transformers import Qwen2VLImageProcessorPil

        return Qwen2VLImageProcessorPil(**self.image_processor_options())

    def video_size(self, num_frames: int, height: int, width: int) -> tuple[int, int]:
        """The ``(height, width)`` the video processor resizes ``num_frames`` frames of ``height x width`` to."""
        factor = self.patch_size * self.merge_size
        max_pixels = self.video_max_pixels
        if self.video_pixels_over_frames:
            # transformers refuses a video shorter than one temporal patch; it is sized as one.
            frames = max(num_frames, self.temporal_patch_size)
            if self.cap_pixels_per_frame:
                per_frame = min(self.max_video_tokens * factor * factor, self.video_max_pixels // frames)
                max_pixels = max(per_frame, int(self.video_min_pixels * 1.05)) * frames
            return smart_resize(
                height, width, factor, self.video_min_pixels, max_pixels, frames, self.temporal_patch_size
            )
        if self.cap_pixels_per_frame:
            total = int(self.max_video_tokens * factor * factor * 0.9)
            max_pixels = max(
                min(max_pixels, total * self.temporal_patch_size // num_frames), int(self.video_min_pixels * 1.05)
            )
        return smart_resize(height, width, factor, self.video_min_pixels, max_pixels)

    def image_size(self, height: int, width: int) -> tuple[int, int]:
        """The ``(height, width)`` the image processor resizes an image of ``height x width`` to."""
        return smart_resize(height, width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels)

    def image_pixel_values(self, pixels: torch.Tensor, fold: bool = False) -> tuple[torch.Tensor, list[int]]:
        """One image's ``(pixel_values, [1, h, w])`` as transformers' torchvision-backed image processor
        (``Qwen2VLImageProcessor``) makes them from ``pixels``, ``(H, W, C)`` uint8 RGB on any device: resized
        (:func:`resize_frames`), normalized in float32 and laid out in merge-block order (:func:`patch_rows`), the
        image written once per temporal slot. ``fold``: written once, rows of ``C * patch_size**2`` values, for a
        patch embedding whose temporal slices are summed (the tower's folded image path)."""
        frames = resize_frames(pixels.permute(2, 0, 1)[None], self.image_size(*pixels.shape[:2]))
        repeats = 1 if fold else self.temporal_patch_size
        mean, std = _scaled_mean_std(self.image_mean, self.image_std, frames.device)
        return patch_rows(frames, mean, std, self.patch_size, self.merge_size, 1, repeats)

    def video_pixel_values(
        self, frames: torch.Tensor, size: tuple[int, int] | None = None
    ) -> tuple[torch.Tensor, list[int]]:
        """One video's ``(pixel_values, [t, h, w])`` as the family's video processor makes them from ``frames``,
        ``(T, H, W, C)`` uint8 RGB on any device: resized to ``size`` ``(h, w)`` (default: :meth:`video_size` of
        these frames) as transformers' torchvision backend resizes them (:func:`resize_frames`), normalized in
        float32 (:func:`patch_rows`), a frame count short of whole temporal patches padded by repeating the last
        frame, and patches laid out ``[t][merge-block order]``. Each frame is prepared alone, so the frames of whole
        temporal patches of a longer video, given that video's size, make exactly that video's rows for them."""
        frames = frames.permute(0, 3, 1, 2)
        frames = resize_frames(frames, size or self.video_size(frames.shape[0], *frames.shape[2:]))
        if pad := -frames.shape[0] % self.temporal_patch_size:
            frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)])
        mean, std = _scaled_mean_std(self.image_mean, self.image_std, frames.device)
        return patch_rows(frames, mean, std, self.patch_size, self.merge_size, self.temporal_patch_size)


@functools.lru_cache(maxsize=16)
def _scaled_mean_std(
    image_mean: tuple[float, ...], image_std: tuple[float, ...], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``image_mean`` and ``image_std`` (float32, on ``device``) times 255, as transformers' torchvision backend
    fuses its 1/255 rescale into them, so that pixel values are ``(uint8 value - mean) / std`` in float32. Made once
    per device: building them copies from host memory, which waits for the device's queued work."""
    scale = 1.0 / (1 / 255)  # the backend's 1 / rescale_factor, bit for bit
    mean = torch.tensor(image_mean, device=device) * scale
    std = torch.tensor(image_std, device=device) * scale
    return mean, std


def resize_frames(frames: torch.Tensor, size: tuple[int, int], uint8_kernel: bool | None = None) -> torch.Tensor:
    """``frames`` ``(N, C, H, W)`` uint8 resized to ``size`` ``(h, w)`` as transformers' torchvision backend resizes
    them (torchvision's bicubic, antialiased resize): on a CPU in uint8 (torch's kernel of PIL's algorithm, whose
    passes each round and clip to 8 bits), on other devices in float32, clipped and rounded back to uint8 at the end
    (torch has no uint8 kernel there). ``uint8_kernel`` picks the recipe (None: by the device; the uint8 kernel
    runs on a CPU only). Frames already of that size are returned as they are."""
    if tuple(frames.shape[-2:]) == tuple(size):
        return frames
    if frames.device.type == "cpu" if uint8_kernel is None else uint8_kernel:
        return F.interpolate(frames, size=size, mode="bicubic", align_corners=False, antialias=True)
    resized = F.interpolate(frames.float(), size=size, mode="bicubic", align_corners=False, antialias=True)
    return resized.clamp_(0, 255).round_().to(torch.uint8)


def patch_rows(
    frames: torch.Tensor,
    mean: torch.Tensor,
    std: torch.Tensor,
    patch_size: int,
    merge_size: int,
    slots: int,
    repeats: int = 1,
) -> tuple[torch.Tensor, list[int]]:
    """``frames`` ``(N, C, H, W)`` uint8 (any strides; ``N`` a multiple of ``slots``, ``H`` and ``W`` of
    ``patch_size * merge_size``) as pixel values ``(x - mean) / std`` in float32 (``mean``, ``std``: ``(C,)`` on the
    frames' device, the 1/255 rescale folded in), each run of ``slots`` frames one temporal patch and each frame
    written ``repeats`` times in it (an image: one frame, repeated ``temporal_patch_size`` times), in rows
    ``[t][merge-block order]`` of ``C * slots * repeats * patch_size**2`` values (channel, then slot, then the
    patch's pixels, as transformers' processors lay them out). Returns ``(rows, [t, h, w])``."""
    count, channels, height, width = frames.shape
    grid_t, grid_h, grid_w = count // slots, height // patch_size, width // patch_size
    blocks = (grid_t, slots, channels, grid_h // merge_size, merge_size, patch_size, grid_w // merge_size, merge_size)
    # Laid out in uint8 (a byte a value), then converted and normalized in place in that layout; repeats are copies of
    # the normalized values, which are the same for every copy.
    values = frames.view(*blocks, patch_size).permute(0, 3, 6, 4, 7, 2, 1, 5, 8).contiguous().to(torch.float32)
    view = (channels, 1, 1, 1)
    values.sub_(mean.view(view)).div_(std.view(view))
    if repeats > 1:
        values = values.unsqueeze(7).expand(*values.shape[:7], repeats, patch_size, patch_size)
    return values.reshape(grid_t * grid_h * grid_w, -1), [grid_t, grid_h, grid_w]


def _pixel_bounds(values: dict, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """A processor config's pixel bounds: its ``size`` shortest and longest edge, overridden by ``min_pixels`` and
    ``max_pixels`` where given (as transformers' processors read them); the defaults where it states neither."""
    size = values.get("size") or {}
    if not isinstance(size, dict):
        raise ValueError(f"the processor config's size must be an object (shortest_edge, longest_edge), got {size!r}")
    min_pixels = values.get("min_pixels") or size.get("shortest_edge") or min_pixels
    max_pixels = values.get("max_pixels") or size.get("longest_edge") or max_pixels
    return int(min_pixels), int(max_pixels)


def smart_resize(
    height: int,
    width: int,
    factor: int,
    min_pixels: int,
    max_pixels: int,
    num_frames: int | None = None,
    temporal_factor: int = 1,
) -> tuple[int, int]:
    """transformers' ``smart_resize`` of Qwen's processors: the ``(height, width)``, multiples of ``factor`` near the
    aspect ratio, whose area lies within ``[min_pixels, max_pixels]``. With ``num_frames``, Qwen3-VL's video
    processor's: the bounds hold for the area times ``num_frames`` (rounded to ``temporal_factor``), and a frame
    smaller than ``factor`` on a side is first scaled up."""
    frames, t_bar = 1, 1
    if num_frames is not None:
        frames, t_bar = num_frames, round(num_frames / temporal_factor) * temporal_factor
        if height < factor or width < factor:
            scale = max(factor / height, factor / width)
            height, width = int(height * scale), int(width * scale)
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


QWEN3_VL_PROCESSING = Processing(
    QWEN3_VL_IMAGE_MEAN,
    QWEN3_VL_IMAGE_STD,
    QWEN3_VL_MIN_PIXELS,
    QWEN3_VL_MAX_PIXELS,
    QWEN3_VL_VIDEO_MIN_PIXELS,
    QWEN3_VL_VIDEO_MAX_PIXELS,
    QWEN3_VL_VIDEO_FPS,
    QWEN3_VL_MIN_FRAMES,
    QWEN3_VL_MAX_FRAMES,
    whole_temporal_patches=False,
    video_pixels_over_frames=True,
    max_video_tokens=QWEN3_VL_MAX_VIDEO_TOKENS,
)
QWEN2_VL_PROCESSING = Processing(
    QWEN2_VL_IMAGE_MEAN,
    QWEN2_VL_IMAGE_STD,
    QWEN2_VL_MIN_PIXELS,
    QWEN2_VL_MAX_PIXELS,
    QWEN2_VL_VIDEO_MIN_PIXELS,
    QWEN2_VL_VIDEO_MAX_PIXELS,
    QWEN3_VL_VIDEO_FPS,
    QWEN3_VL_MIN_FRAMES,
    QWEN3_VL_MAX_FRAMES,
    whole_temporal_patches=True,
    video_pixels_over_frames=False,
    max_video_tokens=QWEN2_VL_MAX_VIDEO_TOKENS,
)
