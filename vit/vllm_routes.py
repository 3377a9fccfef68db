"""How many forwards each of qvl's routes inside vLLM took in this process (see :mod:`qvl.vit.vllm_plugin`)."""

from __future__ import annotations

import threading

__all__ = ["count", "route_counts"]

_lock = threading.Lock()
_counts = {"attention": 0, "attention_fallback": 0, "tower": 0, "tower_fallback": 0}


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
