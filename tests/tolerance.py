"""One tolerance rule for every numeric comparison in the suite.

A result computed in a floating dtype is judged by its error against a float64 ground truth, and the bound
on that error comes from what torch itself gets wrong computing the same thing in the same dtype::

    max|actual - truth64| <= factor * max|baseline - truth64| + eps

This is the flash-attention test idiom. ``truth64`` is the same computation in float64 on the same
(already rounded) inputs, so input rounding is not counted against anybody; ``baseline`` is torch's (or
transformers') own computation in ``actual``'s dtype, so the bound scales with the rounding that the
dtype and the operation really incur: long reductions, cancellation, a transcendental function's libm or
SIMD implementation. A machine whose vectorised ``erf`` is a little less accurate makes torch's error
larger in step, so no bound depends on which CPU ran the suite, and none is read off what one machine
printed.

Why ``factor = 2``: a kernel that is as accurate as torch lands at about torch's error; its summation
order, fused (unrounded) intermediates and its own exp/erf/tanh differ, so the two errors are
independent draws of the same size. Twice the reference error leaves room for that spread while still
failing a kernel that is systematically worse (a wrong accumulation dtype, a lost compensation, a
missing rounding step multiplies the error by far more than two).

Why ``eps``: the rule alone breaks down when torch's error happens to be tiny, e.g. when torch computes
the whole thing in float32 and rounds once, so that its error is at most half an ulp and may be zero at
the element where the kernel differs. The kernel may legitimately lose one ulp more in the final
rounding: Triton's interpreter rounds float32 -> bfloat16/float16 toward zero where torch and the GPU
round to nearest (up to one ulp instead of half), and a different but equally valid accumulation order
moves a result across a rounding boundary (another ulp). ``eps`` therefore defaults to
``DEFAULT_ULPS = 2`` units of ``torch.finfo(dtype).eps`` (the dtype's relative resolution: the spacing
of numbers in [1, 2)) scaled by ``max|truth|``, the output's scale. ``finfo.eps * |x|`` is between one
and two ulp of ``x``, so the default is two to four ulp at the largest output: a few ulp, and never more
than the dtype's resolution can explain. Errors are measured in absolute terms at the output's scale
(not elementwise relative), because a value near zero computed from large terms carries the rounding of
those terms, not of itself. Parts of a result whose scales differ by orders of magnitude (saturated GELU
inputs of 1e4 next to values of order 1) are compared apart, so that each part's eps follows its own scale.

The truth computes in float64 everything that is computed rather than loaded. The rotary's inverse
frequencies are the case in point: transformers and qvl each round them to fp32, and a truth built from
either table would share that rounding with one side (``float64_rotary`` in conftest.py; for transformers'
modules, whose rotary computes in fp32 whatever their dtype, ``towers.rotary_in_float64``).

Exact contracts (bit-identical round trips, fused-vs-unfused paths that are equal by construction) are
not tolerance questions and stay ``rtol=0, atol=0`` in the tests that state them.
"""

import math
from collections.abc import Sequence

import torch

DEFAULT_FACTOR = 2.0
DEFAULT_ULPS = 2


def resolution(dtype: torch.dtype) -> float:
    """The dtype's relative resolution, ``torch.finfo(dtype).eps``: one ulp of a number in [1, 2)."""
    return torch.finfo(dtype).eps


def max_error(x: torch.Tensor, truth: torch.Tensor) -> float:
    """``max|x - truth|`` in float64; 0 for empty tensors; NaN when either side has a NaN."""
    if x.numel() == 0:
        return 0.0
    return (x.detach().to(torch.float64) - truth.detach().to(x.device, torch.float64)).abs().max().item()


def scale_of(truth: torch.Tensor) -> float:
    """The output's scale: ``max|truth|`` (0 for an empty tensor)."""
    return truth.detach().abs().max().item() if truth.numel() else 0.0


def default_eps(dtype: torch.dtype, truth: torch.Tensor, ulps: int = DEFAULT_ULPS) -> float:
    """``ulps`` units of the dtype's resolution at the output's scale (see the module docstring)."""
    return ulps * resolution(dtype) * scale_of(truth)


