"""qvl inside vLLM: the ``vllm.general_plugins`` entry point and its switch.

Installing qvl next to vLLM is the whole set-up: vLLM calls :func:`register` in every process it starts
(API server, engine core, each worker) before it builds a model, and :func:`register` then

* routes vLLM's encoder attention (the ``MMEncoderAttention`` custom op, used by the vision towers of
  Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5, Qwen3-Omni and many other models) to
  ``torch.ops.qvl.vision_attn`` through vLLM's out-of-tree hook (:mod:`qvl.vit.engines.vllm.attention`);
* and runs the whole vision tower of Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 and Qwen3.5-MoE on qvl's tower
  forward over vLLM's own modules and loaded weights (:mod:`qvl.vit.engines.vllm.tower`).

What each route does not cover falls back to vLLM's own code, with one log line per reason. The switch is
the environment variable ``QVL_VLLM``, read by each process when vLLM loads its plugins:

* unset, ``1`` or ``all``: both routes;
* ``attention``: the attention route only (vLLM's own towers, and its own data-parallel split);
* ``0`` or ``off``: nothing changes in vLLM.

On a CPU both routes also follow :mod:`qvl.vit.engines.cpu_path`: by default they take a model's vision work only
where qvl was measured faster than vLLM's own CPU code in the model's dtype, else step aside with one log line;
``QVL_CPU_ROUTES=on`` or ``off`` forces either.

vLLM's own allow-list turns every plugin off or picks some: ``VLLM_PLUGINS=""`` loads none,
``VLLM_PLUGINS=qvl`` (with other names, comma-separated) loads only those named.

This module imports nothing from vLLM at import time, so importing it without vLLM is harmless; the
vLLM-facing modules are imported by :func:`register`, after it has checked that this vLLM looks the way
they expect. A vLLM that does not is left unchanged, with one log line that says why.
"""

from __future__ import annotations

import inspect
import logging

from ..routes import read_switch
from .routes import route_counts, towers

__all__ = ["SWITCH", "TESTED_VLLM_VERSIONS", "register", "route_counts", "state", "towers"]

# The environment variable that turns qvl's routes on and off inside vLLM.
SWITCH = "QVL_VLLM"
TESTED_VLLM_VERSIONS = ("0.32.0",)
# vLLM only prints records of loggers under its own "vllm" logger (it configures that logger's handler),
# so qvl's one-line messages go there to show up in the engine's log next to vLLM's.
logger = logging.getLogger("vllm.qvl")

_state: dict = {"mode": None, "attention": False, "tower_architectures": (), "reason": None}


def state() -> dict:
    """What :func:`register` did in this process: the switch's ``mode``, whether the ``attention`` route is
    installed, the ``tower_architectures`` it took over, and the ``reason`` when it left vLLM unchanged."""
    return dict(_state)


def _attention_mismatch() -> str | None:
    """Why this vLLM's ``MMEncoderAttention`` is not the one the attention route was written against, or
    None when it is."""
    try:
        from vllm.model_executor.custom_op import op_registry_oot
        from vllm.model_executor.layers.attention.mm_encoder_attention import MMEncoderAttention
    except ImportError as error:
        return f"vLLM has no MMEncoderAttention where qvl looks for it ({error})"
    if not hasattr(MMEncoderAttention, "register_oot"):
        return "vLLM's MMEncoderAttention has no out-of-tree hook (register_oot)"
    if "MMEncoderAttention" in op_registry_oot:
        return f"another plugin already replaced MMEncoderAttention ({op_registry_oot['MMEncoderAttention']})"
    expected = ["self", "query", "key", "value", "cu_seqlens", "max_seqlen", "sequence_lengths"]
    for method in ("forward_native", "forward_cuda", "forward_cpu"):
        found = list(inspect.signature(getattr(MMEncoderAttention, method)).parameters)
        if found != expected:
            return f"MMEncoderAttention.{method} takes {found}, qvl expects {expected}"
    init = list(inspect.signature(MMEncoderAttention.__init__).parameters)
    if init[:6] != ["self", "num_heads", "head_size", "scale", "num_kv_heads", "prefix"]:
        return f"MMEncoderAttention.__init__ takes {init}"
    return None


def register() -> None:
    """vLLM's plugin hook (entry point ``qvl`` in group ``vllm.general_plugins``): install qvl's routes in
    this process according to ``QVL_VLLM``. Safe to call more than once; never raises on a vLLM it does not
    recognise (it logs one line and changes nothing)."""
    if _state["mode"] is not None:
        return
    mode = read_switch(SWITCH, _state, logger, "vLLM")
    if mode is None:
        return
    try:
        import vllm
    except ImportError as error:  # only vLLM calls this hook; anyone else gets a note, not an error
        _state["reason"] = f"vLLM is not importable ({error})"
        logger.warning("qvl: %s", _state["reason"])
        return
    version = getattr(vllm, "__version__", "unknown")
    # A plugin must never stop vLLM from starting: whatever goes wrong below is logged, and vLLM keeps the
    # code qvl did not get to replace.
    try:
        reason = _attention_mismatch()
        if reason is None:
            from . import attention

            attention.install()
            _state["attention"] = True
    except Exception as error:
        reason = f"{type(error).__name__}: {error}"
    if reason is not None:
        _state["reason"] = reason
        logger.warning("qvl: vLLM %s left unchanged: %s", version, reason)
        return
    if mode == "all":
        try:
            from . import tower

            _state["tower_architectures"] = tower.install()
        except Exception as error:
            _state["reason"] = f"{type(error).__name__}: {error}"
            logger.warning("qvl: vLLM %s keeps its own towers: %s", version, _state["reason"])
    untested = "" if version in TESTED_VLLM_VERSIONS else f" (untested vLLM {version}; tested: {TESTED_VLLM_VERSIONS})"
    towers = ", ".join(_state["tower_architectures"]) or "none"
    logger.info(
        "qvl: active (%s=%s): encoder attention -> torch.ops.qvl.vision_attn; qvl towers for: %s%s",
        SWITCH,
        mode,
        towers,
        untested,
    )
