"""qvl.kernels: Triton kernels for the Qwen3-VL vision tower, registered as ``torch.ops.qvl.*``.

Importing this package registers the ops; nothing is compiled and no GPU is queried at import.
"""

from .attention import MAX_HEAD_DIM, vision_attn, vision_attn_reference
from .common import backend_for, force_backend, set_value_checks
from .rotary import rotary_2d, rotary_2d_, rotary_2d_reference

__all__ = [
    "MAX_HEAD_DIM",
    "backend_for",
    "force_backend",
    "rotary_2d",
    "rotary_2d_",
    "rotary_2d_reference",
    "set_value_checks",
    "vision_attn",
    "vision_attn_reference",
]
