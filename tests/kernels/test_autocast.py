"""qvl's ops under ``torch.autocast``: each op casts its arguments as its rule says (qvl.kernels.autocast), the same
in eager calls and under torch.compile, with gradients reaching the inputs in their own dtypes.

The expected results are the ops called outside autocast on the arguments cast by hand as torch's own policy
would: the same op on the same values, so the comparisons are exact. What the ops compute is tested in each op's
own file; here only what autocast does to the calls.
"""

from __future__ import annotations

import pytest
import torch

from conftest import norm_params
from tolerance import assert_error_within

AUTOCAST_DTYPES = [torch.bfloat16, torch.float16]


def attention_inputs(device, dtype=torch.float32, rope=True):
    torch.manual_seed(0)
    q, k, v = (torch.randn(12, 2, 16, device=device, dtype=dtype) for _ in range(3))
    cu_seqlens = torch.tensor([0, 5, 12], dtype=torch.int32, device=device)
    positions = (
        torch.stack([torch.arange(12) // 4, torch.arange(12) % 4], dim=1).to(device, torch.int32) if rope else None
    )
    return q, k, v, cu_seqlens, positions


def interp_inputs(device):
    torch.manual_seed(1)
    table = torch.randn(16, 8, device=device)
    indices = torch.randint(0, 16, (6, 4), dtype=torch.int32, device=device)
    weights = torch.rand(6, 4, device=device)
    return table, indices, weights


def cases(device, low):
    """name -> (the call under autocast on fp32 weights and the activations autocast hands the op, the same call
    outside autocast on the arguments cast as the op's rule says). ``low`` is the autocast dtype."""
    torch.manual_seed(2)
    x32, delta32 = torch.randn(6, 8, device=device), torch.randn(6, 8, device=device)
    x, delta = x32.to(low), delta32.to(low)
    weight, bias = norm_params(8, torch.float32, device)
    ops = torch.ops.qvl
    q, k, v, cu_seqlens, positions = attention_inputs(device)
    table, indices, weights = interp_inputs(device)
    gate, up = torch.randn(6, 8, device=device), torch.randn(6, 8, device=device)
    qb, kb = q.to(low), k.to(low)

    def add_norm_16(norm, *params):
        total = x + delta
        return total, norm(total.float(), *params, 1e-6)

    return {
        # Norms in fp32, as torch.layer_norm on CUDA under autocast.
        "layer_norm": (lambda: ops.layer_norm(x, weight, bias, 1e-6), lambda: ops.layer_norm(x.float(), weight, bias)),
        "rms_norm": (lambda: ops.rms_norm(x, weight, 1e-6), lambda: ops.rms_norm(x.float(), weight)),
        # The residual add in the promoted dtype: an fp32 stream plus a 16-bit delta stays fp32...
        "add_layer_norm fp32 stream": (
            lambda: ops.add_layer_norm(x32, delta, weight, bias, 1e-6),
            lambda: ops.add_layer_norm(x32, delta.float(), weight, bias, 1e-6),
        ),
        "add_rms_norm fp32 stream": (
            lambda: ops.add_rms_norm(x32, delta, weight, 1e-6),
            lambda: ops.add_rms_norm(x32, delta.float(), weight, 1e-6),
        ),
        # ... a 16-bit stream stays 16-bit (as transformers' residual adds under autocast), its norm in fp32.
        "add_layer_norm 16-bit stream": (
            lambda: ops.add_layer_norm(x, delta, weight, bias, 1e-6),
            lambda: add_norm_16(ops.layer_norm, weight, bias),
        ),
        "add_rms_norm 16-bit stream": (
            lambda: ops.add_rms_norm(x, delta, weight, 1e-6),
            lambda: add_norm_16(ops.rms_norm, weight),
        ),
        # A linear's bias and activation in the autocast dtype, as F.linear's bias.
        "bias_gelu": (
            lambda: ops.bias_gelu(x32, bias, "tanh"),
            lambda: ops.bias_gelu(x32.to(low), bias.to(low), "tanh"),
        ),
        "bias_swiglu": (
            lambda: ops.bias_swiglu(gate, up, bias, weight),
            lambda: ops.bias_swiglu(gate.to(low), up.to(low), bias.to(low), weight.to(low)),
        ),
        # Attention in the autocast dtype, as scaled_dot_product_attention.
        "vision_attn": (
            lambda: ops.vision_attn(q, k, v, cu_seqlens, 7, None, positions),
            lambda: ops.vision_attn(q.to(low), k.to(low), v.to(low), cu_seqlens, 7, None, positions),
        ),
        "vision_attn_with_lse": (
            lambda: ops.vision_attn_with_lse(q, k, v, cu_seqlens, 7, None, positions, 10000.0),
            lambda: ops.vision_attn_with_lse(q.to(low), k.to(low), v.to(low), cu_seqlens, 7, None, positions, 10000.0),
        ),
        # Elementwise rotation and table blends: no cast.
        "rotary_2d": (lambda: ops.rotary_2d(qb, kb, positions), lambda: ops.rotary_2d(qb, kb, positions)),
        "pos_embed_interp": (
            lambda: ops.pos_embed_interp(table, indices, weights),
            lambda: ops.pos_embed_interp(table, indices, weights),
        ),
    }


CASE_NAMES = list(cases("cpu", torch.bfloat16))


def as_list(result) -> list[torch.Tensor]:
    return list(result) if isinstance(result, (tuple, list)) else [result]


def assert_same(got, expected, what: str) -> None:
    got, expected = as_list(got), as_list(expected)
    assert len(got) == len(expected), what
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert a.dtype == b.dtype, f"{what}[{i}]: {a.dtype}, expected {b.dtype}"
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{what}[{i}]")


@pytest.mark.parametrize("low", AUTOCAST_DTYPES)
@pytest.mark.parametrize("name", CASE_NAMES)
def test_each_op_casts_as_its_rule_says(name, low, device):
    call, expected = cases(device, low)[name]
    with torch.autocast(device, dtype=low):
        got = call()
    assert_same(got, expected(), f"{name} under {low} autocast")


@pytest.mark.parametrize("name", CASE_NAMES)
def test_compiled_calls_cast_as_eager_ones(name, device):
    """torch.compile traces through the same autocast kernels: the same dtypes and values as the eager call."""
    call, expected = cases(device, torch.bfloat16)[name]

    def under_autocast():
        with torch.autocast(device, dtype=torch.bfloat16):
            return call()

    torch._dynamo.reset()
    got = torch.compile(under_autocast, fullgraph=True, backend="aot_eager")()
    assert_same(got, expected(), f"compiled {name}")


def test_compiled_by_inductor_within_rounding():
    """The 16-bit stream's rule (a sum, then an fp32 norm) through Inductor's generated code: the same dtypes and the
    same stored sum; the norm within the rule of the eager call, since Inductor normalizes the sum before rounding it
    to bf16 (it keeps fused intermediates unrounded)."""
    torch.manual_seed(6)
    x, delta = (torch.randn(6, 8).bfloat16() for _ in range(2))
    weight, bias = norm_params(8, torch.float32, "cpu")

    def under_autocast():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return torch.ops.qvl.add_layer_norm(x, delta, weight, bias, 1e-6)

    expected = under_autocast()
    torch._dynamo.reset()
    got = torch.compile(under_autocast, fullgraph=True)()
    assert [t.dtype for t in got] == [t.dtype for t in expected] == [torch.bfloat16, torch.float32]
    assert_same(got[0], expected[0], "the sum")
    sum64 = x.double() + delta.double()
    truth = torch.nn.functional.layer_norm(sum64, (8,), weight.double(), bias.double(), 1e-6)
    assert_error_within(
        got[1],
        truth,
        expected[1],
        what="the norm under Inductor",
        ulps=0,
        wide_ulps=0,
        eps=2 * torch.finfo(torch.bfloat16).eps * truth.abs().max().item(),
    )


def test_in_place_op_keeps_the_written_dtype(device):
    """bias_gelu_ writes its 16-bit x in place: the fp32 bias is cast to x's dtype, x is never copied."""
    torch.manual_seed(3)
    x = torch.randn(6, 8, device=device).bfloat16()
    bias = torch.randn(8, device=device)
    expected = x.clone()
    torch.ops.qvl.bias_gelu_(expected, bias.bfloat16(), "none")
    with torch.autocast(device, dtype=torch.float16):
        torch.ops.qvl.bias_gelu_(x, bias, "none")
    assert_same(x, expected, "bias_gelu_")


def test_gradients_reach_fp32_leaves_through_the_casts(device):
    """A norm, the MLP's activation and the attention under bf16 autocast on fp32 leaves: each leaf's gradient is
    fp32 and the gradient of the hand-cast computation."""
    torch.manual_seed(4)
    weight, bias = (t.requires_grad_() for t in norm_params(32, torch.float32, device))
    q, k, v, cu_seqlens, positions = attention_inputs(device)
    x = q.flatten(1).bfloat16().requires_grad_()
    fc_bias = torch.randn(64, device=device, requires_grad=True)
    leaves = [x, weight, bias, fc_bias]

    def loss(cast):
        h = torch.ops.qvl.layer_norm(cast(x, torch.float32), cast(weight, torch.float32), cast(bias, torch.float32))
        a = h.to(torch.bfloat16).view(12, 2, 16)
        attended = torch.ops.qvl.vision_attn(a, a, a, cu_seqlens, 7, None, positions)
        act = torch.ops.qvl.bias_gelu(attended.flatten(1).repeat(1, 2), cast(fc_bias, torch.bfloat16), "tanh")
        return act.float().square().sum()

    with torch.autocast(device, dtype=torch.bfloat16):
        got = torch.autograd.grad(loss(lambda t, dtype: t), leaves)
    expected = torch.autograd.grad(loss(lambda t, dtype: t.to(dtype)), leaves)
    assert [g.dtype for g in got] == [leaf.dtype for leaf in leaves]
    assert_same(list(got), list(expected), "gradients")


def test_every_op_has_an_autocast_rule():
    """An op without a rule would fall through autocast, and torch ops inside its body would be autocast one by one."""
    names = [
        name for name in dir(torch.ops.qvl) if isinstance(getattr(torch.ops.qvl, name), torch._ops.OpOverloadPacket)
    ]
    assert "vision_attn" in names and len(names) >= 20
    for name in names:
        for key in ("AutocastCPU", "AutocastCUDA"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"qvl::{name}", key), f"qvl::{name} on {key}"


def test_backward_ops_compute_as_given_under_autocast(device):
    """A backward called under autocast (a loss.backward() inside the autocast region) is not cast."""
    torch.manual_seed(5)
    x = torch.randn(6, 8, device=device)
    grad = torch.randn(6, 8, device=device)
    weight, _ = norm_params(8, torch.float32, device)
    expected = torch.ops.qvl.layer_norm_backward(grad, x, weight, 1e-6)
    with torch.autocast(device, dtype=torch.bfloat16):
        got = torch.ops.qvl.layer_norm_backward(grad, x, weight, 1e-6)
    assert_same(got, expected, "layer_norm_backward")
