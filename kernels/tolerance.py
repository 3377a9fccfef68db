"""The one tolerance rule by which qvl's results are judged: by the test suite and by ``qvl check`` alike.

A result computed in a floating dtype is judged by its error against a float64 ground truth, and the bound
on that error comes from what torch itself gets wrong computing the same thing in the same dtype::

    max|actual - truth64| <= factor * max|baseline - truth64| + eps

This is the flash-attention test idiom. ``truth64`` is the same computation in float64 on the same
(already rounded) inputs, so input rounding is not counted against anybody; ``baseline`` is torch's (or
transformers') own computation in ``actual``'s dtype, so the bound scales with the rounding that the
dtype and the operation really incur: long reductions, cancellation, a transcendental function's libm or
SIMD implementation. A machine whose vectorised ``erf`` is a little less accurate makes torch's error
larger in step, so no bound depends on which CPU ran the check, and none is read off what one machine
printed.

Why ``factor = 2``: a kernel that is as accurate as torch lands at about torch's error; its summation
order, fused (unrounded) intermediates and its own exp/erf/tanh differ, so the two errors are
independent draws of the same size. Twice the reference error leaves room for that spread while still
failing a kernel that is systematically worse (a wrong accumulation dtype, a lost compensation, a
missing rounding step multiplies the error by far more than two).

Why ``eps``: the rule alone breaks down when torch's error happens to be tiny, e.g. when torch computes the whole
thing in float32 and rounds once, so that its error is at most half an ulp and may be zero at the element where the
kernel differs. The kernel may legitimately lose an ulp or two more in the final rounding: a different but equally
valid accumulation order moves a result across a rounding boundary. ``eps`` therefore defaults to ``DEFAULT_ULPS =
2`` units of ``torch.finfo(dtype).eps`` (the dtype's relative resolution: the spacing of numbers in [1, 2)) scaled
by ``max|truth|``, the output's scale. ``finfo.eps * |x|`` is between one and two ulp of ``x``, so the default is
two to four ulp at the largest output: a few ulp, and never more than the dtype's resolution can explain. Errors are
measured in absolute terms at the output's scale (not elementwise relative), because a value near zero computed from
large terms carries the rounding of those terms, not of itself. Parts of a result whose scales differ by orders of
magnitude (saturated GELU inputs of 1e4 next to values of order 1, attention's segments: a one-token segment's
output is its value row) are compared apart, so that each part's eps and torch's error follow its own scale.

Roundings that the algorithm under test makes in a wider dtype than its output (an online softmax keeps its
running max, sum and accumulator in fp32) are counted at that dtype's resolution, not the output's: ``eps``
is then ``ulps`` of the output dtype plus ``wide_ulps`` of fp32, both at the output's scale.

Why ``terms``: a result whose exact value cancels (the sum of terms much larger than itself) carries the roundings of
those terms, not of itself, and a scale read off the result shrinks with it. Where the cancellation is exact, torch's
own error can be exactly 0 too, and the bound with it: the gradient of a softmax over one key with respect to the
query is 0, and torch's one-pass backward gets 0, while a flash backward computes the two sums that cancel
(``dP = dO . v`` and ``delta = dO . out``) in two orders in its fp32 accumulators and keeps a few fp32 roundings of
their size. Which order, and so whether those roundings happen to cancel too, depends on the machine's BLAS and SIMD
width: a bound of 0 passes on one CPU and fails on another. ``terms`` gives the scale the computation rounds at
before the cancellation, derived from the inputs alone: the same computation with absolute values, ``|A| @ |B|`` for
``A @ B`` (a tensor, whose ``max|.|`` is taken, or that number itself). The ``wide_ulps`` then count at the larger of
it and the output's scale; the output dtype's ``ulps`` stay at the output's scale, since the output's own rounding is
relative to the output. So the floor follows from the inputs' magnitudes and the resolution the intermediates are
held in, never from the result.

The rule trusts nothing it cannot check: the baseline must itself agree with the truth within :data:`BASELINE_ULPS`
of its dtype's resolution at the output's scale (``eps`` added, for algorithms that round more often in sequence),
per rounded stage of a composite computation: a model's output passes through its operations one after another, each
rounding its result, and those errors add up (``stages``; one for an op). A truth that misreads the computation (erf
for tanh GELU, say) then fails loudly instead of widening the bound for a kernel that shares the misreading. For the
same reason truths are written from torch's own functions in float64 (or transformers' modules), never from the code
under test.

The truth computes in float64 everything that is computed rather than loaded. The rotary's inverse
frequencies are the case in point: transformers and qvl each round them to fp32, and a truth built from
either table would share that rounding with one side.

Exact contracts (bit-identical round trips, fused-vs-unfused paths that are equal by construction) are
not tolerance questions and stay ``rtol=0, atol=0`` in the tests that state them. Equal by construction means the
same computation on every CPU: the same kernel or function on the same values and shapes (run twice, resumed, on a
copy, in place or not, on a batch whose products the code holds to fixed shapes), a copy, a gather or a permutation,
integer metadata, elementwise IEEE arithmetic written op for op alike (each op correctly rounded everywhere). Two
different computations of one value (``addmm`` against ``mm`` then ``add``, a reduction in another order, a matrix
product of other shapes, which a BLAS may block otherwise) agree bit for bit only on the CPUs they were tried on:
they are held to this rule against the float64 truth instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

__all__ = [
    "BASELINE_ULPS",
    "DEFAULT_FACTOR",
    "DEFAULT_ULPS",
    "Comparison",
    "assert_error_within",
    "assert_grads_within",
    "compare",
    "default_eps",
    "max_error",
    "resolution",
    "scale_of",
    "worst_of",
]

DEFAULT_FACTOR = 2.0
DEFAULT_ULPS = 2
# How far torch's own result (the baseline) may be from the float64 truth, in units of its dtype's resolution at the
# output's scale: one rounding of the output is half a unit, a few more cover torch's own reductions. A baseline
# further off means the truth and torch compute different things.
BASELINE_ULPS = 8


def resolution(dtype: torch.dtype) -> float:
    """The dtype's relative resolution, ``torch.finfo(dtype).eps``: one ulp of a number in [1, 2)."""
    return torch.finfo(dtype).eps


