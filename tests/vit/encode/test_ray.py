"""qvl encode --ray (qvl.vit.encode.ray) on a local Ray of 2 CPUs, started once for this module: the features of a
single-process run bit for bit (files, WebDataset shards, Parquet files and a datasets folder; safetensors and
Parquet shards), every input written exactly once when a tower actor or a preparation task dies mid-run and Ray
restarts or retries it, unreadable samples listed with their reasons, ``--resume`` after a lost shard, and the
stages composed by hand as a Ray user would.

The runs share one Ray (each start costs seconds), so the module is one xdist group. The tower actor holds 1 CPU and
runs torch on 1 thread (half the 2 CPUs); the single-process runs it is compared with run on 1 thread too, which is
what makes them bitwise comparable (a BLAS product's order may change with the thread count).
"""

import functools
import json
import logging
import os
import signal
import sys
import tarfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from encoding import encode, make_video, random_picture, read_folder, save_checkpoint
from qvl.vit.encode import ray as qray
from qvl.vit.encode.inputs import discover

ray = pytest.importorskip("ray")
datasets = pytest.importorskip("datasets")

pytestmark = pytest.mark.xdist_group("ray")

# Images and video frames at their size; a forward of at most 12 patches, so that the video (five temporal patches of
# 2x2 patches) is encoded in chunks, which Ray must keep together.
SMALL = ["--device", "cpu", "--min-pixels", 1024, "--max-pixels", 200_000, "--video-min-pixels", 1024, "--budget", 12]
SHAPES = [(32, 32), (32, 64), (64, 32), (64, 64), (32, 96), (96, 32), (48, 80), (64, 96)]


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray of 2 CPUs for the module; this module's functions travel to its workers by value (pytest
    imports it by a name they cannot import)."""
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    ray.shutdown()


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny")
    save_checkpoint(directory)
    return directory


@pytest.fixture(scope="module")
def data_set(tmp_path_factory) -> dict:
    """Eight photos: four as files, three in a WebDataset shard (with masks, and a corrupt sample), and all eight in
    a Parquet file and a datasets folder; a video of ten 32x32 frames."""
    root = tmp_path_factory.mktemp("data")
    files = []
    for number, (height, width) in enumerate(SHAPES):
        files.append(root / f"{number:02d}.png")
        random_picture(height, width, number).save(files[-1])
    with tarfile.open(root / "shard.tar", "w") as tar:
        for number in (4, 5, 6):
            tar.add(files[number], f"s{number}.png")
            tar.add(files[0], f"s{number}.mask.png")
        tar.add(files[7], "broken.png", filter=lambda info: setattr(info, "size", 40) or info)
    hf = datasets.Dataset.from_dict({"image": [str(path) for path in files]}).cast_column("image", datasets.Image())
    hf.to_parquet(str(root / "photos.parquet"))
    hf.save_to_disk(str(root / "saved"))
    return {"root": root, "files": files, "video": make_video(root / "clip.mp4", frames=10, fps=8, size=32)}


def inputs_of(data_set) -> list:
    """The runs' inputs (25: 4 files, 4 samples of a shard, 2 x 8 rows, then the video) and their options."""
    root = data_set["root"]
    return [*data_set["files"][:4], root / "shard.tar", root / "photos.parquet", root / "saved", "--video",
            data_set["video"], "--fps", 8]  # fmt: skip


def by_source(folder: Path) -> tuple[dict, dict]:
    tensors, entries = read_folder(folder)
    features = {entry["source"]: {key.split(".", 2)[2]: tensors[key] for key in entry["keys"]} for entry in entries}
    return features, {entry["source"]: entry for entry in entries}


def assert_same_run(got: Path, expected: Path) -> dict:
    """The two folders hold the same inputs with the same features, bit for bit, and the same index entries (but
    the shards' names); each input once. Returns the entries by source."""
    features, entries = by_source(got)
    expected_features, expected_entries = by_source(expected)
    assert list(entries) == list(expected_entries)
    for source, entry in entries.items():
        expected_entry = expected_entries[source]
        assert {**entry, "shard": None} == {**expected_entry, "shard": None}, source
        assert features[source].keys() == expected_features[source].keys()
        for name, tensor in expected_features[source].items():
            assert torch.equal(features[source][name], tensor), f"{source} {name}"
    return entries


