"""The attention checks bite: deliberately wrong results fail the check that the GPU tests and ``qvl check`` use
(:class:`qvl.kernels.verify.AttentionProblem`), and right results pass it.

Each wrong result is a plausible misreading of the kernel's tiling, computed here in float64 from torch's attention
and rounded to the dtype, so it carries nothing wrong but its misreading: the keys of each segment's last partial
key block dropped (the failure of an earlier head-dim tiling on an H200: a segment shorter than a block is left
without keys, 0/0), the head-dim columns past the main tile ignored (for D 64, the last 16-column tile), the longest
segment's output zeroed, a segment's keys running one past its end, the rotary's row and column axes swapped; in the
backward, an offset of dq and of dk the size of the H200's backward failure (0.216 and 0.281, 2026-12-04), a zeroed
dv row of a ragged block's key, and the gradients of the dropped-block and swapped-axes misreadings.

Right results: at the GPU tests' inputs (16 heads, the sm_90 plan's key blocks), an online softmax written here in
torch (fp32 running max, sum and accumulator, probabilities rounded to the dtype for the value product, as the
kernel computes) and gradients computed in fp32 and rounded; at the interpreter's sizes (the CPU plan), the kernels
themselves, forward and backward, through Triton's interpreter.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from qvl.kernels import force_backend, verify
from qvl.kernels.common import HOPPER, INTERPRETER
from qvl.kernels.verify import ATTENTION_CASES, INTERPRETER_ATTENTION_CASES, AttentionProblem, segment_bounds

# The H200's recorded backward failure at D 80 (bench/results/diag-20261204/bwd.log): dq and dk this far from
# float64 where torch's own bf16 error was 0.004 and 0.006.
H200_DQ_ERROR, H200_DK_ERROR = 0.216, 0.281


def case(cases, name):
    (found,) = [c for c in cases if c.name == name]
    return found


def problem_inputs(lengths, num_heads, head_dim, rope, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(lengths)
    q, k, v, grad_out = torch.randn(4, num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, 40, (num_tokens, 2), generator=gen, dtype=torch.int32) if rope else None
    return q, k, v, verify.cu_seqlens_of(lengths), grad_out, positions


def passes(comparisons) -> bool:
    return all(c.passed for c in comparisons)


def failures(comparisons) -> str:
    return "; ".join(c.message() for c in comparisons if not c.passed)


def main_columns(head_dim: int) -> int:
    """The columns a head-dim tiling's main tile covers: the largest power of two below ``head_dim`` (for a power
    of two, all but its last 16 columns)."""
    power = 1 << (head_dim.bit_length() - 1)
    return power if power < head_dim else head_dim - 16


def own_segment(start, end):
    return range(start, end)


def without_ragged_block(block_n):
    """A segment's keys but those of its last partial block of ``block_n`` (a segment shorter than a block keeps
    none)."""
    return lambda start, end: range(start, start + (end - start) // block_n * block_n)


def one_key_past(num_tokens):
    """A segment's keys and the next segment's first."""
    return lambda start, end: range(start, min(end + 1, num_tokens))


def attend(q, k, v, cu_seqlens, positions=None, keys_of=own_segment, columns=None):
    """Attention of q, k (rotated at ``positions``) and v in float64 where the queries of segment ``[start, end)``
    attend to the keys ``keys_of(start, end)`` (token indices) over the first ``columns`` head-dim columns (all:
    None), at the whole head's softmax scale; rows with no key are 0/0 (NaN)."""
    if positions is not None:
        q, k = verify.float64_rotary(q, k, positions)
    q, k, v = q.double(), k.double(), v.double()
    scale = q.shape[-1] ** -0.5
    q, k = q[..., :columns], k[..., :columns]
    out = torch.full(v.shape, math.nan, dtype=torch.float64)
    for start, end in segment_bounds(cu_seqlens):
        keys = list(keys_of(start, end))
        if keys:
            rows, ks, vs = q[start:end].transpose(0, 1), k[keys].transpose(0, 1), v[keys].transpose(0, 1)
            out[start:end] = F.scaled_dot_product_attention(rows, ks, vs, scale=scale).transpose(0, 1)
    return out


def swapped_axes(positions):
    return None if positions is None else positions.flip(1).contiguous()


def longest_segment(cu_seqlens):
    return max(segment_bounds(cu_seqlens), key=lambda bounds: bounds[1] - bounds[0])


def forward_mutations(q, k, v, cu_seqlens, positions, block_n):
    """Wrong attention outputs by name, in float64 (rounded to the dtype where they are judged)."""
    num_tokens = q.shape[0]
    mutations = {
        "dropped ragged key block": attend(q, k, v, cu_seqlens, positions, without_ragged_block(block_n)),
        "keys one past the segment": attend(q, k, v, cu_seqlens, positions, one_key_past(num_tokens)),
        "head-dim tail ignored": attend(q, k, v, cu_seqlens, positions, columns=main_columns(q.shape[-1])),
    }
    zeroed = attend(q, k, v, cu_seqlens, positions)
    start, end = longest_segment(cu_seqlens)
    zeroed[start:end] = 0
    mutations["longest segment zeroed"] = zeroed
    if positions is not None:
        mutations["rotary axes swapped"] = attend(q, k, v, cu_seqlens, swapped_axes(positions))
    return mutations


