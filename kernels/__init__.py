"""qvl.kernels: Triton kernels for the Qwen-VL vision towers, registered as ``torch.ops.qvl.*``.

Importing this package registers the ops; nothing is compiled and no GPU is queried at import.
Each module holds one kernel family (Triton kernel, launch configuration, launcher, op registration,
torch reference): ``attention`` (vision_attn; a package of ``config``, ``forward`` and ``backward``),
``rotary`` (rotary_2d, rotary_2d_), ``pos_embed`` (pos_embed_interp, pos_embed_interp_add_), ``layer_norm``
(layer_norm, add_layer_norm), ``rms_norm`` (rms_norm, add_rms_norm), ``gelu`` (bias_gelu, bias_gelu_: erf,
tanh and quick GELU), ``swiglu`` (bias_swiglu). The out-of-place ops of pos_embed, layer_norm, rms_norm, gelu
and swiglu have a backward (``torch.library.register_autograd``, itself a custom op ``*_backward``); their
in-place ops refuse gradients. ``tiles`` holds what two families share (Triton device functions, the
row-wise epilogues' tiles, the backward's partial-sum reduction); ``common`` chooses the path each call takes
(the autograd routing included) and checks arguments; ``torch_path`` holds the ops' CPU path (torch's fused
attention, the rotary once per q and k) as functions torch.compile traces into, ``direct`` the ops' bodies for eager
inference on the Triton paths (no dispatcher), and :func:`ops_for` picks one of them or the custom ops for a
device. Single-device ops only: composing them into layers,
and distributing them, is :mod:`qvl.vit`'s business.
"""

import sys as _sys

if __name__ != "qvl.kernels":
    # Imported as a top-level "kernels" because the repository root is on sys.path (``python -m pytest`` from
    # it). That name belongs to Hugging Face's "kernels" distribution, which transformers (5.25 on) depends on
    # and imports: this name gets that package where it is installed, else the one qvl.kernels (a second copy
    # would register the ops again with its own backend state).
    import importlib.machinery as _machinery
    import importlib.util as _util
    from pathlib import Path as _Path

    _root = _Path(__file__).resolve().parent.parent
    _elsewhere = [entry for entry in _sys.path if _Path(entry or ".").resolve() != _root]
    _spec = _machinery.PathFinder.find_spec(__name__, _elsewhere)
    if _spec is None:
        import qvl.kernels as _qvl_kernels

        _sys.modules[__name__] = _qvl_kernels
    else:
        _module = _util.module_from_spec(_spec)
        _sys.modules[__name__] = _module
        _spec.loader.exec_module(_module)
else:
    from .attention import MAX_HEAD_DIM, vision_attn, vision_attn_reference
    from .common import backend_for, force_backend, set_value_checks
    from .gelu import bias_gelu, bias_gelu_, bias_gelu_backward, bias_gelu_reference
    from .layer_norm import (
        add_layer_norm,
        add_layer_norm_reference,
        layer_norm,
        layer_norm_backward,
        layer_norm_reference,
    )
    from .pos_embed import (
        pos_embed_interp,
        pos_embed_interp_add_,
        pos_embed_interp_backward,
        pos_embed_interp_reference,
    )
    from .rms_norm import add_rms_norm, add_rms_norm_reference, rms_norm, rms_norm_backward, rms_norm_reference
    from .rotary import rotary_2d, rotary_2d_, rotary_2d_reference
    from .swiglu import bias_swiglu, bias_swiglu_backward, bias_swiglu_reference
    from .torch_path import ops_for

__all__ = [
    "MAX_HEAD_DIM",
    "add_layer_norm",
    "add_layer_norm_reference",
    "add_rms_norm",
    "add_rms_norm_reference",
    "backend_for",
    "bias_gelu",
    "bias_gelu_backward",
    "bias_gelu_",
    "bias_gelu_reference",
    "bias_swiglu",
    "bias_swiglu_backward",
    "bias_swiglu_reference",
    "force_backend",
    "layer_norm",
    "layer_norm_backward",
    "layer_norm_reference",
    "ops_for",
    "pos_embed_interp",
    "pos_embed_interp_backward",
    "pos_embed_interp_add_",
    "pos_embed_interp_reference",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_reference",
    "rotary_2d",
    "rotary_2d_",
    "rotary_2d_reference",
    "set_value_checks",
    "vision_attn",
    "vision_attn_reference",
]
