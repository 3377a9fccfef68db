"""qvl inside SGLang: the ``sglang.srt.plugins`` entry point and its switch.

Installing qvl next to SGLang is the whole set-up: SGLang calls :func:`register` in each of its processes before it
builds a model, and :func:`register` hooks the function SGLang's model runner loads its model with
(``load_model_with_memory_saver``, an AFTER hook of SGLang's ``HookRegistry``), so that in each scheduler process,
once the model is built and its weights are loaded, :func:`apply`

* gives every ``VisionAttention`` layer (the ViT attention of Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5, GLM-4V,
  InternVL, Idefics2, Pixtral and others) qvl's backend, ``torch.ops.qvl.vision_attn``
  (:mod:`qvl.vit.engines.sglang.attention`), with the backend SGLang chose kept for what qvl does not take;
* and runs the whole vision tower of Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE, Qwen2.5-VL and Qwen2-VL on qvl's
  tower forward over SGLang's own modules and loaded weights (:mod:`qvl.vit.engines.sglang.tower`).

On a CPU the routes run qvl's torch path, and only where it was measured to beat SGLang's own CPU vision code:
elsewhere they step aside (:mod:`qvl.vit.engines.cpu_path`, whose ``QVL_CPU_ROUTES`` forces either way). One log line in
each scheduler says which routes are active and why any fell back. The switch is the environment variable
``QVL_SGLANG``, with the values of vLLM's ``QVL_VLLM``:

* unset, ``1`` or ``all``: both routes;
* ``attention``: the attention route only (SGLang's own towers, and its own data-parallel split);
* ``0`` or ``off``: nothing changes in SGLang.

SGLang's own allow-list picks plugins: ``SGLANG_PLUGINS=qvl`` (with other names, comma-separated) loads only those
named; a list without ``qvl`` leaves qvl out.

This module imports nothing from SGLang at import time; a hook or route that fails is logged and leaves SGLang's
code in place, so the plugin never stops SGLang from serving.
"""

from __future__ import annotations

import logging
import os

from ..routes import RouteLog, read_switch, switch_mode

__all__ = ["SWITCH", "TESTED_SGLANG_VERSIONS", "apply", "register", "route_counts", "state", "towers"]

SWITCH = "QVL_SGLANG"
TESTED_SGLANG_VERSIONS = ("0.5.23",)
# The function whose result (the loaded model, as ``.model``) the routes are applied to: every model a scheduler's
# model runner loads (the draft model of speculative decoding too) comes through it.
MODEL_LOADER = "sglang.srt.model_executor.model_runner_components.load_model_utils.load_model_with_memory_saver"
# SGLang prints the records of loggers under its own "sglang" logger.
logger = logging.getLogger("sglang.qvl")

_routes = RouteLog()
route_counts = _routes.route_counts
towers = _routes.towers
_state: dict = {"mode": None, "hooked": False, "reason": None, "models": []}


def state() -> dict:
    """What the plugin did in this process: the switch's ``mode``, whether the model loader is ``hooked``, the
    ``reason`` when it left SGLang unchanged, and per model it applied to (``models``): its class, the
    ``attention_layers`` qvl took, ``attention_left`` (reason -> layers left to SGLang's backend; -1: all of them),
    ``tower`` (``"qvl"``, or the reason SGLang's tower runs, or None for a model of no qvl family) and ``cpu`` (why qvl
    stepped aside on a CPU, :mod:`qvl.vit.engines.cpu_path`; None where it did not)."""
    return {**_state, "models": [dict(model) for model in _state["models"]]}


def register() -> None:
    """SGLang's plugin hook (entry point ``qvl`` in group ``sglang.srt.plugins``): hook the model loader in this
    process according to ``QVL_SGLANG``. Safe to call more than once; never raises."""
    if _state["mode"] is not None:
        return
    mode = read_switch(SWITCH, _state, logger, "SGLang")
    if mode is None:
        return
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register(MODEL_LOADER, _after_model_loaded, HookType.AFTER)
        _state["hooked"] = True
    except Exception as error:  # only SGLang calls this hook; anyone else gets a note, not an error
        _state["reason"] = f"SGLang's hook registry is not usable ({type(error).__name__}: {error})"
        logger.warning("qvl: %s; SGLang runs unchanged", _state["reason"])


