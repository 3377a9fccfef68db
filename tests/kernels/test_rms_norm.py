"""torch.ops.qvl.rms_norm / add_rms_norm against float64 ground truth and transformers' Qwen2.5-VL RMSNorm.

Each op runs on its default path (the Triton interpreter on CPU, compiled Triton on a GPU) and on the
torch path (the ``backend`` fixture). Errors are held to the suite's rule (tolerance.py): at most twice
the error of transformers' ``Qwen2_5_VLRMSNorm`` (``Qwen2RMSNorm``: the norm of Qwen2.5-VL's vision
blocks and merger ``ln_q``) in the same dtype, plus two units of the dtype's resolution at the output's
scale. The torch path is transformers' forward op for op, so it must match the module bit for bit.
RMSNorm's guard-band test runs with LayerNorm's, on the kernels they share (test_layer_norm.py).
"""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRMSNorm

from conftest import norm_params, row_strided
from qvl.kernels import force_backend
from qvl.kernels.layer_norm import MAX_NORM_DIM
from tolerance import assert_error_within, assert_grads_within

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def eager_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm as transformers' ``Qwen2_5_VLRMSNorm`` computes it in x's dtype, differentiable in x and weight: the
    baseline. In float64, the truth, it is torch's ``F.rms_norm`` instead: transformers' module takes its statistics
    in fp32 whatever x's dtype, so its float64 run would carry fp32's rounding."""
    if x.dtype == torch.float64:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return torch.func.functional_call(Qwen2_5_VLRMSNorm(weight.shape[0], eps=eps), {"weight": weight}, (x,))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(257, 72), (33, 1000), (5, 1280), (3, 1)])
def test_rms_norm(dtype, shape, backend, device):
    torch.manual_seed(0)
    rows, cols = shape
    # An offset mean: RMSNorm does not center, so the mean is part of the scale.
    x = row_strided(rows, cols, dtype, device, scale=2.0, shift=1.0)
    weight, _ = norm_params(cols, dtype, device)
    y = torch.ops.qvl.rms_norm(x, weight, 1e-6)
    assert y.shape == x.shape and y.dtype == dtype and y.is_contiguous()

    truth = eager_rms_norm(x.double(), weight.double())
    eager = eager_rms_norm(x, weight)
    assert_error_within(y, truth, eager, what="rms_norm")
    if backend == "torch":
        assert torch.equal(y, eager)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm(dtype, backend, device):
    torch.manual_seed(1)
    x = row_strided(200, 72, dtype, device, scale=3.0)
    delta = row_strided(200, 72, dtype, device, pad=3)
    weight, _ = norm_params(72, dtype, device)
    h, y = torch.ops.qvl.add_rms_norm(x, delta, weight, 1e-6)
    assert h.is_contiguous() and y.is_contiguous() and h.dtype == y.dtype == dtype

    # The add in fp32, rounded to nearest once: eager torch's sum on every path.
    assert torch.equal(h, x + delta)
    # The norm is of the stored, rounded sum: transformers' block, ``h = h + attn(...); norm2(h)``.
    truth = eager_rms_norm(h.double(), weight.double())
    assert_error_within(y, truth, eager_rms_norm(h, weight), what="add_rms_norm")


def test_add_rms_norm_normalizes_rounded_sum(backend, device):
    """fp16 near 1000 has a spacing of 0.5: rounding x + delta there changes the norm visibly (the row's
    mean is most of it), and the op must give eager ``norm(x + delta)``, not the norm of the exact sum."""
    torch.manual_seed(2)
    x = (1000.0 + 30.0 * torch.randn(64, 96, device=device)).half()
    delta = (0.3 * torch.randn(64, 96, device=device)).half()
    weight, _ = norm_params(96, torch.float16, device)
    _, y = torch.ops.qvl.add_rms_norm(x, delta, weight, 1e-6)
    rounded_sum = x + delta
    truth = eager_rms_norm(rounded_sum.double(), weight.double())
    assert_error_within(y, truth, eager_rms_norm(rounded_sum, weight), what="norm of the rounded sum")
    exact_sum = eager_rms_norm(x.float() + delta.float(), weight.float())
    assert (y.float() - exact_sum).abs().max() > 1e-3


def test_weight_multiplies_after_the_cast(backend, device):
    """transformers rounds the normalized row to the input dtype, then multiplies by the weight (rounding
    again). In fp16 (which the interpreter, like torch, rounds to nearest) the op reproduces that: it matches
    the module almost everywhere, where one rounding of ``weight * normalized`` differs at a quarter of the
    elements."""
    torch.manual_seed(3)
    x = (3.0 * torch.randn(200, 96, device=device)).half()
    weight, _ = norm_params(96, torch.float16, device)
    y = torch.ops.qvl.rms_norm(x, weight, 1e-6)
    eager = eager_rms_norm(x, weight)
    h = x.float()
    rounded_once = (weight.float() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).half()
    assert (rounded_once != eager).float().mean() > 0.1
    assert (y != eager).float().mean() < 0.01


def test_empty_rows(backend, device):
    x = torch.empty(0, 72, device=device)
    weight, _ = norm_params(72, torch.float32, device)
    assert torch.ops.qvl.rms_norm(x, weight).shape == (0, 72)
    h, y = torch.ops.qvl.add_rms_norm(x, x, weight)
    assert h.shape == y.shape == (0, 72)


def opcheck_cases(device):
    torch.manual_seed(8)
    x = row_strided(24, 40, torch.float32, device)
    delta = row_strided(24, 40, torch.float32, device, pad=1)
    weight, _ = norm_params(40, torch.float32, device)
    return {
        "rms_norm": (torch.ops.qvl.rms_norm.default, (x, weight, 1e-6)),
        "add_rms_norm": (torch.ops.qvl.add_rms_norm.default, (x, delta, weight, 1e-5)),
    }


@pytest.mark.parametrize("case", ["rms_norm", "add_rms_norm"])
def test_opcheck(case, device):
    op, args = opcheck_cases(device)[case]
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("path", ["default", "torch"])
def test_compile_dynamic_rows_no_recompile(path, device):
    """A Qwen2.5-VL block's norms (``norm1``, then the residual add fused with ``norm2``) compiled whole: one
    graph serves every token count."""
    torch.manual_seed(9)
    weight1, _ = norm_params(72, torch.float32, device)
    weight2, _ = norm_params(72, torch.float32, device)

    def block_norms(x, attn_out):
        normed1 = torch.ops.qvl.rms_norm(x, weight1, 1e-6)
        h, normed2 = torch.ops.qvl.add_rms_norm(x, attn_out, weight2, 1e-6)
        return normed1, h, normed2

    def block_norms_in_torch(x, attn_out):
        h = x + attn_out
        return eager_rms_norm(x, weight1.to(x.dtype)), h, eager_rms_norm(h, weight2.to(x.dtype))

    torch._dynamo.reset()
    compiled = torch.compile(block_norms, fullgraph=True, dynamic=True)
    context = force_backend("torch") if path == "torch" else contextlib.nullcontext()
    with context:
        # Row counts unlike every other size in play, so duck sizing ties no symbol to them.
        for index, rows in enumerate((67, 101)):
            x, attn_out = torch.randn(rows, 72, device=device), torch.randn(rows, 72, device=device)
            stance = torch.compiler.set_stance("fail_on_recompile") if index else contextlib.nullcontext()
            with stance:
                got = compiled(x, attn_out)
            truth = block_norms_in_torch(x.double(), attn_out.double())
            assert_error_within(got, truth, block_norms_in_torch(x, attn_out), what=f"{rows} rows")


RN, ARN = torch.ops.qvl.rms_norm, torch.ops.qvl.add_rms_norm
BAD_INPUTS = {
    "rn_x_1d": (lambda x, w, b: RN(x[0], w), ValueError, "rms_norm: x must be 2-D"),
    "rn_weight_len": (lambda x, w, b: RN(x, w[:8]), ValueError, "weight must have shape"),
    "rn_weight_2d": (lambda x, w, b: RN(x, w[None]), ValueError, "weight must be 1-D"),
    "rn_weight_dtype": (lambda x, w, b: RN(x, w.half()), TypeError, "weight must have x's dtype"),
    "rn_x_float64": (lambda x, w, b: RN(x.double(), w.double()), TypeError, "x must be one of"),
    "rn_x_strided_cols": (lambda x, w, b: RN(x.t(), w[:8]), ValueError, "x must have a contiguous last"),
    "rn_eps_zero": (lambda x, w, b: RN(x, w, 0.0), ValueError, "eps must be a finite number > 0"),
    "rn_eps_nan": (lambda x, w, b: RN(x, w, float("nan")), ValueError, "eps must be a finite number > 0"),
    "rn_too_wide": (lambda x, w, b: RN(x.new_empty(1, MAX_NORM_DIM + 1), w), ValueError, "normalized dim"),
    "arn_delta_shape": (lambda x, w, b: ARN(x, x[:4], w), ValueError, "add_rms_norm: delta must have x's shape"),
    "arn_delta_dtype": (lambda x, w, b: ARN(x, x.half(), w), TypeError, "delta must have x's dtype"),
    "arn_delta_strided": (lambda x, w, b: ARN(x[:, :8], x.t()[:8], w[:8]), ValueError, "delta must have a contig"),
    "arn_eps_inf": (lambda x, w, b: ARN(x, x, w, float("inf")), ValueError, "eps must be"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs(case, argument_check_inputs):
    call, error, match = BAD_INPUTS[case]
    with pytest.raises(error, match=match):
        call(**argument_check_inputs)


# Backward: gradients of every input against float64 autograd of torch's F.rms_norm, held to the suite's rule with
# autograd of transformers' module in the same dtype as the baseline.


def grad_inputs(rows, cols, dtype, device, seed):
    torch.manual_seed(seed)
    x = row_strided(rows, cols, dtype, device, scale=2.0, shift=1.0)
    delta = row_strided(rows, cols, dtype, device, pad=3)
    weight, _ = norm_params(cols, dtype, device)
    grads = row_strided(rows, cols, dtype, device, pad=5), row_strided(rows, cols, dtype, device, pad=2)
    return [t.detach().requires_grad_() for t in (x, delta, weight)], grads


def eager_add_rms_norm(x, delta, weight):
    h = x + delta
    return h, eager_rms_norm(h, weight)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(40, 72), (3, 1000)])
def test_rms_norm_backward(dtype, shape, backend, device):
    (x, delta, weight), (grad_h, grad_y) = grad_inputs(*shape, dtype, device, seed=10)
    got = torch.autograd.grad(torch.ops.qvl.rms_norm(x, weight, 1e-6), (x, weight), grad_y)
    assert_grads_within(got, eager_rms_norm, [x, weight], [grad_y], "rms_norm grads")
    inputs, grads = [x, delta, weight], [grad_h, grad_y]
    got = torch.autograd.grad(torch.ops.qvl.add_rms_norm(*inputs, 1e-6), inputs, grads)
    assert_grads_within(got, eager_add_rms_norm, inputs, grads, "add_rms_norm grads")


def backward_opcheck_cases(device):
    (x, delta, weight), (grad_h, grad_y) = grad_inputs(24, 40, torch.float32, device, seed=12)
    detached = [t.detach() for t in (x, weight)]
    return {
        "rms_norm": (torch.ops.qvl.rms_norm.default, (x, weight, 1e-6)),
        "add_rms_norm": (torch.ops.qvl.add_rms_norm.default, (x, delta, weight, 1e-5)),
        "rms_norm_backward": (torch.ops.qvl.rms_norm_backward.default, (grad_y, *detached, 1e-6, None)),
        "rms_norm_backward_h": (torch.ops.qvl.rms_norm_backward.default, (grad_y, *detached, 1e-6, grad_h)),
    }


@pytest.mark.parametrize("case", ["rms_norm", "add_rms_norm", "rms_norm_backward", "rms_norm_backward_h"])
def test_opcheck_autograd(case, device):
    op, args = backward_opcheck_cases(device)[case]
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("path", ["default", "torch"])
def test_compile_forward_backward_no_recompile(path, device):
    """A Qwen2.5-VL block's norms, forward and backward, compiled whole: one graph serves every token count."""
    torch.manual_seed(13)
    weight = norm_params(72, torch.float32, device)[0].requires_grad_()

    def norms(x, delta):
        h, y = torch.ops.qvl.add_rms_norm(x, delta, weight, 1e-6)
        return (torch.ops.qvl.rms_norm(h, weight, 1e-6) * y).sum()

    def norms_in_torch(x, delta):
        h, y = eager_add_rms_norm(x, delta, weight.to(x.dtype))
        return (eager_rms_norm(h, weight.to(x.dtype)) * y).sum()

    torch._dynamo.reset()
    compiled = torch.compile(norms, fullgraph=True, dynamic=True)
    context = force_backend("torch") if path == "torch" else contextlib.nullcontext()
    with context:
        for index, rows in enumerate((67, 101)):
            x, delta = (torch.randn(rows, 72, device=device, requires_grad=True) for _ in range(2))
            stance = torch.compiler.set_stance("fail_on_recompile") if index else contextlib.nullcontext()
            with stance:
                got = torch.autograd.grad(compiled(x, delta), (x, delta, weight))
            inputs64 = [t.detach().double().requires_grad_() for t in (x, delta)]
            truth = [t.double() for t in torch.autograd.grad(norms_in_torch(*inputs64), (*inputs64, weight))]
            baseline = torch.autograd.grad(norms_in_torch(x, delta), (x, delta, weight))
            assert_error_within(got, truth, baseline, ulps=4, what=f"{rows} rows")
