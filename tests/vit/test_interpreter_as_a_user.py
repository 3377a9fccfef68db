"""qvl run as a user runs it, with no test set-up in the process: ``TRITON_INTERPRET=1 qvl encode --dtype
bfloat16`` (every kernel through Triton's interpreter, bf16 dots included) gives the features the torch path gives in
bf16, within the tolerance rule, with the fp32 run as the truth (its error is some 10,000 times below bf16's)."""

import os
import subprocess
import sys

from encoding import random_picture, read_output, save_checkpoint
from qvl.kernels.tolerance import compare


def encode_in_a_fresh_process(tmp_path, name, dtype, interpret):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    output = tmp_path / f"{name}.safetensors"
    command = [sys.executable, "-m", "qvl.vit", "encode", str(tmp_path / "photo.png"), "--model",
               str(tmp_path / "checkpoint"), "--dtype", dtype, "--workers", "0", "-o", str(output)]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    tensors, metadata = read_output(output)
    return tensors, metadata


def test_bf16_through_the_interpreter_as_a_user_runs_it(tmp_path):
    save_checkpoint(tmp_path / "checkpoint")
    random_picture(96, 128, seed=4).save(tmp_path / "photo.png")
    kernels, kernel_metadata = encode_in_a_fresh_process(tmp_path, "interpreter", "bfloat16", interpret=True)
    torch_path, torch_metadata = encode_in_a_fresh_process(tmp_path, "torch", "bfloat16", interpret=False)
    truth, _ = encode_in_a_fresh_process(tmp_path, "fp32", "float32", interpret=False)
    assert kernel_metadata["backend"] != torch_metadata["backend"]
    assert set(kernels) == set(truth) and len(truth) == 2
    for name, features in kernels.items():
        comparison = compare(features, truth[name].double(), torch_path[name], what=name)
        assert comparison.passed, comparison.message()
