"""Inputs inside data-set files: WebDataset tar shards, Parquet files and ``datasets.save_to_disk`` folders.

Discovery lists a container's samples without decoding them (:func:`list_tar`, :func:`list_parquet`,
:func:`list_dataset_folder`): each becomes an :class:`~qvl.vit.encode.inputs.Input` whose :class:`Member` says where
its image's bytes are, and the loader reads them (:func:`read_member`) where it decodes, one sample at a time:

- a **WebDataset shard** (an uncompressed ``.tar``): members are grouped into samples by WebDataset's convention, the
  member name up to the first dot of its basename being the sample's key (``dir/0001.jpg`` and ``dir/0001.json`` are
  sample ``dir/0001``) and the rest its extension; a sample's image is its first member whose extension is an image
  format's (``jpg``, ``jpeg``, ``png``, ``webp``, ...: every suffix PIL opens), other members are ignored. Listing
  reads the tar headers only (it seeks past the data); a sample is read by seeking to its member's data. Its source
  is ``shard.tar/KEY``;
- a **Parquet file**: one input per row of its image column (raw bytes, or ``{"bytes", "path"}`` structs as
  ``datasets`` stores an ``Image`` feature); listing reads the footer only, and a sample is read with its row group's
  image column (the last row group read is kept per process, so a worker reads each row group once). Its source is
  ``file.parquet#ROW``;
- a **datasets folder** (``Dataset.save_to_disk``: ``state.json`` and Arrow stream files): the same rows, read from
  the memory-mapped Arrow files. Its source is ``folder#ROW``.

The image column is ``--image-column``, by default ``image`` where there is one, else the file's only column of
binary or image values. pyarrow is needed for Parquet and datasets folders only (the ``data`` extra); tar shards need
nothing beyond the standard library.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tarfile
from collections import OrderedDict

from .errors import EncodeError, require_pyarrow

__all__ = [
    "DATASET_STATE",
    "Member",
    "expand_braces",
    "is_container",
    "list_container",
    "read_member",
]

# The file a datasets.save_to_disk folder holds beside its Arrow files.
DATASET_STATE = "state.json"
TAR_SUFFIXES = (".tar",)
PARQUET_SUFFIXES = (".parquet",)
# Compressed tar shards cannot be read a sample at a time (each read would decompress from the start).
_COMPRESSED = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"\x28\xb5\x2f\xfd": "zstd"}
# WebDataset's split of a member name into the sample's key and the member's extension (webdataset.base_plus_ext).
_KEY_AND_EXTENSION = re.compile(r"^((?:.*/|)[^./]+)[.]([^/]*)$")
# Row groups (Parquet) or tables (Arrow files) kept per process.
_KEPT = 2


@dataclasses.dataclass(frozen=True)
class Member:
    """Where an input's image is inside a container file.

    Attributes:
        format: ``"tar"``, ``"parquet"`` or ``"arrow"`` (a datasets folder's Arrow stream file).
        path: the container file.
        start, length: a tar member's data offset and size in bytes; a Parquet row group and the row within it; an
            Arrow file's row.
        column: the image column (Parquet, Arrow).
    """

    format: str
    path: str
    start: int
    length: int = 0
    column: str | None = None


def expand_braces(pattern: str) -> list[str]:
    """``pattern`` with its brace expressions expanded as a shell expands them: ``a{1,2}b`` -> ``a1b a2b``; integer
    ranges ``{000000..000099}`` (zero-padded to the wider end where either end has a leading zero) and
    ``{1..10..3}``; nested braces. A pattern without a brace expression is returned alone."""
    depth, start = 0, None
    for position, char in enumerate(pattern):
        if char == "{":
            if depth == 0:
                start = position
            depth += 1
        elif char == "}" and depth:
            depth -= 1
            if depth == 0:
                head, body, tail = pattern[:start], pattern[start + 1 : position], pattern[position + 1 :]
                choices = _brace_choices(body)
                if choices is None:  # not an expression ({x}, {}): literal, expand what follows
                    return [head + "{" + body + "}" + rest for rest in expand_braces(tail)]
                return [expanded for choice in choices for expanded in expand_braces(head + choice + tail)]
    return [pattern]


def _brace_choices(body: str) -> list[str] | None:
    match = re.fullmatch(r"(-?\d+)\.\.(-?\d+)(?:\.\.(-?\d+))?", body)
    if match:
        first, last = int(match[1]), int(match[2])
        step = abs(int(match[3])) if match[3] else 1
        step = step or 1
        padded = any(len(end.lstrip("-")) > 1 and end.lstrip("-").startswith("0") for end in match.groups()[:2])
        width = max(len(match[1]), len(match[2])) if padded else 0
        numbers = range(first, last + 1, step) if first <= last else range(first, last - 1, -step)
        return [f"{number:0{width}d}" for number in numbers]
    parts, depth, current = [], 0, ""
    for char in body:
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
            continue
        depth += (char == "{") - (char == "}")
        current += char
    parts.append(current)
    return parts if len(parts) > 1 else None


def is_container(path: str) -> bool:
    """Whether ``path`` names a container of inputs (by its suffix, or a folder with a datasets ``state.json``)."""
    lower = path.lower()
    if lower.endswith(TAR_SUFFIXES + PARQUET_SUFFIXES):
        return not os.path.isdir(path)
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, DATASET_STATE))


def list_container(path: str, image_column: str | None, image_suffixes: frozenset[str]) -> list[tuple]:
    """The samples of container ``path``: ``(source, key, member, problem)`` each (``key`` the sample's key in its
    container: a WebDataset key, or a row number over the whole file or folder; ``member`` None and ``problem`` the
    reason where a sample, or the container itself, cannot be read). Raises :class:`EncodeError` for an image
    column that is missing or ambiguous (``image_column`` names it; None: the default rule)."""
    if path.lower().endswith(TAR_SUFFIXES):
        return list_tar(path, image_suffixes)
    if path.lower().endswith(PARQUET_SUFFIXES):
        return list_parquet(path, image_column)
    return list_dataset_folder(path, image_column)


def _reason(error: BaseException) -> str:
    if isinstance(error, FileNotFoundError):
        return "no such file"
    if isinstance(error, PermissionError):
        return "permission denied"
    return (getattr(error, "strerror", None) or str(error) or type(error).__name__).replace("\n", " ")


def list_tar(path: str, image_suffixes: frozenset[str]) -> list[tuple]:
    """A WebDataset shard's samples in the order their first members come, each with its image member (see the
    module's docstring); a sample without one is listed with the extensions it has as its problem. A shard that
    cannot be read is one problem; one cut short lists its samples up to the cut, then the cut."""
    try:
        with open(path, "rb") as file:
            magic = file.read(6)
    except OSError as error:
        return [(path, None, None, _reason(error))]
    for prefix, name in _COMPRESSED.items():
        if magic.startswith(prefix):
            reason = f"a {name}-compressed tar: qvl reads uncompressed WebDataset shards (decompress it)"
            return [(path, None, None, reason)]
    samples: dict[str, list] = {}  # key -> [image member or None, extensions seen]
    problem = None
    try:
        with tarfile.open(path, mode="r:") as tar:
            while True:
                try:
                    info = tar.next()
                except tarfile.TarError as error:
                    problem = f"cut short or corrupt after {len(tar.members)} members ({_reason(error)})"
                    break
                if info is None:
                    break
                if not info.isreg():
                    continue
                match = _KEY_AND_EXTENSION.match(info.name)
                if match is None:
                    continue
                key, extension = match[1], match[2]
                sample = samples.setdefault(key, [None, []])
                sample[1].append(extension)
                if sample[0] is None and "." + extension.lower() in image_suffixes:
                    sample[0] = Member("tar", path, info.offset_data, info.size)
                tar.members.clear()  # nothing kept per member: a shard of any size lists in little memory
    except (tarfile.TarError, OSError) as error:
        return [(path, None, None, f"not a readable tar file ({_reason(error)})")]
    listed = []
    for key, (member, extensions) in samples.items():
        source = f"{path}/{key}"
        if member is None:
            listed.append((source, key, None, f"no image member (the sample has {', '.join(extensions)})"))
        else:
            listed.append((source, key, member, None))
    if problem is not None:
        listed.append((path, None, None, problem))
    return listed


def _is_image_type(pa, kind) -> bool:
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_binary_view(kind):
        return True
    if pa.types.is_struct(kind):
        names = [kind.field(i).name for i in range(kind.num_fields)]
        return "bytes" in names and _is_image_type(pa, kind.field("bytes").type)
    return False


def _image_column(pa, schema, image_column: str | None, what: str) -> str:
    """The image column of ``schema`` (see the module's docstring); raises :class:`EncodeError` naming ``what``."""
    names = list(schema.names)
    candidates = [name for name in names if _is_image_type(pa, schema.field(name).type)]
    if image_column is not None:
        if image_column not in names:
            raise EncodeError(f"{what}: no column {image_column!r} for --image-column (columns: {', '.join(names)})")
        if image_column not in candidates:
            raise EncodeError(
                f"{what}: column {image_column!r} holds {schema.field(image_column).type}, not image bytes (binary, or"
                " a struct of bytes and path as datasets stores images)"
            )
        return image_column
    if "image" in candidates:
        return "image"
    if len(candidates) == 1:
        return candidates[0]
    found = f"its binary columns are {', '.join(candidates)}" if candidates else "it has no binary column"
    columns = ", ".join(names)
    raise EncodeError(f"{what}: no image column found ({found}; columns: {columns}); name it with --image-column")


def list_parquet(path: str, image_column: str | None) -> list[tuple]:
    """A Parquet file's rows, each an input of its image column (from the footer alone)."""
    pa = require_pyarrow(f"{path}: reading it")
    try:
        parquet = pa.parquet.ParquetFile(path)
    except (OSError, pa.ArrowException) as error:
        return [(path, None, None, f"not a readable Parquet file ({_reason(error)})")]
    with parquet:
        column = _image_column(pa, parquet.schema_arrow, image_column, path)
        listed, row = [], 0
        for group in range(parquet.metadata.num_row_groups):
            for within in range(parquet.metadata.row_group(group).num_rows):
                listed.append((f"{path}#{row}", str(row), Member("parquet", path, group, within, column), None))
                row += 1
    return listed


def _dataset_files(folder: str) -> list[str]:
    state_path = os.path.join(folder, DATASET_STATE)
    try:
        with open(state_path, encoding="utf-8") as file:
            state = json.load(file)
        return [os.path.join(folder, entry["filename"]) for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise EncodeError(f"{state_path}: not a datasets save_to_disk state ({_reason(error)})") from None


def _open_arrow(pa, path: str):
    """An Arrow stream file (datasets' format; a file-format one too) as a table over its memory map."""
    source = pa.memory_map(path)
    try:
        return pa.ipc.open_stream(source).read_all()
    except pa.ArrowInvalid:
        return pa.ipc.open_file(source).read_all()


def list_dataset_folder(folder: str, image_column: str | None) -> list[tuple]:
    """A ``datasets.save_to_disk`` folder's rows, each an input of its image column."""
    pa = require_pyarrow(f"{folder}: reading it")
    listed, row = [], 0
    for path in _dataset_files(folder):
        try:
            table = _open_arrow(pa, path)
        except (OSError, pa.ArrowException) as error:
            listed.append((path, None, None, f"not a readable Arrow file ({_reason(error)})"))
            continue
        column = _image_column(pa, table.schema, image_column, folder)
        for within in range(table.num_rows):
            listed.append((f"{folder}#{row}", str(row), Member("arrow", path, within, 0, column), None))
            row += 1
    return listed


class _Kept(OrderedDict):
    """The last few row groups or tables read in this process."""

    def get_or_make(self, key, make):
        if key in self:
            self.move_to_end(key)
            return self[key]
        value = make()
        self[key] = value
        while len(self) > _KEPT:
            self.popitem(last=False)
        return value


_kept = _Kept()


def read_member(member: Member) -> bytes:
    """The encoded image bytes of ``member``. Raises OSError where its container cannot be read and ValueError
    (its message the reason) where the sample holds no image."""
    if member.format == "tar":
        with open(member.path, "rb") as file:
            file.seek(member.start)
            data = file.read(member.length)
        if len(data) != member.length:
            raise ValueError(f"the shard ends inside this member ({len(data)} of {member.length} bytes)")
        return data
    import pyarrow as pa

    try:
        if member.format == "parquet":
            import pyarrow.parquet as pq

            def read_group():
                with pq.ParquetFile(member.path) as parquet:
                    return parquet.read_row_group(member.start, columns=[member.column]).column(0)

            cell = _kept.get_or_make((member.path, member.start, member.column), read_group)[member.length]
        else:
            table = _kept.get_or_make((member.path, None, None), lambda: _open_arrow(pa, member.path))
            cell = table.column(member.column)[member.start]
    except pa.ArrowException as error:
        raise ValueError(f"unreadable {member.format} data ({_reason(error)})") from None
    value = cell.as_py()
    if isinstance(value, dict):  # datasets' Image storage: the bytes, or a file's path
        data, path = value.get("bytes"), value.get("path")
        if data is None and path:
            if not os.path.isabs(path) and not os.path.exists(path):
                path = os.path.join(os.path.dirname(member.path), path)
            with open(path, "rb") as file:
                return file.read()
        value = data
    if value is None:
        raise ValueError("no image in this row (null)")
    return bytes(value)
