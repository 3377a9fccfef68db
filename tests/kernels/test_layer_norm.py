"""torch.ops.qvl.layer_norm / add_layer_norm against float64 ground truth and eager torch in the same dtype.

Each op runs on its default path (the Triton interpreter on CPU, compiled Triton on a GPU) and on the
torch path (the ``backend`` fixture). Errors are held to the suite's rule (tolerance.py): at most twice
eager ``F.layer_norm``'s own error in the dtype, plus two units of the dtype's resolution at the output's
scale.
"""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from test_rms_norm import eager_rms_norm

from conftest import norm_params, row_strided
from guards import LAYOUTS, assert_clean, guarded, guarded_empty, layout_pads
from qvl.kernels import force_backend
from qvl.kernels.common import device_target, run_launches
from qvl.kernels.layer_norm import MAX_NORM_DIM, norm_backward_launches, norm_launches, norm_partials
from tolerance import assert_error_within, assert_grads_within

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def eager_layer_norm(x, weight, bias, eps=1e-6):
    """torch's ``F.layer_norm`` in x's dtype; in float64, the truth."""
    return F.layer_norm(x, (x.shape[1],), weight, bias, eps)


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

    truth = eager_layer_norm(x.double(), weight.double(), bias.double())
    eager = eager_layer_norm(x, weight, bias)
    assert_error_within(y, truth, eager, what="layer_norm")


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_layer_norm(dtype, backend, device):
    torch.manual_seed(1)
    x = row_strided(200, 72, dtype, device, scale=3.0)
    delta = row_strided(200, 72, dtype, device, pad=3)
    weight, bias = norm_params(72, dtype, device)
    h, y = torch.ops.qvl.add_layer_norm(x, delta, weight, bias, 1e-6)
    assert h.is_contiguous() and y.is_contiguous() and h.dtype == y.dtype == dtype

    # The add in fp32, rounded to nearest once: eager torch's sum on every path.
    assert torch.equal(h, x + delta)
    # The norm is of the stored, rounded sum.
    truth = eager_layer_norm(h.double(), weight.double(), bias.double())
    assert_error_within(y, truth, eager_layer_norm(h, weight, bias), what="add_layer_norm")


def test_add_layer_norm_normalizes_rounded_sum(backend, device):
    """fp16 near 1000 has a spacing of 0.5: rounding x + delta there changes the norm visibly, and the op
    must give eager ``norm(x + delta)``, not the norm of the exact sum."""
    torch.manual_seed(2)
    x = (1000.0 + torch.randn(64, 96, device=device)).half()
    delta = (0.3 * torch.randn(64, 96, device=device)).half()
    weight, bias = norm_params(96, torch.float16, device)
    _, y = torch.ops.qvl.add_layer_norm(x, delta, weight, bias, 1e-6)
    rounded_sum = x + delta
    truth = eager_layer_norm(rounded_sum.double(), weight.double(), bias.double())
    eager = eager_layer_norm(rounded_sum, weight, bias)
    assert_error_within(y, truth, eager, what="norm of the rounded sum")
    exact_sum = F.layer_norm(x.float() + delta.float(), (96,), weight.float(), bias.float(), 1e-6)
    assert (y.float() - exact_sum).abs().max() > 0.05


def test_empty_rows(backend, device):
    x = torch.empty(0, 72, device=device)
    weight, bias = norm_params(72, torch.float32, device)
    assert torch.ops.qvl.layer_norm(x, weight, bias).shape == (0, 72)
    h, y = torch.ops.qvl.add_layer_norm(x, x, weight, bias)
    assert h.shape == y.shape == (0, 72)


def opcheck_cases(device):
    torch.manual_seed(8)
    x = row_strided(24, 40, torch.float32, device)
    delta = row_strided(24, 40, torch.float32, device, pad=1)
    weight, bias = norm_params(40, torch.float32, device)
    return {
        "layer_norm": (torch.ops.qvl.layer_norm.default, (x, weight, bias, 1e-6)),
        "add_layer_norm": (torch.ops.qvl.add_layer_norm.default, (x, delta, weight, bias, 1e-5)),
    }


