"""torch.ops.qvl.bias_gelu / bias_gelu_ against float64 ground truth and eager torch in the same dtype, and
QuickGELU (``approximate="quick"``) against transformers' ``QuickGELUActivation`` and Qwen2-VL's ``VisionMlp``.

Each op runs on its default path (the Triton interpreter on CPU, compiled Triton on a GPU) and on the
torch path (the ``backend`` fixture). Errors are held to the suite's rule (tolerance.py): at most twice
eager ``F.gelu(x + bias)``'s own error in the dtype, plus two units of the dtype's resolution at the
output's scale. Both sides call an erf or tanh whose accuracy depends on the machine's libm and SIMD
width, which is why the bound is relative to torch's error on the same machine.
"""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from transformers.activations import QuickGELUActivation
from transformers.models.qwen2_vl.modeling_qwen2_vl import VisionMlp

from conftest import norm_params, row_strided
from guards import LAYOUTS, assert_clean, guarded, guarded_empty, layout_pads
from qvl.kernels import force_backend, torch_path
from qvl.kernels.common import device_target, run_launches
from qvl.kernels.gelu import (
    GELU_APPROXIMATIONS,
    bias_gelu_backward_launches,
    bias_gelu_launches,
)
from qvl.kernels.tiles import epilogue_backward_config
from tolerance import assert_error_within, assert_grads_within
from towers import float64_copy

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# The tanh GELU's exp2 overflows to inf for large negative inputs by design (the result is then -0);
# numpy, under the interpreter, warns about it.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")


