"""vLLM's encoder attention on ``torch.ops.qvl.vision_attn``: an out-of-tree ``MMEncoderAttention``.

vLLM builds ``MMEncoderAttention(num_heads, head_size, scale, num_kv_heads, prefix)`` in the vision towers of
many models and calls it with ``query``, ``key``, ``value`` of shape ``(batch, seq, heads, head_size)`` (or
``(batch, seq, heads * head_size)``), ``cu_seqlens`` (int32 token offsets of the segments, on the device,
for ``batch == 1``) and ``max_seqlen`` (a CPU scalar some backends read). :class:`QvlEncoderAttention`
takes its place through ``MMEncoderAttention.register_oot`` and runs each call as one varlen
``vision_attn`` over the flattened tokens: no host sync (vLLM's CPU-side ``max_seqlen``, where it is filled,
only picks the op's tiles: short windows get short tiles), a custom op that torch.compile and CUDA graphs
take whole.

On a CPU the op runs qvl's torch path (torch's fused attention per run of equal-length segments); where that was
not measured to beat vLLM's own CPU vision code in the layer's dtype, every layer keeps vLLM's forward by default
(:mod:`qvl.vit.engines.cpu_path`: the decision, its switch ``QVL_CPU_ROUTES``, one log line).

Layers qvl does not cover keep vLLM's own forward for every call (decided when the layer is built, logged
once per reason): fp8 attention, k/v with fewer heads than q, head sizes over 256, dtypes other than
fp16/bf16/fp32, platforms other than CPU and CUDA, and vLLM's FlashInfer backend (its ``cu_seqlens`` are not
token offsets). Calls qvl does not cover fall back one by one (also logged once): cross-attention (key
length != query length), ``cu_seqlens`` with a batch over 1 or not int32. Batches of equal-length
sequences without ``cu_seqlens`` run as one varlen call.
"""

from __future__ import annotations

import torch
from vllm.logger import init_logger
from vllm.model_executor.layers.attention.mm_encoder_attention import MMEncoderAttention
from vllm.platforms import current_platform
from vllm.v1.attention.backends.registry import AttentionBackendEnum

import qvl.kernels  # noqa: F401  (registers torch.ops.qvl)
from qvl.kernels.attention import MAX_HEAD_DIM
from qvl.kernels.common import FLOAT_DTYPES

from ..cpu_path import cpu_route_decision
from ..routes import host_tile_hint
from .routes import count

__all__ = ["QvlEncoderAttention", "cpu_step_aside", "install"]

logger = init_logger("vllm.qvl")


def _layer_mismatch(layer: MMEncoderAttention) -> str | None:
    if not (current_platform.is_cpu() or current_platform.is_cuda()):
        return f"platform {current_platform.device_name!r} (qvl runs on CPU and CUDA)"
    if getattr(layer, "fp8_enabled", False):
        return "fp8 attention (mm_encoder_attn_dtype='fp8')"
    if layer.num_kv_heads != layer.num_heads:
        return f"k/v with fewer heads ({layer.num_kv_heads}) than q ({layer.num_heads})"
    if layer.head_size > MAX_HEAD_DIM:
        return f"head size {layer.head_size} > {MAX_HEAD_DIM}"
    if layer.dtype not in FLOAT_DTYPES:
        return f"dtype {layer.dtype}"
    if layer.attn_backend == AttentionBackendEnum.FLASHINFER:
        return "vLLM's FlashInfer ViT backend (its cu_seqlens are not token offsets)"
    return None


def cpu_step_aside(dtype: torch.dtype) -> str | None:
    """Why qvl's routes leave vision work in ``dtype`` to vLLM on this CPU
    (:func:`qvl.vit.engines.cpu_path.cpu_route_decision`, logged once per process whichever way it goes), or None
    where they take it (any GPU)."""
    if not current_platform.is_cpu():
        return None
    route, reason = cpu_route_decision("vllm", dtype)
    if route:
        logger.info_once(f"qvl: routes vLLM's vision work on this CPU: {reason}")
        return None
    logger.info_once(f"qvl: steps aside on this CPU, vLLM's own vision code runs: {reason}")
    return reason


class QvlEncoderAttention(MMEncoderAttention):
    """``MMEncoderAttention`` whose forward runs ``torch.ops.qvl.vision_attn`` (see the module docstring for
    what falls back to vLLM's own forward). Output shape and dtype are vLLM's: the query's shape, with the
    query's dtype."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float | None = None,
        num_kv_heads: int | None = None,
        prefix: str = "",
        *args,
        **kwargs,
    ) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, prefix, *args, **kwargs)
        try:
            mismatch = _layer_mismatch(self)
            # A CPU step-aside logs its own line (cpu_step_aside), shared with the tower route.
            self.qvl_fallback_reason = mismatch or cpu_step_aside(self.dtype)
        except Exception as error:  # a layer that differs from what qvl expects must still serve, on vLLM's code
            mismatch = self.qvl_fallback_reason = f"a layer qvl does not recognise ({type(error).__name__}: {error})"
        if self.qvl_fallback_reason is None:
            logger.info_once("qvl: vLLM's encoder attention runs on torch.ops.qvl.vision_attn")
        elif mismatch is not None:
            logger.info_once(f"qvl: vLLM's own encoder attention runs for layers with {mismatch}")

    def _call_mismatch(self, query, key, value, cu_seqlens) -> str | None:
        if self.qvl_fallback_reason is not None:
            return self.qvl_fallback_reason
        if query.dim() not in (3, 4) or key.shape[:2] != query.shape[:2] or value.shape[:2] != query.shape[:2]:
            return "cross-attention or unexpected q/k/v shapes"
        if not query.dtype == key.dtype == value.dtype:
            return "q, k and v of different dtypes"
        if cu_seqlens is not None and (query.shape[0] != 1 or cu_seqlens.dtype != torch.int32):
            return "cu_seqlens with a batch over 1 or not int32"
        return None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: torch.Tensor | None = None,
        sequence_lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        reason = self._call_mismatch(query, key, value, cu_seqlens)
        tracing = torch.compiler.is_compiling()
        if reason is not None:
            if not tracing:
                count("attention_fallback")
                if reason is not self.qvl_fallback_reason:
                    logger.info_once(f"qvl: vLLM's own encoder attention runs for calls with {reason}")
            return self._forward_method(query, key, value, cu_seqlens, max_seqlen, sequence_lengths)
        if not tracing:
            count("attention")
        batch, seq_len = query.shape[:2]
        q, k, v = (t.reshape(batch * seq_len, self.num_heads, self.head_size) for t in (query, key, value))
        if cu_seqlens is None:
            cu_seqlens = torch.arange(0, (batch + 1) * seq_len, seq_len, dtype=torch.int32, device=query.device)
            hint = seq_len
        else:
            hint = host_tile_hint(max_seqlen, tracing)
        out = torch.ops.qvl.vision_attn(q, k, v, cu_seqlens, max_seqlen=hint, softmax_scale=self.scale)
        return out.view(query.shape)


def install() -> None:
    """Make vLLM build :class:`QvlEncoderAttention` wherever a model asks for ``MMEncoderAttention``."""
    MMEncoderAttention.register_oot(QvlEncoderAttention)
