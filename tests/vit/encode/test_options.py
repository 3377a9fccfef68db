"""qvl encode's default ``--workers`` (qvl.vit.encode.options.default_workers): on a CPU the tower keeps the cores its
torch threads run on, the workers get the cores they leave; for a GPU the count that keeps it fed. And the job asks
with the thread count its tower runs on."""

import os

import pytest
import torch

from encoding import random_picture, save_checkpoint
from qvl.kernels import force_backend
from qvl.vit import cli
from qvl.vit.encode.options import default_workers


@pytest.mark.parametrize(
    ("cores", "threads", "workers"),
    [
        (2, 2, 0),  # torch's default, a thread per core: no worker takes a core from the tower
        (16, 16, 0),
        (64, 64, 0),
        (1, 1, 0),
        (4, 8, 0),  # more threads than cores
        (2, 1, 1),  # OMP_NUM_THREADS=1: a worker on the core left
        (16, 14, 2),
        (16, 8, 4),  # a worker per core left, at most 4
        (64, 48, 4),
        (32, 16, 4),  # SMT: torch's default is a thread per physical core, the workers go to the siblings
    ],
)
def test_on_a_cpu_the_workers_take_only_the_cores_the_towers_threads_leave(cores, threads, workers):
    assert default_workers("cpu", threads, cores) == workers


@pytest.mark.parametrize(("cores", "workers"), [(1, 1), (2, 1), (16, 8), (64, 8)])
def test_for_a_gpu_the_workers_keep_it_fed_whatever_the_threads(cores, workers):
    # The tower runs on the GPU: the host's threads only launch it.
    assert default_workers("cuda", cores, cores) == default_workers("cuda", 1, cores) == workers


def test_without_cores_given_it_counts_the_ones_this_process_may_run_on():
    cores = len(os.sched_getaffinity(0))
    assert default_workers("cpu", cores) == 0
    assert default_workers("cuda", 1) == max(1, min(8, cores - 1))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: no thread count leaves a core free")
def test_the_job_picks_the_default_from_its_towers_thread_count(tmp_path, capsys):
    cores = len(os.sched_getaffinity(0))
    save_checkpoint(tmp_path / "model")
    random_picture(64, 64, 0).save(tmp_path / "photo.png")
    before = torch.get_num_threads()
    try:
        for threads, where in [(cores, "in this process"), (cores - 1, "in 1 worker process")]:
            torch.set_num_threads(threads)
            argv = ["encode", str(tmp_path / "photo.png"), "--model", str(tmp_path / "model"), "--device", "cpu"]
            argv += ["--min-pixels", "1024", "-o", str(tmp_path / f"{threads}.safetensors")]
            with force_backend("torch"):
                assert cli.main(argv) == 0
            split = next(line for line in capsys.readouterr().err.splitlines() if line.startswith("qvl: time: "))
            assert f"({where}), preparation" in split
    finally:
        torch.set_num_threads(before)
