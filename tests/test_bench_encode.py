"""bench.bench_encode on tiny inputs: the preparation of a photo and of a video by every implementation, the speed-ups
over transformers' processors, two small photos end to end (``qvl encode`` in its own process against transformers'
processors and tower), and the command line's JSON."""

import json

from bench import bench_encode


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
