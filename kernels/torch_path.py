"""The ops' torch path as plain functions, for code that torch.compile should see through.

On the ``"torch"`` path (:mod:`qvl.kernels.common`: CPU tensors outside Triton's interpreter) each ``torch.ops.qvl``
op runs plain torch. Called as custom ops they stay opaque to torch.compile, so Inductor could fuse none of their
elementwise work with the matmuls' neighbours. This module holds the same computations as functions with the ops'
names, arguments and results, which a compiled caller traces into: :func:`ops_for` hands the tower's layers this
module on the torch path in inference and ``torch.ops.qvl`` elsewhere. Attention stays a custom op inside the traced
code (:func:`vision_attn` rotates q and k in traceable torch, then calls ``torch.ops.qvl.vision_attn``, whose torch
path reads the segment bounds on the host), so a compiled tower still has one graph for every batch shape.

Where the ops' references are already as fast as plain torch gets (RMSNorm, SwiGLU) the torch path is the reference
itself.

These functions skip the ops' argument checks (shapes, dtypes, index ranges): their callers are qvl's own layers,
which build every argument, and checks a compiled forward traced would be guards and host reads. Code of one's own
should call ``torch.ops.qvl``, whose entry checks every argument and raises ValueError / TypeError naming it.
"""

from __future__ import annotations

import sys
from types import ModuleType

import torch

from . import direct
from .attention.forward import head_major, vision_attn_sdpa
from .common import TRITON_BACKENDS, backend_for
from .gelu import bias_gelu_torch as bias_gelu
from .gelu import bias_gelu_torch_ as bias_gelu_
from .layer_norm import add_layer_norm_torch as add_layer_norm
from .layer_norm import layer_norm_torch as layer_norm
from .pos_embed import pos_embed_interp_add_torch_ as pos_embed_interp_add_
from .pos_embed import pos_embed_interp_torch as pos_embed_interp
from .rms_norm import add_rms_norm_reference as add_rms_norm
from .rms_norm import rms_norm_reference as rms_norm
from .rotary import rotary_2d_torch as rotary_2d
from .swiglu import bias_swiglu_reference as bias_swiglu

__all__ = [
    "add_layer_norm",
    "add_rms_norm",
    "bias_gelu",
    "bias_gelu_",
    "bias_swiglu",
    "layer_norm",
    "ops_for",
    "pos_embed_interp",
    "pos_embed_interp_add_",
    "rms_norm",
    "rotary_2d",
    "vision_attn",
    "vision_attn_sdpa",
]


def vision_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None = None,
    softmax_scale: float | None = None,
    positions: torch.Tensor | None = None,
    rope_theta: float = 10000.0,
) -> torch.Tensor:
    """``torch.ops.qvl.vision_attn`` on the torch path, arguments and result as the op's: with ``positions`` q and k
    are rotated here (traced, so compiled code fuses the rotation), then the op attends
    (:func:`~qvl.kernels.attention.forward.vision_attn_sdpa`) without rotating again. k and v are put in the
    head-major layout the op attends on here too: in compiled code the copies join the loops that read the packed
    qkv, which then dies before the attention runs."""
    if positions is not None:
        q, k = rotary_2d(q, k, positions, rope_theta, k_head_major=True)
    k, v = head_major(k), head_major(v)
    return torch.ops.qvl.vision_attn(q, k, v, cu_seqlens, max_seqlen=max_seqlen, softmax_scale=softmax_scale)


def ops_for(device: torch.device) -> ModuleType | torch._ops._OpNamespace:
    """Where the towers' layers find qvl's ops for tensors on ``device``. On the ``"torch"`` path with grad mode off
    (inference: ``torch.no_grad``, ``torch.inference_mode``): this module. On the Triton paths, eager and with no
    dispatch mode active: :mod:`qvl.kernels.direct`, whose functions skip the dispatcher's host time wherever autograd
    has nothing to record and call the ops where it has. Everywhere else ``torch.ops.qvl``: the custom ops run Triton
    kernels, the references when ``"reference"`` is forced, and under grad mode their own backward formulas, which
    compute in fp32 where autograd through this module's 16-bit torch code would round each op's gradient (their
    forwards on the torch path are this module's functions); torch.compile and modes such as FakeTensorMode see the
    ops. torch.compile traces the choice, guarding on a forced path and on grad mode.

    Under ``torch.autocast`` for the device, always ``torch.ops.qvl``: the ops' autocast rules
    (:mod:`qvl.kernels.autocast`) live on the dispatcher, which the other two skip."""
    if torch.is_autocast_enabled(device.type):
        return torch.ops.qvl
    backend = backend_for(device)
    if backend == "torch":
        return torch.ops.qvl if torch.is_grad_enabled() else sys.modules[__name__]
    # is_compiling first: traced, it is constant True and the dispatch-stack query is never reached.
    if backend in TRITON_BACKENDS and not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() == 0:
        return direct
    return torch.ops.qvl
