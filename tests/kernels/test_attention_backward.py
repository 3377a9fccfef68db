"""Autograd of torch.ops.qvl.vision_attn (with and without the fused rotary) against float64 autograd of the
reference, through Triton's interpreter; the forward's log-sum-exp only when a gradient is needed; opcheck
with its autograd checks; torch.compile of forward and backward without recompiles.

Shapes stay at one to two heads and 100-200 tokens: the interpreter runs each backward program one at a time.
"""

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_attention import cu_seqlens_of, packed_qkv
from torch.utils._python_dispatch import TorchDispatchMode

import qvl.kernels.attention as attention
from conftest import ON_GPU
from qvl.kernels import force_backend, verify
from qvl.kernels.attention import backward_launch_config
from qvl.kernels.common import INTERPRETER, device_target
from tolerance import assert_error_within


def gradients(fn, tensors, grad_out):
    """torch.autograd's gradients of ``fn(*tensors)`` for the output gradient ``grad_out``, on fresh leaves."""
    leaves = [t.detach().requires_grad_() for t in tensors]
    return torch.autograd.grad(fn(*leaves), leaves, grad_out)


def kernel_gradients(q, k, v, cu_seqlens, grad_out, max_seqlen=None, softmax_scale=None, positions=None):
    """dq, dk, dv of the op, taken through a packed qkv leaf as the tower's projection produces them (so
    the gradients of the three views also meet in one tensor)."""

    def attend(qkv):
        return torch.ops.qvl.vision_attn(*qkv.unbind(1), cu_seqlens, max_seqlen, softmax_scale, positions)

    (dqkv,) = gradients(attend, [torch.stack([q, k, v], dim=1)], grad_out)
    return dqkv.unbind(1)


def assert_gradients_close_to_float64(
    grads, q, k, v, cu_seqlens, grad_out, softmax_scale=None, positions=None, max_seqlen=None
):
    """The checks' rule (qvl.kernels.verify) for each of dq, dk, dv, per segment: the error against float64 autograd
    of the float64 truth is at most twice that of torch's own autograd in the same dtype (rotary first, as in the
    forward's tests), plus two ulps of the dtype at the gradient's scale and the online softmax's fp32 roundings for
    the shortest block the forward and backward kernels step through: the backward rebuilds every probability from
    the forward's log-sum-exp, so it inherits that sum's roundings. Where the gradient's terms cancel to (nearly)
    nothing (a one-token segment's dq and dk), those fp32 roundings count at the scale of the terms
    (:func:`qvl.kernels.verify.uncancelled_gradient_scales`)."""
    for grad in grads:
        assert grad.shape == q.shape and grad.dtype == q.dtype and torch.isfinite(grad).all()
    comparisons = verify.check_attention_gradients(
        grads, q, k, v, cu_seqlens, grad_out, device_target(q.device), max_seqlen, softmax_scale, positions
    )
    for comparison in comparisons:
        assert comparison.passed, comparison.message()


def inputs(lengths, num_heads, head_dim, dtype, seed, with_positions):
    q, k, v = packed_qkv(sum(lengths), num_heads, head_dim, dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    grad_out = torch.randn(q.shape, generator=gen).to(dtype)
    positions = torch.randint(0, 40, (sum(lengths), 2), generator=gen, dtype=torch.int32) if with_positions else None
    return q, k, v, cu_seqlens_of(lengths), grad_out, positions


@pytest.mark.parametrize("with_positions", [False, True], ids=["plain", "rope"])
@pytest.mark.parametrize("head_dim", [64, 72, 80])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gradients_match_float64(dtype, head_dim, with_positions):
    lengths = [37, 0, 100, 1] if with_positions else [65, 0, 17, 48]
    q, k, v, cu, grad_out, positions = inputs(lengths, 1, head_dim, dtype, head_dim, with_positions)
    grads = kernel_gradients(q, k, v, cu, grad_out, positions=positions)
    assert_gradients_close_to_float64(grads, q, k, v, cu, grad_out, positions=positions)


@settings(max_examples=4, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=0, max_value=50), min_size=1, max_size=4).filter(any),
    num_heads=st.sampled_from([1, 2]),
    head_dim=st.sampled_from([64, 72, 80]),
    with_positions=st.booleans(),
    seed=st.integers(0, 2**16),
)
# One token alone: dq and dk cancel to 0 exactly in float64 and in torch's backward, not in a flash backward.
@example(lengths=[1], num_heads=1, head_dim=64, with_positions=False, seed=0)
def test_random_layouts(lengths, num_heads, head_dim, with_positions, seed):
    q, k, v, cu, grad_out, positions = inputs(lengths, num_heads, head_dim, torch.float16, seed, with_positions)
    grads = kernel_gradients(q, k, v, cu, grad_out, positions=positions)
    assert_gradients_close_to_float64(grads, q, k, v, cu, grad_out, positions=positions)


