"""torch.ops.qvl.bias_swiglu against float64 ground truth, eager torch in the same dtype and transformers'
``Qwen2_5_VLMLP``.

Each op runs on its default path (the Triton interpreter on CPU, compiled Triton on a GPU) and on the
torch path (the ``backend`` fixture). Errors are held to the suite's rule (tolerance.py): at most twice
eager torch's (or the transformers module's) own error in the dtype, plus two units of the dtype's
resolution at the output's scale.
"""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLMLP

from conftest import row_strided
from guards import LAYOUTS, assert_clean, guarded, guarded_empty, layout_pads
from qvl.kernels import force_backend
from qvl.kernels.common import device_target, run_launches
from qvl.kernels.swiglu import bias_swiglu_backward_launches, bias_swiglu_launches
from qvl.kernels.tiles import epilogue_backward_config
from tolerance import assert_error_within, assert_grads_within
from towers import float64_copy

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# silu's exp2 overflows to inf for large negative inputs by design (the result is then -0); numpy, under
# the interpreter, warns about it.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")


# Gate values in silu's tails (where exp2 of -g overflows fp32, and where silu is the identity): row 0's first columns.
GATE_EXTREMES = (-1e4, -100.0, -40.0, -10.0, -0.01, 0.0, 5.0, 40.0, 1e4)


def swiglu_inputs(rows, cols, dtype, device, pad=(7, 3)):
    """Row-strided gate and up and their biases; gate's first row holds silu's tails (where exp2 of -g
    overflows fp32, and where silu is the identity)."""
    gate = row_strided(rows, cols, dtype, device, scale=3.0, pad=pad[0])
    up = row_strided(rows, cols, dtype, device, scale=2.0, pad=pad[1])
    extremes = torch.tensor(GATE_EXTREMES, device=device)
    gate[0, : extremes.numel()] = extremes.to(dtype)
    gate_bias = (0.5 * torch.randn(cols, device=device)).to(dtype)
    gate_bias[: extremes.numel()] = 0
    up_bias = (0.5 * torch.randn(cols, device=device)).to(dtype)
    return gate, up, gate_bias, up_bias


def eager_swiglu(gate, up, gate_bias, up_bias):
    """``silu(gate + gate_bias) * (up + up_bias)`` as eager torch computes it in the inputs' dtype; in float64, the
    truth."""
    return F.silu(gate + gate_bias) * (up + up_bias)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_swiglu(dtype, backend, device):
    torch.manual_seed(3)
    gate, up, gate_bias, up_bias = swiglu_inputs(96, 300, dtype, device)
    y = torch.ops.qvl.bias_swiglu(gate, up, gate_bias, up_bias)
    assert y.shape == gate.shape and y.dtype == dtype and y.is_contiguous()
    truth = eager_swiglu(gate.double(), up.double(), gate_bias.double(), up_bias.double())
    eager = eager_swiglu(gate, up, gate_bias, up_bias)
    # Outputs of gate = 1e4 and 40 are compared apart, so that their scale does not set the eps of the rest.
    large = (gate.float() + gate_bias.float()) >= 40
    assert_error_within(y[large], truth[large], eager[large], what="bias_swiglu, large gate")
    assert_error_within(y[~large], truth[~large], eager[~large], what="bias_swiglu")


@pytest.mark.parametrize("num_cols", [136, 140, 138])
def test_stacked_gemm_halves(num_cols, backend, device):
    """The two column halves of one (N, 2F) GEMM output (row stride 2F) and of one stacked bias give what two
    tensors give. F 136 keeps every half 16-byte aligned; 140 (as Qwen2.5-VL's 3,420) puts the up halves 8 bytes
    off, 138 4 bytes off: the kernel then takes them as aligned views and shifts back (kernels/tiles.aligned_view)."""
    torch.manual_seed(4)
    stacked = torch.randn(50, 2 * num_cols, device=device, dtype=torch.bfloat16)
    gate_bias, up_bias = torch.randn(2 * num_cols, device=device, dtype=torch.bfloat16).chunk(2)
    gate, up = stacked[:, :num_cols], stacked[:, num_cols:]
    y = torch.ops.qvl.bias_swiglu(gate, up, gate_bias, up_bias)
    assert torch.equal(y, torch.ops.qvl.bias_swiglu(gate.contiguous(), up.contiguous(), gate_bias, up_bias))
    assert torch.equal(y, torch.ops.qvl.bias_swiglu(gate, up, gate_bias.clone(), up_bias.clone()))
    before = stacked.clone()
    torch.ops.qvl.bias_swiglu(gate, up, gate_bias, up_bias)
    assert torch.equal(stacked, before)


