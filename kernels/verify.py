"""What a right result of qvl's attention is, shared by the test suite and ``qvl check``: float64 truths written
from torch's own functions (not from qvl's references, so a misreading shared by a kernel and its reference cannot
pass), torch's own result in the same dtype as the baseline, the bound of :mod:`.tolerance` per segment, and the
layouts that computed wrong results on a GPU before, as named cases.

Per segment: each segment is its own attention problem with its own output scale (a one-token segment's output is
its value row, several times the scale of a long segment's average), so each is held to the rule on its own, and an
error confined to one segment (a dropped key block, a zeroed segment) is measured against that segment's rounding.

The kernel's online softmax keeps its running max, sum and accumulator in fp32 and rescales the accumulator once
per key block; those roundings are counted at fp32's resolution (:func:`online_softmax_wide_ulps`), the output
dtype's final rounding as :data:`~.tolerance.DEFAULT_ULPS` of the output dtype.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from triton.backends.compiler import GPUTarget

from .attention.config import backward_launch_config, launch_config
from .tolerance import DEFAULT_ULPS, Comparison, compare, default_eps

__all__ = [
    "ATTENTION_CASES",
    "INTERPRETER_ATTENTION_CASES",
    "AttentionCase",
    "AttentionProblem",
    "attention_baseline",
    "attention_comparisons",
    "attention_truth",
    "check_attention",
    "check_attention_gradients",
    "cu_seqlens_of",
    "float64_rotary",
    "key_block",
    "max_abs_logits",
    "online_softmax_wide_ulps",
    "rotary_in_fp32",
    "segment_bounds",
    "uncancelled_gradient_scales",
    "where_wrong",
]


class AttentionCase(NamedTuple):
    """A layout of segments (token counts, in order) and the ``max_seqlen`` hint the call passes (None: none), with
    why it is a case."""

    name: str
    lengths: tuple[int, ...]
    max_seqlen: int | None
    why: str


# The layouts that computed wrong results (or faulted) on an H200 with an earlier head-dim tiling (2026-12-04:
# bench/results/diag-20261204/), and the plain layouts beside them. At GPU sizes: 16 heads.
ATTENTION_CASES = (
    AttentionCase("ragged", (1, 257, 1024, 33), None, "segments ending inside key blocks (error 1.8 at D 80 before)"),
    AttentionCase("lone-33", (33,), None, "one segment shorter than a key block alone (NaN at D 72 before)"),
    AttentionCase("300", (300,), None, "one segment ending inside a key block (error 0.35 at D 72 before)"),
    AttentionCase("inside-blocks", (65, 129, 0, 200, 1, 130), None, "every segment ends inside a query tile"),
    AttentionCase("windows", (64, 48, 0, 16, 1, 37), 64, "window tiles, edge windows shorter than a key block"),
    AttentionCase("aligned", (1024, 256), None, "block multiples: no ragged block"),
)
# The same cases at the interpreter's sizes (2 heads): Triton's interpreter takes seconds per thousand tokens.
INTERPRETER_ATTENTION_CASES = (
    AttentionCase("ragged", (1, 65, 33, 0, 17), None, ATTENTION_CASES[0].why),
    AttentionCase("lone-33", (33,), None, ATTENTION_CASES[1].why),
    AttentionCase("300", (300,), None, ATTENTION_CASES[2].why),
    AttentionCase("windows", (64, 48, 0, 16, 1, 37), 64, ATTENTION_CASES[4].why),
    AttentionCase("aligned", (64, 128), None, ATTENTION_CASES[5].why),
)


def cu_seqlens_of(lengths: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """int32 ``cu_seqlens`` ``[0, l0, l0 + l1, ...]`` of segment ``lengths``."""
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def segment_bounds(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    """The non-empty segments' ``(start, end)`` token bounds (a host copy of ``cu_seqlens``)."""
    bounds = cu_seqlens.tolist()
    return [(start, end) for start, end in zip(bounds[:-1], bounds[1:]) if end > start]


