"""The ops' own bodies as plain functions, for eager calls on the Triton paths (issue 31's host time).

A call through ``torch.ops.qvl.<op>`` crosses the dispatcher twice (qvl's autograd router, then the backend kernel
torch.library registered), boxing every argument each way: on the host that doubles the cost of a small call (a
``(1, 8)`` LayerNorm on a CPU: 15-20 µs through the op, 7-9 µs as its body, ``bench/results/host-cpu-20261204``).
When autograd has nothing to record (grad mode off, or no tensor argument requiring grad: the test the autograd
router makes) nothing below the dispatcher is wanted. Each function here makes that test itself and then calls the
function torch.library registered for the op (argument checks, path choice and launch, exactly as the op runs
them), or else the op, whose autograd formula records the call. :func:`~qvl.kernels.ops_for` hands this module to
the towers' layers on the Triton paths when nothing traces and no dispatch mode is active (FakeTensorMode and
torch.compile see ``torch.ops.qvl``); its names are the ops the layers call, those :mod:`~qvl.kernels.torch_path`
offers. Where the installed torch keeps no body for an op, its name here is the op itself, so a call is never
wrong, only not cheaper (``tests/kernels/test_direct.py`` checks that every body is found, and the names).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from .attention.forward import vision_attn as _vision_attn
from .gelu import bias_gelu as _bias_gelu
from .gelu import bias_gelu_ as _bias_gelu_
from .layer_norm import add_layer_norm as _add_layer_norm
from .layer_norm import layer_norm as _layer_norm
from .pos_embed import pos_embed_interp as _pos_embed_interp
from .pos_embed import pos_embed_interp_add_ as _pos_embed_interp_add_
from .rms_norm import add_rms_norm as _add_rms_norm
from .rms_norm import rms_norm as _rms_norm
from .rotary import rotary_2d as _rotary_2d
from .swiglu import bias_swiglu as _bias_swiglu

__all__ = [
    "add_layer_norm",
    "add_rms_norm",
    "bias_gelu",
    "bias_gelu_",
    "bias_swiglu",
    "layer_norm",
    "pos_embed_interp",
    "pos_embed_interp_add_",
    "rms_norm",
    "rotary_2d",
    "vision_attn",
]


def body(op: Callable) -> Callable:
    """``op``'s registered Python function where autograd has nothing to record, else ``op``; ``op`` itself where
    torch.library keeps no function. An in-place op's body bumps the version counter of each tensor it writes, as
    the op's ADInplaceOrView kernel does, so autograd still refuses a backward through a tensor it overwrote."""
    function = getattr(op, "_init_fn", None)
    if function is None:
        return op
    is_grad_enabled, any_requires_grad = torch.is_grad_enabled, torch._C._any_requires_grad
    arguments = op._opoverload._schema.arguments
    written = [(i, a.name) for i, a in enumerate(arguments) if a.alias_info is not None and a.alias_info.is_write]

    @functools.wraps(function)
    def call(*args, **kwargs):
        if is_grad_enabled() and any_requires_grad(*args, *kwargs.values()):
            return op(*args, **kwargs)
        return function(*args, **kwargs)

    if not written:
        return call
    increment_version = torch._C._increment_version

    @functools.wraps(function)
    def call_in_place(*args, **kwargs):
        if is_grad_enabled() and any_requires_grad(*args, *kwargs.values()):
            return op(*args, **kwargs)
        increment_version(tuple(args[i] if i < len(args) else kwargs[name] for i, name in written))
        return function(*args, **kwargs)

    return call_in_place


add_layer_norm = body(_add_layer_norm)
add_rms_norm = body(_add_rms_norm)
bias_gelu = body(_bias_gelu)
bias_gelu_ = body(_bias_gelu_)
bias_swiglu = body(_bias_swiglu)
layer_norm = body(_layer_norm)
pos_embed_interp = body(_pos_embed_interp)
pos_embed_interp_add_ = body(_pos_embed_interp_add_)
rms_norm = body(_rms_norm)
rotary_2d = body(_rotary_2d)
vision_attn = body(_vision_attn)
