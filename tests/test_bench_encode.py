"""bench.bench_encode on tiny inputs: the preparation of a photo and of a video by every implementation, the speed-ups
over transformers' processors, two small photos end to end (``qvl encode`` in its own process against transformers'
processors and tower), and the command line's JSON."""

import json

import torch

from bench import bench_encode, harness


def test_preparation_rows_time_every_implementation():
    rows = bench_encode.preparation_rows(threads=1, repeats=1, sizes={"tiny": (40, 60)})
    implementations = [row["implementation"] for row in rows]
    assert implementations == ["qvl", "qvl folded", "transformers PIL", "transformers torchvision"]
    assert all(row["size"] == "tiny" and row["threads"] == 1 and row["median_ms"] > 0 for row in rows)
    assert rows[2]["speedup"] == 1.0
    video = bench_encode.video_rows(threads=1, repeats=1, seconds=2, frame_size=(48, 64))
    assert [row["implementation"] for row in video] == ["qvl", "transformers torchvision"]
    assert video[1]["speedup"] == 1.0 and video[0]["size"] == "2 s 64x48 (4 frames)"


def test_end_to_end_rows_compare_qvl_encode_with_transformers(tmp_path):
    rows = bench_encode.end_to_end_rows(photos=2, size=(64, 96), towers=("tiny",), rounds=1, root=tmp_path)
    implementations = ["qvl encode", "transformers PIL", "transformers torchvision", bench_encode.TOWER_ALONE]
    assert [row["implementation"] for row in rows] == implementations
    assert rows[0]["qvl_speedup"] == 1.0 and rows[0]["split"].startswith("time: decoding")
    assert 0 < rows[0]["encoding_s"] < rows[0]["seconds"]
    assert all(row["seconds"] > 0 and row["images_per_s"] == 2 / row["seconds"] for row in rows)
    # The same weights and preparation (up to the resize's last-bit rounding with PIL): the same features.
    assert all(row["max_rel_err"] < 1e-2 for row in rows[1:])
    table = bench_encode.format_end_to_end(rows)
    assert "tiny: qvl encode's own count" in table
    ceiling = rows[1]["seconds"] / rows[3]["seconds"]
    assert f"tiny: the tower alone is {rows[3]['seconds']:.2f} s" in table and f"at most {ceiling:.2f}x" in table


def test_main_prints_the_table_and_writes_json(tmp_path, capsys):
    path = tmp_path / "results.json"
    argv = ["--repeats", "1", "--sizes", "tiny=60x40", "--video-seconds", "0", "--photos", "0", "--json", str(path)]
    assert bench_encode.main(argv) == 0
    assert "qvl folded" in capsys.readouterr().out
    results = json.loads(path.read_text())
    assert sorted(results) == ["facts", "preparation"] and results["facts"]["cores"] >= 1


def test_device_rows_time_qvl_encode_against_its_tower_alone(tmp_path):
    """The GPU figure's path on the CPU (a tiny tower, float32): qvl encode's own count against the same tower on
    the same inputs in the same batches, and their features agree."""
    from qvl.vit import VisionConfig

    config = VisionConfig(**bench_encode.E2E_TOWERS["tiny"])
    rows = bench_encode.device_rows(2, (64, 96), "cpu", "float32", rounds=1, root=tmp_path, config=config)
    encode, alone = rows
    assert (encode["implementation"], alone["implementation"]) == ("qvl encode", "qvl tower alone")
    assert 0 < encode["encoding_s"] < encode["seconds"] and alone["seconds"] > 0
    assert encode["vs_tower_alone"] == encode["encoding_s"] / alone["seconds"]
    assert encode["images_per_s"] == 2 / encode["encoding_s"] and encode["split"].startswith("time: decoding")
    assert harness.agrees(encode["max_rel_err"], torch.float32)
    text = bench_encode.format_device_rows(rows, "cpu")
    assert f"cpu: qvl encode takes {encode['vs_tower_alone']:.2f}x the tower alone's time" in text