@pytest.mark.parametrize("num_cols, vector, up_shift", [(136, 8, 0), (3420, 4, 4), (138, 2, 2), (137, 1, 1)])
def test_launches_move_rows_in_the_widest_vectors_the_layout_allows(num_cols, vector, up_shift):
    """The stacked bf16 layout's launch parameters: VEC elements divide F and every row stride (2F and F), and the
    up half and the up bias, which start F elements into their storage, are passed as views starting up_shift
    elements earlier, so that every pointer the kernel gets is 16-byte aligned (CPU storages start aligned)."""
    stacked = torch.empty(8, 2 * num_cols, dtype=torch.bfloat16)
    gate_bias, up_bias = torch.empty(2 * num_cols, dtype=torch.bfloat16).chunk(2)
    gate, up = stacked[:, :num_cols], stacked[:, num_cols:]
    y, grad_y = torch.empty(8, num_cols, dtype=torch.bfloat16), torch.empty(8, num_cols, dtype=torch.bfloat16)
    d_gate, d_up, partials = torch.empty_like(y), torch.empty_like(y), torch.empty(2, 1, num_cols)
    d_biases = torch.empty(2, num_cols, dtype=torch.bfloat16)
    target = device_target(gate.device)
    forward, *_ = bias_swiglu_launches(gate, up, gate_bias, up_bias, y, target)
    backward, _ = bias_swiglu_backward_launches(grad_y, gate, up, gate_bias, up_bias, d_gate, d_up, partials, *d_biases)
    for launch in (forward, backward):
        shifts = [launch.kwargs[f"SHIFT_{name}"] for name in ("GATE", "UP", "GATE_BIAS", "UP_BIAS")]
        assert (launch.kwargs["VEC"], shifts) == (vector, [0, up_shift, 0, up_shift])
        for name in ("Gate", "Up", "GateBias", "UpBias"):
            assert launch.args[name].data_ptr() % 16 == 0, name
        assert launch.args["Up"].data_ptr() + 2 * up_shift == up.data_ptr()


def tiny_mlp(dtype, device) -> Qwen2_5_VLMLP:
    """transformers' Qwen2.5-VL vision MLP (``bias=True`` as in its vision blocks, ``hidden_act="silu"``)
    with random weights and biases."""
    config = Qwen2_5_VLVisionConfig(hidden_size=72, intermediate_size=136, hidden_act="silu")
    mlp = Qwen2_5_VLMLP(config, bias=True)
    with torch.no_grad():
        for param in mlp.parameters():
            param.copy_(0.2 * torch.randn_like(param))
    return mlp.to(device=device, dtype=dtype).eval()


def qvl_mlp(mlp: Qwen2_5_VLMLP, x: torch.Tensor, stacked: bool) -> torch.Tensor:
    """``mlp``'s forward on qvl's op: bias-less gate and up GEMMs (or one over the stacked weights), the
    fused biases + SwiGLU, then down_proj."""
    if stacked:
        width = mlp.gate_proj.weight.shape[0]
        gate_up = x @ torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).t()
        gate, up = gate_up[:, :width], gate_up[:, width:]
    else:
        gate, up = x @ mlp.gate_proj.weight.t(), x @ mlp.up_proj.weight.t()
    h = torch.ops.qvl.bias_swiglu(gate, up, mlp.gate_proj.bias, mlp.up_proj.bias)
    return mlp.down_proj(h)