def _rotary_angles(positions: torch.Tensor, half: int, rope_theta: float, dtype: torch.dtype) -> torch.Tensor:
    inv_freq = 1.0 / rope_theta ** (torch.arange(0, half, 2, dtype=dtype, device=positions.device) / half)
    angles = (positions.to(dtype)[..., None] * inv_freq).flatten(1)  # (T, half): row angles, then column angles
    return torch.cat([angles, angles], dim=-1)[:, None, :]


def _rotate(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * angles.cos() + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * angles.sin()


def float64_rotary(q, k, positions, rope_theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-VL's 2D rotary of q and k entirely in float64: the ground truth of the rotary and attention checks.

    Written from transformers' Qwen3-VL vision code (``Qwen3VLVisionRotaryEmbedding`` over head_dim / 2 with inverse
    frequencies ``theta ** (-2i / (head_dim / 2))``, each token's row angles then its column angles, the whole
    repeated twice, and ``apply_rotary_pos_emb_vision``'s rotate-half), not from qvl's kernels or reference (the
    suite checks it against transformers' own module). Inverse frequencies in float64 too: transformers and the
    kernels compute them in fp32, a rounding of each implementation the truth must not share with one of them."""
    angles = _rotary_angles(positions, q.shape[-1] // 2, rope_theta, torch.float64)
    return _rotate(q.double(), angles), _rotate(k.double(), angles)


def rotary_in_fp32(q, k, positions, rope_theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rotary as transformers computes it whatever the model's dtype (frequencies, angles and the rotation
    in fp32), rounded to q's dtype: the baseline's rotary."""
    angles = _rotary_angles(positions, q.shape[-1] // 2, rope_theta, torch.float32)
    return _rotate(q.float(), angles).to(q.dtype), _rotate(k.float(), angles).to(k.dtype)


# Query rows per float64 attention call: bounds the truth's logits to 4,096 x segment length per head.
_TRUTH_ROWS = 4096


def _sdpa_segments(q, k, v, cu_seqlens, scale: float) -> torch.Tensor:
    """torch's ``scaled_dot_product_attention`` over each segment of ``(T, H, D)`` q, k, v, in their dtype."""
    out = torch.zeros_like(q)
    for start, end in segment_bounds(cu_seqlens):
        keys, values = (x[start:end].transpose(0, 1) for x in (k, v))
        for first in range(start, end, _TRUTH_ROWS):
            last = min(first + _TRUTH_ROWS, end)
            rows = F.scaled_dot_product_attention(q[first:last].transpose(0, 1), keys, values, scale=scale)
            out[first:last] = rows.transpose(0, 1)
    return out


def _scale(head_dim: int, softmax_scale: float | None) -> float:
    return head_dim**-0.5 if softmax_scale is None else softmax_scale


def attention_truth(q, k, v, cu_seqlens, softmax_scale=None, positions=None, rope_theta: float = 10000.0):
    """The rotary (given ``positions``) and varlen attention of ``(T, H, D)`` q, k, v entirely in float64, from
    torch's own attention per segment (empty segments, and so rows of none, are zeros)."""
    if positions is not None:
        q, k = float64_rotary(q, k, positions, rope_theta)
    return _sdpa_segments(q.double(), k.double(), v.double(), cu_seqlens, _scale(q.shape[-1], softmax_scale))


def attention_baseline(q, k, v, cu_seqlens, softmax_scale=None, positions=None, rope_theta: float = 10000.0):
    """What torch itself computes in q's dtype: the rotary as transformers computes it (:func:`rotary_in_fp32`),
    then torch's ``scaled_dot_product_attention`` per segment in the dtype (its fused kernels, as a user calls
    them)."""
    if positions is not None:
        q, k = rotary_in_fp32(q, k, positions, rope_theta)
    return _sdpa_segments(q, k, v, cu_seqlens, _scale(q.shape[-1], softmax_scale))


def max_abs_logits(q, k, cu_seqlens, softmax_scale=None, positions=None, rope_theta: float = 10000.0) -> list[float]:
    """Each non-empty segment's largest ``|q.k| * scale`` (after the rotary), in float64."""
    scale = _scale(q.shape[-1], softmax_scale)
    if positions is not None:
        q, k = float64_rotary(q, k, positions, rope_theta)
    found = []
    for start, end in segment_bounds(cu_seqlens):
        keys = k[start:end].double().transpose(0, 1)
        largest = 0.0
        for first in range(start, end, _TRUTH_ROWS):
            rows = q[first : min(first + _TRUTH_ROWS, end)].double().transpose(0, 1)
            largest = max(largest, float((rows @ keys.transpose(1, 2)).abs().max()) * scale)
        found.append(largest)
    return found


def online_softmax_wide_ulps(length: int, block_n: int, max_abs_logit: float) -> int:
    """The fp32 roundings an online softmax over key blocks of ``block_n`` makes in sequence on a segment of
    ``length`` tokens, for scaled logits of at most ``max_abs_logit``, in fp32 ulps at the output's scale:

    * it rescales its output accumulator once per key block after the first, ``acc * exp2(m_old - m_new)``: one
      rounding at the output's scale per block;
    * it folds log2(e) into the scale, ``exp2(q.k * scale * log2(e) - m)``: one more rounding of the exponent's
      argument, at the argument's own scale, up to ``max_abs_logit * log2(e)``; an error of ``d`` in the argument
      is a relative error of ``d`` in every probability, so in the output;
    * two for the final division by the row sum and its own accumulation.
    """
    return -(-length // block_n) + math.ceil(max_abs_logit * math.log2(math.e)) + 2


def key_block(
    head_dim: int, dtype: torch.dtype, target: GPUTarget, max_seqlen: int | None = None, backward: bool = False
) -> int:
    """The shortest block of keys (or, in the backward's dK/dV kernel, of queries) a kernel's accumulation steps
    through for a launch of ``head_dim`` in ``dtype`` on ``target`` with the ``max_seqlen`` hint: the forward's
    ``BLOCK_N``; with ``backward``, also the backward kernels' (whose probabilities come from the forward's
    log-sum-exp, so inherit its roundings too)."""
    blocks = [launch_config(head_dim, dtype, target, max_seqlen)["BLOCK_N"]]
    if backward:
        configs = backward_launch_config(head_dim, dtype, target, max_seqlen)
        blocks += [configs["dq"]["BLOCK_N"], configs["dkdv"]["BLOCK_M"]]
    return min(blocks)


def attention_comparisons(
    out: torch.Tensor,
    truth: torch.Tensor,
    baseline: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_n: int,
    logits: Sequence[float],
    what: str = "attention",
    terms: torch.Tensor | None = None,
    term_ulps: int = 0,
) -> list[Comparison]:
    """The rule (:func:`~.tolerance.compare`) applied to each non-empty segment of ``out`` (or of any ``(T, H, D)``
    attention result: the gradients too) on its own: its own scale, torch's own error on it, and ``eps`` of
    :data:`~.tolerance.DEFAULT_ULPS` of the dtype plus :func:`online_softmax_wide_ulps` fp32 ulps for its length,
    ``block_n`` (the kernel's key block) and its largest scaled logit (``logits``, from :func:`max_abs_logits`).
    The fp32 ulps, and ``term_ulps`` more, count at the larger of the segment's scale and that of ``terms``, the
    magnitude of the result's terms before they cancel (:func:`uncancelled_gradient_scales`; None: the result's
    own; :func:`~.tolerance.default_eps`)."""
    comparisons = []
    for (start, end), logit in zip(segment_bounds(cu_seqlens), logits, strict=True):
        part = slice(start, end)
        wide = online_softmax_wide_ulps(end - start, block_n, logit) + term_ulps
        eps = default_eps(out.dtype, truth[part], DEFAULT_ULPS, wide, None if terms is None else terms[part])
        comparison = compare(out[part], truth[part], baseline[part], eps=eps, what=f"{what} [{start}:{end})")
        if not comparison.passed and comparison.baseline_agrees:
            where = where_wrong(out[part], truth[part], comparison.bound)
            comparison = comparison._replace(what=f"{comparison.what} (off at {where})")
        comparisons.append(comparison)
    return comparisons


def where_wrong(result: torch.Tensor, truth: torch.Tensor, bound: float) -> str:
    """Where a segment's ``(L, H, D)`` ``result`` is further than ``bound`` from its float64 ``truth`` (NaN is): the
    rows (counted from the segment's first token), heads and head-dim columns that hold such an error, as index
    ranges. What tells a kernel's failures apart: a ragged block's rows, a tile's columns, one head."""
    off = ~((result.double() - truth).abs() <= bound)
    length, heads, head_dim = off.shape
    return (
        f"rows {_index_ranges(off.any(2).any(1))} of {length}, heads {_index_ranges(off.any(2).any(0))} of {heads},"
        f" columns {_index_ranges(off.any(0).any(0))} of {head_dim}"
    )


def _index_ranges(mask: torch.Tensor, most: int = 6) -> str:
    """The true indices of a 1-D ``mask`` as ranges, ``"0..3, 8, 64..71"``; beyond ``most`` ranges, their count."""
    spans: list[list[int]] = []
    for index in mask.nonzero().flatten().tolist():
        if spans and spans[-1][1] == index - 1:
            spans[-1][1] = index
        else:
            spans.append([index, index])
    text = ", ".join(f"{a}" if a == b else f"{a}..{b}" for a, b in spans[:most])
    return text + (f", ... ({len(spans)} ranges)" if len(spans) > most else "") if spans else "none"


def uncancelled_gradient_scales(q, k, v, cu_seqlens, grad_out, softmax_scale=None, positions=None, rope_theta=10000.0):
    """The scale of each of dq, dk, dv before its terms cancel, in float64, from the inputs alone: what each gradient
    would be if every term of every sum in it added with one sign, ``P * (|dO| |v|^T + rowsum(|dO| * |out|))`` in
    place of ``dS = P * (dP - delta)`` (``dP = dO v^T``, ``delta = rowsum(dO * out)``) and absolute values of the
    operands of the products with q, k and dO; with positions, of the rotated q and k (the gradients before the
    rotation back).

    ``dP - delta`` cancels exactly for a one-token segment: its dq and dk are 0 in float64 and in torch's one-pass
    softmax backward, so the rule's bound is 0 there. A kernel that computes ``delta`` from the stored output, as
    flash attention's backward does, sums the same products as ``dP`` in another order, in its fp32 accumulators,
    and leaves a few fp32 roundings at the scale of those products instead: of ``|dO| . |v|``, not of ``|dO . v|``,
    which cancels over the head dim in its turn (a one-token segment's ``dO . v`` can be a tenth of its terms: the
    bound went with it, and whether the two orders round alike is the BLAS's and the SIMD width's to decide)."""
    scale = _scale(q.shape[-1], softmax_scale)
    if positions is not None:
        q, k = float64_rotary(q, k, positions, rope_theta)
    q, k, v, grad_out = (x.double() for x in (q, k, v, grad_out))
    scales = [torch.zeros_like(q) for _ in range(3)]
    for start, end in segment_bounds(cu_seqlens):
        qs, ks, vs, dos = (x[start:end].transpose(0, 1) for x in (q, k, v, grad_out))
        probs = torch.softmax((qs @ ks.transpose(1, 2)) * scale, dim=-1)
        d_probs = dos.abs() @ vs.abs().transpose(1, 2)
        delta = (dos.abs() * (probs @ vs).abs()).sum(-1, keepdim=True)
        d_logits = probs * (d_probs + delta) * scale
        segment = (d_logits @ ks.abs(), d_logits.transpose(1, 2) @ qs.abs(), probs.transpose(1, 2) @ dos.abs())
        for whole, part in zip(scales, segment):
            whole[start:end] = part.transpose(0, 1)
    return scales


class AttentionProblem:
    """One attention problem (``(T, H, D)`` q, k, v, ``cu_seqlens``, optionally rotary ``positions`` and the
    output gradient ``grad_out``) as a launch for ``target`` with the ``max_seqlen`` hint tiles it, and what a right
    result of it is: the float64 truths, torch's own results in the dtype and the bounds, each computed once (the
    gradients' on first use), so that many results can be judged against them (qvl check's variants, the tests'
    deliberately wrong results). The tests and ``qvl check`` judge by :meth:`check` and :meth:`check_gradients`."""

    def __init__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        target: GPUTarget,
        max_seqlen: int | None = None,
        softmax_scale: float | None = None,
        positions: torch.Tensor | None = None,
        rope_theta: float = 10000.0,
        grad_out: torch.Tensor | None = None,
    ):
        self.inputs = (q, k, v, cu_seqlens)
        self.options = (softmax_scale, positions, rope_theta)
        self.target, self.max_seqlen, self.grad_out = target, max_seqlen, grad_out
        self.logits = max_abs_logits(q, k, cu_seqlens, *self.options)
        self.truth = attention_truth(*self.inputs, *self.options)
        self.baseline = attention_baseline(*self.inputs, *self.options)
        self._gradients = None

    def check(self, out: torch.Tensor, block_n: int | None = None) -> list[Comparison]:
        """:func:`attention_comparisons` of ``out``, with the key block ``block_n`` of the launch that computed it
        (None: that of the tiles the launch takes by default; the tile sweep's candidates have their own)."""
        q, cu_seqlens = self.inputs[0], self.inputs[3]
        if block_n is None:
            block_n = key_block(q.shape[-1], q.dtype, self.target, self.max_seqlen)
        return attention_comparisons(out, self.truth, self.baseline, cu_seqlens, block_n, self.logits)

    def check_gradients(self, grads: Sequence[torch.Tensor]) -> list[Comparison]:
        """The rule for ``grads = (dq, dk, dv)`` (each per segment): against float64 autograd through
        :func:`attention_truth`, with torch's own autograd through :func:`attention_baseline` in the dtype as the
        baseline, and the fp32 roundings of the shortest block the forward's and the backward's kernels step
        through (the backward rebuilds every probability from the forward's log-sum-exp). ``dS = P * (dP - delta)``
        cancels two sums over the head dim (``dP = dO . v`` and ``delta = dO . out``), each rounded up to
        ``log2(head_dim)`` times in a pairwise or tensor-core sum: those fp32 roundings count too, at the scale of
        the terms before they cancel (:func:`uncancelled_gradient_scales`)."""
        q, cu_seqlens = self.inputs[0], self.inputs[3]
        if self.grad_out is None:
            raise ValueError("AttentionProblem: check_gradients needs the problem's grad_out")
        if self._gradients is None:
            self._gradients = self._reference_gradients()
        block = key_block(q.shape[-1], q.dtype, self.target, self.max_seqlen, backward=True)
        head_dim_sums = 2 * math.ceil(math.log2(q.shape[-1]))
        comparisons = []
        for name, got, (expected, baseline, terms) in zip(("dq", "dk", "dv"), grads, self._gradients, strict=True):
            comparisons += attention_comparisons(
                got, expected, baseline, cu_seqlens, block, self.logits, name, terms, head_dim_sums
            )
        return comparisons

    def _reference_gradients(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(truth, baseline, uncancelled scale) of each of dq, dk, dv."""
        q, k, v, cu_seqlens = self.inputs
        wide = [x.detach().double().requires_grad_() for x in (q, k, v)]
        truth = attention_truth(*wide, cu_seqlens, *self.options)
        truths = torch.autograd.grad(truth, wide, self.grad_out.double())
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        baselines = torch.autograd.grad(attention_baseline(*leaves, cu_seqlens, *self.options), leaves, self.grad_out)
        scales = uncancelled_gradient_scales(q, k, v, cu_seqlens, self.grad_out, *self.options)
        return list(zip(truths, baselines, scales, strict=True))


def check_attention(out, q, k, v, cu_seqlens, target, max_seqlen=None, softmax_scale=None, positions=None):
    """:meth:`AttentionProblem.check` of one output."""
    return AttentionProblem(q, k, v, cu_seqlens, target, max_seqlen, softmax_scale, positions).check(out)


def check_attention_gradients(
    grads, q, k, v, cu_seqlens, grad_out, target, max_seqlen=None, softmax_scale=None, positions=None
):
    """:meth:`AttentionProblem.check_gradients` of one set of gradients."""
    problem = AttentionProblem(q, k, v, cu_seqlens, target, max_seqlen, softmax_scale, positions, grad_out=grad_out)
    return problem.check_gradients(grads)