@pytest.mark.parametrize("case", ["layer_norm", "add_layer_norm"])
def test_opcheck(case, device):
    op, args = opcheck_cases(device)[case]
    torch.library.opcheck(op, args)


LN, ALN = torch.ops.qvl.layer_norm, torch.ops.qvl.add_layer_norm
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
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs(case, argument_check_inputs):
    call, error, match = BAD_INPUTS[case]
    with pytest.raises(error, match=match):
        call(**argument_check_inputs)


# Backward: gradients of every input against float64 autograd of F.layer_norm, held to the suite's rule with torch's
# own autograd in the same dtype as the baseline.


def norm_grad_inputs(rows, cols, dtype, device, seed):
    torch.manual_seed(seed)
    x = row_strided(rows, cols, dtype, device, scale=2.0, shift=3.0)
    delta = row_strided(rows, cols, dtype, device, pad=3)
    weight, bias = norm_params(cols, dtype, device)
    grads = row_strided(rows, cols, dtype, device, pad=5), row_strided(rows, cols, dtype, device, pad=2)
    return [t.detach().requires_grad_() for t in (x, delta, weight, bias)], grads


def eager_add_layer_norm(x, delta, weight, bias):
    h = x + delta
    return h, eager_layer_norm(h, weight, bias)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(40, 72), (3, 1000)])
def test_layer_norm_backward(dtype, shape, backend, device):
    (x, delta, weight, bias), (grad_h, grad_y) = norm_grad_inputs(*shape, dtype, device, seed=10)

    got = torch.autograd.grad(torch.ops.qvl.layer_norm(x, weight, bias, 1e-6), (x, weight, bias), grad_y)
    assert_grads_within(got, eager_layer_norm, [x, weight, bias], [grad_y], "layer_norm grads")

    inputs, grads = [x, delta, weight, bias], [grad_h, grad_y]
    got = torch.autograd.grad(torch.ops.qvl.add_layer_norm(*inputs, 1e-6), inputs, grads)
    assert_grads_within(got, eager_add_layer_norm, inputs, grads, "add grads")


