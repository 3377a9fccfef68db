"""SGLang's vision attention on ``torch.ops.qvl.vision_attn``: a ViT attention backend put into every
``VisionAttention`` layer of a loaded model.

SGLang builds ``VisionAttention`` in the vision towers of its multimodal models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL,
Qwen3.5, GLM-4V, InternVL and more); each layer holds one backend instance (``qkv_backend``: fa3, fa4, triton_attn,
sdpa, ... chosen by ``--mm-attention-backend`` or the platform) that it calls with ``q``, ``k``, ``v`` of shape
``(batch * seq, heads, head_size)``, the segments' token offsets (``cu_seqlens``: a tensor, SGLang's
``SingletonCache``, None for equal-length batches, or the ``[cu_seqlens, seq_lens, max_seqlen]`` list of its ViT
CUDA graphs) or precomputed ``forward_metadata``. :func:`attach` replaces each layer's backend with
:class:`QvlVisionBackend`, which runs every call it covers as one varlen ``vision_attn`` and hands the others to the
layer's own backend, kept as its fallback. The layer's ``qkv_backend_name`` becomes ``"qvl"``; q, k and v then
arrive as strided views of the packed projection (the op takes any layout whose last dim is contiguous) wherever
SGLang offers them.

Layers left on SGLang's backend (decided by :func:`attach`, one log line per reason): k/v with fewer heads than q,
head sizes over 256, weights on devices other than CPU and CUDA. Calls handed to the fallback (logged once per
reason): an explicit attention mask, sliding windows or attention sinks, dtypes other than fp16/bf16/fp32.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

import qvl.kernels  # noqa: F401  (registers torch.ops.qvl)
from qvl.kernels.attention import MAX_HEAD_DIM
from qvl.kernels.common import FLOAT_DTYPES

from ..routes import RouteLog, host_tile_hint

__all__ = ["QvlVisionBackend", "attach", "layer_mismatch"]

# SGLang prints the records of loggers under its own "sglang" logger.
logger = logging.getLogger("sglang.qvl")
_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.info(message)


def layer_mismatch(layer: nn.Module) -> str | None:
    """Why qvl's backend cannot serve SGLang's ``VisionAttention`` ``layer`` (None when it can)."""
    heads, kv_heads = layer.num_attention_heads_per_partition, layer.num_attention_kv_heads_per_partition
    if kv_heads != heads:
        return f"k/v with fewer heads ({kv_heads}) than q ({heads})"
    if layer.head_size > MAX_HEAD_DIM:
        return f"head size {layer.head_size} > {MAX_HEAD_DIM}"
    device = layer.proj.weight.device
    if device.type not in ("cpu", "cuda"):
        return f"weights on {device.type} (qvl runs on CPU and CUDA)"
    return None


class QvlVisionBackend(nn.Module):
    """A ViT attention backend of SGLang's ``VisionAttention`` that runs ``torch.ops.qvl.vision_attn``.

    Args:
        fallback: the layer's own backend, which takes the calls qvl does not cover (module docstring).
        fallback_name: its name in SGLang's ``QKV_BACKEND_IMPL``.
        strided_fallback: whether ``fallback`` reads strided q/k/v views (SGLang's ``STRIDED_QKV_BACKENDS``);
            else the views are made dense before it is called.
        routes: where calls are counted.

    ``forward`` takes SGLang's backend arguments and returns ``(batch * seq, heads, head_size)`` in q's dtype.
    """

    def __init__(self, fallback: nn.Module, fallback_name: str, strided_fallback: bool, routes: RouteLog):
        super().__init__()
        self.fallback = fallback
        self.fallback_name = fallback_name
        self.strided_fallback = strided_fallback
        self.routes = routes

    @staticmethod
    def _call_mismatch(q, k, v, attention_mask, window_size, s_aux) -> str | None:
        if attention_mask is not None:
            return "an explicit attention mask"
        if window_size is not None and tuple(window_size) != (-1, -1):
            return f"a sliding window {tuple(window_size)}"
        if s_aux is not None:
            return "attention sinks"
        if q.dtype not in FLOAT_DTYPES or not q.dtype == k.dtype == v.dtype:
            return f"dtypes {q.dtype}, {k.dtype}, {v.dtype}"
        if k.shape != q.shape or v.shape != q.shape:
            return "k or v shaped unlike q"
        return None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        bsz: int = 1,
        seq_len: int | None = None,
        cu_seqlens=None,
        attention_mask: torch.Tensor | None = None,
        forward_metadata=None,
        max_seqlen=None,
        softmax_scale: float | None = None,
        window_size=None,
        s_aux: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        tracing = torch.compiler.is_compiling()
        reason = self._call_mismatch(q, k, v, attention_mask, window_size, s_aux)
        if reason is not None:
            if not tracing:
                self.routes.count("attention_fallback")
                _log_once(f"qvl: SGLang's {self.fallback_name} vision attention runs for calls with {reason}")
            if not self.strided_fallback:
                q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            return self.fallback(
                q=q,
                k=k,
                v=v,
                bsz=bsz,
                seq_len=seq_len,
                cu_seqlens=cu_seqlens,
                attention_mask=attention_mask,
                forward_metadata=forward_metadata,
                max_seqlen=max_seqlen,
                softmax_scale=softmax_scale,
                window_size=window_size,
                s_aux=s_aux,
                **kwargs,
            )
        if not tracing:
            self.routes.count("attention")
        segments, hint = _segments(q, bsz, cu_seqlens, forward_metadata, max_seqlen, tracing)
        return torch.ops.qvl.vision_attn(q, k, v, segments, max_seqlen=hint, softmax_scale=softmax_scale)


def _segments(q: torch.Tensor, bsz: int, cu_seqlens, forward_metadata, max_seqlen, tracing: bool):
    """``(cu_seqlens, tile hint)`` of a call: int32 token offsets on q's device and, where SGLang holds it on the
    host, the longest segment (no device sync is made for it)."""
    if forward_metadata is not None:
        return forward_metadata.cu_seqlens, forward_metadata.max_seqlen
    if isinstance(cu_seqlens, list):
        # SGLang's ViT CUDA graphs: [cu_seqlens, seq_lens, max_seqlen] for the layer's original backend triton_attn,
        # [cu_seqlens, max_seqlen] for fa3 / fa4 (the graph runner reads the name before qvl replaces it).
        cu_seqlens, max_seqlen = cu_seqlens[0], cu_seqlens[-1]
    elif cu_seqlens is not None and not isinstance(cu_seqlens, torch.Tensor):  # SingletonCache
        cu_seqlens = cu_seqlens.get_data()
    if cu_seqlens is None:  # bsz sequences of one length
        seq_len = q.shape[0] // bsz
        return torch.arange(0, q.shape[0] + 1, seq_len, dtype=torch.int32, device=q.device), seq_len
    cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32, non_blocking=True)
    return cu_seqlens, host_tile_hint(max_seqlen, tracing)


def attach(model: nn.Module, routes: RouteLog) -> tuple[int, dict[str, int]]:
    """Put :class:`QvlVisionBackend` into every SGLang ``VisionAttention`` layer of ``model`` that qvl can serve.
    Returns ``(layers taken, {reason: layers left to SGLang})``."""
    from sglang.srt.layers.attention import vision

    taken, left = 0, {}
    for module in model.modules():
        if not isinstance(module, vision.VisionAttention) or isinstance(module.qkv_backend, QvlVisionBackend):
            continue
        reason = layer_mismatch(module)
        if reason is not None:
            left[reason] = left.get(reason, 0) + 1
            continue
        name = module.qkv_backend_name
        module.qkv_backend = QvlVisionBackend(module.qkv_backend, name, name in vision.STRIDED_QKV_BACKENDS, routes)
        module.qkv_backend_name = "qvl"
        # The layer hands strided q/k/v views to backends that take them, as VisionAttention.__init__ decides for
        # SGLang's own: not where a qk norm or a model's position applier between the projection and the
        # backend needs them dense.
        module.pass_strided_qkv = (
            module.use_qkv_parallel
            and not module.qk_normalization
            and module.customized_position_embedding_applier is None
        )
        taken += 1
    return taken, left