def gradients_of(out_of, q, k, v, grad_out):
    """float64 autograd of ``out_of(q, k, v)`` for ``grad_out``."""
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    return list(torch.autograd.grad(out_of(*leaves), leaves, grad_out.double()))


def ragged_key(cu_seqlens, block_n):
    """A key in a partial key block: the last of the first segment of more than one token whose length is not a
    multiple of ``block_n``."""
    for start, end in segment_bounds(cu_seqlens):
        if end - start > 1 and (end - start) % block_n:
            return end - 1
    raise AssertionError("no segment with a ragged key block")


def backward_mutations(q, k, v, cu_seqlens, grad_out, positions, block_n):
    """Wrong gradients ``[dq, dk, dv]`` by name, in float64."""
    right = gradients_of(lambda *x: attend(*x, cu_seqlens, positions), q, k, v, grad_out)
    start, end = longest_segment(cu_seqlens)
    row = (start + end) // 2
    mutations = {}
    for name, index, offset in (("dq", 0, H200_DQ_ERROR), ("dk", 1, H200_DK_ERROR)):
        grads = [grad.clone() for grad in right]
        grads[index][row, 0, 0] += offset
        mutations[f"{name} off by the H200's failure"] = grads
    dq, dk, dv = (grad.clone() for grad in right)
    dv[ragged_key(cu_seqlens, block_n)] = 0
    mutations["zeroed dv row of a ragged key"] = [dq, dk, dv]
    mutations["dropped ragged key block"] = gradients_of(
        lambda *x: attend(*x, cu_seqlens, positions, without_ragged_block(block_n)), q, k, v, grad_out
    )
    if positions is not None:
        mutations["rotary axes swapped"] = gradients_of(
            lambda *x: attend(*x, cu_seqlens, swapped_axes(positions)), q, k, v, grad_out
        )
    return right, mutations


def online_softmax(q, k, v, cu_seqlens, block_n, positions=None):
    """A right attention in another arithmetic than the truth's and torch's: the kernel's online softmax written
    in torch, key block by key block of ``block_n``, with fp32 running max, sum and accumulator, the probabilities
    rounded to the dtype for the value product, q and k rotated in fp32 and rounded (as the kernel's rotary)."""
    if positions is not None:
        q, k = verify.rotary_in_fp32(q, k, positions)
    out = torch.zeros(q.shape, dtype=torch.float32)
    scale = q.shape[-1] ** -0.5 * math.log2(math.e)
    for start, end in segment_bounds(cu_seqlens):
        rows = q[start:end].float().transpose(0, 1)
        running_max = torch.full(rows.shape[:2], -math.inf)
        running_sum = torch.zeros(rows.shape[:2])
        acc = torch.zeros(rows.shape)
        for first in range(start, end, block_n):
            keys, values = (x[first : min(first + block_n, end)].float().transpose(0, 1) for x in (k, v))
            logits = rows @ keys.transpose(1, 2) * scale
            new_max = torch.maximum(running_max, logits.amax(-1))
            correction = torch.exp2(running_max - new_max)
            probs = torch.exp2(logits - new_max[..., None])
            running_sum = running_sum * correction + probs.sum(-1)
            acc = acc * correction[..., None] + probs.to(q.dtype).float() @ values
            running_max = new_max
        out[start:end] = (acc / running_sum[..., None]).transpose(0, 1)
    return out.to(q.dtype)


def fp32_gradients(q, k, v, cu_seqlens, grad_out, positions=None):
    """Right gradients in another arithmetic: torch's attention autograd in fp32, rounded to q's dtype."""
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
    out = verify.attention_baseline(*leaves, cu_seqlens, positions=positions)
    return [grad.to(q.dtype) for grad in torch.autograd.grad(out, leaves, grad_out.float())]


def assert_the_check_bites(check, cu_seqlens, right, exact, wrongs):
    """``right`` (tensors in the dtype) passes ``check``; each of ``wrongs`` (float64 tensors, by name) fails it,
    rounded to the dtype, in every segment where it differs from ``exact`` (the float64 right result it was made
    from): an error confined to one segment is caught in that segment."""
    comparisons = check(right)
    assert passes(comparisons), failures(comparisons)
    bounds = segment_bounds(cu_seqlens)
    dtype = right[0].dtype
    for name, wrong in wrongs.items():
        comparisons = check([x.to(dtype) for x in wrong])
        changed = [
            part * len(bounds) + index
            for part, (mutated, unmutated) in enumerate(zip(wrong, exact, strict=True))
            for index, (start, end) in enumerate(bounds)
            if not torch.equal(mutated[start:end], unmutated[start:end])
        ]
        assert changed, f"{name}: changes nothing"
        passed = [comparisons[i].message() for i in changed if comparisons[i].passed]
        assert not passed, f"{name} passes where it is wrong: {passed}"


