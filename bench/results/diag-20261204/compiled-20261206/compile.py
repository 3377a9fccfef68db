"""Compile one attention forward launch for sm_90 on a CPU and write Triton's IR and PTX (no GPU needed).

    PYTHONPATH=<shim with qvl -> kernels, vit of the commit to read> TRITON_INTERPRET=0 \
        python compile.py CONFIG HEAD_DIM [LAYOUT] OUT_DIR

CONFIG: s3 (128x64 tiles, 8 warps, 3 stages: the H200 diagnosis run's failing default), s1 (1 stage), w4 (4 warps)
or heur (the package's own tiles). LAYOUT (split, split32, padded) only for commits that have head-dim layouts.
The batch is the diagnosis run's ragged one: segments of 1, 257, 1024 and 33 tokens, 16 heads, bf16, q, k, v views
of one packed qkv.
"""

import os
import sys

os.environ["TRITON_INTERPRET"] = "0"
import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

import qvl.kernels  # noqa: E402, F401
import qvl.kernels.attention as attention  # noqa: E402
from qvl.kernels.common import compile_launch  # noqa: E402

config, head_dim, *rest = sys.argv[1:]
layout, out_dir = (rest[0], rest[1]) if len(rest) == 2 else (None, rest[0])
if layout is not None:
    attention.set_head_dim_layout(layout)
target = GPUTarget("cuda", 90, 32)
lengths = [1, 257, 1024, 33]
q, k, v = torch.randn(sum(lengths), 3, 16, int(head_dim)).to(torch.bfloat16).unbind(1)
cu_seqlens = torch.tensor([0, 1, 258, 1282, 1315], dtype=torch.int32)
out = torch.empty(q.shape, dtype=torch.bfloat16)
lse = torch.empty(q.shape[0] * q.shape[1], dtype=torch.float32)
base = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, DESCRIPTORS=False)
tiles = {"s3": base, "s1": {**base, "num_stages": 1}, "w4": {**base, "num_warps": 4}, "heur": None}[config]
launch = attention.vision_attn_launches(q, k, v, out, cu_seqlens, None, None, 10000.0, target, None, lse, tiles)[-1]
compiled = compile_launch(launch, target)
os.makedirs(out_dir, exist_ok=True)
for key in ("ttgir", "ptx"):
    with open(os.path.join(out_dir, key), "w") as f:
        f.write(compiled.asm[key])
print({name: value for name, value in launch.kwargs.items()}, "shared", compiled.metadata.shared)