@pytest.mark.parametrize("head_dim_layout", ["split", "split32"])
def test_window_tiles_and_softmax_scale(head_dim_layout, use_head_dim_layout):
    """The short-segment tiles a ``max_seqlen`` hint of 64 selects, and a softmax scale of the caller's, with either
    width of D 80's tail (16 or 32 columns)."""
    use_head_dim_layout(head_dim_layout)
    for hint, resident_rows in ((None, 128), (64, 64)):
        config = backward_launch_config(80, torch.float16, INTERPRETER, hint)
        assert config["dkdv"]["BLOCK_N"] == config["dq"]["BLOCK_M"] == resident_rows
        assert config["dq"]["D_TAIL"] == (16 if head_dim_layout == "split" else 32)
    lengths = [64, 30, 0, 64]
    q, k, v, cu, grad_out, positions = inputs(lengths, 1, 80, torch.float16, 5, True)
    grads = kernel_gradients(q, k, v, cu, grad_out, max_seqlen=64, softmax_scale=0.2, positions=positions)
    assert_gradients_close_to_float64(grads, q, k, v, cu, grad_out, 0.2, positions, max_seqlen=64)


def test_torch_path():
    lengths = [90, 0, 3, 120]
    q, k, v, cu, grad_out, positions = inputs(lengths, 2, 72, torch.float32, 9, True)
    with force_backend("torch"):
        grads = kernel_gradients(q, k, v, cu, grad_out, positions=positions)
    assert_gradients_close_to_float64(grads, q, k, v, cu, grad_out, positions=positions)


def test_forward_log_sum_exp():
    """The saved log-sum-exp against float64 (the rotary written from transformers', torch's logsumexp), by torch's
    own in fp32 (transformers' rotary in fp32, torch's logsumexp) with the online softmax's fp32 roundings; the
    training forward's output is bit-identical to the inference one."""
    lengths = [50, 0, 70]
    q, k, v, cu, _, positions = inputs(lengths, 2, 72, torch.float32, 3, True)

    def log_sum_exp(q, k):
        q, k = (x.transpose(0, 1) for x in (q, k))
        logits = [q[:, s:e] @ k[:, s:e].transpose(1, 2) * 72**-0.5 for s, e in verify.segment_bounds(cu)]
        return torch.cat([torch.logsumexp(x, -1) for x in logits], 1).flatten()

    truth = log_sum_exp(*verify.float64_rotary(q, k, positions))
    in_torch = log_sum_exp(*verify.rotary_in_fp32(q, k, positions))
    args = (q, k, v, cu, None, None, positions, 10000.0)
    out, lse = torch.ops.qvl.vision_attn_with_lse(*args)
    assert torch.equal(out, torch.ops.qvl.vision_attn(*args))
    assert lse.shape == (2 * 120,) and lse.dtype == torch.float32 and lse.is_contiguous()
    block_n = verify.key_block(72, torch.float32, device_target(q.device))
    logit = max(verify.max_abs_logits(q, k, cu, positions=positions))
    wide = verify.online_softmax_wide_ulps(max(lengths), block_n, logit)
    assert_error_within(lse, truth, in_torch, wide_ulps=wide, what="log-sum-exp")