ROPE = pytest.mark.parametrize("rope", [False, True], ids=["plain", "rope"])
HEAD_DIMS = pytest.mark.parametrize("head_dim", [64, 72, 80])


@ROPE
@HEAD_DIMS
@pytest.mark.parametrize("name", ["ragged", "windows"])
def test_the_gpu_check_fails_wrong_attention(name, head_dim, rope):
    """The GPU tests' cases (16 heads, bf16, the sm_90 plan's key blocks)."""
    lengths, hint = case(ATTENTION_CASES, name)[1:3]
    q, k, v, cu, grad_out, positions = problem_inputs(lengths, 16, head_dim, rope, seed=head_dim)
    problem = AttentionProblem(q, k, v, cu, HOPPER, hint, positions=positions, grad_out=grad_out)
    block_n = verify.key_block(head_dim, q.dtype, HOPPER, hint)
    right = online_softmax(q, k, v, cu, block_n, positions)
    wrongs = forward_mutations(q, k, v, cu, positions, block_n)
    exact = attend(q, k, v, cu, positions)
    assert_the_check_bites(lambda outs: problem.check(*outs), cu, [right], [exact], {n: [w] for n, w in wrongs.items()})


@ROPE
@HEAD_DIMS
def test_the_gpu_check_fails_wrong_gradients(head_dim, rope):
    """The GPU backward tests' case (the ragged one: 16 heads, bf16, the sm_90 plan's blocks)."""
    q, k, v, cu, grad_out, positions = problem_inputs(case(ATTENTION_CASES, "ragged").lengths, 16, head_dim, rope)
    problem = AttentionProblem(q, k, v, cu, HOPPER, positions=positions, grad_out=grad_out)
    block_n = verify.key_block(head_dim, q.dtype, HOPPER)
    exact, wrongs = backward_mutations(q, k, v, cu, grad_out, positions, block_n)
    right = fp32_gradients(q, k, v, cu, grad_out, positions)
    assert_the_check_bites(problem.check_gradients, cu, right, exact, wrongs)


@ROPE
@HEAD_DIMS
@pytest.mark.parametrize("name", ["ragged", "windows"])
def test_the_kernels_pass_and_wrong_results_fail_on_the_cpu_plan(name, head_dim, rope):
    """The interpreter's cases (2 heads, bf16) with the kernels' own results, forward and backward."""
    lengths, hint = case(INTERPRETER_ATTENTION_CASES, name)[1:3]
    q, k, v, cu, grad_out, positions = problem_inputs(lengths, 2, head_dim, rope, seed=head_dim + 1)
    problem = AttentionProblem(q, k, v, cu, INTERPRETER, hint, positions=positions, grad_out=grad_out)
    qkv = torch.stack([q, k, v], dim=1).requires_grad_()
    with force_backend("interpreter"):
        out = torch.ops.qvl.vision_attn(*qkv.unbind(1), cu, hint, positions=positions)
        (dqkv,) = torch.autograd.grad(out, qkv, grad_out)

    block_n = verify.key_block(head_dim, q.dtype, INTERPRETER, hint)
    wrongs = forward_mutations(q, k, v, cu, positions, block_n)
    exact = attend(q, k, v, cu, positions)
    forward = {name: [wrong] for name, wrong in wrongs.items()}
    assert_the_check_bites(lambda outs: problem.check(*outs), cu, [out.detach()], [exact], forward)
    block_n = verify.key_block(head_dim, q.dtype, INTERPRETER, hint, backward=True)
    exact, wrongs = backward_mutations(q, k, v, cu, grad_out, positions, block_n)
    assert_the_check_bites(problem.check_gradients, cu, list(dqkv.unbind(1)), exact, wrongs)


def test_a_failure_says_where_in_its_segment_the_error_sits():
    """A wrong result's message names the rows (from the segment's start), heads and head-dim columns that are off:
    here the last two rows of the 257-token segment in one head's tail columns, as a ragged block's tail tile would
    be; the segments it leaves alone pass."""
    q, k, v, cu, _, _ = problem_inputs(case(ATTENTION_CASES, "ragged").lengths, 16, 72, False)
    problem = AttentionProblem(q, k, v, cu, HOPPER)
    wrong = attend(q, k, v, cu, None)
    wrong[256:258, 3, 64:72] += 0.5
    comparisons = problem.check(wrong.to(q.dtype))
    assert [c.passed for c in comparisons] == [True, False, True, True]
    where = "(off at rows 255..256 of 257, heads 3 of 16, columns 64..71 of 72)"
    assert comparisons[1].message().startswith(f"attention [1:258) {where} (bfloat16): error")
    nan = attend(q, k, v, cu, None).to(q.dtype)
    nan[0, :, 5] = math.nan
    assert "(off at rows 0 of 1, heads 0..15 of 16, columns 5 of 72)" in problem.check(nan)[0].message()
    right = wrong[1:258]
    assert verify.where_wrong(right, right, 0.0) == "rows none of 257, heads none of 16, columns none of 72"
