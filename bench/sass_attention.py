"""What the attention kernel compiles to on Hopper, read without a GPU: ``python -m bench.sass_attention``.

Triton's wheel carries ptxas and cuobjdump, so the sm_90 machine code of ``vision_attn``'s kernel can be
inspected anywhere. For each variant (bf16, Qwen3-VL's D = 72 tiles, with and without the rotary
embedding of q) it prints registers and stack per thread, the SASS instruction count, the size of the
key loop (from its first to its last tensor-core instruction) and the local-memory instructions inside
that loop, which would be spills the loop pays for on every key block. Numbers of the compiler, not
timings: they guide tile and fusion choices until a device measures them.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "0"  # the interpreter's kernel objects cannot be compiled

import argparse  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from qvl.kernels import attention  # noqa: E402
from qvl.kernels.common import FMA_CONTRACTION  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def compile_attention(head_dim: int, rotate_q: bool):
    """The bf16 kernel as ``vision_attn`` would launch it for ``head_dim`` (32-bit in-batch offsets)."""
    kernel = attention._vision_attn_kernel
    main, tail = attention.head_dim_tiles(head_dim)
    config = attention._launch_config(head_dim, torch.bfloat16)
    constexprs = {
        "HEAD_DIM": head_dim, "D_MAIN": main, "D_TAIL": tail, "BLOCK_M": config["BLOCK_M"],
        "BLOCK_N": config["BLOCK_N"], "ROTATE_Q": rotate_q, "DOT_PRECISION": "tf32", "WIDE_OFFSETS": False,
    }  # fmt: skip
    pointers = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Out": "*bf16", "CuSeqlens": "*i32", "Positions": "*i32"}
    signature = {
        name: "constexpr" if name in constexprs else pointers.get(name, "fp32" if name in ("qk_scale", "log2_theta") else "i32")
        for name in kernel.arg_names
    }  # fmt: skip
    options = {"num_warps": config["num_warps"], "num_stages": config["num_stages"], **FMA_CONTRACTION}
    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=HOPPER, options=options)


def inspect(compiled) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([CUOBJDUMP, "--dump-resource-usage", cubin], capture_output=True, text=True, check=True)
        sass = subprocess.run([CUOBJDUMP, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    registers = int(re.search(r"REG:(\d+)", usage.stdout).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage.stdout).group(1))
    instructions = [line for line in sass.splitlines() if re.match(r"\s*/\*[0-9a-f]{4,}\*/", line)]
    dots = [i for i, line in enumerate(instructions) if "HGMMA" in line]
    loop = instructions[dots[0] : dots[-1] + 1] if dots else []
    return {
        "registers": registers,
        "stack_bytes": stack,
        "instructions": len(instructions),
        "loop_instructions": len(loop),
        "loop_local_memory": sum(1 for line in loop if re.search(r"\b(LDL|STL)\b", line)),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, nargs="+", default=[72])
    args = parser.parse_args(argv)
    print("| head_dim | rope on q | registers | stack B | SASS instructions | key loop | local memory in loop |")
    print("|---|---|---|---|---|---|---|")
    for head_dim in args.head_dim:
        for rotate_q in (False, True):
            row = inspect(compile_attention(head_dim, rotate_q))
            print(f"| {head_dim} | {rotate_q} | {row['registers']} | {row['stack_bytes']} | {row['instructions']} "
                  f"| {row['loop_instructions']} | {row['loop_local_memory']} |")


if __name__ == "__main__":
    main()