def gelu_inputs(rows, cols, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    x = row_strided(rows, cols, dtype, device, scale=3.0)
    # Tails where 1 + erf(.) and 1 + tanh(.) cancel, and values whose exp2 overflows fp32 in the tanh form.
    extremes = torch.tensor([-1e4, -40.0, -10.0, -5.0, -0.01, 0.0, 5.0, 40.0, 1e4], device=device)
    x[0, : extremes.numel()] = extremes.to(dtype)
    bias = (0.5 * torch.randn(cols, device=device)).to(dtype)
    bias[: extremes.numel()] = 0
    return x, bias


def eager_gelu(x, bias, approximate):
    """``gelu(x + bias)`` as torch and transformers compute it, in x's dtype: ``F.gelu``, or transformers'
    ``QuickGELUActivation`` for "quick". In float64 it is the suite's truth."""
    v = x + bias
    return QuickGELUActivation()(v) if approximate == "quick" else F.gelu(v, approximate=approximate)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_gelu(dtype, approximate, backend, device):
    torch.manual_seed(3)
    x, bias = gelu_inputs(96, 300, dtype, device)
    y = torch.ops.qvl.bias_gelu(x, bias, approximate)
    assert y.shape == x.shape and y.dtype == dtype and y.is_contiguous()
    truth = eager_gelu(x.double(), bias.double(), approximate)
    # From |x + bias| = 40 on, erf and tanh are +-1 in fp32 (and in float64 the tail is below the smallest
    # subnormal), so gelu is exactly x + bias or 0. Held apart, these inputs (up to 1e4) also leave the
    # rule's eps at the scale of the other outputs.
    saturated = (x.float() + bias.float()).abs() >= 40
    assert torch.equal(y[saturated], truth[saturated].to(dtype))
    eager = eager_gelu(x, bias, approximate)
    assert_error_within(y[~saturated], truth[~saturated], eager[~saturated], what="bias_gelu")


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_quick_gelu(dtype, backend, device):
    """QuickGELU ``v * sigmoid(1.702 v)``, v = x + bias, against transformers' ``QuickGELUActivation`` (which
    in a 16-bit dtype rounds ``1.702 v``, the sigmoid and the product; the op rounds once)."""
    torch.manual_seed(3)
    x, bias = gelu_inputs(96, 300, dtype, device)
    y = torch.ops.qvl.bias_gelu(x, bias, "quick")
    assert y.shape == x.shape and y.dtype == dtype and y.is_contiguous()
    truth = eager_gelu(x.double(), bias.double(), "quick")
    # From v = 40 on, sigmoid(1.702 v) is 1 in fp32: the output is v itself. Held apart, these inputs (up to
    # 1e4) leave the rule's eps at the scale of the other outputs; the negative tail is ~0 and stays in.
    saturated = (x.float() + bias.float()) >= 40
    assert torch.equal(y[saturated], (x + bias)[saturated])
    eager = eager_gelu(x, bias, "quick")
    assert_error_within(y[~saturated], truth[~saturated], eager[~saturated], what="bias_gelu quick")


@pytest.mark.parametrize("dtype", DTYPES)
def test_quick_gelu_matches_qwen2_vl_mlp(dtype, backend, device):
    """Qwen2-VL's vision MLP (``hidden_act="quick_gelu"``) as qvl runs such an MLP: bias-less fc1, then the
    in-place bias + QuickGELU, then fc2."""
    torch.manual_seed(5)
    mlp = VisionMlp(dim=72, hidden_dim=136, hidden_act="quick_gelu")
    with torch.no_grad():
        for param in mlp.parameters():
            param.copy_(0.2 * torch.randn_like(param))
    mlp = mlp.to(device=device, dtype=dtype).eval()
    x = torch.randn(120, 72, device=device).to(dtype)
    with torch.no_grad():
        h = x @ mlp.fc1.weight.t()
        torch.ops.qvl.bias_gelu_(h, mlp.fc1.bias, "quick")
        got = mlp.fc2(h)
        truth, eager = float64_copy(mlp)(x.double()), mlp(x)
    assert_error_within(got, truth, eager, what="Qwen2-VL VisionMlp on bias_gelu quick")


@pytest.mark.parametrize("path", ["default", "torch"])
def test_compile_dynamic_rows_no_recompile(path, device):
    """All three GELUs, out of place and in place, compiled whole: one graph serves every token count."""
    torch.manual_seed(6)
    bias = torch.randn(72, device=device)

    def gelus(x):
        y = torch.ops.qvl.bias_gelu(x, bias, "quick") + torch.ops.qvl.bias_gelu(x, bias, "none")
        h = x.clone()
        torch.ops.qvl.bias_gelu_(h, bias, "tanh")
        return y, h

    def gelus_in_torch(x):
        b = bias.to(x.dtype)
        return QuickGELUActivation()(x + b) + F.gelu(x + b), F.gelu(x + b, approximate="tanh")

    torch._dynamo.reset()
    compiled = torch.compile(gelus, fullgraph=True, dynamic=True)
    context = force_backend("torch") if path == "torch" else contextlib.nullcontext()
    with context:
        # Row counts unlike every other size in play, so duck sizing ties no symbol to them.
        for index, rows in enumerate((67, 101)):
            x = torch.randn(rows, 72, device=device)
            stance = torch.compiler.set_stance("fail_on_recompile") if index else contextlib.nullcontext()
            with stance:
                got = compiled(x)
            assert_error_within(got, gelus_in_torch(x.double()), gelus_in_torch(x), what=f"{rows} rows")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_tanh_gelu_compiled(dtype):
    """The torch path's tanh GELU as Inductor compiles it on CPU (written ``v * sigmoid(2u)`` when traced), out of
    place and in place, against float64: the saturated tails exact, the rest within the suite's rule."""
    torch.manual_seed(7)
    x, bias = gelu_inputs(96, 300, dtype, "cpu")

    def both(x):
        h = x.clone()
        torch_path.bias_gelu_(h, bias, "tanh")
        return torch_path.bias_gelu(x, bias, "tanh"), h

    torch._dynamo.reset()
    truth = eager_gelu(x.double(), bias.double(), "tanh")
    saturated = (x.float() + bias.float()).abs() >= 40
    eager = eager_gelu(x, bias, "tanh")
    for y in torch.compile(both, fullgraph=True)(x):
        assert y.dtype == dtype and y.is_contiguous()
        assert torch.equal(y[saturated], truth[saturated].to(dtype))
        assert_error_within(y[~saturated], truth[~saturated], eager[~saturated], what="compiled torch-path tanh gelu")


@pytest.mark.parametrize("approximate", ["none", "tanh", "quick"])
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
    _, bias = norm_params(72, torch.float32, device)
    assert torch.ops.qvl.bias_gelu(x, bias, "tanh").shape == (0, 72)


def test_zero_columns_forward_and_backward(backend, device):
    """F = 0 on every path: nothing to compute, empty results of the right shapes (the Triton path's backward tiles
    once divided by the width)."""
    x = torch.empty(4, 0, device=device, requires_grad=True)
    bias = torch.empty(0, device=device, requires_grad=True)
    y = torch.ops.qvl.bias_gelu(x, bias, "tanh")
    y.sum().backward()
    assert y.shape == (4, 0) and x.grad.shape == (4, 0) and bias.grad.shape == (0,)


def test_in_place_refuses_an_output_that_overlaps_itself(backend, device):
    """One row expanded to four: GELU would be applied to it four times. Every path refuses, as torch's in-place
    ops do."""
    x = torch.randn(1, 40, device=device).expand(4, 40)
    _, bias = norm_params(40, torch.float32, device)
    with pytest.raises(ValueError, match=r"bias_gelu_: x is written in place, so no two of its elements"):
        torch.ops.qvl.bias_gelu_(x, bias, "none")


def opcheck_cases(device):
    torch.manual_seed(8)
    x = row_strided(24, 40, torch.float32, device)
    _, bias = norm_params(40, torch.float32, device)
    return {
        "bias_gelu_none": (torch.ops.qvl.bias_gelu.default, (x, bias, "none")),
        "bias_gelu_tanh": (torch.ops.qvl.bias_gelu.default, (x, bias, "tanh")),
        "bias_gelu_quick": (torch.ops.qvl.bias_gelu.default, (x, bias, "quick")),
        "bias_gelu_": (torch.ops.qvl.bias_gelu_.default, (x.clone(), bias, "tanh")),
        "bias_gelu__quick": (torch.ops.qvl.bias_gelu_.default, (x.clone(), bias, "quick")),
    }


OPCHECK_CASES = ["bias_gelu_none", "bias_gelu_tanh", "bias_gelu_quick", "bias_gelu_", "bias_gelu__quick"]


@pytest.mark.parametrize("case", OPCHECK_CASES)
def test_opcheck(case, device):
    op, args = opcheck_cases(device)[case]
    torch.library.opcheck(op, args)


BG, BG_ = torch.ops.qvl.bias_gelu, torch.ops.qvl.bias_gelu_
BAD_INPUTS = {
    "bg_bias_len": (lambda x, w, b: BG(x, b[:8]), ValueError, "bias must have shape"),
    "bg_bias_dtype": (lambda x, w, b: BG(x, b.bfloat16()), TypeError, "bias must have x's dtype"),
    "bg_x_3d": (lambda x, w, b: BG(x[None], b), ValueError, "x must be 2-D"),
    "bg_approximate": (lambda x, w, b: BG(x, b, "erf"), ValueError, "approximate must be one of"),
    "bg__approximate": (lambda x, w, b: BG_(x, b, "sigmoid"), ValueError, "approximate must be one of"),
    "bg_approximate_case": (lambda x, w, b: BG(x, b, "Quick"), ValueError, "approximate must be one of"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs(case, argument_check_inputs):
    call, error, match = BAD_INPUTS[case]
    with pytest.raises(error, match=match):
        call(**argument_check_inputs)


# Backward: gradients of x and bias against float64 autograd of torch's (transformers') GELU, held to the suite's
# rule with torch's own autograd in the same dtype as the baseline.


@pytest.mark.parametrize("approximate", ["none", "tanh", "quick"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_gelu_backward(dtype, approximate, backend, device):
    torch.manual_seed(10)
    x, bias = (t.detach().requires_grad_() for t in gelu_inputs(24, 300, dtype, device))
    grad_y = row_strided(24, 300, dtype, device, pad=5)
    got = torch.autograd.grad(torch.ops.qvl.bias_gelu(x, bias, approximate), (x, bias), grad_y)
    x64, bias64 = (t.detach().double().requires_grad_() for t in (x, bias))
    truth = torch.autograd.grad(eager_gelu(x64, bias64, approximate), (x64, bias64), grad_y.double())
    baseline = torch.autograd.grad(eager_gelu(x, bias, approximate), (x, bias), grad_y)
    assert_error_within(got, truth, baseline, what=f"bias_gelu {approximate} grads")


@pytest.mark.parametrize("approximate", ["none", "quick"])
def test_opcheck_autograd(approximate, device):
    torch.manual_seed(11)
    x = row_strided(24, 40, torch.float32, device).requires_grad_()
    bias = torch.randn(40, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.qvl.bias_gelu.default, (x, bias, approximate))
    grad_y = torch.randn(24, 40, device=device)
    torch.library.opcheck(torch.ops.qvl.bias_gelu_backward.default, (grad_y, x.detach(), bias.detach(), approximate))


@pytest.mark.parametrize("path", ["default", "torch"])
def test_compile_forward_backward_no_recompile(path, device):
    """The three GELUs, forward and backward, compiled whole: one graph serves every token count."""
    torch.manual_seed(12)
    bias = torch.randn(72, device=device, requires_grad=True)

    def gelus(x, fn=torch.ops.qvl.bias_gelu):
        b = bias.to(x.dtype)
        return (fn(x, b, "none") * fn(x, b, "tanh") + fn(x, b, "quick")).sum()

    torch._dynamo.reset()
    compiled = torch.compile(gelus, fullgraph=True, dynamic=True)
    context = force_backend("torch") if path == "torch" else contextlib.nullcontext()
    with context:
        for index, rows in enumerate((67, 101)):
            x = torch.randn(rows, 72, device=device, requires_grad=True)
            stance = torch.compiler.set_stance("fail_on_recompile") if index else contextlib.nullcontext()
            with stance:
                got = torch.autograd.grad(compiled(x), (x, bias))
            x64 = x.detach().double().requires_grad_()
            truth = [t.double() for t in torch.autograd.grad(gelus(x64, eager_gelu), (x64, bias))]
            baseline = torch.autograd.grad(gelus(x, eager_gelu), (x, bias))
            assert_error_within(got, truth, baseline, ulps=4, what=f"{rows} rows")


def test_inplace_refuses_autograd(device):
    """bias_gelu_ has no backward: with grad mode on and an input requiring grad it raises, naming the op and
    the out-of-place alternative, and leaves x untouched; without either it runs."""
    x = torch.randn(8, 16, device=device)
    bias = torch.randn(16, device=device, requires_grad=True)
    before = x.clone()
    with pytest.raises(RuntimeError, match=r"qvl::bias_gelu_ .*torch\.ops\.qvl\.bias_gelu\(x, bias"):
        torch.ops.qvl.bias_gelu_(x, bias, "tanh")
    with pytest.raises(RuntimeError, match="qvl::bias_gelu_"):
        torch.ops.qvl.bias_gelu_(x.clone().requires_grad_(), bias.detach())
    assert torch.equal(x, before)
    with torch.no_grad():
        torch.ops.qvl.bias_gelu_(x, bias, "tanh")
    assert torch.equal(x, torch.ops.qvl.bias_gelu(before, bias.detach(), "tanh"))
    torch.ops.qvl.bias_gelu_(before, bias.detach(), "tanh")
    assert torch.equal(x, before)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("approximate", GELU_APPROXIMATIONS)
def test_guard_bands(approximate, dtype, layout, device):
    """bias_gelu out of place and in place and its backward (the partial-sum reduction included) with every float
    tensor a view inside a NaN-filled buffer (tests/guards.py), on 37 rows of 1,100 columns (ragged row blocks, a
    whole and a ragged column block): results finite and within the suite's rule, nothing written outside a view."""
    torch.manual_seed(13)
    pads = layout_pads(layout, dtype)
    x, grad_y = (guarded(row_strided(37, 1100, dtype, device, scale=scale), pad=next(pads)) for scale in (3.0, 1.0))
    bias = guarded((0.5 * torch.randn(1100, device=device)).to(dtype), pad=next(pads))
    in_place = guarded(x, pad=next(pads))
    y, dx = (guarded_empty(x.shape, dtype, device, pad=next(pads)) for _ in range(2))
    dbias = guarded_empty(bias.shape, dtype, device, pad=next(pads))
    target = device_target(x.device)
    programs = epilogue_backward_config(*x.shape)["programs"]
    partials = guarded_empty((1, programs, x.shape[1]), torch.float32, device, pad=0)
    run_launches(
        bias_gelu_launches(x, bias, y, approximate, target)
        + bias_gelu_launches(in_place, bias, in_place, approximate, target)
        + bias_gelu_backward_launches(grad_y, x, bias, dx, partials, dbias, approximate),
        x.device,
    )
    assert_clean(x, bias, grad_y, y, in_place, dx, dbias, partials)

    def eager(x, bias):
        return eager_gelu(x, bias, approximate)

    assert_error_within(y, eager(x.double(), bias.double()), eager(x, bias), what=f"bias_gelu {approximate}")
    assert torch.equal(in_place, y)
    assert_grads_within((dx, dbias), eager, [x, bias], [grad_y], f"bias_gelu {approximate} backward")
