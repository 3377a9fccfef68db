"""Compile every qvl Triton kernel for Hopper (sm_90) on a machine without a GPU.

Triton's wheel carries ptxas, so lowering to PTX and assembling a cubin needs no device: this catches
kernels that the interpreter runs but the GPU compiler rejects, and tiles that overflow shared memory.
Run as a script with TRITON_INTERPRET=0 (the interpreter's kernel objects cannot be compiled); prints one
JSON line per variant: {"name", "shared", "num_warps"}.
"""

import json
import os

assert os.environ.get("TRITON_INTERPRET", "0") == "0", "compile with the interpreter off"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from qvl.kernels import attention, gelu, layer_norm, pos_embed, rotary  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
POINTER = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32"}


def compile_variant(name, kernel, pointers, floats, constexprs, num_warps, num_stages=2):
    """Signature from the kernel's own argument names: pointers and floats as given, every other
    runtime argument an i32, the rest constexpr."""
    signature = {}
    for arg in kernel.arg_names:
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg in pointers:
            signature[arg] = pointers[arg]
        else:
            signature[arg] = "fp32" if arg in floats else "i32"
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    # pos_embed launches without FMA contraction, every other kernel with it (see FMA_CONTRACTION).
    fusion = kernel is not pos_embed._pos_embed_interp_kernel
    options = {"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": fusion}
    compiled = triton.compile(source, target=HOPPER, options=options)
    print(json.dumps({"name": name, "shared": compiled.metadata.shared, "num_warps": num_warps}), flush=True)


def attention_variant(head_dim, dtype, rope):
    main, tail = attention.head_dim_tiles(head_dim)
    config = attention._launch_config(head_dim, dtype)
    p = POINTER[dtype]
    compile_variant(
        f"vision_attn D={head_dim} {dtype} rope={rope}",
        attention._vision_attn_kernel,
        {"Q": p, "K": p, "V": p, "Out": p, "CuSeqlens": "*i32", "Positions": "*i32"},
        {"qk_scale", "log2_theta"},
        {"HEAD_DIM": head_dim, "D_MAIN": main, "D_TAIL": tail, "BLOCK_M": config["BLOCK_M"],
         "BLOCK_N": config["BLOCK_N"], "ROTATE_Q": rope,
         "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32", "WIDE_OFFSETS": False},
        config["num_warps"], config["num_stages"],
    )


def main():
    attention_variant(72, torch.bfloat16, True)
    attention_variant(128, torch.float32, True)
    b = POINTER[torch.bfloat16]
    compile_variant(
        "rotary_2d D=72", rotary._rotary_2d_kernel,
        {"Q": b, "K": b, "QOut": b, "KOut": b, "Positions": "*i32"}, {"log2_theta"},
        {"HEAD_DIM": 72, "BLOCK_D": 128, "BLOCK_T": 32, "ROTATE_Q": True}, 4,
    )
    compile_variant(
        "pos_embed_interp_add_", pos_embed._pos_embed_interp_kernel,
        {"Table": b, "Indices": "*i32", "Weights": "*fp32", "Out": b}, set(),
        {"ADD": True, "NUM_TAPS": 4, "BLOCK_T": 32, "BLOCK_C": 128}, 4,
    )
    compile_variant(
        "add_layer_norm C=4608", layer_norm._layer_norm_kernel,
        {"X": b, "Delta": b, "Sum": b, "Weight": b, "Bias": b, "Y": b}, {"eps"},
        {"BLOCK_M": 1, "BLOCK_C": 8192, "HAS_DELTA": True}, 8,
    )
    for tanh in (False, True):
        compile_variant(
            f"bias_gelu tanh={tanh}", gelu._bias_gelu_kernel,
            {"X": b, "Bias": b, "Y": b}, set(),
            {"BLOCK_M": 4, "BLOCK_N": 1024, "APPROXIMATE_TANH": tanh}, 4,
        )


if __name__ == "__main__":
    main()
