"""What qvl's routes inside vLLM did in this process (see :mod:`qvl.vit.engines.vllm.plugin`): how many forwards each
took (:meth:`~qvl.vit.engines.routes.RouteLog.route_counts`), and how each tower it took over runs: :func:`towers` gives
one dict per tower with ``model`` (vLLM's class name), ``split`` (``"data"``: qvl's balancer over vLLM's
tensor-parallel group, ``"weights"``: vLLM's sharded linears and all-reduces, ``None``: one rank), ``compiled``
(vLLM's ``compile_mm_encoder``) and ``encoder_graphs`` (vLLM's encoder CUDA graphs capture and replay it). Under
those graphs a tower forward is counted per batch replayed."""

from __future__ import annotations

from ..routes import RouteLog

__all__ = ["count", "record_tower", "route_counts", "towers"]

_log = RouteLog()
count = _log.count
route_counts = _log.route_counts
record_tower = _log.record_tower
towers = _log.towers
