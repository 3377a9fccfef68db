"""qvl.kernels: Triton kernels for the Qwen3-VL vision tower, registered as ``torch.ops.qvl.*``.

Importing this package registers the ops; nothing is compiled and no GPU is queried at import.
Each module holds one kernel family (Triton kernel, launcher, op registration, torch reference):
``attention`` (vision_attn), ``rotary`` (rotary_2d, rotary_2d_), ``pos_embed`` (pos_embed_interp,
pos_embed_interp_add_), ``merger`` (layer_norm, add_layer_norm, bias_gelu, bias_gelu_, and the
patch_merger / vision_mlp compositions); ``common`` chooses the path each call takes.
"""

import sys as _sys

if __name__ != "qvl.kernels":
    # Imported as a top-level "kernels" because the repository root is on sys.path (transformers probes
    # for Hugging Face's "kernels" package by importing it). A second copy would register the ops again
    # with its own backend state, so this name gets the one qvl.kernels instead.
    import qvl.kernels as _qvl_kernels

    _sys.modules[__name__] = _qvl_kernels
else:
    from .attention import MAX_HEAD_DIM, vision_attn, vision_attn_reference
    from .common import backend_for, force_backend, set_value_checks
    from .merger import (
        add_layer_norm,
        add_layer_norm_reference,
        bias_gelu,
        bias_gelu_,
        bias_gelu_reference,
        layer_norm,
        layer_norm_reference,
        patch_merger,
        vision_mlp,
    )
    from .pos_embed import pos_embed_interp, pos_embed_interp_add_, pos_embed_interp_reference
    from .rotary import rotary_2d, rotary_2d_, rotary_2d_reference

__all__ = [
    "MAX_HEAD_DIM",
    "add_layer_norm",
    "add_layer_norm_reference",
    "backend_for",
    "bias_gelu",
    "bias_gelu_",
    "bias_gelu_reference",
    "force_backend",
    "layer_norm",
    "layer_norm_reference",
    "patch_merger",
    "pos_embed_interp",
    "pos_embed_interp_add_",
    "pos_embed_interp_reference",
    "rotary_2d",
    "rotary_2d_",
    "rotary_2d_reference",
    "set_value_checks",
    "vision_attn",
    "vision_attn_reference",
    "vision_mlp",
]