def _after_model_loaded(loaded, *args, **kwargs) -> None:
    model_config = kwargs.get("model_config")
    apply(loaded.model, getattr(model_config, "hf_config", None))


def apply(model, hf_config=None) -> dict:
    """Put qvl's routes into a built SGLang ``model`` (``hf_config``: its transformers config, which the tower route
    reads; None: attention route only), as the plugin does after SGLang loads a model; returns what it did (an
    entry of :func:`state`'s ``models``). Idempotent per layer and tower. Never raises: a route that fails leaves
    SGLang's code and is logged."""
    mode = _state["mode"] or switch_mode(SWITCH) or "off"
    done = {"model": type(model).__name__, "attention_layers": 0, "attention_left": {}, "tower": None, "cpu": None}
    try:
        from . import attention, tower
    except Exception as error:  # an SGLang (or a Triton) the routes cannot import next to must still serve
        reason = f"qvl's SGLang routes did not import ({type(error).__name__}: {error})"
        done.update(attention_left={reason: -1}, tower=reason)
        _state["models"].append(done)
        logger.warning("qvl: SGLang's own vision code runs for %s: %s", done["model"], reason)
        return done
    family = tower.ARCHITECTURES.get(type(model).__name__)
    aside = f"{SWITCH}={mode}" if mode == "off" else _cpu_step_aside(model)
    if aside is not None:
        done["attention_left"] = {aside: -1}
        done["tower"] = None if family is None else aside
        done["cpu"] = aside if mode != "off" else None
        _state["models"].append(done)
        logger.info("qvl: SGLang's own vision code runs for %s (pid %d): %s", done["model"], os.getpid(), aside)
        return done
    try:
        done["attention_layers"], done["attention_left"] = attention.attach(model, _routes)
    except Exception as error:
        done["attention_left"] = {f"{type(error).__name__}: {error}": -1}
    if family is not None:
        if mode != "all":
            done["tower"] = f"{SWITCH}={mode}"
        elif hf_config is None:
            done["tower"] = "no model config given"
        else:
            done["tower"] = tower.attach(model, hf_config, family, _routes) or "qvl"
    _state["models"].append(done)
    _log(done, mode)
    return done


def _cpu_step_aside(model) -> str | None:
    """Why qvl leaves a model on a CPU to SGLang's own vision code
    (:func:`qvl.vit.engines.cpu_path.cpu_route_decision`), or None where its routes run (any GPU, or a CPU where they
    were measured to win)."""
    from ..cpu_path import cpu_route_decision

    parameter = next(model.parameters(), None)
    if parameter is None or parameter.device.type != "cpu":
        return None
    route, reason = cpu_route_decision("sglang", parameter.dtype)
    return None if route else f"on this CPU: {reason}"


def _log(done: dict, mode: str) -> None:
    try:
        import sglang

        version = sglang.__version__
    except (ImportError, AttributeError):
        version = "unknown"
    untested = "" if version in TESTED_SGLANG_VERSIONS else f"; untested SGLang {version}"
    left = "".join(f"; {count} left to SGLang's backend: {reason}" for reason, count in done["attention_left"].items())
    attention = f"vision attention -> torch.ops.qvl.vision_attn in {done['attention_layers']} layers{left}"
    tower = done["tower"]
    if tower is None:
        towers = ""
    elif tower == "qvl":
        towers = f"; {done['model']}'s vision tower on qvl"
    else:
        towers = f"; SGLang's own vision tower for {done['model']}: {tower}"
    logger.info("qvl: active (%s=%s, pid %d): %s%s%s", SWITCH, mode, os.getpid(), attention, towers, untested)
