"""Compile every qvl Triton kernel for Hopper (sm_90), and the attention tiles that differ on Ada (sm_89), on a
machine without a GPU.

Triton's wheel carries ptxas, so lowering to PTX and assembling a cubin needs no device: this catches
kernels that the interpreter runs but the GPU compiler rejects, and tiles that overflow shared memory.
Each variant is an op's own launch list (its ``*_launches`` function, which its launcher runs) built for
CPU stand-ins shaped, strided and aligned like the tower's calls and compiled through Triton's launch
binder (:func:`qvl.kernels.common.compile_launch`), so what compiles here is what a launch compiles.

Run as a script with TRITON_INTERPRET=0 (the interpreter's kernel objects cannot be compiled). Prints one
JSON line ``{"variants": [names]}`` first, then one per compiled launch: ``{"name", "kernel", "shared",
"shared_limit", "num_warps", "num_stages", "registers", "stack"}`` (``shared_limit``: the most a block may
use on the target; ``registers`` and ``stack`` bytes per thread as cuobjdump reads them from the cubin, None
where Triton's wheel has no cuobjdump).
"""

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET", "0") == "0", "compile with the interpreter off"

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for bench

import torch  # noqa: E402
import triton  # noqa: E402

from bench.sass_attention import stand_in_launches  # noqa: E402
from qvl.kernels.attention import head_dim_layout_in, vision_attn_backward_launches, vision_attn_launches  # noqa: E402
from qvl.kernels.common import ADA, HOPPER, compile_launch, shared_memory_per_block  # noqa: E402
from qvl.kernels.gelu import bias_gelu_backward_launches, bias_gelu_launches  # noqa: E402
from qvl.kernels.layer_norm import layer_norm_launches, norm_backward_launches, norm_partials  # noqa: E402
from qvl.kernels.pos_embed import pos_embed_interp_backward_launches, pos_embed_interp_launches  # noqa: E402
from qvl.kernels.rms_norm import rms_norm_launches  # noqa: E402
from qvl.kernels.rotary import rotary_launches  # noqa: E402
from qvl.kernels.swiglu import bias_swiglu_backward_launches, bias_swiglu_launches  # noqa: E402
from qvl.kernels.tiles import epilogue_backward_config  # noqa: E402

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


def bias_swiglu_two_gemms(num_cols):
    """gate and up as two GEMM outputs (qvl's and transformers' Qwen2.5-VL MLP), two biases."""
    gate, up, y = (torch.empty(TOKENS, num_cols, dtype=BF16) for _ in range(3))
    return bias_swiglu_launches(
        gate, up, torch.empty(num_cols, dtype=BF16), torch.empty(num_cols, dtype=BF16), y, HOPPER
    )


def bias_swiglu_stacked(num_cols):
    """gate and up as the column halves of one stacked GEMM output (row stride 2F) and their biases as the halves
    of one stacked bias (vLLM's ``gate_up_proj``)."""
    gate_up = torch.empty(TOKENS, 2 * num_cols, dtype=BF16)
    gate_bias, up_bias = torch.empty(2 * num_cols, dtype=BF16).chunk(2)
    y = torch.empty(TOKENS, num_cols, dtype=BF16)
    return bias_swiglu_launches(gate_up[:, :num_cols], gate_up[:, num_cols:], gate_bias, up_bias, y, HOPPER)


