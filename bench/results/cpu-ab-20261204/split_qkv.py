"""qkv as three projections (q, k, v from row slices of the qkv weight, each output a third of the packed one,
under glibc's 32 MiB mmap ceiling up to ~7,000 tokens) against the shipped runner: one compiled tower, the variant
swapped in per call (Dynamo guards on the function, so each keeps its own graph).

Arguments: dtype (fp32 or bf16), rounds. Run through run.sh."""
import time, torch, sys
import torch.nn.functional as F
from bench.bench_cpu import TOWER, pixels_of, qvl_run, transformers_run
from bench.bench_tower import hf_tower
from bench.workloads import randomize
from bench import harness
from qvl.vit import VisionTransformer
from qvl.vit import runner as R
from qvl.kernels import ops_for
torch.manual_seed(0)
dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[sys.argv[1]]
orig = R._attention
def split(block, h, windowed, spec, inputs, all_reduce, linear):
    segments, max_seqlen = inputs.cu_seqlens, inputs.max_seqlen
    w, b = linear(R.part(block, spec.names.attn_qkv))
    q, k, v = (F.linear(h, wi, bi).view(h.shape[0], spec.num_heads, spec.head_dim) for wi, bi in zip(w.chunk(3), b.chunk(3)))
    a = ops_for(q.device).vision_attn(q, k, v, segments, max_seqlen=max_seqlen, positions=inputs.positions, rope_theta=spec.rope_theta)
    return R.row_parallel_linear(a.flatten(1), *linear(block.attn.proj), all_reduce)
torch._dynamo.config.cache_size_limit = 16
ref = randomize(hf_tower(TOWER, harness.get_device("cpu"), torch.float32, "sdpa")).to(dtype)
tower = VisionTransformer.from_hf(ref).requires_grad_(False).compile()
q = qvl_run(tower)
def with_(fn):
    def run(p, g):
        R._attention = fn
        return q(p, g)
    return run
runs = {"hf": transformers_run(ref), "base": with_(orig), "split": with_(split)}
for grid_thw in [((1,32,32),), ((1,64,64),), ((1,32,32),)*4]:
    pixels, grid = pixels_of(TOWER, grid_thw, dtype), torch.tensor(grid_thw)
    with torch.inference_mode():
        exp = runs["hf"](pixels, grid)
        for k, rr in runs.items():
            out = rr(pixels, grid)
        best = {k: [] for k in runs}
        for _ in range(int(sys.argv[2])):
            for k, rr in runs.items():
                t=time.perf_counter(); rr(pixels, grid); best[k].append(time.perf_counter()-t)
    hf = min(best["hf"])
    print(grid_thw[0], len(grid_thw), {k: (round(min(v)/hf,3), round(sorted(v)[len(v)//2]/hf,3)) for k,v in best.items()}, round(hf*1e3), flush=True)
