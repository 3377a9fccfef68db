"""Features as Parquet (``--format parquet``, or an output named ``*.parquet``): one row per encoded input.

Columns (:func:`schema`):

- ``input`` (int64): the input's number (its ``i`` in the index);
- ``key`` (string): its key in its container (a WebDataset key, a Parquet or datasets row number), else its path;
- ``source`` (string): its source as the index gives it (a path, ``shard.tar/KEY``, ``file.parquet#ROW``);
- ``kind`` (string): ``"image"`` or ``"video"``;
- ``grid_thw`` (fixed-size list of 3 int32): its patch grid;
- ``merged`` and ``deepstack_0``, ``deepstack_1``, ... (list of fixed-size lists of ``out_hidden`` floats): its
  features, one inner list per merged token, as ``image.{i}.merged`` and ``image.{i}.deepstack.{j}`` of the
  safetensors layout. float32 for fp32 and bf16 runs (bf16 values are exact in float32, which Arrow, pandas and
  ``datasets`` all read; Arrow has no bfloat16), float16 for fp16 runs.

Plain Arrow types, so pyarrow, pandas (``pd.read_parquet``: a row's ``merged`` is an array of per-token arrays;
``np.stack`` makes it ``(n, out_hidden)``) and ``datasets`` (``load_dataset("parquet", data_files=...)``,
``Dataset.from_parquet``; ``.with_format("numpy")`` gives ``(n, out_hidden)`` arrays) read them as they are. An
input that could not be encoded has no row: it is in the index with its reason. Each file's schema metadata holds
the run's constants and the index entries of the inputs it completes, skipped ones included (as a safetensors shard's
metadata does), so the files alone are the index. pyarrow is imported only here (the ``data`` extra).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from .errors import require_pyarrow

__all__ = ["column_name", "merge_parts", "read_metadata", "schema", "write_part"]

# Rows of a row group are chosen to hold about this many bytes of features.
ROW_GROUP_BYTES = 64 * 2**20
WRITING = "--format parquet: writing Parquet"


def column_name(name: str) -> str:
    """The column of feature ``name`` (``merged``, ``deepstack.0``): ``merged``, ``deepstack_0``."""
    return name.replace(".", "_")


def _value_type(pa, dtype: torch.dtype):
    return pa.float16() if dtype == torch.float16 else pa.float32()


def schema(names: list[str], width: int, dtype: torch.dtype, metadata: dict[str, str] | None = None):
    """The Arrow schema of a run whose features are ``names`` (``merged``, ``deepstack.0``, ...), ``width`` values a
    token, computed in ``dtype``."""
    pa = require_pyarrow(WRITING)
    token = pa.list_(_value_type(pa, dtype), width)
    fields = [
        pa.field("input", pa.int64()),
        pa.field("key", pa.string()),
        pa.field("source", pa.string()),
        pa.field("kind", pa.string()),
        pa.field("grid_thw", pa.list_(pa.int32(), 3)),
        *(pa.field(column_name(name), pa.list_(token)) for name in names),
    ]
    return pa.schema(fields, metadata=metadata)


def _features(pa, tensors: list[torch.Tensor], width: int, dtype: torch.dtype):
    """``tensors`` (each ``(n_i, width)``) as one list-of-tokens array."""
    numpy_dtype = np.float16 if dtype == torch.float16 else np.float32
    counts = [tensor.shape[0] for tensor in tensors]
    offsets = np.zeros(len(tensors) + 1, dtype=np.int32)
    np.cumsum(counts, out=offsets[1:])
    if tensors:
        values = torch.cat([tensor.reshape(-1, width) for tensor in tensors]).to(torch.float32).numpy()
    else:
        values = np.zeros((0, width), np.float32)
    values = pa.array(values.astype(numpy_dtype, copy=False).reshape(-1), type=_value_type(pa, dtype))
    tokens = pa.FixedSizeListArray.from_arrays(values, width)
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), tokens)


def write_part(
    path: Path,
    entries: list[dict],
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str],
    names: list[str],
    width: int,
    dtype: torch.dtype,
) -> None:
    """One Parquet file at ``path`` (written as is: the caller renames it into place) holding the rows of the encoded
    ``entries`` (in input order; their features ``tensors[f"image.{i}.{name}"]``) and ``metadata``."""
    pa = require_pyarrow(WRITING)
    encoded = sorted((entry for entry in entries if entry["error"] is None), key=lambda entry: entry["input"])
    table_schema = schema(names, width, dtype, metadata)
    columns = [
        pa.array([entry["input"] for entry in encoded], pa.int64()),
        pa.array([entry.get("key", entry["source"]) for entry in encoded], pa.string()),
        pa.array([entry["source"] for entry in encoded], pa.string()),
        pa.array([entry["kind"] for entry in encoded], pa.string()),
        pa.array([entry["grid_thw"] for entry in encoded], pa.list_(pa.int32(), 3)),
    ]
    for name in names:
        columns.append(_features(pa, [tensors[f"image.{entry['input']}.{name}"] for entry in encoded], width, dtype))
    table = pa.Table.from_arrays(columns, schema=table_schema)
    row_bytes = table.nbytes / max(1, table.num_rows)
    rows = max(1, int(ROW_GROUP_BYTES // max(row_bytes, 1)))
    pa.parquet.write_table(table, str(path), row_group_size=rows)


def read_metadata(path: Path) -> dict[str, str]:
    """The schema metadata of Parquet file ``path`` (its run's constants and index entries). Raises OSError or
    pyarrow's ArrowException where it cannot be read."""
    pa = require_pyarrow(WRITING)
    metadata = pa.parquet.read_schema(str(path)).metadata or {}
    return {key.decode(): value.decode() for key, value in metadata.items()}


def read_table(path: Path):
    """The rows of Parquet file ``path``."""
    return require_pyarrow(WRITING).parquet.read_table(str(path))


def merge_parts(paths: list[Path], path: Path, metadata: dict[str, str]) -> int:
    """The rows of the Parquet files ``paths`` as one file at ``path`` (written as is), in input order, with
    ``metadata``; returns the number of rows. Every part is read into memory (the single-file layout is for small
    jobs)."""
    pa = require_pyarrow(WRITING)
    tables = [pa.parquet.read_table(str(part)) for part in paths]
    table = pa.concat_tables(tables).sort_by("input")
    table = table.replace_schema_metadata(metadata)
    row_bytes = table.nbytes / max(1, table.num_rows)
    pa.parquet.write_table(table, str(path), row_group_size=max(1, int(ROW_GROUP_BYTES // max(row_bytes, 1))))
    return table.num_rows


def entries_of(metadata: dict[str, str]) -> list[dict]:
    """The index entries a part's metadata holds."""
    return json.loads(metadata.get("entries", "[]"))
