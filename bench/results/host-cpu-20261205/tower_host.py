"""Host time of one tower forward on this CPU with every Triton launch stubbed out: the interpreter path, so the
kernels' host code (checks, plans, launch building) runs and the kernels do not. A 27-block tower at a tiny width
(64) on 64 patches, so torch's own CPU work (the linears) stays small. 'direct': ops_for as committed (eager
inference calls qvl.kernels.direct); 'ops': ops_for handing out torch.ops.qvl instead, as before 0669f73.

    .venv/bin/python bench/results/host-cpu-20261205/tower_host.py direct|ops [profile]
"""
import cProfile, os, pstats, sys, time
os.environ.setdefault("TRITON_INTERPRET", "1")
import torch
from qvl.kernels import common
from qvl.vit import VisionConfig, VisionTransformer

mode = sys.argv[1] if len(sys.argv) > 1 else "direct"
common.KernelLaunch.run = lambda self: None
torch.manual_seed(0)
config = VisionConfig(depth=27, hidden_size=64, num_heads=2, intermediate_size=96, out_hidden_size=64,
                      num_position_embeddings=64)
tower = VisionTransformer(config).eval()
grid = [(1, 8, 8)]
pixels = torch.randn(64, config.in_channels * config.temporal_patch_size * config.patch_size**2)
if mode == "ops":
    import qvl.kernels.torch_path as tp
    tp.direct = torch.ops.qvl  # what ops_for handed out before
ctx = torch.no_grad
with ctx():
    for _ in range(5):
        tower(pixels, grid)
    times = []
    for _ in range(30):
        t = time.perf_counter(); tower(pixels, grid); times.append(time.perf_counter() - t)
times.sort()
print(f"{mode}: forward host time median {times[15]*1e3:.2f} ms (p20 {times[6]*1e3:.2f}, p80 {times[24]*1e3:.2f})")
if len(sys.argv) > 2:
    with ctx():
        pr = cProfile.Profile(); pr.enable()
        for _ in range(10):
            tower(pixels, grid)
        pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(25)