@pytest.fixture(scope="module")
def single_process(checkpoint, data_set, tmp_path_factory) -> Path:
    """The single-process run of every input, on 1 thread, decoding in the process."""
    output = tmp_path_factory.mktemp("single") / "out"
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert encode(*inputs_of(data_set), "--model", checkpoint, *SMALL, "-o", output) == 0
    finally:
        torch.set_num_threads(before)
    return output


def test_ray_gives_the_single_process_features(local_ray, one_thread, checkpoint, data_set, single_process, tmp_path,
                                               capsys):  # fmt: skip
    """Files, a WebDataset shard, a Parquet file and a datasets folder through --ray in groups of 3 inputs: the
    single process's features and index entries, each input in exactly one shard, named after its group; the
    unreadable samples reported and listed with their reasons."""
    output = tmp_path / "out"
    argv = [*inputs_of(data_set), "--model", checkpoint, *SMALL, "--ray", "--shard-inputs", 3, "-o", output]
    assert encode(*argv) == 0
    log = capsys.readouterr().err
    assert "qvl: Ray: 1 tower actor (1 CPU each)" in log and ", on Ray: 1 tower actor" in log
    entries = assert_same_run(output, single_process)
    shard = data_set["root"] / "shard.tar"
    assert entries[f"{shard}/broken"]["error"] == "not an image file PIL can read"
    assert f"qvl: skipped {shard}/broken: " in log
    assert len(entries) == 4 + 4 + 8 + 8 + 1 and entries[str(data_set["video"])]["grid_thw"] == [5, 2, 2]
    names = sorted(path.name for path in output.glob("shard-*.safetensors"))
    assert len(names) == 9 and all(name.startswith("shard-g") for name in names)
    items = discover([str(path) for path in inputs_of(data_set)[:-4]], [str(data_set["video"])])
    assert names == sorted(f"{qray.group_name([item.number for item in group])}.safetensors"
                           for group in qray.groups(items, 3))  # fmt: skip


def kill_once(marker: Path) -> None:
    """SIGKILL this process, the first time only (``marker`` made just before says it was done)."""
    try:
        descriptor = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.close(descriptor)
    os.kill(os.getpid(), signal.SIGKILL)


class KilledTower(qray.Tower):
    """A tower actor that kills its own process in its second call, once."""

    marker: str = ""
    calls = 0

    def __call__(self, batch):
        self.calls += 1
        if self.calls == 2:
            kill_once(Path(self.marker))
        return super().__call__(batch)


def killed_prepare(batch, settings, marker):
    """The preparation task of the third group kills its own process, once."""
    if batch["group"][0].startswith("shard-g000000006-"):
        kill_once(Path(marker))
    return qray.prepare(batch, settings)


@pytest.mark.parametrize("killed", ["tower actor", "preparation task"])
def test_a_worker_killed_mid_run_is_retried_and_every_input_written_once(
    killed, local_ray, one_thread, checkpoint, data_set, single_process, tmp_path, monkeypatch
):
    """A tower actor (restarted by Ray, its group retried) or a preparation task (retried) SIGKILLs itself mid-run:
    the run succeeds with the single process's features, each input in exactly one Parquet shard, which
    ``datasets`` reads back."""
    marker = tmp_path / "killed"
    if killed == "tower actor":
        monkeypatch.setattr(qray, "Tower", type("Tower", (KilledTower,), {"marker": str(marker)}))
    else:
        monkeypatch.setattr(qray, "prepare", functools.partial(killed_prepare, marker=str(marker)))
    output = tmp_path / "out"
    argv = [*inputs_of(data_set), "--model", checkpoint, *SMALL, "--ray", "--shard-inputs", 3]
    assert encode(*argv, "--format", "parquet", "-o", output) == 0
    assert marker.exists()  # the kill happened

    expected, expected_entries = by_source(single_process)
    entries = [json.loads(line) for line in (output / "_index.jsonl").read_text().splitlines()]
    assert [entry["source"] for entry in entries] == list(expected_entries)
    table = pq.read_table(output)
    sources = table.column("source").to_pylist()
    assert sorted(sources) == sorted(source for source, entry in expected_entries.items() if entry["error"] is None)
    assert len(sources) == len(set(sources)) == 24
    loaded = datasets.load_dataset("parquet", data_files=str(output / "*.parquet"), split="train")
    for row in loaded:
        for name in ("merged", "deepstack_0"):
            assert torch.equal(torch.tensor(row[name]), expected[row["source"]][name.replace("_", ".")]), row["source"]


