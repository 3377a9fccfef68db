"""torch.ops.qvl.layer_norm / add_layer_norm / bias_gelu / bias_gelu_ and the merger/MLP helpers.

Each op runs on its default path (the Triton interpreter on CPU, compiled Triton on a GPU) and on the
torch path, against fp64 ground truth and transformers' Qwen3-VL modules run in the same dtype.

Tolerances are in units of the dtype's rounding: ``torch.finfo(dtype).eps`` is one ulp at 1, so
``rtol=eps`` allows one ulp. One ulp, not half, because the interpreter rounds fp32 -> bf16 toward
zero where the GPU and torch round to nearest.
"""

import contextlib

import pytest
import torch
import torch.nn.functional as F

from transformers import Qwen3VLVisionConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionMLP, Qwen3VLVisionPatchMerger

from qvl.kernels.common import backend_for, force_backend
from qvl.kernels.gelu import bias_gelu_reference
from qvl.kernels.layer_norm import MAX_NORM_DIM, layer_norm_reference
from qvl.vit.layers import patch_merger, vision_mlp

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# The tanh GELU's exp2 overflows to inf for large negative inputs by design (the result is then -0);
# numpy, under the interpreter, warns about it.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")


@pytest.fixture(params=["default", "torch"])
def backend(request, device):
    """The path under test: the device's default (interpreter on CPU, Triton on CUDA) or torch."""
    context = force_backend("torch") if request.param == "torch" else contextlib.nullcontext()
    with context:
        yield backend_for(torch.device(device))


