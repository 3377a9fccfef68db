"""What qvl's routes inside a serving engine did in this process: how many forwards each took, and how each tower it
took over runs. One :class:`RouteLog` per engine plugin (:mod:`qvl.vit.engines.vllm.routes`,
:mod:`qvl.vit.engines.sglang.plugin`); the engines' test helpers read them in the engine's worker processes, where the
calls happen. Also what both engines' attention routes share: their switch, and the tile hint read from the engine's
``max_seqlen``."""

from __future__ import annotations

import os
import threading

import torch

__all__ = ["ROUTES", "SWITCH_MODES", "RouteLog", "host_tile_hint", "read_switch", "switch_mode"]

# The routes a log counts: calls taken by qvl, and calls left to the engine's own code.
ROUTES = ("attention", "attention_fallback", "tower", "tower_fallback")
# An engine plugin's switch (QVL_VLLM, QVL_SGLANG): its values -> the routes it turns on.
SWITCH_MODES = {"": "all", "1": "all", "all": "all", "on": "all", "attention": "attention", "0": "off", "off": "off"}


def switch_mode(variable: str) -> str | None:
    """The mode an engine plugin's switch, the environment variable ``variable``, asks for (``"all"``,
    ``"attention"`` or ``"off"``; unset is ``"all"``), or None for a value that is not one of :data:`SWITCH_MODES`."""
    return SWITCH_MODES.get(os.environ.get(variable, "").strip().lower())


def read_switch(variable: str, state: dict, logger, engine: str) -> str | None:
    """An engine plugin's first step: read its switch ``variable`` into the plugin's ``state`` (``mode``, and the
    ``reason`` nothing is installed), logging one line when it turns qvl off or holds an unknown value. Returns the
    mode to install (``"all"`` or ``"attention"``), or None when the plugin should change nothing in ``engine``."""
    value = os.environ.get(variable)
    mode = switch_mode(variable)
    if mode is None:
        state.update(mode="off", reason=f"unknown {variable}={value!r}")
        logger.warning(
            "qvl: %s=%r is not one of %s; qvl leaves %s unchanged", variable, value, sorted(SWITCH_MODES), engine
        )
        return None
    state["mode"] = mode
    if mode == "off":
        state["reason"] = f"{variable}={value}"
        logger.info("qvl: off (%s=%s); %s runs unchanged", variable, value, engine)
        return None
    return mode


def host_tile_hint(max_seqlen, tracing: bool) -> int | None:
    """An engine's ``max_seqlen`` as ``vision_attn``'s tile hint (short windows get short tiles), when it is a
    positive host value: vLLM and SGLang keep it a Python int or a CPU scalar (vLLM fills it for its flash, triton
    and flashinfer backends, 0 otherwise), so reading it costs no device sync. None for anything else, and while
    torch.compile traces, where reading a tensor would break the graph."""
    if isinstance(max_seqlen, int):
        return max_seqlen if max_seqlen > 0 else None
    if tracing or not isinstance(max_seqlen, torch.Tensor) or max_seqlen.device.type != "cpu":
        return None
    value = int(max_seqlen)
    return value if value > 0 else None


class RouteLog:
    """Thread-safe counts of the forwards each route took, and the towers qvl runs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(ROUTES, 0)
        self._towers: list[dict] = []

    def count(self, route: str) -> None:
        """Count one forward taken by ``route`` (one of :data:`ROUTES`)."""
        with self._lock:
            self._counts[route] += 1

    def route_counts(self) -> dict[str, int]:
        """How many forwards each route took since the process started: ``attention`` (the engine's vision
        attention calls run by ``torch.ops.qvl.vision_attn``), ``attention_fallback`` (calls left to the engine's
        own attention), ``tower`` (vision tower forwards run by qvl's tower) and ``tower_fallback`` (tower forwards
        left to the engine's own). Calls made while torch.compile traces are not counted."""
        with self._lock:
            return dict(self._counts)

    def record_tower(self, description: dict) -> None:
        """Note a tower qvl took over."""
        with self._lock:
            self._towers.append(dict(description))

    def towers(self) -> list[dict]:
        """The towers qvl runs in this process, one dict each (the engine plugin says which keys)."""
        with self._lock:
            return [dict(tower) for tower in self._towers]
