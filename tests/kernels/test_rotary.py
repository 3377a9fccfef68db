"""torch.ops.qvl.rotary_2d / rotary_2d_ against transformers' Qwen3-VL vision rotary embedding; rotary_2d's
backward against float64 autograd (its compiled backward: tests/kernels/test_attention_backward.py)."""

import contextlib

import pytest
import torch
from transformers import Qwen3VLVisionConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import (
    Qwen3VLVisionRotaryEmbedding,
    apply_rotary_pos_emb_vision,
)
from transformers.vision_utils import get_vision_position_ids

from conftest import float64_rotary
from guards import LAYOUTS, assert_clean, guarded, guarded_empty, layout_pads
from qvl.kernels import force_backend
from qvl.kernels.common import device_target, run_launches
from qvl.kernels.rotary import rotary_launches
from tolerance import assert_error_within

GRIDS = [[1, 2, 2], [1, 6, 10], [1, 50, 34], [2, 8, 8], [4, 16, 12]]


def transformers_rotary(q, k, positions, head_dim, rope_theta=10000.0, inverse=False):
    """q and k rotated by transformers' Qwen3-VL vision rotary, or with ``inverse`` by the opposite angles (sin
    negated: the rotation's inverse, which its backward applies)."""
    config = Qwen3VLVisionConfig(
        hidden_size=head_dim * q.shape[1], num_heads=q.shape[1], rope_parameters={"rope_theta": rope_theta}
    )
    cos, sin = Qwen3VLVisionRotaryEmbedding(config)(q, positions.long())
    return apply_rotary_pos_emb_vision(q, k, cos, -sin if inverse else sin)


def angle_ulps(positions, rotations=1):
    """The rule's fp32 allowance for the rotation angles (kernels and torch compute them in fp32, the truth in
    float64): an angle a = position * frequency (frequencies at most 1) is rounded, so cos and sin are off by up to
    a * eps / 2 each, and each output sums two such products at the output's scale: 2 * (1 + max position) fp32 ulps
    per rotation applied."""
    return 2 * rotations * (1 + int(positions.max()))


def grid_positions(grids):
    return get_vision_position_ids(torch.tensor(grids), 2).to(torch.int32)


@pytest.mark.parametrize("head_dim", [64, 72, 80])
def test_the_float64_truth_is_transformers_rotary(head_dim):
    """The suite's truth (conftest.float64_rotary, written apart from qvl's code) is transformers' rotary: they
    differ by fp32 roundings only, transformers computing in fp32. An angle of a rotates by cos and sin of its
    fp32 rounding, off by a * eps; each output sums two such products: the bound is 4 * eps * (1 + max a) * max |x|
    (a wrong angle, axis or half moves outputs by O(max |x|))."""
    positions = grid_positions(GRIDS)
    q, k = torch.randn(2, positions.shape[0], 2, head_dim).unbind(0)
    truth = float64_rotary(q, k, positions)
    expected = transformers_rotary(q, k, positions, head_dim)
    eps = torch.finfo(torch.float32).eps
    bound = 4 * eps * (1 + int(positions.max())) * max(float(q.abs().max()), float(k.abs().max()))
    for got, true in zip(expected, truth, strict=True):
        assert float((got.double() - true).abs().max()) <= bound


@pytest.mark.parametrize("head_dim", [64, 72, 80])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_transformers(head_dim, dtype):
    positions = grid_positions(GRIDS[:2] + GRIDS[3:])
    num_tokens = positions.shape[0]
    qkv = torch.randn(num_tokens, 3, 2, head_dim).to(dtype)
    q, k, _ = qkv.unbind(1)
    expected_q, expected_k = transformers_rotary(q, k, positions, head_dim)
    q_rot, k_rot = torch.ops.qvl.rotary_2d(q, k, positions)
    assert q_rot.is_contiguous() and q_rot.dtype == dtype
    assert_error_within(
        (q_rot, k_rot),
        float64_rotary(q, k, positions),
        (expected_q, expected_k),
        what="q, k",
        wide_ulps=angle_ulps(positions),
    )


