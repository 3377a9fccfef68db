"""Deprecated: the old path of :mod:`qvl.vit.engines.cpu_path` (whether the engine plugins route on a CPU), kept for
one release; this module goes away in the next one. Import :mod:`qvl.vit.engines.cpu_path` instead.

It re-exports that module's public names (the same objects: :data:`MEASURED` is the table the plugins read).
Importing it raises a :class:`DeprecationWarning`; no part of qvl imports it.
"""

import warnings

from .engines.cpu_path import MEASURED, SWITCH, Measurement, cpu_route_decision, forced_routes

__all__ = ["MEASURED", "SWITCH", "Measurement", "cpu_route_decision", "forced_routes"]

warnings.warn(
    "qvl.vit.cpu_path moved to qvl.vit.engines.cpu_path; the old path goes away in the next release",
    DeprecationWarning,
    stacklevel=2,
)
