"""Inputs at data-set scale: what the command line names -> numbered :class:`Input` records (:func:`discover`), and
reading one input's pixels (:func:`read_image`, :class:`VideoFile`, :func:`frame_files`).

Discovery is cheap (paths and directory listings, nothing decoded), so a run starts at once and its inputs are
numbered in a fixed order: the positional inputs in the order given, a folder's files in natural order (``frame2``
before ``frame10``), a glob's matches sorted the same way, then each ``--list`` file's lines, then the ``--video``
inputs. Decoding happens later, in the loader's worker processes; an input that cannot be read there is reported with
its reason and skipped (:class:`InputFailure`), never ending the run.

Data-set files are containers of inputs (:mod:`.containers`): a WebDataset tar shard, a Parquet file or a
``datasets.save_to_disk`` folder named like a file (directly, in a list, by a glob or a brace range such as
``data-{000000..000099}.tar``) gives one input per sample or row, in its order, with the :class:`Member` that says
where its image is; its source is ``shard.tar/KEY``, ``file.parquet#ROW`` or ``folder#ROW``.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import sys
from collections.abc import Iterator, Sequence

import numpy as np

from .containers import Member, expand_braces, is_container, list_container, read_member
from .errors import EncodeError
from .options import VIDEO_EXTENSIONS

__all__ = [
    "Input",
    "InputFailure",
    "Member",
    "VideoFile",
    "discover",
    "frame_files",
    "image_extensions",
    "read_image",
    "read_input_image",
    "stamp",
]


@dataclasses.dataclass(frozen=True)
class Input:
    """One input of the run.

    Attributes:
        number: its place in the run (the ``i`` of its output keys ``image.{i}.*``).
        kind: ``"image"`` or ``"video"``.
        source: the path as found (given, listed, matched or walked to); for a sample of a data-set file
            ``shard.tar/KEY``, ``file.parquet#ROW`` or ``folder#ROW``.
        frames: a video given as a folder of frame images: the frame files in order; empty otherwise.
        problem: why discovery already knows it cannot be encoded (a glob that matches nothing, a folder with no
            frames), else None.
        member: where a data-set file's sample is (:class:`~qvl.vit.encode.containers.Member`); None for a file.
        sample: a data-set file's sample's key in it (a WebDataset key, a row number); None for a file.
    """

    number: int
    kind: str
    source: str
    frames: tuple[str, ...] = ()
    problem: str | None = None
    member: Member | None = None
    sample: str | None = None

    @property
    def key(self) -> str:
        """The input's key in its container (a WebDataset key, a row number), else its source."""
        return self.source if self.sample is None else self.sample


class InputFailure(Exception):
    """An input that cannot be encoded; the message is the reason (the record names the input)."""


def image_extensions() -> frozenset[str]:
    """The file suffixes (lower case, with the dot) of the image formats PIL opens."""
    from PIL import Image

    return frozenset(ext for ext, name in Image.registered_extensions().items() if name in Image.OPEN)