def attention_tensors(head_dim, dtype, max_seqlen):
    """The tower's call: q, k, v views of a packed qkv, a contiguous output, its log-sum-exp, segments as
    the forward's stand-ins have them (windows of ``max_seqlen`` tokens given as the hint)."""
    q, k, v = torch.empty(TOKENS, 3, HEADS, head_dim, dtype=dtype).unbind(1)
    out = torch.empty(TOKENS, HEADS, head_dim, dtype=dtype)
    bounds = [0, TOKENS // 4, TOKENS] if max_seqlen is None else [*range(0, TOKENS, max_seqlen), TOKENS]
    return q, k, v, out, torch.empty(HEADS, TOKENS), torch.tensor(bounds, dtype=torch.int32)


def attention_with_lse(head_dim, max_seqlen=None):
    """vision_attn_with_lse's launch: the forward kernel also writing the log-sum-exp."""
    q, k, v, out, lse, cu_seqlens = attention_tensors(head_dim, BF16, max_seqlen)
    return vision_attn_launches(q, k, v, out, cu_seqlens, None, None, 10000.0, HOPPER, max_seqlen, lse)


def attention_backward(head_dim, rope=False, dtype=BF16, max_seqlen=None, target=HOPPER):
    """vision_attn_backward's launches: delta, dK/dV, dQ, with rope the rotary kernel forward and inverse."""
    q, k, v, out, lse, cu_seqlens = attention_tensors(head_dim, dtype, max_seqlen)
    grad_out, dq, dk, dv = (torch.empty(out.shape, dtype=dtype) for _ in range(4))
    positions = torch.zeros(TOKENS, 2, dtype=torch.int32) if rope else None
    return vision_attn_backward_launches(
        grad_out, q, k, v, out, lse, dq, dk, dv, cu_seqlens, None, positions, 10000.0, target, max_seqlen
    )


def in_layout(layout, build):
    """``build()``'s launches, made in the attention kernels' head-dim layout ``layout``."""
    with head_dim_layout_in(layout):
        return build()


def norm_backward(num_cols, num_params, add):
    """LayerNorm's (``num_params`` 2) or RMSNorm's (1) backward: dx with the fp32 partial rows, their reduction."""
    x, grad_y, grad_h, dx = (torch.empty(TOKENS, num_cols, dtype=BF16) for _ in range(4))
    weight = torch.empty(num_cols, dtype=BF16)
    param_grads = tuple(torch.empty(num_cols, dtype=BF16) for _ in range(num_params))
    partials = norm_partials(x, num_params)
    return norm_backward_launches(grad_y, x, weight, grad_h if add else None, dx, partials, param_grads, 1e-6, HOPPER)


def epilogue_partials(num_rows, num_cols, count):
    programs = epilogue_backward_config(num_rows, num_cols)["programs"]
    return torch.empty(count, programs, num_cols)


def bias_gelu_backward(num_cols, approximate):
    x, grad_y, dx = (torch.empty(TOKENS, num_cols, dtype=BF16) for _ in range(3))
    bias, dbias = torch.empty(2, num_cols, dtype=BF16)
    partials = epilogue_partials(TOKENS, num_cols, 1)
    return bias_gelu_backward_launches(grad_y, x, bias, dx, partials, dbias, approximate)


def bias_swiglu_backward(num_cols):
    gate_up = torch.empty(TOKENS, 2 * num_cols, dtype=BF16)
    grad_y, d_gate, d_up = (torch.empty(TOKENS, num_cols, dtype=BF16) for _ in range(3))
    gate_bias, up_bias, d_gate_bias, d_up_bias = torch.empty(4, num_cols, dtype=BF16)
    partials = epilogue_partials(TOKENS, num_cols, 2)
    return bias_swiglu_backward_launches(
        grad_y, gate_up[:, :num_cols], gate_up[:, num_cols:], gate_bias, up_bias, d_gate, d_up, partials,
        d_gate_bias, d_up_bias,
    )  # fmt: skip


def pos_embed_backward():
    """The table gradient from the (token, tap) pairs sorted by table row."""
    rows = 48 * 48
    grad_out = torch.empty(TOKENS, HIDDEN, dtype=BF16)
    order = torch.zeros(4 * TOKENS, dtype=torch.int64)
    run_starts = torch.zeros(rows + 1, dtype=torch.int64)
    grad_table = torch.empty(rows, HIDDEN, dtype=BF16)
    return pos_embed_interp_backward_launches(grad_out, order, run_starts, torch.zeros(TOKENS, 4), grad_table, HOPPER)


CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


# A global load or store of one 16- or 8-bit element: rows moved element by element instead of in vectors.
NARROW_GLOBAL = re.compile(r"\b(?:LDG|STG)\.E(?:\.\w+)*\.(?:U16|S16|U8|S8)\b")


def cubin_facts(compiled) -> tuple[int | None, int | None, int | None]:
    """Registers and stack bytes per thread of a compiled kernel, and its count of narrow global accesses
    (:data:`NARROW_GLOBAL`), from its cubin (None for each without cuobjdump). Stack is where spilled registers
    go."""
    if not CUOBJDUMP.exists():
        return None, None, None
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([CUOBJDUMP, "--dump-resource-usage", cubin], capture_output=True, text=True, check=True)
        sass = subprocess.run([CUOBJDUMP, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    registers = int(re.search(r"REG:(\d+)", usage.stdout).group(1))
    return registers, int(re.search(r"STACK:(\d+)", usage.stdout).group(1)), len(NARROW_GLOBAL.findall(sass))


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
    # Training: the forward that also writes the log-sum-exp (with rope as the rope forward), the backward.
    "vision_attn_with_lse bf16 D=72": lambda: attention_with_lse(72),
    "vision_attn_with_lse bf16 D=80 windows": lambda: attention_with_lse(80, max_seqlen=64),
    "vision_attn_backward bf16 D=64": lambda: attention_backward(64),
    "vision_attn_backward bf16 D=72": lambda: attention_backward(72),
    "vision_attn_backward bf16 D=72 rope": lambda: attention_backward(72, rope=True),
    # The 32-wide head-dim tail a device run falls back to where the 16-wide one is wrong (head_dim_tiles).
    "vision_attn_with_lse bf16 D=72 split32": lambda: in_layout("split32", lambda: attention_with_lse(72)),
    "vision_attn_backward bf16 D=72 split32": lambda: in_layout("split32", lambda: attention_backward(72)),
    "vision_attn_backward bf16 D=80 windows": lambda: attention_backward(80, max_seqlen=64),
    "vision_attn_backward bf16 D=128": lambda: attention_backward(128),
    "vision_attn_backward bf16 D=256": lambda: attention_backward(256),
    "vision_attn_backward fp32 D=256 sm_89": lambda: attention_backward(256, dtype=torch.float32, target=ADA),
    "rotary_2d_ bf16 D=72": rotary_in_place,
    "pos_embed_interp_add_ bf16": pos_embed_add,
    "layer_norm bf16 C=1152": lambda: norm(HIDDEN, False),
    "add_layer_norm bf16 C=4608": lambda: norm(MERGED, True),
    "bias_gelu bf16 F=4608": lambda: bias_gelu(MERGED, "none"),
    "bias_gelu tanh bf16 F=4304": lambda: bias_gelu(MLP, "tanh"),
    "bias_gelu quick bf16 F=5120": lambda: bias_gelu(QWEN2_MLP, "quick"),
    "rms_norm bf16 C=1280": lambda: rms_norm(QWEN25_HIDDEN, False),
    "add_rms_norm bf16 C=1280": lambda: rms_norm(QWEN25_HIDDEN, True),
    "bias_swiglu bf16 F=3420": lambda: bias_swiglu_two_gemms(QWEN25_MLP),
    "bias_swiglu bf16 F=3420 stacked": lambda: bias_swiglu_stacked(QWEN25_MLP),
    # The other ops' backwards (attention's are above).
    "layer_norm_backward bf16 C=1152": lambda: norm_backward(HIDDEN, 2, False),
    "add_layer_norm_backward bf16 C=4608": lambda: norm_backward(MERGED, 2, True),
    "rms_norm_backward bf16 C=1280": lambda: norm_backward(QWEN25_HIDDEN, 1, False),
    "add_rms_norm_backward bf16 C=1280": lambda: norm_backward(QWEN25_HIDDEN, 1, True),
    "bias_gelu_backward tanh bf16 F=4304": lambda: bias_gelu_backward(MLP, "tanh"),
    "bias_gelu_backward bf16 F=4608": lambda: bias_gelu_backward(MERGED, "none"),
    "bias_gelu_backward quick bf16 F=5120": lambda: bias_gelu_backward(QWEN2_MLP, "quick"),
    "bias_swiglu_backward bf16 F=3420 stacked": lambda: bias_swiglu_backward(QWEN25_MLP),
    "pos_embed_interp_backward bf16": pos_embed_backward,
}


def main():
    print(json.dumps({"variants": list(VARIANTS)}), flush=True)
    for name, build in VARIANTS.items():
        launches = build()
        assert launches, f"{name}: nothing to launch"
        target = ADA if name.endswith("sm_89") else HOPPER
        for launch in launches:
            compiled = compile_launch(launch, target)
            registers, stack, narrow = cubin_facts(compiled)
            line = {
                "name": name,
                "kernel": compiled.metadata.name,
                "shared": compiled.metadata.shared,
                "shared_limit": shared_memory_per_block(target),
                "num_warps": compiled.metadata.num_warps,
                "num_stages": compiled.metadata.num_stages,
                "registers": registers,
                "stack": stack,
                "narrow_global": narrow,
            }
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
