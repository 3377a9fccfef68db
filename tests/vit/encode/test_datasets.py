"""qvl encode on data-set files and into Parquet (qvl.vit.encode.containers, .parquet): WebDataset tar shards (brace
ranges, samples by key, the image member by extension, other members ignored), Parquet files (raw bytes and
datasets' {bytes, path} structs) and a ``datasets.save_to_disk`` folder give every sample the features of the same
image given as a file, bit for bit; unreadable samples are listed with their reasons; Parquet output reads back with
pyarrow, pandas and ``datasets`` as the safetensors run's features, and ``--resume`` continues it.

A tiny tower (tests/encoding.py's TINY_CONFIG) and 32-64 pixel images keep each run to a fraction of a second.
"""

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from encoding import encode, random_picture, read_folder, save_checkpoint
from qvl.vit.encode import containers
from qvl.vit.encode.containers import expand_braces
from qvl.vit.encode.inputs import discover

datasets = pytest.importorskip("datasets")

SMALL = ["--device", "cpu", "--min-pixels", 1024, "--max-pixels", 200_000]
# (height, width) of the data set's images: 2x2 to 4x4 merged blocks, none resized.
SHAPES = [(32, 32), (32, 64), (64, 32), (64, 64), (32, 96), (96, 32)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny")
    save_checkpoint(directory)
    return directory


def image_bytes(number: int, fmt: str = "PNG") -> bytes:
    height, width = SHAPES[number % len(SHAPES)]
    buffer = io.BytesIO()
    random_picture(height, width, number).save(buffer, fmt)
    return buffer.getvalue()


def add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


@pytest.fixture(scope="module")
def data_set(tmp_path_factory) -> dict:
    """Six images as files (the reference), the same bytes in two WebDataset shards (with a caption member each, a
    sample without an image and a corrupt one), in a Parquet file of raw bytes, and, as datasets stores images, in a
    Parquet file and a save_to_disk folder."""
    root = tmp_path_factory.mktemp("data")
    images = [image_bytes(number, "JPEG" if number == 4 else "PNG") for number in range(6)]
    files = []
    for number, data in enumerate(images):
        files.append(root / f"{number:02d}.{'jpg' if number == 4 else 'png'}")
        files[-1].write_bytes(data)
    for shard, numbers in enumerate([(0, 1, 2), (3, 4, 5)]):
        with tarfile.open(root / f"data-{shard:06d}.tar", "w") as tar:
            for number in numbers:
                key = f"sample{number:04d}"
                add_member(tar, f"{key}.txt", f"caption {number}".encode())
                add_member(tar, f"{key}.{files[number].suffix[1:]}", images[number])
                add_member(tar, f"{key}.seg.png", image_bytes(99))  # not the image: its extension is seg.png
            if shard == 1:
                add_member(tar, "nothing.json", b"{}")
                add_member(tar, "broken.png", images[0][:40])
    raw = pa.table({"id": [f"r{n}" for n in range(6)], "image": pa.array(images, pa.binary())})
    pq.write_table(raw, root / "raw.parquet", row_group_size=4)
    hf = datasets.Dataset.from_dict({"image": [str(path) for path in files], "label": list(range(6))})
    hf = hf.cast_column("image", datasets.Image())
    hf.to_parquet(str(root / "hf.parquet"))
    hf.save_to_disk(str(root / "saved"))
    return {"root": root, "files": files}


def features_by_source(folder: Path) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, dict]]:
    """A shard folder's features per input source (by their names without the input's number) and its entries."""
    tensors, entries = read_folder(folder)
    by_source = {entry["source"]: {} for entry in entries}
    for entry in entries:
        for key in entry["keys"]:
            by_source[entry["source"]][key.split(".", 2)[2]] = tensors[key]
    return by_source, {entry["source"]: entry for entry in entries}


def assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == expected.keys() and got, what
    for name in expected:
        assert torch.equal(got[name], expected[name]), f"{what}: {name}"


@pytest.fixture(scope="module")
def reference(checkpoint, data_set, tmp_path_factory) -> dict[str, dict[str, torch.Tensor]]:
    """The six images encoded as files, by file name."""
    output = tmp_path_factory.mktemp("reference") / "out"
    assert encode(*data_set["files"], "--model", checkpoint, *SMALL, "-o", output) == 0
    features, _ = features_by_source(output)
    return {Path(source).name: value for source, value in features.items()}


def test_brace_expressions_expand_like_a_shell():
    assert expand_braces("data-{000000..000002}.tar") == ["data-000000.tar", "data-000001.tar", "data-000002.tar"]
    assert expand_braces("a{b,c{1..2}}d") == ["abd", "ac1d", "ac2d"]
    assert expand_braces("{9..11}x") == ["9x", "10x", "11x"] and expand_braces("{3..1..2}") == ["3", "1"]
    assert expand_braces("x{y}z") == ["x{y}z"] and expand_braces("plain.tar") == ["plain.tar"]


