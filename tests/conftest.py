"""Test set-up: the Triton kernels run on CPU through Triton's interpreter.

Triton decides at decoration time whether a kernel is interpreted, so TRITON_INTERPRET must be set
before qvl.kernels is imported; this file runs first. Tests reach the pure-torch path with
``force_backend("torch")``.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import qvl.kernels  # noqa: E402,F401

ON_GPU = torch.cuda.is_available() and os.environ["TRITON_INTERPRET"] == "0"
DEVICE = "cuda" if ON_GPU else "cpu"


@pytest.fixture
def device() -> str:
    """Where kernel tests run: CUDA when a GPU is present and the interpreter is off, else CPU."""
    return DEVICE


@pytest.fixture
def bf16_dot_as_fp32(monkeypatch):
    """Make the interpreter's ``tl.dot`` upcast bf16 operands to fp32 before multiplying.

    Triton's interpreter multiplies bf16 dot operands as raw bit patterns (triton issue 11584). A bf16
    tensor-core dot takes bf16 inputs exactly and accumulates in fp32, which is what this computes.
    Elementwise bf16 work (loads, casts, stores) is left to the interpreter as it is. On a GPU the
    fixture does nothing.
    """
    if ON_GPU:
        yield
        return
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def upcast(handle):
        if handle.dtype.scalar == tl.bfloat16 or handle.dtype == tl.bfloat16:
            bits = handle.data.astype(np.uint32) << 16
            return interpreter.TensorHandle(bits.view(np.float32), tl.float32)
        return handle

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, upcast(a), upcast(b), d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(builder, "create_dot", create_dot)
    yield