def online_softmax_ulps(cu_seqlens: torch.Tensor, block_n: int, max_abs_logit: float) -> int:
    """The ulps of ``eps`` for attention computed with an online softmax over key blocks of ``block_n``, in
    base 2, for scaled logits ``q.k * scale`` of at most ``max_abs_logit`` in magnitude.

    Such a kernel (flash attention, the Triton tutorial's) rounds in sequence where a one-pass softmax
    (torch's, the baseline) does not, and each of these roundings is the algorithm's, not one machine's:

    * it rescales its output accumulator once per key block after the first, ``acc * exp2(m_old - m_new)``:
      one rounding at the output's scale per block;
    * it folds log2(e) into the scale, ``exp2(q.k * scale * log2(e) - m)``: one more rounding of the
      exponent's argument, at the argument's own scale, up to ``max_abs_logit * log2(e)``; an error of
      ``d`` in the argument is a relative error of ``d`` in every probability, so in the output.

    In 16-bit dtypes the output's final rounding dwarfs these; in fp32 they are what lets a correct kernel's
    error pass twice torch's on long segments and wide logits. So the kernel gets :data:`DEFAULT_ULPS`, one
    ulp per key block of its longest segment and ``ceil(max_abs_logit * log2(e))`` ulps for the argument.
    """
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0
    return DEFAULT_ULPS + -(-longest // block_n) + math.ceil(max_abs_logit * math.log2(math.e))


def assert_error_within(actual, truth, baseline, *, factor=DEFAULT_FACTOR, eps=None, ulps=DEFAULT_ULPS, what=""):
    """Pass when max|actual - truth| <= factor * max|baseline - truth| + eps.

    actual: the result under test (any float dtype); truth: the same quantity computed in float64;
    baseline: torch's / transformers' own computation in actual's dtype on the same inputs.
    eps defaults to ``ulps`` (default two, why: the module docstring; more where the algorithm under test
    rounds more often in sequence than torch's, e.g. :func:`online_softmax_ulps`) units of the dtype's
    resolution at ``max|truth|``. Tuples/lists of tensors are compared pairwise, each pair with its own
    scale. The failure message gives both errors and the bound.
    """
    if isinstance(actual, Sequence) and not isinstance(actual, torch.Tensor):
        assert len(actual) == len(truth) == len(baseline), f"{what}: {len(actual)}, {len(truth)}, {len(baseline)} items"
        for i, (a, t, b) in enumerate(zip(actual, truth, baseline)):
            assert_error_within(a, t, b, factor=factor, eps=eps, ulps=ulps, what=f"{what}[{i}]")
        return
    assert actual.is_floating_point(), f"{what}: {actual.dtype} is not a floating dtype"
    assert truth.dtype == torch.float64, f"{what}: the truth must be float64, got {truth.dtype}"
    assert baseline.dtype == actual.dtype, f"{what}: baseline is {baseline.dtype}, actual {actual.dtype}"
    assert actual.shape == truth.shape == baseline.shape, (
        f"{what}: shapes {tuple(actual.shape)}, {tuple(truth.shape)}, {tuple(baseline.shape)}"
    )
    if eps is None:
        eps = default_eps(actual.dtype, truth, ulps)
    error = max_error(actual, truth)
    baseline_error = max_error(baseline, truth)
    bound = factor * baseline_error + eps
    assert error <= bound, (
        f"{what or 'result'} ({actual.dtype}): error {error:.4g} against float64 exceeds the bound {bound:.4g}"
        f" = {factor:g} x torch's own error {baseline_error:.4g} + eps {eps:.4g}"
    )


def assert_grads_within(got, eager_fn, inputs, grads, what=""):
    """Pass when the gradients ``got`` of ``inputs`` (computed by the code under test for the output gradients
    ``grads``) are within :func:`assert_error_within` of float64 autograd of ``eager_fn`` on the same values,
    with ``eager_fn``'s own autograd in the inputs' dtype as the baseline."""
    inputs64 = [t.detach().double().requires_grad_() for t in inputs]
    truth = torch.autograd.grad(eager_fn(*inputs64), inputs64, [g.double() for g in grads])
    leaves = [t.detach().requires_grad_() for t in inputs]
    baseline = torch.autograd.grad(eager_fn(*leaves), leaves, grads)
    assert_error_within(got, truth, baseline, what=what)
