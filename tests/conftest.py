"""Test set-up: the Triton kernels run on CPU through Triton's interpreter.

Triton decides at decoration time whether a kernel is interpreted, so TRITON_INTERPRET must be set
before qvl.kernels is imported; this file runs first. Tests reach the pure-torch path with
``force_backend("torch")``.

pytest puts this folder on sys.path, so tests in every subfolder import ``tolerance`` (the suite's one
error bound) and this file's helpers by bare name.
"""

import contextlib
import importlib.util
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

# tests/vllm runs in .venv-vllm (bash install.sh vllm); where vllm is missing the folder is not collected.
# A spec without origin is that folder itself, found as a namespace package (this folder is on sys.path).
_vllm = importlib.util.find_spec("vllm")
collect_ignore_glob = [] if _vllm is not None and _vllm.origin is not None else ["vllm", "vllm/*"]
# tests/sglang likewise runs in .venv-sglang (bash install.sh sglang) and only there.
_sglang = importlib.util.find_spec("sglang")
if _sglang is None or _sglang.origin is None:
    collect_ignore_glob += ["sglang", "sglang/*"]

import pytest  # noqa: E402
import torch  # noqa: E402

import qvl.kernels  # noqa: E402,F401
from qvl.kernels.common import backend_for, force_backend  # noqa: E402

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


def float64_rotary(q, k, positions, rope_theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-VL's 2D rotary of q and k entirely in float64: the ground truth of the rotary and attention tests.

    Written here from transformers' Qwen3-VL vision code (``Qwen3VLVisionRotaryEmbedding`` over head_dim / 2
    with inverse frequencies ``theta ** (-2i / (head_dim / 2))``, each token's row angles then its column angles,
    the whole repeated twice, and ``apply_rotary_pos_emb_vision``'s rotate-half), not from qvl's reference: a
    truth computed by the code under test would let a misreading of the model pass, since the tolerance rule
    measures qvl against the truth. Inverse frequencies in float64 too (transformers and the kernels compute them
    in fp32, a rounding of each implementation the truth must not share with one of them)."""
    q, k = q.double(), k.double()
    half = q.shape[-1] // 2
    inv_freq = 1.0 / rope_theta ** (torch.arange(0, half, 2, dtype=torch.float64, device=q.device) / half)
    angles = (positions.double()[..., None] * inv_freq).flatten(1)  # (T, half): row angles, then column angles
    angles = torch.cat([angles, angles], dim=-1)[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        return x * angles.cos() + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * angles.sin()

    return rotate(q), rotate(k)


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
    after it."""
    from qvl.kernels.attention import head_dim_layout, set_head_dim_layout

    before = head_dim_layout()
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
