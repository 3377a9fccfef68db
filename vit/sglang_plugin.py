"""Deprecated: the old path of :mod:`qvl.vit.engines.sglang.plugin` (qvl's SGLang plugin), kept for one release;
this module goes away in the next one. Import :mod:`qvl.vit.engines.sglang.plugin` instead.

It re-exports that module's public names (the same objects: ``state()`` here reads the same plugin state). An
environment where qvl was installed before the engines moved to :mod:`qvl.vit.engines` names
``qvl.vit.sglang_plugin:register`` in its ``sglang.srt.plugins`` entry point until qvl is reinstalled, and SGLang
imports this module in each process it starts there; so importing it warns of nothing (a warning there would reach
every SGLang process's start-up, or stop the plugin where warnings are errors).
"""

from .engines.sglang.plugin import SWITCH, TESTED_SGLANG_VERSIONS, apply, register, route_counts, state, towers

__all__ = ["SWITCH", "TESTED_SGLANG_VERSIONS", "apply", "register", "route_counts", "state", "towers"]
