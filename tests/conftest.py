"""Test set-up: the Triton kernels run compiled on a CUDA GPU where there is one, else on CPU through Triton's
interpreter.

Triton decides at decoration time whether a kernel is interpreted, so TRITON_INTERPRET must be set
before qvl.kernels is imported; this file runs first. A plain ``pytest`` on a machine with a CUDA GPU
runs the GPU tests (TRITON_INTERPRET=1 set by the caller still selects the interpreter there). Tests
reach the pure-torch path with ``force_backend("torch")``.

pytest puts this folder on sys.path, so tests in every subfolder import ``tolerance`` (the suite's one
error bound) and this file's helpers by bare name.
"""

import contextlib
import importlib.util
import os

import torch  # imported before TRITON_INTERPRET is set: torch alone does not import Triton

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

# tests/vllm runs in .venv-vllm (bash install.sh vllm); where vllm is missing the folder is not collected.
# A spec without origin is that folder itself, found as a namespace package (this folder is on sys.path).
_vllm = importlib.util.find_spec("vllm")
collect_ignore_glob = [] if _vllm is not None and _vllm.origin is not None else ["vllm", "vllm/*"]
# tests/sglang likewise runs in .venv-sglang (bash install.sh sglang) and only there.
_sglang = importlib.util.find_spec("sglang")
if _sglang is None or _sglang.origin is None:
    collect_ignore_glob += ["sglang", "sglang/*"]

import pytest  # noqa: E402

import qvl.kernels  # noqa: E402,F401
from qvl.kernels.common import backend_for, force_backend  # noqa: E402

# The rotary's float64 truth, written from transformers' code (qvl.kernels.verify); tests import it from here.
from qvl.kernels.verify import float64_rotary  # noqa: E402,F401

ON_GPU = torch.cuda.is_available() and os.environ["TRITON_INTERPRET"] == "0"
DEVICE = "cuda" if ON_GPU else "cpu"


@pytest.fixture
def device() -> str:
    """Where kernel tests run: CUDA when a GPU is present and the interpreter is off, else CPU."""
    return DEVICE


def row_strided(rows: int, cols: int, dtype, device, scale=1.0, shift=0.0, pad=7) -> torch.Tensor:
    """``(rows, cols)`` random view whose row stride is ``cols + pad``: the row-wise ops (LayerNorm, bias +
    GELU) take free row strides."""
    wide = torch.randn(rows, cols + pad, device=device) * scale + shift
    return wide.to(dtype)[:, :cols]


def norm_params(cols: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm weight and bias away from their init (1 and 0), which would hide a swapped or dropped one."""
    weight = (1.0 + 0.3 * torch.randn(cols, device=device)).to(dtype)
    bias = (0.2 * torch.randn(cols, device=device)).to(dtype)
    return weight, bias


@pytest.fixture
def fresh_attention_plans():
    """No attention launch plan cached before or after the test (plans are cached per shape with the tile table
    and launch configuration they were made from: tests that patch either start and end without them)."""
    from qvl.kernels.attention import reload_tile_table

    reload_tile_table()
    yield
    reload_tile_table()


@pytest.fixture
def use_head_dim_layout():
    """``use_head_dim_layout(layout)`` switches the attention kernels' head-dim layout
    (:func:`qvl.kernels.attention.set_head_dim_layout`) for the rest of the test; the process's layout comes back
    after it (a layout set before it, or each target's default)."""
    from qvl.kernels.attention import config, set_head_dim_layout

    before = config._head_dim_layout
    yield set_head_dim_layout
    set_head_dim_layout(before)


@pytest.fixture
def empty_tile_table(monkeypatch, fresh_attention_plans):
    """Attention launches configured by the heuristic alone: the packaged tile table (a device's sm_90 entries,
    checked where they are used: test_attention_descriptors, test_cuda_compile) reads as empty."""
    from qvl.kernels.attention import config

    monkeypatch.setattr(config, "tile_table", dict)


@pytest.fixture(params=["default", "torch"])
def backend(request, device):
    """The path under test: the device's default (interpreter on CPU, Triton on CUDA) or torch."""
    context = force_backend("torch") if request.param == "torch" else contextlib.nullcontext()
    with context:
        yield backend_for(torch.device(device))


@pytest.fixture
def argument_check_inputs(device):
    """``x (8, 16)``, ``w``, ``b (16,)``: fp32 inputs for the row-wise ops' argument checks."""
    return dict(x=torch.randn(8, 16, device=device), w=torch.randn(16, device=device), b=torch.randn(16, device=device))


@pytest.fixture
def tower_calls(monkeypatch):
    """The vision modules whose patched forward ran on qvl (the runner's ``device_forward``), one entry per run: a
    call that fell back to transformers' own forward adds nothing."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0])
        return device_forward(*args, **kwargs)

    from qvl.vit import runner

    device_forward = runner.device_forward
    monkeypatch.setattr(runner, "device_forward", counted)
    return calls


@pytest.fixture
def block_runs(monkeypatch):
    """The blocks qvl's block step ran on, one entry per run (a recomputation in backward adds one)."""
    from qvl.vit import runner

    runs = []
    block_step = runner.block_step

    def counted(block, *args, **kwargs):
        runs.append(block)
        return block_step(block, *args, **kwargs)

    monkeypatch.setattr(runner, "block_step", counted)
    return runs