def test_large_grid_and_theta():
    positions = grid_positions([GRIDS[2]])
    q, k = torch.randn(2, positions.shape[0], 1, 72).unbind(0)
    got = torch.ops.qvl.rotary_2d(q, k, positions, 500.0)
    in_transformers = transformers_rotary(q, k, positions, 72, 500.0)
    assert_error_within(
        got, float64_rotary(q, k, positions, 500.0), in_transformers, what="q, k", wide_ulps=angle_ulps(positions)
    )


def test_in_place_on_packed_qkv_views():
    positions = grid_positions([[1, 6, 10], [2, 4, 4]])
    qkv = torch.randn(positions.shape[0], 3, 2, 72, dtype=torch.float16)
    q, k, v = qkv.unbind(1)
    v_before = v.clone()
    expected_q, expected_k = torch.ops.qvl.rotary_2d(q, k, positions)
    torch.ops.qvl.rotary_2d_(q, k, positions)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    assert torch.equal(v, v_before)


def test_torch_path_matches_kernel():
    positions = grid_positions([[1, 6, 10]])
    q, k = torch.randn(2, positions.shape[0], 3, 80).unbind(0)
    kernel = torch.ops.qvl.rotary_2d(q, k, positions)
    with force_backend("torch"):
        reference = torch.ops.qvl.rotary_2d(q, k, positions)
        q_in_place, k_in_place = q.clone(), k.clone()
        torch.ops.qvl.rotary_2d_(q_in_place, k_in_place, positions)
    # Both paths within rounding of float64, by the same yardstick, hence of each other.
    truth, in_transformers = float64_rotary(q, k, positions), transformers_rotary(q, k, positions, 80)
    assert_error_within(kernel, truth, in_transformers, what="kernel", wide_ulps=angle_ulps(positions))
    assert_error_within(reference, truth, in_transformers, what="torch path", wide_ulps=angle_ulps(positions))
    torch.testing.assert_close(q_in_place, reference[0], rtol=0, atol=0)


def test_empty_batch():
    q = torch.empty(0, 2, 72)
    q_rot, k_rot = torch.ops.qvl.rotary_2d(q, q, torch.empty(0, 2, dtype=torch.int32))
    assert q_rot.shape == (0, 2, 72) and k_rot.shape == (0, 2, 72)


def test_opcheck():
    positions = grid_positions([[1, 4, 6]])
    q, k = torch.randn(2, positions.shape[0], 2, 72).unbind(0)
    torch.library.opcheck(torch.ops.qvl.rotary_2d.default, (q, k, positions))
    torch.library.opcheck(torch.ops.qvl.rotary_2d_.default, (q.clone(), k.clone(), positions, 100.0))


def test_compile_fullgraph_without_recompiles():
    def rotate(qkv, positions):
        q, k, _ = qkv.unbind(1)
        q_rot, k_rot = torch.ops.qvl.rotary_2d(q, k, positions)
        return q_rot + k_rot

    compiled = torch.compile(rotate, fullgraph=True, dynamic=True)

    def check(grids):
        positions = grid_positions(grids)
        qkv = torch.randn(positions.shape[0], 3, 2, 72)
        q, k, _ = qkv.unbind(1)
        in_transformers = sum(transformers_rotary(q, k, positions, 72))
        truth = sum(float64_rotary(q, k, positions))
        assert_error_within(
            compiled(qkv, positions),
            truth,
            in_transformers,
            what=f"compiled, grids {grids}",
            wide_ulps=angle_ulps(positions, 2),
        )

    check([[1, 4, 6]])
    with torch.compiler.set_stance("fail_on_recompile"):
        check([[2, 8, 8], [1, 2, 2]])
        check([[1, 6, 10]])


def rotary_gradients(rotate, q, k, positions, grad_q, grad_k):
    """torch.autograd's gradients of ``rotate(q, k, positions)`` for the output gradients, on fresh leaves."""
    leaves = [x.detach().requires_grad_() for x in (q, k)]
    return torch.autograd.grad(rotate(*leaves, positions), leaves, (grad_q, grad_k))


