"""qvl.kernels.tolerance's summary of several comparisons (worst_of): what qvl check's table and the tile sweep read."""

import math

import torch

from tolerance import compare, worst_of


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
