"""What qvl's routes inside vLLM did in this process (see :mod:`qvl.vit.vllm_plugin`): how many forwards each
took, and how each tower it took over runs."""

from __future__ import annotations

import threading

__all__ = ["count", "record_tower", "route_counts", "towers"]

_lock = threading.Lock()
_counts = {"attention": 0, "attention_fallback": 0, "tower": 0, "tower_fallback": 0}
_towers: list[dict] = []


def count(route: str) -> None:
    """Count one forward taken by ``route`` (a key of :func:`route_counts`)."""
    with _lock:
        _counts[route] += 1


def route_counts() -> dict[str, int]:
    """How many forwards each route took in this process since it started: ``attention`` (vLLM's encoder
    attention calls run by ``torch.ops.qvl.vision_attn``), ``attention_fallback`` (calls left to vLLM's
    own attention), ``tower`` (vision tower forwards run by qvl's tower) and ``tower_fallback`` (tower
    forwards left to vLLM's own). Calls made while torch.compile traces are not counted."""
    with _lock:
        return dict(_counts)


def record_tower(description: dict) -> None:
    """Note a tower qvl took over (:func:`qvl.vit.vllm_tower.attach`)."""
    with _lock:
        _towers.append(dict(description))


def towers() -> list[dict]:
    """The towers qvl runs in this process, one dict each: ``model`` (vLLM's class name), ``split`` (``"data"``:
    qvl's balancer over vLLM's tensor-parallel group, ``"weights"``: vLLM's sharded linears and all-reduces,
    ``None``: one rank), ``compiled`` (vLLM's ``compile_mm_encoder``)."""
    with _lock:
        return [dict(tower) for tower in _towers]
