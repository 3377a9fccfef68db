"""The suite's tolerance rule, imported by bare name (``from tolerance import ...``) in every test folder: it is the
package's own (:mod:`qvl.kernels.tolerance`), so that ``qvl check`` judges a user's machine by the same rule; its
docstring says why the rule is what it is."""

from qvl.kernels.tolerance import (
    BASELINE_ULPS,
    DEFAULT_FACTOR,
    DEFAULT_ULPS,
    Comparison,
    assert_error_within,
    assert_grads_within,
    compare,
    default_eps,
    max_error,
    resolution,
    scale_of,
)

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
]