class ForwardOps(TorchDispatchMode):
    """Records the qvl ops that run below autograd."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "qvl":
            self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_log_sum_exp_only_when_a_gradient_is_needed(monkeypatch):
    """Inference (no_grad, inference_mode, or no input requiring grad) runs vision_attn itself, whose kernel
    launch does not write the log-sum-exp; a forward that autograd records runs vision_attn_with_lse."""
    store_lse = []
    run_launches = attention.forward.run_launches

    def recording_run_launches(launches, device):
        store_lse.extend(launch.kwargs.get("STORE_LSE") for launch in launches)
        run_launches(launches, device)

    monkeypatch.setattr(attention.forward, "run_launches", recording_run_launches)
    q, k, v, cu, _, positions = inputs([20, 13], 1, 64, torch.float32, 1, True)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]

    def forward(*tensors):
        with ForwardOps() as recorded:
            out = torch.ops.qvl.vision_attn(*tensors, cu, positions=positions)
        return out, recorded.ops

    with torch.no_grad():
        no_grad, ops = forward(*leaves)
    assert ops == ["vision_attn.default"] and store_lse == [None, False]  # the rotary launch for k, then attention
    with torch.inference_mode():  # no dispatch mode sees below autograd here: the launch tells
        torch.ops.qvl.vision_attn(*leaves, cu, positions=positions)
    assert store_lse[-1] is False
    assert forward(q, k, v)[1] == ["vision_attn.default"]
    training, ops = forward(*leaves)
    assert ops == ["vision_attn_with_lse.default"] and store_lse[-1] is True and training.requires_grad
    assert torch.equal(training.detach(), no_grad)


def test_empty_batch_and_empty_segments():
    for lengths in ([], [0, 0]):
        q, k, v, cu, grad_out, _ = inputs(lengths, 2, 72, torch.float16, 0, False)
        for grad in kernel_gradients(q, k, v, cu, grad_out):
            assert grad.shape == (0, 2, 72)


def test_expanded_output_gradient():
    """``out.sum().backward()`` hands the backward an expanded gradient (stride 0 everywhere)."""
    q, k, v, cu, _, _ = inputs([40, 25], 2, 64, torch.float32, 2, False)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    torch.ops.qvl.vision_attn(*leaves, cu).sum().backward()
    ones = torch.ones(q.shape)
    assert_gradients_close_to_float64([x.grad for x in leaves], q, k, v, cu, ones)


def test_wide_offset_variant(monkeypatch, fresh_attention_plans):
    """The 64-bit in-batch offsets taken when T * stride can pass 2**31 give the same gradients."""
    q, k, v, cu, grad_out, positions = inputs([70, 0, 33], 2, 72, torch.float16, 21, True)
    narrow = kernel_gradients(q, k, v, cu, grad_out, positions=positions)
    monkeypatch.setattr(attention.config, "wide_token_offsets", lambda *args: True)
    monkeypatch.setattr(attention.backward, "needs_wide_offsets", lambda *args: True)
    attention.reload_tile_table()
    build, flags = attention.backward.vision_attn_backward_launches, []

    def recording(*args, **kwargs):
        launches = build(*args, **kwargs)
        flags.extend(launch.kwargs["WIDE_OFFSETS"] for launch in launches if "WIDE_OFFSETS" in launch.kwargs)
        return launches

    monkeypatch.setattr(attention.backward, "vision_attn_backward_launches", recording)
    wide = kernel_gradients(q, k, v, cu, grad_out, positions=positions)
    assert flags == [True, True]  # the dK/dV and dQ launches took the 64-bit offsets
    for a, b in zip(narrow, wide, strict=True):
        assert torch.equal(a, b)


def test_opcheck():
    """torch.library's own checks, autograd registration and AOT-dispatched backward included."""
    lengths = [12, 0, 9]
    q, k, v, cu, grad_out, positions = inputs(lengths, 2, 72, torch.float32, 4, True)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    args = (cu, 12, 0.25, positions, 100.0)
    torch.library.opcheck(torch.ops.qvl.vision_attn.default, (*leaves, *args))
    torch.library.opcheck(torch.ops.qvl.vision_attn_with_lse.default, (*leaves, *args))
    out, lse = torch.ops.qvl.vision_attn_with_lse(q, k, v, *args)
    torch.library.opcheck(torch.ops.qvl.vision_attn_backward.default, (grad_out, q, k, v, out, lse, *args))


