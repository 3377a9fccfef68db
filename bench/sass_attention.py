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
with that ``max_seqlen`` hint, which selects the short-segment tiles).

Beyond the launch configuration ``vision_attn`` picks today: ``--descriptors`` compiles it with K and V loaded
through TMA descriptors; ``--candidates`` compiles every tile candidate ``bench.tune_attention`` sweeps (without
rope); ``--table`` compiles every sm_90 entry of the packaged tile table (what a device chose); ``--heuristic``
the tiles ``vision_attn`` takes where the table has no entry. ``--head-dim-layout padded`` compiles heads that are not
a power of two as one padded tile instead of the split main + tail tiles, ``split32`` with a 32-wide tail
(``--table``: each entry in the layout its key names; the ``head-dim tiles`` column says which ran). Each row also
gives the key loop's warp-instructions per 1,000 useful multiply-adds (q.k and p.v at the true head dim:
``loop x warps x 1000 / (2 x BLOCK_M x BLOCK_N x D)``), which compares tiles of different sizes. Numbers of the
compiler, not timings: they guide tile and fusion choices until a device measures them.
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
    "head_dim_tiles": "head-dim tiles",
    "tiles": "BLOCK_M x BLOCK_N / warps / stages",
    "descriptors": "TMA loads",
    "registers": "registers",
    "stack_bytes": "stack B",
    "shared_bytes": "shared B",
    "instructions": "SASS instructions",
    "loop_instructions": "key loop",
    "loop_local_memory": "local memory in loop",
    "loop_ldg_u16": "LDG.E.U16 in loop",
    "loop_ldgsts": "LDGSTS in loop",
    "loop_utmaldg": "UTMALDG in loop",
    "loop_per_kmac": "loop per 1k MACs",
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
    tiles: dict | None = None,
) -> list[KernelLaunch]:
    """The launches ``vision_attn`` makes for the tower's call (rotary for k with rope, then attention),
    built on CPU tensors; with ``max_seqlen``, for windows of that many tokens given as the hint; ``tiles``
    overrides the launch configuration's (see :func:`qvl.kernels.attention.vision_attn_launches`)."""
    offset = LAYOUTS.index(layout)  # "offset": the buffer starts one element past a 16-byte boundary
    buffer = torch.empty(offset + NUM_TOKENS * 3 * NUM_HEADS * head_dim, dtype=dtype)
    q, k, v = buffer[offset:].view(NUM_TOKENS, 3, NUM_HEADS, head_dim).unbind(1)
    out = torch.empty(q.shape, dtype=dtype)
    if max_seqlen is None:
        cu_seqlens = torch.tensor([0, NUM_TOKENS // 4, NUM_TOKENS], dtype=torch.int32)
    else:
        cu_seqlens = torch.tensor([*range(0, NUM_TOKENS, max_seqlen), NUM_TOKENS], dtype=torch.int32)
    positions = torch.zeros(NUM_TOKENS, 2, dtype=torch.int32) if rotate_q else None
    return attention.vision_attn_launches(
        q, k, v, out, cu_seqlens, None, positions, 10000.0, target, max_seqlen, None, tiles
    )


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


def variants(args: argparse.Namespace) -> list[dict]:
    """What to compile: ``{head_dim, rope, max_seqlen, dtype, tiles, head_dim_layout}`` per row, from the command
    line."""
    layout = args.head_dim_layout
    if args.table:
        found = []
        for key, entry in attention.tile_table().items():
            arch, dtype_name, head_dim, segments, *keyed_layout = key.split("/")
            if arch != f"cuda:{HOPPER.arch}":
                continue
            tiles = {name: entry[name] for name in attention.TILE_KEYS}
            max_seqlen = attention.SHORT_SEGMENT_MAX if segments == "short" else None
            dtype = getattr(torch, dtype_name)
            found += [dict(head_dim=int(head_dim[1:]), rope=rope, max_seqlen=max_seqlen, dtype=dtype, tiles=tiles,
                           head_dim_layout=keyed_layout[0] if keyed_layout else "split")
                      for rope in (False, True)]  # fmt: skip
        return found
    if args.candidates:
        from .tune_attention import candidates

        tiles_list = candidates(attention.segment_class(args.max_seqlen))
        return [dict(head_dim=d, rope=False, max_seqlen=args.max_seqlen, dtype=torch.bfloat16, tiles=tiles,
                     head_dim_layout=layout) for d in args.head_dim for tiles in tiles_list]  # fmt: skip

    def tiles(head_dim: int) -> dict | None:
        if args.heuristic:
            return attention.heuristic_tiles(head_dim, torch.bfloat16, HOPPER, args.max_seqlen)
        return {"DESCRIPTORS": True} if args.descriptors else None

    return [dict(head_dim=d, rope=rope, max_seqlen=args.max_seqlen, dtype=torch.bfloat16, tiles=tiles(d),
                 head_dim_layout=layout) for d in args.head_dim for rope in (False, True)]  # fmt: skip


def compile_row(variant: dict, layout: str) -> dict:
    """One variant's row: its launch configuration and :func:`inspect`'s columns."""
    with attention.head_dim_layout_in(variant["head_dim_layout"]):
        launch = stand_in_launches(
            variant["head_dim"], variant["rope"], layout, variant["dtype"], HOPPER, variant["max_seqlen"],
            variant["tiles"],
        )[-1]  # fmt: skip
    config = launch.kwargs
    row = {
        "head_dim": variant["head_dim"],
        "rope": variant["rope"],
        "head_dim_tiles": f"{config['D_MAIN']}+{config['D_TAIL']}",
        "dtype": str(variant["dtype"]).removeprefix("torch."),
        "max_seqlen": variant["max_seqlen"],
        "tiles": f"{config['BLOCK_M']}x{config['BLOCK_N']}/{config['num_warps']}/{config['num_stages']}",
        "descriptors": config["DESCRIPTORS"],
        **inspect(compile_launch(launch, HOPPER)),
    }
    useful_macs = 2 * config["BLOCK_M"] * config["BLOCK_N"] * variant["head_dim"]
    row["loop_per_kmac"] = round(row["loop_instructions"] * config["num_warps"] * 1000 / useful_macs, 2)
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, nargs="+", default=[64, 72, 80, 128])
    parser.add_argument("--layout", choices=LAYOUTS, default="packed")
    parser.add_argument("--max-seqlen", type=int, default=None, help="window length given as the tile hint")
    choice = parser.add_mutually_exclusive_group()
    choice.add_argument("--descriptors", action="store_true", help="K and V through TMA descriptors")
    choice.add_argument("--candidates", action="store_true", help="every tile candidate of bench.tune_attention")
    choice.add_argument("--table", action="store_true", help="every sm_90 entry of the packaged tile table")
    choice.add_argument("--heuristic", action="store_true", help="the tiles taken where the table has no entry")
    parser.add_argument("--head-dim-layout", choices=attention.HEAD_DIM_LAYOUTS, default=attention.head_dim_layout(),
                        help="how heads that are not a power of two are tiled (--table: each entry's own)")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="one JSON object per variant instead of a table")
    args = parser.parse_args(argv)
    if not args.json:
        segments = "" if args.max_seqlen is None else f", windows of {args.max_seqlen} as max_seqlen"
        print(f"Triton {triton.__version__}, sm_90, {args.layout} qkv (T={NUM_TOKENS}, H={NUM_HEADS}{segments})")
        print("| " + " | ".join(COLUMNS.values()) + " |")
        print("|" + "---|" * len(COLUMNS))
    for variant in variants(args):
        row = compile_row(variant, args.layout)
        line = json.dumps(row) if args.json else "| " + " | ".join(str(row[key]) for key in COLUMNS) + " |"
        print(line, flush=True)


if __name__ == "__main__":
    main()