def test_backward_is_deterministic_and_takes_expanded_grads(backend, device):
    (x, _, weight, bias), _ = norm_grad_inputs(70, 40, torch.float32, device, seed=11)
    runs = [torch.autograd.grad(torch.ops.qvl.layer_norm(x, weight, bias).sum(), (x, weight, bias)) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def backward_opcheck_cases(device):
    (x, delta, weight, bias), (grad_h, grad_y) = norm_grad_inputs(24, 40, torch.float32, device, seed=12)
    detached = [t.detach() for t in (x, weight)]
    return {
        "layer_norm": (torch.ops.qvl.layer_norm.default, (x, weight, bias, 1e-6)),
        "add_layer_norm": (torch.ops.qvl.add_layer_norm.default, (x, delta, weight, bias, 1e-5)),
        "layer_norm_backward": (torch.ops.qvl.layer_norm_backward.default, (grad_y, *detached, 1e-6, None)),
        "layer_norm_backward_h": (torch.ops.qvl.layer_norm_backward.default, (grad_y, *detached, 1e-6, grad_h)),
    }


@pytest.mark.parametrize("case", ["layer_norm", "add_layer_norm", "layer_norm_backward", "layer_norm_backward_h"])
def test_opcheck_autograd(case, device):
    op, args = backward_opcheck_cases(device)[case]
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("path", ["default", "torch"])
def test_compile_forward_backward_no_recompile(path, device):
    """A block's norms, forward and backward, compiled whole: one graph serves every token count."""
    weight, bias = (t.requires_grad_() for t in norm_params(72, torch.float32, device))

    def norms(x, delta):
        h, y = torch.ops.qvl.add_layer_norm(x, delta, weight, bias, 1e-6)
        return (torch.ops.qvl.layer_norm(h, weight, bias, 1e-6) * y).sum()

    def norms_in_torch(x, delta):
        h, y = eager_add_layer_norm(x, delta, weight.to(x.dtype), bias.to(x.dtype))
        return (F.layer_norm(h, (72,), weight.to(x.dtype), bias.to(x.dtype), 1e-6) * y).sum()

    torch._dynamo.reset()
    compiled = torch.compile(norms, fullgraph=True, dynamic=True)
    context = force_backend("torch") if path == "torch" else contextlib.nullcontext()
    with context:
        for index, rows in enumerate((67, 101)):
            x, delta = (torch.randn(rows, 72, device=device, requires_grad=True) for _ in range(2))
            stance = torch.compiler.set_stance("fail_on_recompile") if index else contextlib.nullcontext()
            with stance:
                got = torch.autograd.grad(compiled(x, delta), (x, delta, weight, bias))
            inputs64 = [t.detach().double().requires_grad_() for t in (x, delta)]
            truth = torch.autograd.grad(norms_in_torch(*inputs64), (*inputs64, weight, bias))
            baseline = torch.autograd.grad(norms_in_torch(x, delta), (x, delta, weight, bias))
            # weight and bias gradients of the float64 run come back in fp32: compare against their float64 sums.
            truth = [t.double() for t in truth]
            assert_error_within(got, truth, baseline, ulps=4, what=f"{rows} rows")


# Guard bands (tests/guards.py): every float tensor the kernels read or write is a view inside a NaN-filled buffer,
# so a read past a tensor reaches a result and a write past one lands in a band. LayerNorm and RMSNorm share the
# kernels (norm_launches, norm_backward_launches) and are tested together here: 37 rows of 200 columns, a multiple
# of neither the row blocks nor the column tile.
GUARDED_NORMS = {
    # The eager computation in the inputs' dtype (the baseline); in float64, the truth.
    "layer_norm": eager_layer_norm,
    "rms_norm": eager_rms_norm,
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("norm", list(GUARDED_NORMS))
def test_guard_bands(norm, dtype, layout, device):
    eager, pads = GUARDED_NORMS[norm], layout_pads(layout, dtype)
    (x, delta, *params), grads = norm_grad_inputs(37, 200, dtype, device, seed=14)
    params = params[: 2 if norm == "layer_norm" else 1]
    x, delta, grad_h, grad_y, *params = (guarded(t.detach(), pad=next(pads)) for t in (x, delta, *grads, *params))
    y, h, y_of_h, dx, dh = (guarded_empty(x.shape, dtype, device, pad=next(pads)) for _ in range(5))
    param_grads = [[guarded_empty(x.shape[1:], dtype, device, pad=next(pads)) for _ in params] for _ in range(2)]
    partials = [guarded_empty(norm_partials(x, len(params)).shape, torch.float32, device, pad=0) for _ in range(2)]
    target = device_target(x.device)
    run_launches(
        norm_launches(x, None, None, params, y, 1e-6, target)
        + norm_launches(x, delta, h, params, y_of_h, 1e-6, target)
        + norm_backward_launches(grad_y, x, params[0], None, dx, partials[0], param_grads[0], 1e-6, target)
        + norm_backward_launches(grad_y, h, params[0], grad_h, dh, partials[1], param_grads[1], 1e-6, target),
        x.device,
    )
    assert_clean(x, delta, grad_h, grad_y, *params, y, h, y_of_h, dx, dh, *param_grads[0], *param_grads[1], *partials)

    params64 = [p.double() for p in params]
    assert_error_within(y, eager(x.double(), *params64), eager(x, *params), what=norm)
    assert torch.equal(h, x + delta)
    assert_error_within(y_of_h, eager(h.double(), *params64), eager(h, *params), what=f"{norm} of h = x + delta")
    assert_grads_within((dx, *param_grads[0]), eager, [x, *params], [grad_y], f"{norm} backward")
    assert_grads_within(
        (dh, *param_grads[1]),
        lambda h, *params: (h, eager(h, *params)),
        [h, *params],
        [grad_h, grad_y],
        f"{norm} backward with grad_h",
    )