def natural_key(path: str) -> list:
    """Sort key of ``path`` in which digit runs compare by value (``frame2`` before ``frame10``)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path)]


def _walk(folder: str, suffixes: frozenset[str]) -> list[str]:
    """Every file under ``folder`` (recursively, hidden names left out) whose suffix is in ``suffixes``, in natural
    order of their paths."""
    found = []
    for root, directories, files in os.walk(folder):
        directories[:] = [name for name in directories if not name.startswith(".")]
        found += [os.path.join(root, name) for name in files
                  if not name.startswith(".") and os.path.splitext(name)[1].lower() in suffixes]  # fmt: skip
    return sorted(found, key=natural_key)


def _kind(path: str) -> str:
    return "video" if os.path.splitext(path)[1].lower() in VIDEO_EXTENSIONS else "image"


def _container(path: str, image_column: str | None) -> list[Input]:
    images = image_extensions()
    return [Input(-1, "image", source, problem=problem, member=member, sample=key)
            for source, key, member, problem in list_container(path, image_column, images)]  # fmt: skip


def _expand(path: str, media: frozenset[str], named: bool, image_column: str | None = None) -> list[Input]:
    """``path`` as inputs (numbered later): a data-set file's samples, a folder's media files, a glob's or a brace
    expression's matches, else the path itself. A path ``named`` on the command line that does not exist is an error
    (a typo, known before any work); one from a list file is an input that fails when read."""
    if not os.path.lexists(path):
        expanded = expand_braces(path) if "{" in path else [path]
        if len(expanded) > 1:
            return [item for each in expanded for item in _expand(each, media, False, image_column)]
        if glob.has_magic(path):
            matches = sorted(glob.glob(path, recursive=True), key=natural_key)
            if not matches:
                return [Input(-1, "image", path, problem="no file matches this pattern")]
            return [item for match in matches for item in _expand(match, media, False, image_column)]
        if named:
            raise EncodeError(f"{path}: no such file or directory")
    if is_container(path):
        return _container(path, image_column)
    if os.path.isdir(path):
        files = _walk(path, media)
        if not files:
            return [Input(-1, "image", path, problem="no image or video files in this folder")]
        return [Input(-1, _kind(file), file) for file in files]
    return [Input(-1, _kind(path), path)]


def _read_list(name: str) -> list[str]:
    """The paths in list file ``name`` (``-``: standard input), one a line; blank lines and lines starting with
    ``#`` are left out."""
    try:
        if name == "-":
            lines = sys.stdin.read().splitlines()
        else:
            with open(name, encoding="utf-8") as file:
                lines = file.read().splitlines()
    except FileNotFoundError:
        raise EncodeError(f"--list {name}: no such file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise EncodeError(f"--list {name}: cannot read ({getattr(error, 'strerror', None) or error})") from None
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def frame_files(folder: str) -> list[str]:
    """The frame images of a video given as ``folder``, in natural order (hidden files and non-images left out).
    Raises :class:`InputFailure` where there are none or the folder cannot be listed."""
    suffixes = image_extensions()
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        raise InputFailure("no such directory") from None
    except NotADirectoryError:
        raise InputFailure("not a directory (--video takes a video file or a folder of frame images)") from None
    except PermissionError:
        raise InputFailure("permission denied") from None
    frames = [entry.path for entry in entries if not entry.name.startswith(".") and not entry.is_dir()
              and os.path.splitext(entry.name)[1].lower() in suffixes]  # fmt: skip
    if not frames:
        raise InputFailure("no frame images (expected files such as 0001.png, 0002.png, ...)")
    return sorted(frames, key=lambda path: natural_key(os.path.basename(path)))


def discover(
    inputs: Sequence[str], videos: Sequence[str] = (), lists: Sequence[str] = (), image_column: str | None = None
) -> list[Input]:
    """The run's inputs, numbered: ``inputs`` (files, folders searched recursively for images and videos, glob
    patterns such as ``photos/**/*.jpg``, brace expressions such as ``data-{000..099}.tar``, and data-set files:
    WebDataset tar shards, Parquet files, datasets folders, whose samples are inputs with ``image_column`` their
    image: :mod:`.containers`), the paths in the ``lists`` files (each line as an entry of ``inputs``), then
    ``videos`` (video files of any name, or folders of frame images, one video each).

    Nothing is decoded. Raises :class:`EncodeError` for a path named in ``inputs`` or ``videos`` that does not exist,
    for a list file that cannot be read and for a data-set file without the image column; anything found wanting
    later (a glob that matches nothing, an empty folder, a sample without an image) becomes an :class:`Input` with its
    ``problem``."""
    media = image_extensions() | VIDEO_EXTENSIONS
    found = [item for path in inputs for item in _expand(path, media, True, image_column)]
    for name in lists:
        found += [item for path in _read_list(name) for item in _expand(path, media, False, image_column)]
    for path in videos:
        if not os.path.lexists(path):
            raise EncodeError(f"{path}: no such file or directory")
        if not os.path.isdir(path):
            found.append(Input(-1, "video", path))
            continue
        try:
            found.append(Input(-1, "video", path, tuple(frame_files(path))))
        except InputFailure as failure:
            found.append(Input(-1, "video", path, problem=str(failure)))
    return [dataclasses.replace(item, number=number) for number, item in enumerate(found)]


def stamp(item: Input) -> dict[str, int] | None:
    """What identifies the content of ``item`` without reading it: its size in bytes and modification time (for a
    frame folder, its frames' total size and latest time; for a sample of a data-set file, the file's); None where it
    cannot be read."""
    try:
        stats = [os.stat(path) for path in item.frames or (item.source if item.member is None else item.member.path,)]
    except OSError:
        return None
    return {"size": sum(s.st_size for s in stats), "mtime_ns": max(s.st_mtime_ns for s in stats)}


def _failure_of(error: BaseException) -> InputFailure:
    """One line for why a file could not be read."""
    if isinstance(error, FileNotFoundError):
        return InputFailure("no such file")
    if isinstance(error, IsADirectoryError):
        return InputFailure("is a directory (give frame folders with --video)")
    if isinstance(error, PermissionError):
        return InputFailure("permission denied")
    reason = getattr(error, "strerror", None) or str(error) or type(error).__name__
    return InputFailure(reason.replace("\n", " "))


def read_image(path: str) -> np.ndarray:
    """The image file at ``path`` as ``(H, W, 3)`` uint8 RGB, as transformers' processors see it (upright, any
    transparency laid over white: :func:`~qvl.vit.encode.prepare.decode_image`). Raises :class:`InputFailure` with
    the reason where it cannot be read."""
    from .prepare import decode_image

    try:
        return decode_image(path)
    except (OSError, ValueError) as error:
        raise _failure_of(error) from None


def read_input_image(item: Input) -> np.ndarray:
    """The image of ``item`` (a file, or a data-set file's sample) as :func:`read_image` gives it. Raises
    :class:`InputFailure` with the reason where it cannot be read."""
    if item.member is None:
        return read_image(item.source)
    import io

    from .prepare import decode_image

    try:
        return decode_image(io.BytesIO(read_member(item.member)))
    except (OSError, ValueError) as error:
        raise _failure_of(error) from None


class VideoFile:
    """A video file decoded with PyAV as transformers' ``read_video_pyav`` decodes it (the first video stream, frames
    as ``to_ndarray(format="rgb24")``), streamed: only the frames asked for are kept, one at a time."""

    def __init__(self, path: str):
        self.path = path
        try:
            import av
        except ImportError:
            raise InputFailure("video files are decoded with PyAV, which is not installed; pip install av") from None
        self._av = av

    def _open(self):
        try:
            container = self._av.open(self.path)
        except Exception as error:  # noqa: BLE001 - PyAV's FFmpegError subclasses, OSError, ValueError alike
            raise self._failure(error) from None
        if not container.streams.video:
            container.close()
            raise InputFailure("no video stream")
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        return container, stream

    def _failure(self, error: BaseException) -> InputFailure:
        if isinstance(error, (FileNotFoundError, IsADirectoryError, PermissionError)):
            return _failure_of(error)
        reason = getattr(error, "strerror", None) or str(error)
        return InputFailure(f"not a video file PyAV can decode ({type(error).__name__}: {reason})")

    def probe(self) -> tuple[int, float | None]:
        """``(frame count, frame rate)``: the count the container states (as transformers reads it), else counted by
        decoding every frame (WebM and Matroska often state none); the stream's rate (None where it states none)."""
        container, stream = self._open()
        with container:
            rate = stream.average_rate or stream.guessed_rate
            count = stream.frames
            if count <= 0:
                count = sum(1 for _ in self._decoded(container, stream))
        if count == 0:
            raise InputFailure("no video frames")
        return count, None if rate is None else float(rate)

    def _decoded(self, container, stream) -> Iterator:
        try:
            yield from container.decode(stream)
        except Exception as error:  # noqa: BLE001 - corrupt data fails with any of PyAV's errors
            raise self._failure(error) from None

    def frames(self, indices: Sequence[int]) -> Iterator[np.ndarray]:
        """The frames numbered ``indices`` (ascending; repeats allowed) as ``(H, W, 3)`` uint8 arrays, in order, decoded
        as they are reached. Raises :class:`InputFailure` where frames differ in size or the video ends before them."""
        wanted = list(indices)
        container, stream = self._open()
        with container:
            position, size, count = 0, None, 0
            for number, frame in enumerate(self._decoded(container, stream)):
                count = number + 1
                if size is None:
                    size = (frame.width, frame.height)
                elif (frame.width, frame.height) != size:
                    raise InputFailure(
                        f"frame {number} is {frame.width}x{frame.height} but frame 0 is {size[0]}x{size[1]}"
                        " (all frames of a video must have one size)"
                    )
                if position < len(wanted) and wanted[position] == number:
                    pixels = frame.to_ndarray(format="rgb24")
                    while position < len(wanted) and wanted[position] == number:
                        yield pixels
                        position += 1
                if position == len(wanted):
                    return
        raise InputFailure(f"has {count} frames, fewer than its container states")
