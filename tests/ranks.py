"""Two-rank gloo tests: a test file whose ``__main__`` is one rank runs on two ranks under torch.distributed.run
(:func:`run_two_ranks`), each rank through :func:`run_rank`."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path


def python_path_with_tests() -> str:
    """This process's PYTHONPATH with tests/ in front: for rank processes, which import the suite's helpers."""
    return os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))


def run_two_ranks(script: str, out_dir, timeout: int = 300, **env) -> None:
    """Run ``script`` (a test file whose ``__main__`` is one rank) on two ranks under ``torch.distributed.run``
    with ``out_dir`` as its argument and working directory, tests/ on PYTHONPATH (each rank imports the file and
    its helpers), one thread per rank and ``env`` on top; fails the calling test with the ranks' stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path_with_tests(), **env}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               script, str(out_dir)]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=out_dir)
    assert result.returncode == 0, result.stderr[-3000:]


def run_rank(rank_main: Callable[[str], None]) -> None:
    """A rank script's ``__main__``: ``rank_main(out_dir)`` with the directory :func:`run_two_ranks` passes, then exit
    status 0 without the interpreter's finalization (``rank_main`` writes its results and destroys its process group;
    an exception it raises fails the rank with its traceback as usual).

    Why skip finalization: after a gloo collective's wait returns, one of gloo's worker threads may still hold the
    collective's work and its tensors; releasing those takes the GIL, and a thread that asks for the GIL while the
    interpreter finalizes aborts the process ("terminate called without an active exception", SIGABRT), results
    already written. destroy_process_group does not join those threads while functional collectives keep the group
    referenced. A rank that exits right after its last collective hit this in 5 of 15 runs on 2 cores (torch 2.13);
    a long-running process such as ``qvl encode`` under torchrun has long released the work by then."""
    rank_main(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