def test_webdataset_shards_give_each_sample_the_features_of_its_image_file(checkpoint, data_set, reference, tmp_path):
    """Two shards named by a brace range: one input per sample key, in shard order, its image member chosen by its
    extension (the caption and the seg.png member ignored), the features of the same bytes as a file; a sample
    without an image and a corrupt one are listed with their reasons."""
    root = data_set["root"]
    pattern = str(root / "data-{000000..000001}.tar")
    output = tmp_path / "out"
    assert encode(pattern, "--model", checkpoint, *SMALL, "-o", output) == 0
    features, entries = features_by_source(output)
    shards = [root / "data-000000.tar"] * 3 + [root / "data-000001.tar"] * 5
    keys = [f"sample{n:04d}" for n in range(6)] + ["nothing", "broken"]
    assert list(entries) == [f"{shard}/{key}" for shard, key in zip(shards, keys, strict=True)]
    assert [entry["key"] for entry in entries.values()] == keys
    for number, file in enumerate(data_set["files"]):
        assert_same(features[f"{shards[number]}/{keys[number]}"], reference[file.name], f"sample {number}")
    nothing, broken = entries[f"{shards[-1]}/nothing"], entries[f"{shards[-1]}/broken"]
    assert nothing["error"] == "no image member (the sample has json)" and nothing["keys"] == []
    assert "unreadable image" in broken["error"] or "not an image" in broken["error"], broken


def test_a_compressed_or_truncated_shard_is_listed_with_its_reason(tmp_path, data_set):
    with tarfile.open(tmp_path / "zipped.tar", "w:gz") as tar:
        add_member(tar, "a.png", image_bytes(0))
    good = (data_set["root"] / "data-000000.tar").read_bytes()
    (tmp_path / "cut.tar").write_bytes(good[:3000])
    [zipped] = discover([str(tmp_path / "zipped.tar")])
    assert zipped.problem.startswith("a gzip-compressed tar: qvl reads uncompressed WebDataset shards")
    cut = discover([str(tmp_path / "cut.tar")])
    assert cut[-1].source == str(tmp_path / "cut.tar") and cut[-1].problem.startswith("cut short or corrupt")


@pytest.mark.parametrize("name", ["raw.parquet", "hf.parquet", "saved"])
def test_parquet_files_and_datasets_folders_give_each_row_the_features_of_its_image_file(
    name, checkpoint, data_set, reference, tmp_path
):
    """A Parquet file of raw image bytes (its image column found by name among a string and a binary column), one
    that datasets wrote ({bytes, path} structs) and a save_to_disk folder: row r's features are image r's."""
    source = data_set["root"] / name
    output = tmp_path / "out"
    assert encode(source, "--model", checkpoint, *SMALL, "-o", output) == 0
    features, entries = features_by_source(output)
    assert list(entries) == [f"{source}#{row}" for row in range(6)]
    assert [entry["key"] for entry in entries.values()] == [str(row) for row in range(6)]
    for row, file in enumerate(data_set["files"]):
        assert_same(features[f"{source}#{row}"], reference[file.name], f"{name} row {row}")


def test_the_image_column_is_chosen_or_named(tmp_path, data_set, capsys, checkpoint):
    """--image-column picks among binary columns; none, several or a column of another type is one line naming the
    file and the columns, exit status 2, before any work."""
    images = [image_bytes(0), image_bytes(1)]
    pq.write_table(pa.table({"a": pa.array(images), "b": pa.array(images), "n": [1, 2]}), tmp_path / "two.parquet")
    path = tmp_path / "two.parquet"
    assert encode(path, "--model", checkpoint, *SMALL, "-o", tmp_path / "x") == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == (
        f"qvl: error: {path}: no image column found (its binary columns are a, b; columns: a, b, n); name it with"
        " --image-column"
    )
    assert encode(path, "--image-column", "n", "--model", checkpoint, *SMALL, "-o", tmp_path / "x") == 2
    assert "column 'n' holds int64, not image bytes" in capsys.readouterr().err
    assert encode(path, "--image-column", "b", "--model", checkpoint, *SMALL, "-o", tmp_path / "y") == 0