@pytest.mark.parametrize("head_dim", [64, 72, 80])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_backward_matches_float64(head_dim, dtype):
    """The gradients flow back through the inverse rotation: against float64 autograd of the rotary, with
    torch's own autograd of transformers' rotary in the same dtype as the yardstick."""
    positions = grid_positions([[1, 6, 10], [2, 4, 4]])
    q, k, grad_q, grad_k = torch.randn(4, positions.shape[0], 2, head_dim).to(dtype).unbind(0)
    got = rotary_gradients(torch.ops.qvl.rotary_2d, q, k, positions, grad_q, grad_k)
    truth = rotary_gradients(float64_rotary, q.double(), k.double(), positions, grad_q.double(), grad_k.double())
    in_transformers = rotary_gradients(
        lambda q, k, positions: transformers_rotary(q, k, positions, head_dim), q, k, positions, grad_q, grad_k
    )
    assert all(g.dtype == dtype and g.is_contiguous() for g in got)
    assert_error_within(got, truth, in_transformers, what="dq, dk", wide_ulps=angle_ulps(positions))


def test_backward_op_inverts_the_rotation_on_both_paths():
    positions = grid_positions([[1, 6, 10]])
    q, k = torch.randn(2, positions.shape[0], 3, 72).unbind(0)
    truth = (q.double(), k.double())
    in_transformers = transformers_rotary(*transformers_rotary(q, k, positions, 72), positions, 72, inverse=True)
    for path in ("interpreter", "torch"):
        with force_backend(path):
            back = torch.ops.qvl.rotary_2d_backward(*torch.ops.qvl.rotary_2d(q, k, positions), positions)
        assert_error_within(
            back, truth, in_transformers, what=f"rotated and back, {path}", wide_ulps=angle_ulps(positions, 2)
        )


def test_opcheck_with_autograd():
    positions = grid_positions([[1, 4, 6]])
    q, k = (x.requires_grad_() for x in torch.randn(2, positions.shape[0], 2, 72).unbind(0))
    torch.library.opcheck(torch.ops.qvl.rotary_2d.default, (q, k, positions, 500.0))
    torch.library.opcheck(torch.ops.qvl.rotary_2d_backward.default, (q.detach(), k.detach(), positions))


def test_in_place_refuses_autograd_before_mutating():
    positions = grid_positions([[1, 4, 6]])
    q, k = torch.randn(2, positions.shape[0], 2, 72).unbind(0)
    leaf = q.clone().requires_grad_()
    for q_in in (leaf, leaf * 1.0):
        before = q_in.detach().clone()
        with pytest.raises(RuntimeError, match=r"qvl::rotary_2d_ .* no backward .* torch\.ops\.qvl\.rotary_2d "):
            torch.ops.qvl.rotary_2d_(q_in, k.clone(), positions)
        assert torch.equal(q_in.detach(), before)
    expected = torch.ops.qvl.rotary_2d(q, k, positions)
    with torch.no_grad():  # no gradient needed: rotating a tensor that requires grad is fine
        torch.ops.qvl.rotary_2d_(leaf, k_in_place := k.clone(), positions)
    torch.ops.qvl.rotary_2d_(q_in_place := q.clone(), k.clone(), positions)  # grad mode on, nothing requires it
    assert torch.equal(leaf.detach(), expected[0]) and torch.equal(k_in_place, expected[1])
    assert torch.equal(q_in_place, expected[0])


def test_in_place_refuses_a_tensor_that_overlaps_itself():
    """q's two heads one head expanded: rotating each would rotate that memory twice. Refused on every path."""
    positions = torch.zeros(8, 2, dtype=torch.int32)
    q, k = torch.randn(8, 1, 72).expand(8, 2, 72), torch.randn(8, 2, 72)
    for path in ("torch", "reference", None):
        with force_backend(path) if path else contextlib.nullcontext():
            with pytest.raises(ValueError, match=r"rotary_2d_: q is written in place"):
                torch.ops.qvl.rotary_2d_(q, k, positions)


