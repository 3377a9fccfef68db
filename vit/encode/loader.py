"""The loader: inputs -> :class:`Piece` objects (decoded, sampled and, on a CPU, prepared, in torch ``DataLoader``
worker processes overlapping the tower) -> batches packed to a patch budget (:class:`Packer`).

A video is decoded, prepared and encoded in chunks of whole temporal patches, each within the budget and holding at
most :data:`CHUNK_BYTES` of decoded frames, so its memory does not grow with its length: every chunk is prepared at
the whole video's size and the towers attend within each temporal patch's frame, so the chunks' features are the
whole video's. An input that cannot be read becomes a piece with its ``failure`` and the run goes on.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ..processing import Processing
from .inputs import Input, InputFailure, VideoFile, read_image, read_input_image, stamp
from .prepare import MAX_ASPECT_RATIO, Preparer

__all__ = ["CHUNK_BYTES", "Packer", "Piece", "PieceStream", "load"]

# Decoded frames (uint8 RGB at the source's size) per video chunk: a 1080p chunk holds about 10 frames.
CHUNK_BYTES = 64 * 2**20


@dataclasses.dataclass
class Piece:
    """One input, or one chunk of a video, on its way to a batch.

    Attributes:
        item: the input.
        part, last: which chunk of the input this is (0-based), and whether it is its last.
        grid: this piece's ``[t, h, w]`` patch grid (a chunk's ``t`` is its own temporal patches).
        rows: its pixel values, prepared (on a CPU, by the worker); None where ``pixels`` still need preparing.
        pixels: its uint8 pixels, ``(H, W, 3)`` for an image, ``(T, H, W, 3)`` for a video, where the device
            prepares them; else None.
        size: a video's resized ``(height, width)`` (the whole video's, for every chunk).
        sampling: a video file's frame count, rate and sampled frame numbers; None otherwise.
        stamp: the input's size and modification time when it was read (:func:`~qvl.vit.encode.inputs.stamp`).
        failure: why the input cannot be encoded (the piece then carries nothing else).
        decode_s, prepare_s: seconds spent decoding and preparing this piece where it was read.
    """

    item: Input
    part: int = 0
    last: bool = True
    grid: list[int] = dataclasses.field(default_factory=list)
    rows: torch.Tensor | None = None
    pixels: torch.Tensor | None = None
    size: tuple[int, int] | None = None
    sampling: dict | None = None
    stamp: dict | None = None
    failure: str | None = None
    decode_s: float = 0.0
    prepare_s: float = 0.0

    @property
    def patches(self) -> int:
        """The patches this piece adds to a batch."""
        return math.prod(self.grid)

    def pin_memory(self) -> Piece:
        """This piece with its pixels in pinned memory (the ``DataLoader``'s pinning thread calls this), so that their
        copy to the GPU runs asynchronously."""
        if self.pixels is None:
            return self
        return dataclasses.replace(self, pixels=self.pixels.pin_memory())


def _check_aspect(width: int, height: int) -> None:
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        raise InputFailure(f"{width}x{height} is more elongated than {MAX_ASPECT_RATIO}:1 (Qwen's limit)")


class PieceStream(IterableDataset):
    """The pieces of ``inputs`` (each ``DataLoader`` worker takes every ``num_workers``-th input), decoded and, with a
    ``preparer``, prepared; without one, carrying uint8 ``pixels`` for the device to prepare. ``budget`` bounds a
    video chunk's patches (at least one temporal patch)."""

    def __init__(self, inputs: Sequence[Input], processing: Processing, budget: int, preparer: Preparer | None):
        self.inputs, self.processing, self.budget, self.preparer = list(inputs), processing, budget, preparer

    def __iter__(self) -> Iterator[Piece]:
        worker = get_worker_info()
        share = self.inputs if worker is None else self.inputs[worker.id :: worker.num_workers]
        for item in share:
            yield from self.pieces(item)

    def pieces(self, item: Input) -> Iterator[Piece]:
        """``item`` as its pieces, or as one piece with its ``failure`` (after any pieces made before the failure)."""
        if item.problem is not None:
            yield Piece(item, failure=item.problem)
            return
        try:
            if item.kind == "image":
                yield self._image(item)
            else:
                yield from self._video(item)
        except InputFailure as failure:
            yield Piece(item, failure=str(failure))
        # One input's failure never ends the run, whatever the decoder raised.
        except Exception as error:  # noqa: BLE001
            yield Piece(item, failure=f"{type(error).__name__}: {error}".replace("\n", " "))

    def _image(self, item: Input) -> Piece:
        start = time.perf_counter()
        identity = stamp(item)
        pixels = read_input_image(item)
        _check_aspect(pixels.shape[1], pixels.shape[0])
        decoded = time.perf_counter()
        piece = Piece(item, stamp=identity, decode_s=decoded - start)
        pixels = torch.from_numpy(pixels)
        if self.preparer is None:
            height, width = self.processing.image_size(*pixels.shape[:2])
            patch = self.processing.patch_size
            return dataclasses.replace(piece, pixels=pixels, grid=[1, height // patch, width // patch])
        rows, grid = self.preparer.image(pixels)
        return dataclasses.replace(piece, rows=rows, grid=grid, prepare_s=time.perf_counter() - decoded)

    def _video(self, item: Input) -> Iterator[Piece]:
        start = time.perf_counter()
        identity = stamp(item)
        if item.frames:
            sampling, count = None, len(item.frames)
            frames = (read_image(path) for path in item.frames)
        else:
            video = VideoFile(item.source)
            total, rate = video.probe()
            indices = self.processing.sample(total, rate, self.processing.fps, self.processing.max_frames)
            sampling, count = {"frames": total, "fps": rate, "indices": indices}, len(indices)
            frames = video.frames(indices)
        first = next(frames)
        height, width = first.shape[:2]
        _check_aspect(width, height)
        size = self.processing.video_size(count, height, width)
        slots, patch = self.processing.temporal_patch_size, self.processing.patch_size
        per_step = (size[0] // patch) * (size[1] // patch)
        steps = min(max(1, self.budget // per_step), max(1, CHUNK_BYTES // (slots * first.nbytes)))
        chunk_frames, decode_s = steps * slots, time.perf_counter() - start
        chunk, made, part = [first], 1, 0
        while True:
            start = time.perf_counter()
            for frame in frames:
                if frame.shape != first.shape:
                    raise InputFailure(
                        f"frame {made} is {frame.shape[1]}x{frame.shape[0]} but the first is {width}x{height}"
                        " (all frames of a video must have one size)"
                    )
                chunk.append(frame)
                made += 1
                if len(chunk) == chunk_frames:
                    break
            pixels = torch.from_numpy(np.stack(chunk))
            decode_s += time.perf_counter() - start
            last = made == count
            piece = Piece(item, part, last, size=size, sampling=sampling, stamp=identity, decode_s=decode_s)
            if self.preparer is None:
                grid = [-(-len(chunk) // slots), size[0] // patch, size[1] // patch]
                yield dataclasses.replace(piece, pixels=pixels, grid=grid)
            else:
                start = time.perf_counter()
                rows, grid = self.preparer.video(pixels, size)
                yield dataclasses.replace(piece, rows=rows, grid=grid, prepare_s=time.perf_counter() - start)
            if last:
                return
            chunk, part, decode_s = [], part + 1, 0.0


def _as_is(piece: Piece) -> Piece:
    return piece


def load(
    inputs: Sequence[Input],
    processing: Processing,
    budget: int,
    device: torch.device,
    workers: int,
    fold_images: bool = False,
) -> Iterator[Piece]:
    """The pieces of ``inputs``, read by ``workers`` processes (0: in this one). On a CPU ``device`` the workers also
    prepare them (images folded with ``fold_images``); for a GPU they only decode, into pinned memory, and the caller
    prepares on the device (:class:`~qvl.vit.encode.prepare.Preparer`)."""
    preparer = Preparer(processing, "cpu", fold_images) if device.type == "cpu" else None
    stream = PieceStream(inputs, processing, budget, preparer)
    workers = min(workers, len(inputs))
    if workers == 0:
        return iter(stream)
    loader = DataLoader(
        stream, batch_size=None, num_workers=workers, collate_fn=_as_is, pin_memory=device.type == "cuda"
    )
    return iter(loader)


class Packer:
    """Pieces -> batches of at most ``budget`` patches and ``max_pieces`` pieces, in arrival order; a piece of more
    than ``budget`` patches runs alone. Pieces whose rows differ in width (an image's folded rows, a video's whole
    ones) never share a batch, so that an image's features never depend on whether a video came with it: each width
    fills a batch of its own."""

    def __init__(self, budget: int, max_pieces: int | None = None):
        self.budget, self.max_pieces = budget, max_pieces
        self._open: dict[int, tuple[list[Piece], int]] = {}  # row width -> (queued pieces, their patches)

    def add(self, piece: Piece) -> list[list[Piece]]:
        """Queue ``piece`` (prepared: its ``rows`` set); returns the batches that are now complete (none, or the
        queued one of its width, or both it and ``piece`` alone)."""
        width = piece.rows.shape[-1]
        batch, patches = self._open.pop(width, ([], 0))
        ready = []
        if batch and (patches + piece.patches > self.budget or len(batch) == self.max_pieces):
            ready, batch, patches = [batch], [], 0
        if piece.patches >= self.budget:
            ready.append([piece])
        else:
            batch.append(piece)
            patches += piece.patches
        if batch:
            self._open[width] = batch, patches
        return ready

    def flush(self) -> list[list[Piece]]:
        """The queued batches, if any, now."""
        batches = [batch for batch, _ in self._open.values()]
        self._open = {}
        return batches
