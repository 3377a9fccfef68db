"""Deprecated: the old path of :mod:`qvl.vit.engines.vllm.plugin` (qvl's vLLM plugin), kept for one release; this
module goes away in the next one. Import :mod:`qvl.vit.engines.vllm.plugin` instead.

It re-exports that module's public names (the same objects: ``state()`` here reads the same plugin state). An
environment where qvl was installed before the engines moved to :mod:`qvl.vit.engines` names
``qvl.vit.vllm_plugin:register`` in its ``vllm.general_plugins`` entry point until qvl is reinstalled, and vLLM
imports this module in each process it starts there; so importing it warns of nothing (a warning there would reach
every vLLM process's start-up, or stop the plugin where warnings are errors).
"""

from .engines.vllm.plugin import SWITCH, TESTED_VLLM_VERSIONS, register, route_counts, state, towers

__all__ = ["SWITCH", "TESTED_VLLM_VERSIONS", "register", "route_counts", "state", "towers"]