@pytest.mark.parametrize(
    "mutate, error, words",
    [
        (lambda a: {**a, "q": a["q"][0]}, ValueError, "q must be 3-D"),
        (lambda a: {**a, "k": a["k"][:, :1]}, ValueError, "k must have q's shape"),
        (lambda a: {**a, "k": a["k"].half()}, TypeError, "k must have q's dtype"),
        (lambda a: {**a, "q": a["q"].long()}, TypeError, "q must be one of"),
        (lambda a: {**a, "positions": a["positions"].long()}, TypeError, "positions must be one of"),
        (lambda a: {**a, "positions": a["positions"][:-1]}, ValueError, "positions must have shape"),
        (lambda a: {**a, "positions": -a["positions"] - 1}, ValueError, "positions must be non-negative"),
        (lambda a: {**a, "rope_theta": 1.0}, ValueError, "rope_theta"),
        (lambda a: {**a, "q": a["q"][..., :70], "k": a["k"][..., :70]}, ValueError, "divisible by 4"),
        (lambda a: {**a, "q": a["q"][..., :0], "k": a["k"][..., :0]}, ValueError, "positive head_dim"),
    ],
)
def test_bad_input(mutate, error, words):
    args = dict(q=torch.randn(8, 2, 72), k=torch.randn(8, 2, 72), positions=torch.zeros(8, 2, dtype=torch.int32))
    with pytest.raises(error, match=words):
        torch.ops.qvl.rotary_2d(**mutate(args))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_guard_bands(dtype, layout):
    """rotary_2d, rotary_2d_ and the backward's inverse rotation with q, k, their gradients and every output a view
    inside a NaN-filled buffer (tests/guards.py; a gap after each head), on 37 tokens (a whole and a ragged token
    block) of 3 heads of 72 dims (a ragged dim tile), down the aligned-strides path or the other one: results finite
    and within the suite's rule, nothing written outside a view."""
    torch.manual_seed(13)
    pads = layout_pads(layout, dtype)
    positions = torch.randint(0, 50, (37, 2), dtype=torch.int32)
    q, k, grad_q, grad_k = (guarded(t.to(dtype), pad=next(pads)) for t in torch.randn(4, 37, 3, 72))
    q_in_place, k_in_place = guarded(q, pad=next(pads)), guarded(k, pad=next(pads))
    q_rot, k_rot, dq, dk = (guarded_empty(q.shape, dtype, pad=next(pads)) for _ in range(4))
    target = device_target(q.device)
    launches = (
        rotary_launches(q, k, q_rot, k_rot, positions, 10000.0, target)
        + rotary_launches(q_in_place, k_in_place, q_in_place, k_in_place, positions, 10000.0, target)
        + rotary_launches(grad_q, grad_k, dq, dk, positions, 10000.0, target, inverse=True)
    )
    assert all(launch.kwargs["STRIDES_ALIGNED"] == (layout == "aligned") for launch in launches)
    run_launches(launches, q.device)
    assert_clean(q, k, grad_q, grad_k, q_in_place, k_in_place, q_rot, k_rot, dq, dk)

    truth, in_transformers = float64_rotary(q, k, positions), transformers_rotary(q, k, positions, 72)
    assert_error_within((q_rot, k_rot), truth, in_transformers, what="q, k", wide_ulps=angle_ulps(positions))
    assert torch.equal(q_in_place, q_rot) and torch.equal(k_in_place, k_rot)
    truth = rotary_gradients(float64_rotary, q.double(), k.double(), positions, grad_q.double(), grad_k.double())
    in_transformers = rotary_gradients(
        lambda q, k, positions: transformers_rotary(q, k, positions, 72), q, k, positions, grad_q, grad_k
    )
    assert_error_within((dq, dk), truth, in_transformers, what="dq, dk", wide_ulps=angle_ulps(positions))
