"""The suite's tolerance rule, imported by bare name (``from tolerance import ...``) in every test folder: it is the
package's own (:mod:`qvl.kernels.tolerance`), so that ``qvl check`` judges a user's machine by the same rule; its
docstring says why the rule is what it is."""

from qvl.kernels.tolerance import *  # noqa: F403
from qvl.kernels.tolerance import __all__  # noqa: F401