def max_error(x: torch.Tensor, truth: torch.Tensor) -> float:
    """``max|x - truth|`` in float64; 0 for empty tensors; NaN when either side has a NaN."""
    if x.numel() == 0:
        return 0.0
    difference = x.detach().to(torch.float64) - truth.detach().to(x.device, torch.float64)
    if torch.isnan(difference).any():
        return math.nan
    return difference.abs().max().item()


def scale_of(truth: torch.Tensor) -> float:
    """The output's scale: ``max|truth|`` (0 for an empty tensor)."""
    return truth.detach().abs().max().item() if truth.numel() else 0.0


def default_eps(
    dtype: torch.dtype,
    truth: torch.Tensor,
    ulps: float = DEFAULT_ULPS,
    wide_ulps: float = 0,
    terms: torch.Tensor | float | None = None,
) -> float:
    """``ulps`` units of the dtype's resolution at the output's scale plus ``wide_ulps`` units of fp32's at the larger
    of the output's scale and that of ``terms``, the magnitude of what the result is computed from before it cancels
    (a tensor: its ``max|.|``; a number: itself; None: the output's own; see the module docstring)."""
    scale = scale_of(truth)
    if terms is None:
        wide_scale = scale
    else:
        wide_scale = max(scale, scale_of(terms) if isinstance(terms, torch.Tensor) else float(terms))
    return ulps * resolution(dtype) * scale + wide_ulps * resolution(torch.float32) * wide_scale


