"""Compile every qvl Triton kernel for Hopper (sm_90), and the attention tiles that differ on Ada (sm_89), on a
machine without a GPU.

Triton's wheel carries ptxas, so lowering to PTX and assembling a cubin needs no device: this catches
kernels that the interpreter runs but the GPU compiler rejects, and tiles that overflow shared memory.
Each variant is an op's own launch list (its ``*_launches`` function, which its launcher runs) built for
CPU stand-ins shaped, strided and aligned like the tower's calls and compiled through Triton's launch
binder (:func:`qvl.kernels.common.compile_launch`), so what compiles here is what a launch compiles.

Run as a script with TRITON_INTERPRET=0 (the interpreter's kernel objects cannot be compiled). Prints one
JSON line ``{"variants": [names]}`` first, then one per compiled launch: ``{"name", "kernel", "shared",
"shared_limit", "num_warps", "num_stages"}`` (``shared_limit``: the most a block may use on the target).
"""

import json
import os
import sys
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET", "0") == "0", "compile with the interpreter off"

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for bench

import torch  # noqa: E402

from bench.sass_attention import stand_in_launches  # noqa: E402
from qvl.kernels.common import ADA, HOPPER, compile_launch, shared_memory_per_block  # noqa: E402
from qvl.kernels.gelu import bias_gelu_launches  # noqa: E402
from qvl.kernels.layer_norm import layer_norm_launches  # noqa: E402
from qvl.kernels.pos_embed import pos_embed_interp_launches  # noqa: E402
from qvl.kernels.rms_norm import rms_norm_launches  # noqa: E402
from qvl.kernels.rotary import rotary_launches  # noqa: E402
from qvl.kernels.swiglu import bias_swiglu_launches  # noqa: E402

BF16 = torch.bfloat16
# Qwen3-VL 8B's vision tower: 16 heads of 72, hidden 1152, MLP 4304, merger input 4 * 1152.
TOKENS, HEADS, HIDDEN, MLP, MERGED = 1024, 16, 1152, 4304, 4608


def rotary_in_place():
    q, k, _ = torch.empty(TOKENS, 3, HEADS, 72, dtype=BF16).unbind(1)
    positions = torch.zeros(TOKENS, 2, dtype=torch.int32)
    return rotary_launches(q, k, q, k, positions, 10000.0, HOPPER)


def pos_embed_add():
    table = torch.empty(48 * 48, HIDDEN, dtype=BF16)
    indices = torch.zeros(TOKENS, 4, dtype=torch.int32)
    weights = torch.zeros(TOKENS, 4)
    hidden = torch.empty(TOKENS, HIDDEN, dtype=BF16)
    return pos_embed_interp_launches(table, indices, weights, hidden, True, HOPPER)


def norm(num_cols, add):
    x, delta, h, y = (torch.empty(TOKENS, num_cols, dtype=BF16) for _ in range(4))
    weight, bias = torch.empty(num_cols, dtype=BF16), torch.empty(num_cols, dtype=BF16)
    return layer_norm_launches(x, delta if add else None, h if add else None, weight, bias, y, 1e-6, HOPPER)


def bias_gelu(num_cols, approximate):
    x = torch.empty(TOKENS, num_cols, dtype=BF16)
    return bias_gelu_launches(x, torch.empty(num_cols, dtype=BF16), x, approximate, HOPPER)


# Qwen2.5-VL's vision tower: hidden 1280 (RMSNorm), SwiGLU MLP 3420; Qwen2-VL's QuickGELU MLP 4 * 1280.
QWEN25_HIDDEN, QWEN25_MLP, QWEN2_MLP = 1280, 3420, 5120


def rms_norm(num_cols, add):
    x, delta, h, y = (torch.empty(TOKENS, num_cols, dtype=BF16) for _ in range(4))
    weight = torch.empty(num_cols, dtype=BF16)
    return rms_norm_launches(x, delta if add else None, h if add else None, weight, y, 1e-6, HOPPER)


def bias_swiglu_stacked(num_cols):
    """gate and up as the column halves of one stacked GEMM output (row stride 2F)."""
    gate_up = torch.empty(TOKENS, 2 * num_cols, dtype=BF16)
    gate_bias, up_bias = torch.empty(2, num_cols, dtype=BF16)
    y = torch.empty(TOKENS, num_cols, dtype=BF16)
    return bias_swiglu_launches(gate_up[:, :num_cols], gate_up[:, num_cols:], gate_bias, up_bias, y, HOPPER)


VARIANTS = {
    "vision_attn bf16 D=64": lambda: stand_in_launches(64, False),
    "vision_attn bf16 D=72": lambda: stand_in_launches(72, False),
    "vision_attn bf16 D=72 rope": lambda: stand_in_launches(72, True),
    "vision_attn bf16 D=72 unaligned": lambda: stand_in_launches(72, False, layout="offset"),
    "vision_attn bf16 D=256": lambda: stand_in_launches(256, False),
    "vision_attn fp32 D=128 rope": lambda: stand_in_launches(128, True, dtype=torch.float32),
    "vision_attn fp32 D=256": lambda: stand_in_launches(256, False, dtype=torch.float32),
    "vision_attn fp32 D=256 sm_89": lambda: stand_in_launches(256, False, dtype=torch.float32, target=ADA),
    # Qwen2.5-VL's window attention: 64-token windows with max_seqlen=64, the short-segment tiles.
    "vision_attn bf16 D=80 windows": lambda: stand_in_launches(80, False, max_seqlen=64),
    "vision_attn bf16 D=80 windows rope": lambda: stand_in_launches(80, True, max_seqlen=64),
    "vision_attn bf16 D=128 windows unaligned": lambda: stand_in_launches(128, False, "offset", max_seqlen=64),
    "rotary_2d_ bf16 D=72": rotary_in_place,
    "pos_embed_interp_add_ bf16": pos_embed_add,
    "layer_norm bf16 C=1152": lambda: norm(HIDDEN, False),
    "add_layer_norm bf16 C=4608": lambda: norm(MERGED, True),
    "bias_gelu bf16 F=4608": lambda: bias_gelu(MERGED, "none"),
    "bias_gelu tanh bf16 F=4304": lambda: bias_gelu(MLP, "tanh"),
    "bias_gelu quick bf16 F=5120": lambda: bias_gelu(QWEN2_MLP, "quick"),
    "rms_norm bf16 C=1280": lambda: rms_norm(QWEN25_HIDDEN, False),
    "add_rms_norm bf16 C=1280": lambda: rms_norm(QWEN25_HIDDEN, True),
    "bias_swiglu bf16 F=3420 stacked": lambda: bias_swiglu_stacked(QWEN25_MLP),
}


def main():
    print(json.dumps({"variants": list(VARIANTS)}), flush=True)
    for name, build in VARIANTS.items():
        launches = build()
        assert launches, f"{name}: nothing to launch"
        target = ADA if name.endswith("sm_89") else HOPPER
        for launch in launches:
            compiled = compile_launch(launch, target)
            line = {
                "name": name,
                "kernel": compiled.metadata.name,
                "shared": compiled.metadata.shared,
                "shared_limit": shared_memory_per_block(target),
                "num_warps": compiled.metadata.num_warps,
                "num_stages": compiled.metadata.num_stages,
            }
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