def ulp(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def rtol_for(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else ulp(dtype)


def row_strided(rows: int, cols: int, dtype, device, scale=1.0, shift=0.0, pad=7) -> torch.Tensor:
    """``(rows, cols)`` random view whose row stride is ``cols + pad``: the ops take free row strides."""
    wide = torch.randn(rows, cols + pad, device=device) * scale + shift
    return wide.to(dtype)[:, :cols]


def norm_params(cols: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    weight = (1.0 + 0.3 * torch.randn(cols, device=device)).to(dtype)
    bias = (0.2 * torch.randn(cols, device=device)).to(dtype)
    return weight, bias


# ----------------------------------------------------------------------------------------------------
# layer_norm / add_layer_norm
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(257, 72), (33, 1000), (5, 4 * 1152), (3, 1)])
def test_layer_norm(dtype, shape, backend, device):
    torch.manual_seed(0)
    rows, cols = shape
    # A large mean over a small spread: the variance must come from centered values.
    x = row_strided(rows, cols, dtype, device, scale=2.0, shift=5.0)
    weight, bias = norm_params(cols, dtype, device)
    y = torch.ops.qvl.layer_norm(x, weight, bias, 1e-6)
    assert y.shape == x.shape and y.dtype == dtype and y.is_contiguous()

    truth = layer_norm_reference(x.double(), weight.double(), bias.double(), 1e-6)
    torch.testing.assert_close(y.double(), truth, rtol=rtol_for(dtype), atol=1e-5)
    eager = F.layer_norm(x, (cols,), weight, bias, 1e-6)
    torch.testing.assert_close(y.float(), eager.float(), rtol=rtol_for(dtype), atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_layer_norm(dtype, backend, device):
    torch.manual_seed(1)
    x = row_strided(200, 72, dtype, device, scale=3.0)
    delta = row_strided(200, 72, dtype, device, pad=3)
    weight, bias = norm_params(72, dtype, device)
    h, y = torch.ops.qvl.add_layer_norm(x, delta, weight, bias, 1e-6)
    assert h.is_contiguous() and y.is_contiguous() and h.dtype == y.dtype == dtype

    if dtype == torch.bfloat16 and backend == "interpreter":
        torch.testing.assert_close(h, x + delta, rtol=ulp(dtype), atol=0)
    else:
        assert torch.equal(h, x + delta)
    # The norm is of the stored, rounded sum.
    torch.testing.assert_close(
        y.double(), layer_norm_reference(h.double(), weight.double(), bias.double()), rtol=rtol_for(dtype), atol=1e-5
    )


def test_add_layer_norm_normalizes_rounded_sum(backend, device):
    """fp16 near 1000 has a spacing of 0.5: rounding x + delta there changes the norm visibly, and the op
    must give eager ``norm(x + delta)``, not the norm of the exact sum."""
    torch.manual_seed(2)
    x = (1000.0 + torch.randn(64, 96, device=device)).half()
    delta = (0.3 * torch.randn(64, 96, device=device)).half()
    weight, bias = norm_params(96, torch.float16, device)
    _, y = torch.ops.qvl.add_layer_norm(x, delta, weight, bias, 1e-6)
    eager = F.layer_norm(x + delta, (96,), weight, bias, 1e-6)
    # A mean 1000 times the spread leaves fp32 statistics about 1e-4 of absolute error near 0.
    torch.testing.assert_close(y, eager, rtol=ulp(torch.float16), atol=ulp(torch.float16))
    exact_sum = F.layer_norm(x.float() + delta.float(), (96,), weight.float(), bias.float(), 1e-6)
    assert (y.float() - exact_sum).abs().max() > 0.05


# ----------------------------------------------------------------------------------------------------
# bias_gelu / bias_gelu_
# ----------------------------------------------------------------------------------------------------
def gelu_inputs(rows, cols, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    x = row_strided(rows, cols, dtype, device, scale=3.0)
    # Tails where 1 + erf(.) and 1 + tanh(.) cancel, and values whose exp2 overflows fp32 in the tanh form.
    extremes = torch.tensor([-1e4, -40.0, -10.0, -5.0, -0.01, 0.0, 5.0, 40.0, 1e4], device=device)
    x[0, : extremes.numel()] = extremes.to(dtype)
    bias = (0.5 * torch.randn(cols, device=device)).to(dtype)
    bias[: extremes.numel()] = 0
    return x, bias


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_gelu(dtype, approximate, backend, device):
    torch.manual_seed(3)
    x, bias = gelu_inputs(96, 300, dtype, device)
    y = torch.ops.qvl.bias_gelu(x, bias, approximate)
    assert y.shape == x.shape and y.dtype == dtype and y.is_contiguous()
    truth = bias_gelu_reference(x.double(), bias.double(), approximate)
    torch.testing.assert_close(y.double(), truth, rtol=rtol_for(dtype), atol=1e-6)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu_inplace(approximate, backend, device):
    torch.manual_seed(4)
    wide = torch.randn(40, 200, device=device, dtype=torch.bfloat16)
    view = wide[:, :150]
    bias = torch.randn(150, device=device, dtype=torch.bfloat16)
    expected = torch.ops.qvl.bias_gelu(view, bias, approximate)
    untouched = wide[:, 150:].clone()
    assert torch.ops.qvl.bias_gelu_(view, bias, approximate) is None
    assert torch.equal(view, expected)
    assert torch.equal(wide[:, 150:], untouched)


def test_empty_rows(backend, device):
    x = torch.empty(0, 72, device=device)
    weight, bias = norm_params(72, torch.float32, device)
    assert torch.ops.qvl.layer_norm(x, weight, bias).shape == (0, 72)
    h, y = torch.ops.qvl.add_layer_norm(x, x, weight, bias)
    assert h.shape == y.shape == (0, 72)
    assert torch.ops.qvl.bias_gelu(x, bias, "tanh").shape == (0, 72)


# ----------------------------------------------------------------------------------------------------
# The helpers against transformers' modules.
# ----------------------------------------------------------------------------------------------------
def vision_config() -> Qwen3VLVisionConfig:
    return Qwen3VLVisionConfig(hidden_size=72, out_hidden_size=96, intermediate_size=128, num_heads=4, depth=1)


def randomized(module: torch.nn.Module, dtype, device) -> torch.nn.Module:
    """Random norm parameters too (their init is 1 and 0); linears keep their random init."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name == "norm.weight":
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
            elif name == "norm.bias":
                param.copy_(0.2 * torch.randn_like(param))
    return module.to(device=device, dtype=dtype).eval()


def merger_args(module: Qwen3VLVisionPatchMerger) -> tuple[torch.Tensor, ...]:
    return (
        module.norm.weight, module.norm.bias,
        module.linear_fc1.weight, module.linear_fc1.bias,
        module.linear_fc2.weight, module.linear_fc2.bias,
    )  # fmt: skip


def mlp_args(module: Qwen3VLVisionMLP) -> tuple[torch.Tensor, ...]:
    return module.linear_fc1.weight, module.linear_fc1.bias, module.linear_fc2.weight, module.linear_fc2.bias


def assert_matches_module(out, eager, truth, dtype):
    """fp32: within 1e-5 of the module. 16-bit: elementwise within two ulps of the output's scale of the
    module run in the same dtype (each side rounds the norm, fc1 and GELU outputs once, the interpreter
    toward zero), and no further from fp64 truth than the module is, plus one ulp."""
    scale = truth.abs().max().item()
    if dtype == torch.float32:
        torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5 * scale)
        return
    torch.testing.assert_close(out.float(), eager.float(), rtol=2 * ulp(dtype), atol=2 * ulp(dtype) * scale)
    our_error = (out.double() - truth).abs().max().item()
    eager_error = (eager.double() - truth).abs().max().item()
    assert our_error <= eager_error + ulp(dtype) * scale


@pytest.mark.parametrize("postshuffle_norm", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_patch_merger_matches_transformers(dtype, postshuffle_norm, backend, device):
    torch.manual_seed(5)
    module = randomized(Qwen3VLVisionPatchMerger(vision_config(), use_postshuffle_norm=postshuffle_norm), dtype, device)
    x = (torch.randn(256, 72, device=device) * 2 + 0.5).to(dtype)
    with torch.no_grad():
        eager = module(x)
        truth = module.double()(x.double())
        module.to(dtype)
        out = patch_merger(x, *merger_args(module), spatial_merge_size=2, postshuffle_norm=postshuffle_norm)
    assert out.shape == (64, 96) and out.dtype == dtype
    assert_matches_module(out, eager, truth, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_vision_mlp_matches_transformers(dtype, backend, device):
    torch.manual_seed(6)
    module = randomized(Qwen3VLVisionMLP(vision_config()), dtype, device)
    x = (torch.randn(200, 72, device=device) * 2).to(dtype)
    with torch.no_grad():
        eager = module(x)
        truth = module.double()(x.double())
        module.to(dtype)
        out = vision_mlp(x, *mlp_args(module))
    assert out.shape == (200, 72) and out.dtype == dtype
    assert_matches_module(out, eager, truth, dtype)


def test_tensor_parallel_shards(device):
    """Two simulated ranks: fc1 split by output features, fc2 by input features, one all-reduce of the
    partial fc2 products, fc2's bias added once; every rank then holds the unsharded result."""
    torch.manual_seed(7)
    config = vision_config()
    merger = randomized(Qwen3VLVisionPatchMerger(config), torch.float32, device)
    mlp = randomized(Qwen3VLVisionMLP(config), torch.float32, device)
    x = torch.randn(64, 72, device=device)

    def run_sharded(forward, args, fc1_index, fc2_index, hidden):
        shards = [slice(0, hidden // 2), slice(hidden // 2, hidden)]

        def shard_args(s):
            sharded = list(args)
            sharded[fc1_index] = args[fc1_index][s]
            sharded[fc1_index + 1] = args[fc1_index + 1][s]
            sharded[fc2_index] = args[fc2_index][:, s]
            return sharded

        partials = []
        for s in shards:
            forward(x, *shard_args(s), all_reduce=lambda t: partials.append(t) or t)
        total = partials[0] + partials[1]
        return [forward(x, *shard_args(s), all_reduce=lambda t: total) for s in shards]

    with torch.no_grad():
        merger_outs = run_sharded(patch_merger, merger_args(merger), 2, 4, 288)
        mlp_outs = run_sharded(vision_mlp, mlp_args(mlp), 0, 2, 128)
        for out in merger_outs:
            torch.testing.assert_close(out, merger(x), rtol=1e-5, atol=1e-5)
        for out in mlp_outs:
            torch.testing.assert_close(out, mlp(x), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------------
# Registration: opcheck, torch.compile, argument checks.
# ----------------------------------------------------------------------------------------------------
def opcheck_cases(device):
    torch.manual_seed(8)
    x = row_strided(24, 40, torch.float32, device)
    delta = row_strided(24, 40, torch.float32, device, pad=1)
    weight, bias = norm_params(40, torch.float32, device)
    return {
        "layer_norm": (torch.ops.qvl.layer_norm.default, (x, weight, bias, 1e-6)),
        "add_layer_norm": (torch.ops.qvl.add_layer_norm.default, (x, delta, weight, bias, 1e-5)),
        "bias_gelu_none": (torch.ops.qvl.bias_gelu.default, (x, bias, "none")),
        "bias_gelu_tanh": (torch.ops.qvl.bias_gelu.default, (x, bias, "tanh")),
        "bias_gelu_": (torch.ops.qvl.bias_gelu_.default, (x.clone(), bias, "tanh")),
    }


@pytest.mark.parametrize("case", ["layer_norm", "add_layer_norm", "bias_gelu_none", "bias_gelu_tanh", "bias_gelu_"])
def test_opcheck(case, device):
    op, args = opcheck_cases(device)[case]
    torch.library.opcheck(op, args)


def test_compile_dynamic_rows_no_recompile(device):
    torch.manual_seed(9)
    config = vision_config()
    merger = randomized(Qwen3VLVisionPatchMerger(config), torch.float32, device)
    mlp = randomized(Qwen3VLVisionMLP(config), torch.float32, device)
    weight, bias = norm_params(72, torch.float32, device)

    def block_tail(x, attn_out):
        h, normed = torch.ops.qvl.add_layer_norm(x, attn_out, weight, bias, 1e-6)
        h = h + vision_mlp(normed, *mlp_args(mlp))
        merged = patch_merger(torch.ops.qvl.layer_norm(h, weight, bias), *merger_args(merger))
        return h, merged

    torch._dynamo.reset()
    compiled = torch.compile(block_tail, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for rows in (64, 96):
            stance = torch.compiler.set_stance("fail_on_recompile") if rows != 64 else contextlib.nullcontext()
            x, attn_out = torch.randn(rows, 72, device=device), torch.randn(rows, 72, device=device)
            with stance:
                got = compiled(x, attn_out)
            for a, b in zip(got, block_tail(x, attn_out)):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.fixture
def small(device):
    """``x (8, 16)``, ``w``, ``b (16,)``: fp32 inputs for the argument checks."""
    return dict(x=torch.randn(8, 16, device=device), w=torch.randn(16, device=device), b=torch.randn(16, device=device))


LN, ALN, BG, BG_ = (torch.ops.qvl.layer_norm, torch.ops.qvl.add_layer_norm,
                    torch.ops.qvl.bias_gelu, torch.ops.qvl.bias_gelu_)  # fmt: skip
BAD_INPUTS = {
    "ln_x_1d": (lambda x, w, b: LN(x[0], w, b), ValueError, "x must be 2-D"),
    "ln_weight_len": (lambda x, w, b: LN(x, w[:8], b), ValueError, "weight must have shape"),
    "ln_bias_len": (lambda x, w, b: LN(x, w, b[:8]), ValueError, "bias must have shape"),
    "ln_weight_dtype": (lambda x, w, b: LN(x, w.half(), b), TypeError, "weight must have x's dtype"),
    "ln_x_float64": (lambda x, w, b: LN(x.double(), w.double(), b.double()), TypeError, "x must be one of"),
    "ln_x_strided_cols": (lambda x, w, b: LN(x.t(), w[:8], b[:8]), ValueError, "x must have a contiguous last"),
    "ln_eps_zero": (lambda x, w, b: LN(x, w, b, 0.0), ValueError, "eps must be a finite number > 0"),
    "ln_eps_negative": (lambda x, w, b: LN(x, w, b, -1e-6), ValueError, "eps must be a finite number > 0"),
    "ln_too_wide": (lambda x, w, b: LN(x.new_empty(1, MAX_NORM_DIM + 1), w, b), ValueError, "normalized dim"),
    "aln_delta_shape": (lambda x, w, b: ALN(x, x[:4], w, b), ValueError, "delta must have x's shape"),
    "aln_delta_dtype": (lambda x, w, b: ALN(x, x.half(), w, b), TypeError, "delta must have x's dtype"),
    "aln_eps_inf": (lambda x, w, b: ALN(x, x, w, b, float("inf")), ValueError, "eps must be"),
    "bg_bias_len": (lambda x, w, b: BG(x, b[:8]), ValueError, "bias must have shape"),
    "bg_bias_dtype": (lambda x, w, b: BG(x, b.bfloat16()), TypeError, "bias must have x's dtype"),
    "bg_x_3d": (lambda x, w, b: BG(x[None], b), ValueError, "x must be 2-D"),
    "bg_approximate": (lambda x, w, b: BG(x, b, "erf"), ValueError, "approximate must be one of"),
    "bg__approximate": (lambda x, w, b: BG_(x, b, "sigmoid"), ValueError, "approximate must be one of"),
    "merger_rows": (lambda x, w, b: patch_merger(x[:6], w, b, w, w, w, w), ValueError, "divisible by spatial_merge"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs(case, small):
    call, error, match = BAD_INPUTS[case]
    with pytest.raises(error, match=match):
        call(**small)
