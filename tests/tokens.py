"""Greedy tokens of two engine runs compared as the tolerance rule allows (tests/vllm and tests/sglang).

Two runs whose scores each round within the rule of the float64 truth may order two nearly equal scores either way
(which way, a CPU's BLAS and SIMD width decide), so a request may part from the expected run at such a near-tie, and
from there on it follows other tokens and is not compared.
"""

from __future__ import annotations


def tie(dtype: str, *scores: float) -> float:
    """How close two scores (logits or log-probabilities) of a run in ``dtype`` may be for another, equally right run
    to order them otherwise: each run's may be :data:`~tolerance.BASELINE_ULPS` of the dtype's resolution at their
    scale from the truth (the rule's limit on torch's own result), so the two runs' gaps may differ by four times
    that. (A log-probability is the logit less the log-sum-exp, both rounded at about its size.)"""
    import torch

    from tolerance import BASELINE_ULPS, resolution

    return 4 * BASELINE_ULPS * resolution(getattr(torch, dtype)) * max(abs(score) for score in scores)


def assert_same_tokens(result: dict, expected: dict, what: str = "") -> None:
    """The same greedy tokens, request by request, but where a request parts at a near-tie: a step at which the run
    chose the expected run's runner-up, within :func:`tie` of its top score. ``result`` and ``expected`` hold
    ``dtype``, ``tokens`` (per request, per step) and, for ``expected``, ``top_two`` (per step, two ``(token,
    score)`` pairs)."""
    prefix = f"{what}, " if what else ""
    assert result["dtype"] == expected["dtype"], what
    requests = zip(result["tokens"], expected["tokens"], expected["top_two"], strict=True)
    for request, (got, want, top_two) in enumerate(requests):
        assert len(got) == len(want), f"{prefix}request {request}"
        steps = zip(got, want, top_two, strict=True)  # every step has its top two
        for step, (chosen, wanted, ((_, first), (runner_up, second))) in enumerate(steps):
            if chosen != wanted:
                gap, apart = first - second, tie(expected["dtype"], first, second)
                assert chosen == runner_up and gap <= apart, (
                    f"{prefix}request {request} (image, two images, video), step {step}: token {chosen} where"
                    f" {wanted} led {runner_up} by {gap:.4g} (a near-tie within {apart:.4g}): {got} != {want}"
                )
                break