def test_a_parquet_file_is_read_a_row_group_at_a_time(data_set, monkeypatch):
    """Reading every row of a file of two row groups (4 + 2 rows) reads each row group once, one column."""
    reads = []
    read_row_group = pq.ParquetFile.read_row_group

    def counted(self, index, columns=None, **kwargs):
        reads.append((index, tuple(columns)))
        return read_row_group(self, index, columns=columns, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", counted)
    containers._kept.clear()
    items = discover([str(data_set["root"] / "raw.parquet")])
    assert [item.member.start for item in items] == [0, 0, 0, 0, 1, 1]
    expected = [image_bytes(number, "JPEG" if number == 4 else "PNG") for number in range(6)]
    assert [containers.read_member(item.member) for item in items] == expected
    assert reads == [(0, ("image",)), (1, ("image",))]


def parquet_features(table: pa.Table) -> dict[str, dict[str, torch.Tensor]]:
    """A Parquet output's features per source, named as the safetensors keys are (merged, deepstack.0)."""
    names = [name for name in table.column_names if name == "merged" or name.startswith("deepstack_")]
    rows = {}
    for row in table.to_pylist():
        rows[row["source"]] = {name.replace("_", "."): torch.tensor(row[name]) for name in names}
    return rows


def test_parquet_output_reads_back_with_pyarrow_pandas_and_datasets(checkpoint, data_set, tmp_path):
    """--format parquet: one row per encoded input (skipped ones only in the index, _index.jsonl, which Parquet
    readers leave out), features bitwise the safetensors run's; pyarrow reads the folder, pandas its rows, datasets
    loads the files (and one .parquet file) with the features' shapes."""
    inputs = [data_set["root"] / "data-000001.tar", data_set["root"] / "raw.parquet"]
    argv = [*inputs, "--model", checkpoint, *SMALL]
    assert encode(*argv, "-o", tmp_path / "safetensors") == 0
    assert encode(*argv, "--format", "parquet", "--shard-inputs", 3, "-o", tmp_path / "parquet") == 0
    assert encode(*argv, "-o", tmp_path / "one.parquet") == 0
    expected, expected_entries = features_by_source(tmp_path / "safetensors")
    folder = tmp_path / "parquet"
    assert sorted(path.name for path in folder.iterdir() if not path.name.startswith("shard-")) == ["_index.jsonl"]
    entries = [json.loads(line) for line in (folder / "_index.jsonl").read_text().splitlines()]
    assert [entry["source"] for entry in entries] == list(expected_entries)
    assert [entry["error"] for entry in entries] == [entry["error"] for entry in expected_entries.values()]
    encoded = {source: value for source, value in expected.items() if value}
    assert len(encoded) == 9

    table = pq.read_table(folder)  # the folder as a Parquet data set
    assert table.column_names == ["input", "key", "source", "kind", "grid_thw", "merged", "deepstack_0"]
    merged_type = table.schema.field("merged").type  # a list of tokens, each a fixed-size list of 96 floats
    assert pa.types.is_list(merged_type) and pa.types.is_fixed_size_list(merged_type.value_type)
    assert merged_type.value_type.list_size == 96 and merged_type.value_type.value_type == pa.float32()
    assert sorted(table.column("input").to_pylist()) == [e["input"] for e in entries if e["error"] is None]
    for source, features in parquet_features(table).items():
        assert_same(features, encoded[source], f"pyarrow {source}")
    single = pq.read_table(tmp_path / "one.parquet")
    assert single.column("input").to_pylist() == sorted(table.column("input").to_pylist())
    assert json.loads(single.schema.metadata[b"entries"])[-1]["source"] == entries[-1]["source"]
    for source, features in parquet_features(single).items():
        assert_same(features, encoded[source], f"one file {source}")

    frame = pd.read_parquet(folder)
    row = frame[frame["source"] == f"{inputs[1]}#2"].iloc[0]
    assert row["key"] == "2" and list(row["grid_thw"]) == [1, 4, 2]
    assert torch.equal(torch.from_numpy(np.stack(row["merged"])), encoded[f"{inputs[1]}#2"]["merged"])

    loaded = datasets.load_dataset("parquet", data_files=str(folder / "*.parquet"), split="train")
    assert len(loaded) == 9 and loaded.features["merged"].feature.length == 96
    by_source = {row["source"]: row for row in loaded.with_format("numpy")}
    for source, features in encoded.items():
        merged = torch.from_numpy(np.stack(by_source[source]["merged"]))
        assert torch.equal(merged, features["merged"]), source
    assert len(datasets.Dataset.from_parquet(str(tmp_path / "one.parquet"))) == 9


def test_parquet_output_resumes(checkpoint, data_set, tmp_path, capsys):
    """A Parquet folder missing a shard (a run cut short) is continued by --resume: only that shard's inputs are
    encoded again, and the folder's rows are the uninterrupted run's; a folder of the other format is refused."""
    argv = [data_set["root"] / "raw.parquet", "--model", checkpoint, *SMALL, "--format", "parquet"]
    output = tmp_path / "out"
    assert encode(*argv, "--shard-inputs", 2, "-o", output) == 0
    expected = parquet_features(pq.read_table(output))
    lost = sorted(output.glob("shard-*.parquet"))[1]
    lost.unlink()
    (output / "_index.jsonl").unlink()
    capsys.readouterr()
    assert encode(*argv, "--shard-inputs", 2, "-o", output, "--resume") == 0
    assert "resuming" in capsys.readouterr().err and len(list(output.glob("shard-*.parquet"))) == 3
    got = parquet_features(pq.read_table(output))
    assert got.keys() == expected.keys()
    for source in expected:
        assert_same(got[source], expected[source], source)
    again = [data_set["root"] / "raw.parquet", "--model", checkpoint, *SMALL, "-o", output, "--resume"]
    assert encode(*again) == 2
    assert "holds parquet shards, this run writes safetensors" in capsys.readouterr().err
