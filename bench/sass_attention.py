"""What the attention kernel compiles to on Hopper, read without a GPU: ``python -m bench.sass_attention``.

Triton's wheel carries ptxas and cuobjdump, so the sm_90 machine code of ``vision_attn``'s kernel can be
inspected anywhere. Each variant is compiled from the launch ``vision_attn`` itself builds
(:func:`qvl.kernels.attention.vision_attn_launches`) for CPU stand-ins shaped, strided and aligned like the
tower's call (q, k, v views of a packed ``(T, 3, H, D)`` qkv, H = 16, bf16; with rope, k is the rotary
kernel's contiguous output), specialized by Triton's own launch binder
(:func:`qvl.kernels.common.compile_launch`): the kernel a real launch gets, alignment attributes included.

For each head dim, without and with the rotary embedding of q, it prints registers and stack per thread,
shared memory per block, the SASS instruction count, and for the key loop (the loop over full key blocks:
the SASS from the target of its backward branch to that branch) its instruction count, local-memory
instructions (spills paid on every key block), 2-byte scalar global loads (``LDG.E.U16``: rows fetched
element by element) and asynchronous copies into shared memory (``LDGSTS``; ``UTMALDG`` for TMA).
``--layout offset`` shifts the qkv buffer by one element, the path for layouts whose rows are not all
16-byte aligned. ``--max-seqlen 64`` compiles the launch of window attention instead (segments of 64 tokens
with that ``max_seqlen`` hint, which selects the short-segment tiles). Numbers of the compiler, not timings:
they guide tile and fusion choices until a device measures them.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "0"  # the interpreter's kernel objects cannot be compiled

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from qvl.kernels import attention  # noqa: E402
from qvl.kernels.common import HOPPER, KernelLaunch, compile_launch  # noqa: E402

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
NUM_TOKENS, NUM_HEADS = 1024, 16
LAYOUTS = ("packed", "offset")
COLUMNS = {
    "head_dim": "head_dim",
    "rope": "rope on q",
    "registers": "registers",
    "stack_bytes": "stack B",
    "shared_bytes": "shared B",
    "instructions": "SASS instructions",
    "loop_instructions": "key loop",
    "loop_local_memory": "local memory in loop",
    "loop_ldg_u16": "LDG.E.U16 in loop",
    "loop_ldgsts": "LDGSTS in loop",
    "loop_utmaldg": "UTMALDG in loop",
}
_INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH_TARGET = re.compile(r"\bBRA\b.*?\b0x([0-9a-f]+)\s*$")


def stand_in_launches(
    head_dim: int,
    rotate_q: bool,
    layout: str = "packed",
    dtype: torch.dtype = torch.bfloat16,
    target: GPUTarget = HOPPER,
    max_seqlen: int | None = None,
) -> list[KernelLaunch]:
    """The launches ``vision_attn`` makes for the tower's call (rotary for k with rope, then attention),
    built on CPU tensors; with ``max_seqlen``, for windows of that many tokens given as the hint."""
    offset = LAYOUTS.index(layout)  # "offset": the buffer starts one element past a 16-byte boundary
    buffer = torch.empty(offset + NUM_TOKENS * 3 * NUM_HEADS * head_dim, dtype=dtype)
    q, k, v = buffer[offset:].view(NUM_TOKENS, 3, NUM_HEADS, head_dim).unbind(1)
    out = torch.empty(q.shape, dtype=dtype)
    if max_seqlen is None:
        cu_seqlens = torch.tensor([0, NUM_TOKENS // 4, NUM_TOKENS], dtype=torch.int32)
    else:
        cu_seqlens = torch.tensor([*range(0, NUM_TOKENS, max_seqlen), NUM_TOKENS], dtype=torch.int32)
    positions = torch.zeros(NUM_TOKENS, 2, dtype=torch.int32) if rotate_q else None
    return attention.vision_attn_launches(q, k, v, out, cu_seqlens, None, positions, 10000.0, target, max_seqlen)


def key_loop(instructions: list[tuple[int, str]]) -> list[str]:
    """The first loop holding a tensor-core instruction: from its backward branch's target to the branch."""
    for end, (address, text) in enumerate(instructions):
        target = _BRANCH_TARGET.search(text)
        if target is None or int(target.group(1), 16) >= address:
            continue
        start = next(i for i, (a, _) in enumerate(instructions) if a >= int(target.group(1), 16))
        body = [t for _, t in instructions[start : end + 1]]
        if any("HGMMA" in t for t in body):
            return body
    return []


def inspect(compiled) -> dict:
    """The columns of :data:`COLUMNS` after head_dim and rope, read from a compiled kernel's cubin."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([CUOBJDUMP, "--dump-resource-usage", cubin], capture_output=True, text=True, check=True)
        sass = subprocess.run([CUOBJDUMP, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    instructions = [(int(m.group(1), 16), m.group(2)) for m in map(_INSTRUCTION.match, sass.splitlines()) if m]
    loop = key_loop(instructions)
    return {
        "registers": int(re.search(r"REG:(\d+)", usage.stdout).group(1)),
        "stack_bytes": int(re.search(r"STACK:(\d+)", usage.stdout).group(1)),
        "shared_bytes": compiled.metadata.shared,
        "instructions": len(instructions),
        "loop_instructions": len(loop),
        "loop_local_memory": sum(1 for text in loop if re.search(r"\b(LDL|STL)\b", text)),
        "loop_ldg_u16": sum(1 for text in loop if re.search(r"\bLDG\.E\.U16\b", text)),
        "loop_ldgsts": sum(1 for text in loop if re.search(r"\bLDGSTS\b", text)),
        "loop_utmaldg": sum(1 for text in loop if re.search(r"\bUTMALDG\b", text)),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, nargs="+", default=[64, 72, 80, 128])
    parser.add_argument("--layout", choices=LAYOUTS, default="packed")
    parser.add_argument("--max-seqlen", type=int, default=None, help="window length given as the tile hint")
    parser.add_argument("--json", action="store_true", help="one JSON object per variant instead of a table")
    args = parser.parse_args(argv)
    if not args.json:
        segments = "" if args.max_seqlen is None else f", windows of {args.max_seqlen} as max_seqlen"
        print(f"Triton {triton.__version__}, sm_90, bf16, {args.layout} qkv (T={NUM_TOKENS}, H={NUM_HEADS}{segments})")
        print("| " + " | ".join(COLUMNS.values()) + " |")
        print("|" + "---|" * len(COLUMNS))
    for head_dim in args.head_dim:
        for rotate_q in (False, True):
            row = {"head_dim": head_dim, "rope": rotate_q}
            attention_launch = stand_in_launches(head_dim, rotate_q, args.layout, max_seqlen=args.max_seqlen)[-1]
            row.update(inspect(compile_launch(attention_launch, HOPPER)))
            line = json.dumps(row) if args.json else "| " + " | ".join(str(row[key]) for key in COLUMNS) + " |"
            print(line, flush=True)


if __name__ == "__main__":
    main()
