"""Inductor freezing (torch._inductor.config.freezing: weights as constants, oneDNN prepacked linears with the bias
and the residual add fused in) against the shipped compiled tower; the frozen tower holds its tree as a module
attribute, since freezing only folds parameters Dynamo sees as a module's own.

Arguments: dtype (fp32 or bf16), rounds. Run through run.sh."""
import time, torch, sys
from torch import nn
from bench.bench_cpu import TOWER, pixels_of, qvl_run, transformers_run
from bench.bench_tower import hf_tower
from bench.workloads import randomize
from bench import harness
from qvl.vit import VisionTransformer
torch.manual_seed(0)
dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[sys.argv[1]]
class Held(nn.Module):
    def __init__(self, fwd, tree):
        super().__init__(); self.fwd = fwd; self.tree = tree
    def forward(self, tree, pixel_values, inputs):
        return self.fwd(self.tree, pixel_values, inputs)
ref = randomize(hf_tower(TOWER, harness.get_device("cpu"), torch.float32, "sdpa")).to(dtype)
base = VisionTransformer.from_hf(ref).requires_grad_(False).compile()
frz = VisionTransformer.from_hf(ref).requires_grad_(False)
r = frz._runner
r._compiled = torch.compile(Held(r._forward, r.tree), fullgraph=True, dynamic=True)
qb, qf = qvl_run(base), qvl_run(frz)
def frozen(p, g):
    with torch._inductor.config.patch(freezing=True):
        return qf(p, g)
runs = {"hf": transformers_run(ref), "base": qb, "frz": frozen}
for grid_thw in [((1,32,32),), ((1,64,64),), ((1,32,32),)*4]:
    pixels, grid = pixels_of(TOWER, grid_thw, dtype), torch.tensor(grid_thw)
    with torch.inference_mode():
        exp = runs["hf"](pixels, grid)
        for k, rr in runs.items():
            out = rr(pixels, grid); print(k, "%.2e" % harness.max_rel_err(out, exp), end=" ")
        best = {k: [] for k in runs}
        for _ in range(int(sys.argv[2])):
            for k, rr in runs.items():
                t=time.perf_counter(); rr(pixels, grid); best[k].append(time.perf_counter()-t)
    hf = min(best["hf"])
    print(grid_thw[0], len(grid_thw), {k: (round(min(v)/hf,3), round(sorted(v)[len(v)//2]/hf,3)) for k,v in best.items()}, round(hf*1e3), flush=True)