def test_backward_needs_the_forwards_log_sum_exp():
    q, k, v, cu, grad_out, _ = inputs([5], 1, 64, torch.float32, 0, False)
    out = torch.ops.qvl.vision_attn(q, k, v, cu)
    backward = torch.ops.qvl.vision_attn_backward
    with pytest.raises(ValueError, match="lse must be 1-D"):
        backward(grad_out, q, k, v, out, torch.zeros(1, 5), cu, None, None, None, 10000.0)
    with pytest.raises(ValueError, match=r"lse must be a contiguous \(H \* T,\)"):
        backward(grad_out, q, k, v, out, torch.zeros(4), cu, None, None, None, 10000.0)


def test_compile_forward_and_backward_without_recompiles():
    """One compiled training step through both autograd formulas, vision_attn with the fused rotary and
    rotary_2d before a plain vision_attn, over batches of other sizes and layouts, with no recompile."""

    # One compiled step per formula: a compiled backward frees its saved buffers, so each output gets its own graph.
    def fused(qkv, cu_seqlens, positions):
        q, k, v = qkv.unbind(1)
        return torch.ops.qvl.vision_attn(q, k, v, cu_seqlens, positions=positions)

    def separate(qkv, cu_seqlens, positions):
        q, k, v = qkv.unbind(1)
        q_rot, k_rot = torch.ops.qvl.rotary_2d(q, k, positions)
        return torch.ops.qvl.vision_attn(q_rot, k_rot, v, cu_seqlens)

    steps = [torch.compile(step, fullgraph=True, dynamic=True) for step in (fused, separate)]

    def check(lengths, seed):
        q, k, v, cu, grad_out, positions = inputs(lengths, 2, 72, torch.float32, seed, True)
        for step in steps:
            qkv = torch.stack([q, k, v], dim=1).requires_grad_()
            (dqkv,) = torch.autograd.grad(step(qkv, cu, positions), qkv, grad_out)
            assert_gradients_close_to_float64(dqkv.unbind(1), q, k, v, cu, grad_out, positions=positions)

    check([30, 40, 50], seed=1)
    with torch.compiler.set_stance("fail_on_recompile"):
        check([7, 90, 0, 33, 1], seed=2)