@pytest.mark.parametrize("stacked", [False, True], ids=["two_gemms", "stacked_gemm"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_transformers_mlp(dtype, stacked, backend, device):
    torch.manual_seed(5)
    mlp = tiny_mlp(dtype, device)
    x = torch.randn(120, 72, device=device).to(dtype)
    with torch.no_grad():
        got = qvl_mlp(mlp, x, stacked)
        truth, eager = float64_copy(mlp)(x.double()), mlp(x)
    assert_error_within(got, truth, eager, what="Qwen2_5_VLMLP on bias_swiglu")


def test_empty_rows(backend, device):
    x = torch.empty(0, 72, device=device)
    bias = torch.zeros(72, device=device)
    assert torch.ops.qvl.bias_swiglu(x, x, bias, bias).shape == (0, 72)


def test_zero_columns_backward(backend, device):
    gate, up = (torch.empty(4, 0, device=device, requires_grad=True) for _ in range(2))
    gate_bias, up_bias = (torch.empty(0, device=device, requires_grad=True) for _ in range(2))
    torch.ops.qvl.bias_swiglu(gate, up, gate_bias, up_bias).sum().backward()
    assert gate.grad.shape == up.grad.shape == (4, 0) and gate_bias.grad.shape == up_bias.grad.shape == (0,)


def test_opcheck(device):
    torch.manual_seed(8)
    gate, up, gate_bias, up_bias = swiglu_inputs(24, 40, torch.float32, device)
    torch.library.opcheck(torch.ops.qvl.bias_swiglu.default, (gate, up, gate_bias, up_bias))


@pytest.mark.parametrize("path", ["default", "torch"])
def test_compile_dynamic_rows_no_recompile(path, device):
    """The Qwen2.5-VL vision MLP on qvl's op, compiled whole: one graph serves every token count."""
    torch.manual_seed(9)
    mlp = tiny_mlp(torch.float32, device)
    mlp64 = float64_copy(mlp)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: qvl_mlp(mlp, x, stacked=True), fullgraph=True, dynamic=True)
    context = force_backend("torch") if path == "torch" else contextlib.nullcontext()
    with context, torch.no_grad():
        # Row counts unlike every other size in play, so duck sizing ties no symbol to them.
        for index, rows in enumerate((67, 101)):
            x = torch.randn(rows, 72, device=device)
            stance = torch.compiler.set_stance("fail_on_recompile") if index else contextlib.nullcontext()
            with stance:
                got = compiled(x)
            assert_error_within(got, mlp64(x.double()), mlp(x), what=f"{rows} rows")


SW = torch.ops.qvl.bias_swiglu
BAD_INPUTS = {
    "gate_1d": (lambda x, w, b: SW(x[0], x[0], b, b), ValueError, "bias_swiglu: gate must be 2-D"),
    "gate_float64": (lambda x, w, b: SW(x.double(), x.double(), b.double(), b.double()), TypeError, "gate must be one"),
    "gate_strided_cols": (lambda x, w, b: SW(x.t()[:8], x[:, :8], b[:8], b[:8]), ValueError, "gate must have a contig"),
    "up_strided_cols": (lambda x, w, b: SW(x[:, :8], x.t()[:8], b[:8], b[:8]), ValueError, "up must have a contig"),
    "up_shape": (lambda x, w, b: SW(x, x[:4], b, b), ValueError, "up must have gate's shape"),
    "up_dtype": (lambda x, w, b: SW(x, x.half(), b, b), TypeError, "up must have gate's dtype"),
    "gate_bias_len": (lambda x, w, b: SW(x, x, b[:8], b), ValueError, r"gate_bias must have shape \(F,\)"),
    "up_bias_len": (lambda x, w, b: SW(x, x, b, b[:8]), ValueError, r"up_bias must have shape \(F,\)"),
    "gate_bias_dtype": (lambda x, w, b: SW(x, x, b.half(), b), TypeError, "gate_bias must have gate's dtype"),
    "up_bias_2d": (lambda x, w, b: SW(x, x, b, b[None]), ValueError, "up_bias must be 1-D"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs(case, argument_check_inputs):
    call, error, match = BAD_INPUTS[case]
    with pytest.raises(error, match=match):
        call(**argument_check_inputs)


# Backward: gradients of all four inputs against float64 autograd of eager_swiglu, held to the suite's rule with
# torch's own autograd of it in the same dtype as the baseline.


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_swiglu_backward(dtype, backend, device):
    torch.manual_seed(10)
    inputs = [t.detach().requires_grad_() for t in swiglu_inputs(24, 300, dtype, device)]
    grad_y = row_strided(24, 300, dtype, device, pad=5)
    got = torch.autograd.grad(torch.ops.qvl.bias_swiglu(*inputs), inputs, grad_y)
    inputs64 = [t.detach().double().requires_grad_() for t in inputs]
    truth = torch.autograd.grad(eager_swiglu(*inputs64), inputs64, grad_y.double())
    baseline = torch.autograd.grad(eager_swiglu(*inputs), inputs, grad_y)
    # Row 0 holds gate = 1e4 (d_up = 1e4 * dy): compared apart, so that its scale does not set the rest's eps.
    for name, a, t, b in zip(("gate", "up"), got, truth, baseline):
        assert_error_within(a[1:], t[1:], b[1:], what=f"d_{name}")
        assert_error_within(a[0], t[0], b[0], what=f"d_{name} row 0")
    # The bias gradients of the extreme gates' columns sum row 0's large terms: compared apart as well.
    extreme, rest = slice(0, len(GATE_EXTREMES)), slice(len(GATE_EXTREMES), None)
    for name, a, t, b in zip(("gate_bias", "up_bias"), got[2:], truth[2:], baseline[2:]):
        assert_error_within(a[rest], t[rest], b[rest], what=f"d_{name}")
        assert_error_within(a[extreme], t[extreme], b[extreme], what=f"d_{name}, extreme gates' columns")


def test_opcheck_autograd(device):
    torch.manual_seed(11)
    inputs = [t.detach().requires_grad_() for t in swiglu_inputs(24, 40, torch.float32, device)]
    torch.library.opcheck(torch.ops.qvl.bias_swiglu.default, tuple(inputs))
    grad_y = torch.randn(24, 40, device=device)
    backward_args = (grad_y, *(t.detach() for t in inputs))
    torch.library.opcheck(torch.ops.qvl.bias_swiglu_backward.default, backward_args)


@pytest.mark.parametrize("path", ["default", "torch"])
def test_compile_forward_backward_no_recompile(path, device):
    """The MLP's SwiGLU, forward and backward, compiled whole: one graph serves every token count."""
    torch.manual_seed(12)
    gate_bias, up_bias = (torch.randn(72, device=device, requires_grad=True) for _ in range(2))

    def swiglu_sum(gate, up, eager=False):
        fn = eager_swiglu if eager else torch.ops.qvl.bias_swiglu
        return fn(gate, up, gate_bias.to(gate.dtype), up_bias.to(gate.dtype)).sum()

    torch._dynamo.reset()
    compiled = torch.compile(swiglu_sum, fullgraph=True, dynamic=True)
    context = force_backend("torch") if path == "torch" else contextlib.nullcontext()
    with context:
        for index, rows in enumerate((67, 101)):
            gate, up = (torch.randn(rows, 72, device=device, requires_grad=True) for _ in range(2))
            stance = torch.compiler.set_stance("fail_on_recompile") if index else contextlib.nullcontext()
            with stance:
                got = torch.autograd.grad(compiled(gate, up), (gate, up, gate_bias, up_bias))
            inputs64 = [t.detach().double().requires_grad_() for t in (gate, up)]
            truth = [
                t.double() for t in torch.autograd.grad(swiglu_sum(*inputs64, True), (*inputs64, gate_bias, up_bias))
            ]
            baseline = torch.autograd.grad(swiglu_sum(gate, up, True), (gate, up, gate_bias, up_bias))
            assert_error_within(got, truth, baseline, ulps=4, what=f"{rows} rows")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_guard_bands(dtype, layout, device):
    """bias_swiglu and its backward (the partial-sum reduction included) with every float tensor a view inside a
    NaN-filled buffer (tests/guards.py), on 37 rows of 1,100 columns (ragged row blocks, a whole and a ragged
    column block): results finite and within the suite's rule, nothing written outside a view."""
    torch.manual_seed(13)
    pads = layout_pads(layout, dtype)
    gate, up, grad_y = (guarded(row_strided(37, 1100, dtype, device, scale=s), pad=next(pads)) for s in (3.0, 2.0, 1.0))
    gate_bias, up_bias = (guarded((0.5 * torch.randn(1100, device=device)).to(dtype), pad=next(pads)) for _ in range(2))
    y, d_gate, d_up = (guarded_empty(gate.shape, dtype, device, pad=next(pads)) for _ in range(3))
    d_gate_bias, d_up_bias = (guarded_empty(gate_bias.shape, dtype, device, pad=next(pads)) for _ in range(2))
    target = device_target(gate.device)
    programs = epilogue_backward_config(*gate.shape)["programs"]
    partials = guarded_empty((2, programs, gate.shape[1]), torch.float32, device, pad=0)
    inputs = [gate, up, gate_bias, up_bias]
    grads = [d_gate, d_up, d_gate_bias, d_up_bias]
    run_launches(
        bias_swiglu_launches(*inputs, y, target)
        + bias_swiglu_backward_launches(grad_y, *inputs, d_gate, d_up, partials, d_gate_bias, d_up_bias),
        gate.device,
    )
    assert_clean(*inputs, grad_y, y, *grads, partials)

    assert_error_within(y, eager_swiglu(*(t.double() for t in inputs)), eager_swiglu(*inputs), what="bias_swiglu")
    assert_grads_within(grads, eager_swiglu, inputs, [grad_y], "bias_swiglu backward")
