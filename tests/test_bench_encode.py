"""bench.bench_encode on tiny inputs: the preparation of a photo and of a video by every implementation, the speed-ups
over transformers' processors, two small photos end to end (``qvl encode`` in its own process against transformers'
processors and tower), the time per photo once running, and the command line's JSON."""

import json

import pytest
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


def test_steady_state_rows_time_a_photo_once_running(tmp_path, capsys):
    """(MANY photos' time - FEW photos') / (MANY - FEW) for qvl encode (its default --workers and --encode-workers 1,
    each a process) and transformers' processors + tower, their ratio, the table's lines and the JSON's rows."""
    path = tmp_path / "results.json"
    argv = ["--repeats", "1", "--sizes", "tiny=60x40", "--video-seconds", "0", "--photos", "0", "--rounds", "1"]
    argv += ["--photo-size", "96x64", "--steady-state", "1", "3", "--encode-workers", "1", "--json", str(path)]
    assert bench_encode.main(argv) == 0
    rows = json.loads(path.read_text())["steady_state"]
    implementations = ["qvl encode", "qvl encode --workers 1", "transformers PIL", "transformers torchvision"]
    assert [row["implementation"] for row in rows] == implementations
    for row in rows:
        assert row["tower"] == "tiny" and row["photos"] == [1, 3] and row["few_s"] > 0 and row["many_s"] > 0
        assert row["seconds_per_photo"] == (row["many_s"] - row["few_s"]) / 2
        assert row["images_per_s"] == 1 / row["seconds_per_photo"]
        assert row["qvl_speedup"] == row["seconds_per_photo"] / rows[0]["seconds_per_photo"]
    assert rows[1]["split"].startswith("time: decoding") and "(in 1 worker process)" in rows[1]["split"]
    assert "split" not in rows[2]
    table = capsys.readouterr().out
    assert bench_encode.format_steady_state(rows) in table
    assert "tiny: qvl encode --workers 1, 3 photos: time: decoding" in table
    assert f"transformers PIL processor + tower {rows[2]['seconds_per_photo']:.3f} s" in table


@pytest.mark.parametrize(
    "argv",
    [["--steady-state", "3", "1"], ["--encode-workers", "1"], ["--steady-state", "1", "2", "--device", "cpu"]],
)
def test_steady_state_arguments_are_checked_before_anything_runs(argv, capsys):
    with pytest.raises(SystemExit) as exit:
        bench_encode.main(argv)
    assert exit.value.code == 2 and "--steady-state" in capsys.readouterr().err


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


@pytest.mark.parametrize("argv", [["--ray", "4", "2"], ["--ray-cpus", "2"]])
def test_ray_arguments_are_checked_before_anything_runs(argv, capsys):
    with pytest.raises(SystemExit) as exit:
        bench_encode.main(argv)
    assert exit.value.code == 2 and "--ray" in capsys.readouterr().err


def test_ray_rows_print_the_time_per_photo_and_what_ray_adds():
    """The --ray rows' table: each run's FEW and MANY times, the time per photo, what a run pays once and the
    milliseconds Ray adds a photo, then each MANY run's own count and split."""
    rows = [
        dict(tower="tiny", implementation=name, device="cpu", photos=[16, 64], few_s=few, many_s=many,
             seconds_per_photo=(many - few) / 48, images_per_s=48 / (many - few), once_s=few - 16 * (many - few) / 48,
             overhead_ms=overhead, encoding_s=many - 1, split="time: decoding 1.00 s (in Ray tasks)")
        for name, few, many, overhead in (("qvl encode", 5.0, 9.8, 0.0), ("qvl encode --ray", 12.0, 19.2, 50.0))
    ]  # fmt: skip
    table = bench_encode.format_ray_rows(rows).splitlines()
    assert table[0].split() == ["tower", "implementation", "16", "photos", "64", "photos", "s/photo", "images/s",
                                "once", "s", "+ms/photo"]  # fmt: skip
    assert table[2].split()[-6:] == ["12.00", "19.20", "0.150", "6.67", "9.60", "50.0"]
    assert table[4] == "tiny: qvl encode --ray, 64 photos: own count 18.20 s, time: decoding 1.00 s (in Ray tasks)"
