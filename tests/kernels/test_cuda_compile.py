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