class Comparison(NamedTuple):
    """One application of the rule: ``error`` against ``bound`` = factor x ``baseline_error`` + eps, and the
    baseline's own error against ``baseline_limit`` (:data:`BASELINE_ULPS`)."""

    what: str
    dtype: torch.dtype
    error: float
    bound: float
    baseline_error: float
    baseline_limit: float

    @property
    def baseline_agrees(self) -> bool:
        """Whether torch's result is within :data:`BASELINE_ULPS` of the truth (a NaN never is)."""
        return self.baseline_error <= self.baseline_limit

    @property
    def passed(self) -> bool:
        """Within the bound, with a baseline that agrees with the truth (a NaN error never passes)."""
        return self.error <= self.bound and self.baseline_agrees

    def message(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        if not self.baseline_agrees:
            return (
                f"{self.what or 'result'} ({dtype}): torch's own result is {self.baseline_error:.4g} from the float64"
                f" truth, more than {self.baseline_limit:.4g} ({BASELINE_ULPS} of its dtype's ulps at the output's"
                " scale): the truth and the baseline compute different things"
            )
        return (
            f"{self.what or 'result'} ({dtype}): error {self.error:.4g} against float64"
            f" {'within' if self.passed else 'exceeds'} the bound {self.bound:.4g}"
            f" (torch's own error {self.baseline_error:.4g})"
        )


def worst_of(comparisons: Sequence[Comparison]) -> tuple[float, bool, str]:
    """Of several comparisons: the largest error as a share of its bound (at most 1 passes; NaN where an error is NaN;
    0 for an exact result on a bound of 0), whether all passed, and what failed ("" if nothing): the first failure's
    message, then what each further failure compared (up to five; the count beyond)."""
    shares = [c.error / c.bound if c.bound > 0 else (0.0 if c.error == 0 else math.inf) for c in comparisons]
    worst = math.nan if any(math.isnan(share) for share in shares) else max(shares, default=0.0)
    failed = [c for c in comparisons if not c.passed]
    if not failed:
        return worst, True, ""
    failure = failed[0].message()
    if len(failed) > 1:
        more = "; ".join(c.what for c in failed[1:6]) + ("; ..." if len(failed) > 6 else "")
        failure += f"; {len(failed) - 1} more: {more}"
    return worst, False, failure


def compare(
    actual: torch.Tensor,
    truth: torch.Tensor,
    baseline: torch.Tensor,
    *,
    factor: float = DEFAULT_FACTOR,
    eps: float | None = None,
    ulps: float = DEFAULT_ULPS,
    wide_ulps: float = 0,
    what: str = "",
    stages: int = 1,
    terms: torch.Tensor | float | None = None,
) -> Comparison:
    """The rule applied to one tensor: ``actual`` (the result under test, any float dtype), ``truth`` (the same
    quantity in float64), ``baseline`` (torch's or transformers' own computation in ``actual``'s dtype on the same
    inputs). ``eps`` defaults to :func:`default_eps` with ``ulps``, ``wide_ulps`` and ``terms``."""
    assert actual.is_floating_point(), f"{what}: {actual.dtype} is not a floating dtype"
    assert truth.dtype == torch.float64, f"{what}: the truth must be float64, got {truth.dtype}"
    assert baseline.dtype == actual.dtype, f"{what}: baseline is {baseline.dtype}, actual {actual.dtype}"
    assert actual.shape == truth.shape == baseline.shape, (
        f"{what}: shapes {tuple(actual.shape)}, {tuple(truth.shape)}, {tuple(baseline.shape)}"
    )
    if eps is None:
        eps = default_eps(actual.dtype, truth, ulps, wide_ulps, terms)
    baseline_error = max_error(baseline, truth)
    return Comparison(
        what=what,
        dtype=actual.dtype,
        error=max_error(actual, truth),
        bound=factor * baseline_error + eps,
        baseline_error=baseline_error,
        baseline_limit=BASELINE_ULPS * stages * resolution(actual.dtype) * scale_of(truth) + eps,
    )


def assert_error_within(
    actual,
    truth,
    baseline,
    *,
    factor: float = DEFAULT_FACTOR,
    eps: float | None = None,
    ulps: float = DEFAULT_ULPS,
    wide_ulps: float = 0,
    what: str = "",
    stages: int = 1,
    terms=None,
) -> None:
    """Pass when max|actual - truth| <= factor * max|baseline - truth| + eps and the baseline agrees with the truth
    (:func:`compare`). Tuples/lists of tensors are compared pairwise, each pair with its own scale (and its own
    ``terms``, given as a sequence alike). The failure message gives both errors and the bound."""
    if isinstance(actual, Sequence) and not isinstance(actual, torch.Tensor):
        assert len(actual) == len(truth) == len(baseline), f"{what}: {len(actual)}, {len(truth)}, {len(baseline)} items"
        each_terms = [None] * len(actual) if terms is None else terms
        assert len(each_terms) == len(actual), f"{what}: {len(each_terms)} terms for {len(actual)} items"
        for i, (a, t, b, s) in enumerate(zip(actual, truth, baseline, each_terms, strict=True)):
            assert_error_within(
                a,
                t,
                b,
                factor=factor,
                eps=eps,
                ulps=ulps,
                wide_ulps=wide_ulps,
                what=f"{what}[{i}]",
                stages=stages,
                terms=s,
            )
        return
    comparison = compare(
        actual,
        truth,
        baseline,
        factor=factor,
        eps=eps,
        ulps=ulps,
        wide_ulps=wide_ulps,
        what=what,
        stages=stages,
        terms=terms,
    )
    assert comparison.passed, comparison.message()


def assert_grads_within(got, eager_fn, inputs, grads, what: str = "", stages: int = 1) -> None:
    """Pass when the gradients ``got`` of ``inputs`` (computed by the code under test for the output gradients
    ``grads``) are within :func:`assert_error_within` of float64 autograd of ``eager_fn`` on the same values,
    with ``eager_fn``'s own autograd in the inputs' dtype as the baseline."""
    inputs64 = [t.detach().double().requires_grad_() for t in inputs]
    truth = torch.autograd.grad(eager_fn(*inputs64), inputs64, [g.double() for g in grads])
    leaves = [t.detach().requires_grad_() for t in inputs]
    baseline = torch.autograd.grad(eager_fn(*leaves), leaves, grads)
    assert_error_within(got, truth, baseline, what=what, stages=stages)