def test_resume_under_ray_encodes_only_the_lost_shards_inputs(
    local_ray, one_thread, checkpoint, data_set, single_process, tmp_path, capsys
):
    """A --ray folder missing one shard (lost with its machine) and its index: --resume --ray encodes only that
    shard's inputs, into a shard of the same name, and the folder is the single process's run again."""
    output = tmp_path / "out"
    argv = [*inputs_of(data_set), "--model", checkpoint, *SMALL, "--ray", "--shard-inputs", 5, "-o", output]
    assert encode(*argv) == 0
    lost = sorted(output.glob("shard-*.safetensors"))[2]
    lost_inputs = 5
    lost.unlink()
    (output / "index.jsonl").unlink()
    capsys.readouterr()
    assert encode(*argv, "--resume") == 0
    log = capsys.readouterr().err
    assert f"{25 - lost_inputs} of 25 inputs already written" in log and f"qvl: encoded {lost_inputs} images" in log
    assert lost.exists()
    assert_same_run(output, single_process)
    assert encode(*argv, "--resume") == 0  # nothing left: no group runs
    log = capsys.readouterr().err
    assert "25 of 25 inputs already written" in log and "qvl: encoded 0 images" in log


def test_the_stages_compose_as_a_ray_user_composes_them(local_ray, checkpoint, data_set, tmp_path):
    """settings_for -> read_inputs -> prepare_stage -> a filter of the user's -> tower_stage -> write_stage: the
    shards the groups name, with every input's entry, which qvl encode --resume takes as a whole run."""
    from qvl.vit.encode.options import EncodeOptions

    options = EncodeOptions(model=str(checkpoint), min_pixels=1024, max_pixels=200_000, shard_inputs=4)
    output = tmp_path / "out"
    output.mkdir()
    settings = qray.settings_for(options, output)
    assert settings.dtype == "float32" and settings.backend == "interpreter"  # this suite's CPU path
    items = discover([str(path) for path in data_set["files"]])
    dataset = qray.prepare_stage(qray.read_inputs(items, settings.group), settings)
    dataset = dataset.filter(lambda row: True)
    dataset = qray.write_stage(qray.tower_stage(dataset, settings, actors=1), settings)
    written = [entry for row in dataset.iter_rows() for entry in json.loads(row["entries"])]
    assert sorted(entry["input"] for entry in written) == list(range(8))
    assert sorted(path.name for path in output.iterdir()) == sorted(
        f"{qray.group_name(list(range(start, start + 4)))}.safetensors" for start in (0, 4)
    )
    resumed = [*data_set["files"], "--model", checkpoint, "--min-pixels", 1024, "--max-pixels", 200_000]
    assert encode(*resumed, "--device", "cpu", "--resume", "-o", output, backend="interpreter") == 0
    assert len((output / "index.jsonl").read_text().splitlines()) == 8


@pytest.mark.parametrize(
    "argv, images, address",
    [
        (["--ray", "photos/", "more.png"], ["photos/", "more.png"], ""),
        (["photos/", "--ray"], ["photos/"], ""),
        (["photos/", "--ray", "local"], ["photos/"], ""),
        (["photos/", "--ray", "auto"], ["photos/"], "auto"),
        (["photos/", "--ray=ray://head:10001"], ["photos/"], "ray://head:10001"),
        (["photos/", "--ray", "10.0.0.1:6379", "--ray-actors", "2"], ["photos/"], "10.0.0.1:6379"),
    ],
)
def test_ray_takes_an_address_only_where_one_is_given(argv, images, address):
    """--ray's value is an address (auto, local, HOST:PORT, ray://...); anything else after it is the first input."""
    from qvl.vit import cli

    parser = cli.build_parser()
    args = parser.parse_args(["encode", *argv])
    args.check(args)
    assert args.images == images and args.ray == address


@pytest.mark.parametrize(
    "argv, message",
    [
        (["x.png", "--ray-actors", "2"], "--ray-actors: only with --ray"),
        (["x.png", "--ray", "auto", "--ray-cpus", "2"], "--ray-cpus: sets the CPUs of a Ray started here"),
    ],
)
def test_ray_options_are_checked_before_anything_runs(argv, message, capsys):
    from qvl.vit import cli

    assert cli.main(["encode", *argv]) == 2
    assert message in capsys.readouterr().err
