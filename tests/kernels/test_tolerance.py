"""qvl.kernels.tolerance's summary of several comparisons (worst_of): what qvl check's table and the tile sweep read;
the floor a result that cancels takes from its terms' scale (default_eps's ``terms``)."""

import math

import torch

from tolerance import compare, default_eps, resolution, worst_of


def comparison(error: float, what: str):
    truth = torch.tensor([1.0, -0.5], dtype=torch.float64)
    baseline = truth.float()
    return compare(truth.float() + torch.tensor([error, 0.0]), truth, baseline, what=what)


def test_the_worst_share_of_a_bound_and_the_first_failure():
    right, wrong, worse = comparison(0.0, "a"), comparison(0.5, "b"), comparison(1.0, "c")
    assert right.bound > 0 and not wrong.passed and not worse.passed
    worst, passed, failure = worst_of([right, wrong, worse])
    assert worst == worse.error / worse.bound and not passed
    assert failure == f"{wrong.message()}; 1 more: c" and failure.startswith("b (float32): error 0.5")
    assert worst_of([right]) == (0.0, True, "")
    assert worst_of([]) == (0.0, True, "")


def test_a_nan_is_the_worst_and_never_passes():
    worst, passed, failure = worst_of([comparison(0.0, "a"), comparison(math.nan, "b")])
    assert math.isnan(worst) and not passed and failure.startswith("b (float32): error nan")


def test_an_exact_result_on_a_bound_of_zero_passes():
    zero = torch.zeros(3, dtype=torch.float64)
    exact = compare(zero.float(), zero, zero.float(), eps=0.0)
    assert exact.bound == 0 and exact.passed
    assert worst_of([exact]) == (0.0, True, "")


def test_a_result_that_cancels_is_held_at_its_terms_scale():
    """``a . b - a . b`` summed in two orders: 0 exactly in float64 and in a baseline that sums both alike, a few fp32
    roundings of ``|a| . |b|`` where the orders differ. The output's scale gives a bound of 0; the terms' scale, from
    the inputs, gives ``wide_ulps`` fp32 ulps of it, and no more: an error of the terms' size still fails."""
    a, b = torch.randn(2, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    terms = (a.abs() @ b.abs()).reshape(1)
    truth = torch.zeros(1, dtype=torch.float64)
    roundings = 2 * resolution(torch.float32) * terms
    cancelled = roundings.half()
    assert cancelled.item() != 0
    assert not compare(cancelled, truth, truth.half(), wide_ulps=4).passed
    assert compare(cancelled, truth, truth.half(), wide_ulps=4, terms=terms).passed
    assert compare(cancelled, truth, truth.half(), wide_ulps=4, terms=terms.item()).passed
    assert not compare((0.01 * terms).half(), truth, truth.half(), wide_ulps=4, terms=terms).passed
    assert default_eps(torch.float16, truth, wide_ulps=4, terms=terms) == 4 * resolution(torch.float32) * terms.item()
    # Terms smaller than the output leave the output's scale in charge.
    one = torch.ones(1, dtype=torch.float64)
    assert default_eps(torch.float16, one, wide_ulps=4, terms=0.5) == default_eps(torch.float16, one, wide_ulps=4)
