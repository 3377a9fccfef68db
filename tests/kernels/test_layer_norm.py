"""torch.ops.qvl.layer_norm / add_layer_norm against float64 ground truth and eager torch in the same dtype.

Each op runs on its default path (the Triton interpreter on CPU, compiled Triton on a GPU) and on the
torch path (the ``backend`` fixture). Errors are held to the suite's rule (tolerance.py): at most twice
eager ``F.layer_norm``'s own error in the dtype, plus two units of the dtype's resolution at the output's
scale.
"""

import pytest
import torch
import torch.nn.functional as F

from conftest import norm_params, row_strided
from qvl.kernels.layer_norm import MAX_NORM_DIM, layer_norm_reference
from tolerance import assert_error_within, resolution

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


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
    eager = F.layer_norm(x, (cols,), weight, bias, 1e-6)
    assert_error_within(y, truth, eager, what="layer_norm")


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_layer_norm(dtype, backend, device):
    torch.manual_seed(1)
    x = row_strided(200, 72, dtype, device, scale=3.0)
    delta = row_strided(200, 72, dtype, device, pad=3)
    weight, bias = norm_params(72, dtype, device)
    h, y = torch.ops.qvl.add_layer_norm(x, delta, weight, bias, 1e-6)
    assert h.is_contiguous() and y.is_contiguous() and h.dtype == y.dtype == dtype

    if dtype == torch.bfloat16 and backend == "interpreter":
        # The add in fp32, then the interpreter rounds to bf16 toward zero where torch rounds to nearest: one ulp.
        torch.testing.assert_close(h, x + delta, rtol=resolution(dtype), atol=0)
    else:
        assert torch.equal(h, x + delta)
    # The norm is of the stored, rounded sum.
    truth = layer_norm_reference(h.double(), weight.double(), bias.double())
    assert_error_within(y, truth, F.layer_norm(h, (72,), weight, bias, 1e-6), what="add_layer_norm")


def test_add_layer_norm_normalizes_rounded_sum(backend, device):
    """fp16 near 1000 has a spacing of 0.5: rounding x + delta there changes the norm visibly, and the op
    must give eager ``norm(x + delta)``, not the norm of the exact sum."""
    torch.manual_seed(2)
    x = (1000.0 + torch.randn(64, 96, device=device)).half()
    delta = (0.3 * torch.randn(64, 96, device=device)).half()
    weight, bias = norm_params(96, torch.float16, device)
    _, y = torch.ops.qvl.add_layer_norm(x, delta, weight, bias, 1e-6)
    rounded_sum = x + delta
    truth = layer_norm_reference(rounded_sum.double(), weight.double(), bias.double())
    eager = F.layer_norm(rounded_sum, (96,), weight, bias, 1e-6)
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
