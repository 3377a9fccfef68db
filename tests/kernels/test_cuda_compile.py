"""Every Triton kernel compiles for Hopper and fits its shared memory, checked without a GPU."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import triton

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
HOPPER_SHARED_BYTES = 232448  # 227 KiB: the most one block may use on sm_90


@pytest.mark.skipif(not PTXAS.exists() and shutil.which("ptxas") is None, reason="Triton's ptxas is not installed")
def test_kernels_compile_for_sm90_within_shared_memory():
    script = Path(__file__).with_name("compile_sm90.py")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "TRITON_INTERPRET": "0"})
    assert result.returncode == 0, result.stderr[-3000:]
    variants = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(variants) == 7, result.stdout
    too_big = [v for v in variants if v["shared"] > HOPPER_SHARED_BYTES]
    assert not too_big, too_big


CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


@pytest.mark.skipif(not (PTXAS.exists() and CUOBJDUMP.exists()), reason="Triton's ptxas/cuobjdump are not installed")
def test_attention_key_loop_has_no_local_memory_and_rope_adds_nothing_to_it():
    """Qwen3-VL's D = 72 in bf16, read from the sm_90 machine code: no spill inside the key loop, and rotating
    q (done once per program) leaves the loop as long as plain attention's."""
    result = subprocess.run([sys.executable, "-m", "bench.sass_attention", "--head-dim", "72"], capture_output=True,
                            text=True, timeout=600, cwd=Path(__file__).parents[2])
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {}
    for line in result.stdout.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if cells[0] == "72":
            rows[cells[1] == "True"] = (int(cells[5]), int(cells[6]))  # key loop, local memory in it
    assert set(rows) == {False, True}, result.stdout
    assert rows[False][1] == 0 and rows[True][1] == 0, result.stdout
    assert rows[True][0] <= rows[False][0] * 1.05, result.stdout