@pytest.mark.parametrize("head_dim", [72, 80])
def test_bf16_through_the_interpreter(head_dim):
    """The towers' training dtype on CPU: bf16 dots through the interpreter (bf16 operands, fp32 accumulation, as
    a tensor core multiplies them), with rope, ragged segments and both head-dim tails."""
    q, k, v, cu, grad_out, positions = inputs([1, 40, 0, 17], 2, head_dim, torch.bfloat16, 31, True)
    grads = kernel_gradients(q, k, v, cu, grad_out, positions=positions)
    assert_gradients_close_to_float64(grads, q, k, v, cu, grad_out, positions=positions)


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("with_positions", [False, True], ids=["plain", "rope"])
@pytest.mark.parametrize("head_dim", [64, 72, 80])
@pytest.mark.parametrize("attention_case", [pytest.param(case, id=case.name) for case in verify.ATTENTION_CASES])
def test_bf16_on_gpu(attention_case, head_dim, with_positions):
    """The forward's GPU cases (qvl.kernels.verify.ATTENTION_CASES) through the backward, window tiles included."""
    lengths, hint = attention_case.lengths, attention_case.max_seqlen
    q, k, v, cu, grad_out, positions = inputs(lengths, 16, head_dim, torch.bfloat16, head_dim, with_positions)
    q, k, v, cu, grad_out = (x.cuda() for x in (q, k, v, cu, grad_out))
    positions = None if positions is None else positions.cuda()
    grads = kernel_gradients(q, k, v, cu, grad_out, hint, positions=positions)
    assert_gradients_close_to_float64(grads, q, k, v, cu, grad_out, positions=positions, max_seqlen=hint)


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (the interpreter cannot hold 2**31-element tensors here)")
def test_int64_offsets_past_2_pow_31_on_gpu():
    """A packed qkv whose token stride times token count passes 2**31 elements, in windows (cheap to
    compute, far to address): the last window's gradients depend on its own tokens only."""
    num_tokens, num_heads, head_dim, window = 700_000, 16, 72, 1000
    qkv = torch.randn(num_tokens, 3, num_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    assert num_tokens * qkv.stride(0) > 2**31
    cu = torch.arange(0, num_tokens + 1, window, dtype=torch.int32, device="cuda")
    grad_out = torch.randn(num_tokens, num_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    grads = kernel_gradients(*qkv.unbind(1), cu, grad_out)
    tail = slice(num_tokens - window, num_tokens)
    q, k, v = (x[tail] for x in qkv.unbind(1))
    last = [grad[tail] for grad in grads]
    assert_gradients_close_to_float64(last, q, k, v, cu_seqlens_of([window], "cuda"), grad_out[tail])


def spread_heads(num_tokens: int, num_heads: int, head_dim: int, head_stride: int, device, dtype):
    """q, k, v and an output gradient ``(T, H, D)``, random, as views of one buffer whose heads lie ``head_stride``
    elements apart (the four tensors' tokens side by side within each head's stretch)."""
    rows = num_tokens * head_dim
    assert 4 * rows <= head_stride
    buffer = torch.randn((num_heads - 1) * head_stride + 4 * rows, device=device, dtype=dtype)
    shape, strides = (num_tokens, num_heads, head_dim), (head_dim, head_stride, 1)
    return [buffer.as_strided(shape, strides, index * rows) for index in range(4)]


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (the interpreter cannot hold 2**31-element tensors here)")
def test_int64_head_offsets_past_2_pow_31_on_gpu():
    """q, k, v and the output gradient with heads 2**30 + 1024 elements apart, so that head 2 starts past 2**31
    while every stride fits in int32 (a stride past it would be passed as int64 and hide the product's width),
    with the rotary embedding: the rotation of k, the backward's delta and the rotation of the gradients back
    address every head in 64 bits. One 4.3 GB buffer holds all four."""
    num_tokens, num_heads, head_dim, head_stride = 3000, 3, 72, 2**30 + 1024
    q, k, v, grad_out = spread_heads(num_tokens, num_heads, head_dim, head_stride, "cuda", torch.bfloat16)
    assert (num_heads - 1) * head_stride > 2**31 > head_stride
    lengths = [1000, 1000, 1000]
    cu = cu_seqlens_of(lengths, "cuda")
    positions = torch.randint(0, 64, (num_tokens, 2), dtype=torch.int32, device="cuda")
    grads = gradients(lambda q, k, v: torch.ops.qvl.vision_attn(q, k, v, cu, positions=positions), [q, k, v], grad_out)
    assert_gradients_close_to_float64(grads, q, k, v, cu, grad_out, positions=positions)


def test_spread_heads_within_the_interpreter():
    """The layout of the test above at a head stride the interpreter holds (the test's own check): within the
    tolerance rule."""
    q, k, v, grad_out = spread_heads(40, 3, 72, 4 * 40 * 72 + 8, "cpu", torch.float32)
    cu = cu_seqlens_of([15, 25])
    positions = torch.randint(0, 30, (40, 2), dtype=torch.int32)
    grads = gradients(lambda q, k, v: torch.ops.qvl.vision_attn(q, k, v, cu, positions=positions), [q, k, v], grad_out)
    assert_gradients_close_to_float64(grads, q, k, v, cu, grad_out, positions=positions)
