"""Does Triton's automatic warp specialization on Hopper (``tl.range(..., warp_specialize=True)``) take qvl's
attention forward? Compiles for sm_90 without a GPU (Triton's bundled ptxas) and counts ``ttg.warp_specialize`` ops
in the TTGIR: a minimal online-softmax loop first, then qvl's kernel with its key loop marked, as it stands and
with the ragged last block after the loop cut out. qvl's variants are built in a scratch copy of the package (the
loop edited as text) and compiled in a process of their own, whose stderr holds the compiler's reasons.

    TRITON_INTERPRET=0 python bench/results/ws-triton36-20261206/probe.py
"""

import itertools
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ROOT = Path(__file__).resolve().parents[3]
HOPPER = GPUTarget("cuda", 90, 32)
LOOP = "        for kv_start in range(0, full_end, BLOCK_N):"
MARKED = "        for kv_start in tl.range(0, full_end, BLOCK_N, warp_specialize=True):"
RAGGED = "        if full_end < seqlen:\n            acc, m_i, l_i = _attn_kv_block("
AFTER_RAGGED = "        inv_l = 1.0 / l_i"


@triton.jit
def minimal_attention(q_desc, k_desc, v_desc, o_ptr, N, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr):
    q = q_desc.load([tl.program_id(0) * BM, 0])
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    for n in tl.range(0, N, BN, warp_specialize=True):
        qk = tl.dot(q, tl.trans(k_desc.load([n, 0])))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(tl.bfloat16), v_desc.load([n, 0]), acc * alpha[:, None])
        m_i = m_new
    offs = tl.arange(0, BM)[:, None] * D + tl.arange(0, D)[None, :]
    tl.store(o_ptr + offs, acc / l_i[:, None])


def minimal() -> None:
    for block_m, num_warps in ((64, 4), (128, 4), (128, 8)):
        signature = {
            "q_desc": f"tensordesc<bf16[{block_m}, 64]>", "k_desc": "tensordesc<bf16[64, 64]>",
            "v_desc": "tensordesc<bf16[64, 64]>", "o_ptr": "*fp32", "N": "i32",
            "BM": "constexpr", "BN": "constexpr", "D": "constexpr",
        }  # fmt: skip
        source = ASTSource(minimal_attention, signature, {"BM": block_m, "BN": 64, "D": 64})
        try:
            compiled = triton.compile(source, target=HOPPER, options={"num_warps": num_warps, "num_stages": 2})
            found = f"{compiled.asm['ttgir'].count('ttg.warp_specialize(')} warp_specialize ops"
        except Exception as exc:  # noqa: BLE001 - what the compiler says is the finding
            found = f"{type(exc).__name__} (the compiler's error above)"
        print(f"minimal loop, BLOCK_M {block_m}, {num_warps} warps: {found}", flush=True)


def qvl_variant(variant: str) -> None:
    """In a scratch copy: compile qvl's forward (D 64 and 72, bf16, the tower's packed qkv) at every tile."""
    from bench.sass_attention import stand_in_launches
    from qvl.kernels.common import compile_launch

    for head_dim, block_m, block_n, num_warps, descriptors in itertools.product(
        (64, 72), (64, 128), (64, 128), (4, 8), (False, True)
    ):
        tiles = dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=2, DESCRIPTORS=descriptors)
        try:
            compiled = compile_launch(stand_in_launches(head_dim, False, tiles=tiles)[-1], HOPPER)
            found = compiled.asm["ttgir"].count("ttg.warp_specialize(")
            print(f"qvl {variant}, D {head_dim}, {tiles}: {found} warp_specialize ops", flush=True)
        except Exception as exc:  # noqa: BLE001 - what the compiler says is the finding
            print(f"qvl {variant}, D {head_dim}, {tiles}: {type(exc).__name__}", flush=True)


def scratch_copy(variant: str) -> Path:
    root = Path(tempfile.mkdtemp())
    for name in ("kernels", "vit", "bench"):
        shutil.copytree(ROOT / name, root / name, ignore=shutil.ignore_patterns("__pycache__", "results"))
    (root / "shim" / "qvl").mkdir(parents=True)
    for name in ("kernels", "vit"):
        (root / "shim" / "qvl" / name).symlink_to(root / name)
    forward = root / "kernels" / "attention" / "forward.py"
    text = forward.read_text()
    assert LOOP in text and RAGGED in text
    text = text.replace(LOOP, MARKED)
    if variant == "without the ragged block":
        text = text[: text.index(RAGGED)] + text[text.index(AFTER_RAGGED) :]
    forward.write_text(text)
    return root


def main() -> None:
    if len(sys.argv) > 1:
        qvl_variant(sys.argv[1])
        return
    print(f"triton {triton.__version__}, sm_90")
    minimal()
    for variant in ("as it stands", "without the ragged block"):
        root = scratch_copy(variant)
        env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": f"{root / 'shim'}:{root}"}
        result = subprocess.run(
            [sys.executable, __file__, variant], capture_output=True, text=True, env=env, cwd=root
        )  # fmt: skip
        print(result.stdout, end="")
        why = sorted(
            {line.strip() for line in result.stderr.splitlines() if "Assertion" in line or "failed while" in line}
        )
        print(f"qvl {variant}: exit {result.returncode}; the compiler's reasons for its errors: {why}")


if __name__ == "__main__":
    main()
