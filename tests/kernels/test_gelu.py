"""torch.ops.qvl.bias_gelu / bias_gelu_ against float64 ground truth and eager torch in the same dtype.

Each op runs on its default path (the Triton interpreter on CPU, compiled Triton on a GPU) and on the
torch path (the ``backend`` fixture). Errors are held to the suite's rule (tolerance.py): at most twice
eager ``F.gelu(x + bias)``'s own error in the dtype, plus two units of the dtype's resolution at the
output's scale. Both sides call an erf or tanh whose accuracy depends on the machine's libm and SIMD
width, which is why the bound is relative to torch's error on the same machine.
"""

import pytest
import torch
import torch.nn.functional as F

from conftest import norm_params, row_strided
from qvl.kernels.gelu import bias_gelu_reference
from tolerance import assert_error_within

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


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_gelu(dtype, approximate, backend, device):
    torch.manual_seed(3)
    x, bias = gelu_inputs(96, 300, dtype, device)
    y = torch.ops.qvl.bias_gelu(x, bias, approximate)
    assert y.shape == x.shape and y.dtype == dtype and y.is_contiguous()
    truth = bias_gelu_reference(x.double(), bias.double(), approximate)
    # From |x + bias| = 40 on, erf and tanh are +-1 in fp32 (and in float64 the tail is below the smallest
    # subnormal), so gelu is exactly x + bias or 0. Held apart, these inputs (up to 1e4) also leave the
    # rule's eps at the scale of the other outputs.
    saturated = (x.float() + bias.float()).abs() >= 40
    assert torch.equal(y[saturated], truth[saturated].to(dtype))
    eager = F.gelu(x + bias, approximate=approximate)
    assert_error_within(y[~saturated], truth[~saturated], eager[~saturated], what="bias_gelu")


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
    _, bias = norm_params(72, torch.float32, device)
    assert torch.ops.qvl.bias_gelu(x, bias, "tanh").shape == (0, 72)


def opcheck_cases(device):
    torch.manual_seed(8)
    x = row_strided(24, 40, torch.float32, device)
    _, bias = norm_params(40, torch.float32, device)
    return {
        "bias_gelu_none": (torch.ops.qvl.bias_gelu.default, (x, bias, "none")),
        "bias_gelu_tanh": (torch.ops.qvl.bias_gelu.default, (x, bias, "tanh")),
        "bias_gelu_": (torch.ops.qvl.bias_gelu_.default, (x.clone(), bias, "tanh")),
    }


@pytest.mark.parametrize("case", ["bias_gelu_none", "bias_gelu_tanh", "bias_gelu_"])
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
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs(case, argument_check_inputs):
    call, error, match = BAD_INPUTS[case]
    with pytest.raises(error, match=match):
        call(**argument_check_inputs)
