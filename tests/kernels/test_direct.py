"""qvl.kernels.direct, the ops' bodies that eager inference on the Triton paths calls without the dispatcher: what
ops_for hands out where, the same bits and the same argument errors as the ops, and torch.compile or a dispatch
mode still seeing the ops."""

import pytest
import torch
from test_attention import cu_seqlens_of, packed_qkv
from torch._library.custom_ops import CustomOpDef
from torch._subclasses.fake_tensor import FakeTensorMode

from conftest import DEVICE, norm_params
from qvl.kernels import direct, force_backend, ops_for, torch_path
from qvl.kernels.common import TRITON_BACKENDS, backend_for

# The kernel tests' device: the Triton kernels compiled on a GPU, interpreted on a CPU.
TRITON_DEVICE = torch.device(DEVICE)
pytestmark = pytest.mark.skipif(
    backend_for(TRITON_DEVICE) not in TRITON_BACKENDS, reason="no Triton path here: a CPU needs TRITON_INTERPRET=1"
)


def test_every_op_has_its_body():
    """On the installed torch each name wraps the registered Python function, not the op (which would work,
    through the dispatcher, but save nothing)."""
    for name in direct.__all__:
        function = getattr(direct, name)
        assert not isinstance(function, CustomOpDef) and callable(function), name
        assert function.__wrapped__.__name__ == name, name
    # The layers call the same names whichever module ops_for hands them.
    assert set(direct.__all__) == set(torch_path.__all__) - {"ops_for", "vision_attn_sdpa"}


def test_ops_for_gives_the_bodies_to_eager_calls_only():
    for mode in (torch.no_grad, torch.inference_mode, torch.enable_grad):
        with mode():
            assert ops_for(TRITON_DEVICE) is direct, mode
    with torch.no_grad(), FakeTensorMode():
        assert ops_for(TRITON_DEVICE) is torch.ops.qvl
    with force_backend("reference"), torch.no_grad():
        assert ops_for(TRITON_DEVICE) is torch.ops.qvl
    with force_backend("torch"):
        with torch.no_grad():
            assert ops_for(TRITON_DEVICE) is torch_path
        with torch.enable_grad():
            assert ops_for(TRITON_DEVICE) is torch.ops.qvl


def test_calls_autograd_records_go_through_the_ops():
    """Grad mode on and an argument requiring grad: the op runs (its backward formula records the call), with the
    op's gradients bit for bit; grad mode on and nothing requiring grad: the body runs, and nothing is recorded."""
    torch.manual_seed(1)
    x = torch.randn(5, 24, device=DEVICE)
    weight, bias = norm_params(24, torch.float32, DEVICE)
    grad_y = torch.randn(5, 24, device=DEVICE)
    results = []
    for function in (direct.layer_norm, torch.ops.qvl.layer_norm):
        leaf = weight.clone().requires_grad_()
        y = function(x, leaf, bias, 1e-6)
        assert y.grad_fn is not None
        y.backward(grad_y)
        results.append((y.detach(), leaf.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    plain = direct.layer_norm(x, weight, bias, 1e-6)
    assert plain.grad_fn is None and torch.equal(plain, results[1][0])
    # The in-place ops refuse autograd through the direct call as through the op.
    with pytest.raises(RuntimeError, match="bias_gelu_ mutates its input"):
        direct.bias_gelu_(x.clone(), bias.clone().requires_grad_(), "none")


def test_bodies_equal_the_ops():
    """The same kernels on the same arguments: bit for bit, in-place ops included."""
    torch.manual_seed(0)
    x, delta = (torch.randn(9, 40, dtype=torch.float16, device=DEVICE) for _ in range(2))
    weight, bias = norm_params(40, torch.float16, DEVICE)
    lengths = [5, 0, 17, 1]
    q, k, v = packed_qkv(sum(lengths), 2, 24, torch.float16, DEVICE, seed=1)
    cu = cu_seqlens_of(lengths, DEVICE)
    positions = torch.randint(0, 9, (sum(lengths), 2), dtype=torch.int32, device=DEVICE)
    calls = {
        "layer_norm": (x, weight, bias, 1e-6),
        "add_layer_norm": (x, delta, weight, bias, 1e-6),
        "rms_norm": (x, weight, 1e-6),
        "bias_gelu": (x, bias, "tanh"),
        "bias_swiglu": (x, delta, bias, weight),
    }
    with torch.no_grad():
        for name, args in calls.items():
            torch.testing.assert_close(
                getattr(direct, name)(*args), getattr(torch.ops.qvl, name)(*args), rtol=0, atol=0
            )
        got = direct.vision_attn(q, k, v, cu, max_seqlen=17, positions=positions)
        torch.testing.assert_close(got, torch.ops.qvl.vision_attn(q, k, v, cu, 17, None, positions), rtol=0, atol=0)
        in_place, expected = x.clone(), x.clone()
        direct.bias_gelu_(in_place, bias, "none")
        torch.ops.qvl.bias_gelu_(expected, bias, "none")
        assert torch.equal(in_place, expected)


def test_bodies_check_their_arguments():
    """The op's checks are in its body: the direct call names the argument as the op does."""
    x = torch.randn(4, 8, device=DEVICE)
    weight, bias = norm_params(8, torch.float32, DEVICE)
    with torch.no_grad(), pytest.raises(ValueError, match="layer_norm: weight"):
        direct.layer_norm(x, weight[:4], bias, 1e-6)
    with torch.no_grad(), pytest.raises(TypeError, match="bias_gelu: bias"):
        direct.bias_gelu(x, bias.half(), "none")


def test_in_place_bodies_bump_the_version_as_the_ops_do():
    """A tensor autograd saved, overwritten in place by a body with grad mode on (nothing of the call itself
    requiring grad): the backward refuses, as it does after the op, instead of using the new values."""
    weight = torch.randn(8, device=DEVICE, requires_grad=True)
    bias = torch.randn(8, device=DEVICE)
    for in_place in (torch.ops.qvl.bias_gelu_, direct.bias_gelu_):
        x = torch.randn(4, 8, device=DEVICE)
        loss = (x * weight).sum()
        version = x._version
        in_place(x, bias, "none")
        assert x._version > version
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
    table = torch.randn(9, 8, device=DEVICE)
    hidden = torch.randn(4, 8, device=DEVICE)
    indices = torch.zeros(4, 4, dtype=torch.int32, device=DEVICE)
    weights = torch.full((4, 4), 0.25, device=DEVICE)
    version = hidden._version
    direct.pos_embed_interp_add_(hidden, table, interp_indices=indices, interp_weights=weights)
    assert hidden._version > version


def test_compiled_callers_see_the_ops():
    """Traced, ops_for's choice is the custom ops: a fullgraph compile of an inference step on the Triton path
    (which could not trace a body's launch) holds one graph and gives the eager bits."""
    weight, bias = norm_params(16, torch.float32, DEVICE)

    def step(x):
        ops = ops_for(x.device)
        return ops.bias_gelu(ops.layer_norm(x, weight, bias, 1e-6), bias, "none")

    x = torch.randn(6, 16, device=DEVICE)
    with torch.no_grad():
        compiled = torch.compile(step, fullgraph=True, backend="eager")
        assert torch.equal(compiled(x), step(x))
