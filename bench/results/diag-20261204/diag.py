"""GPU diagnosis of the bf16 D 72/80 attention failures: forward errors per config/lengths, backward, TMA cases."""
import sys, time, torch
import qvl.kernels  # noqa
import qvl.kernels.attention as A
from qvl.kernels.common import device_target, run_launches

torch.manual_seed(0)
target = device_target(torch.device("cuda"))
LENGTHS = {"ragged": [1, 257, 1024, 33], "aligned": [1024, 256], "s257": [257], "s33": [33], "s1024": [1024]}

def cu_of(lengths):
    b = [0]
    for n in lengths: b.append(b[-1] + n)
    return torch.tensor(b, dtype=torch.int32, device="cuda")

def inputs(lengths, D, dtype, H=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(sum(lengths), 3, H, D, generator=g).to("cuda", dtype)
    return (*qkv.unbind(1), cu_of(lengths))

def run(q, k, v, cu, tiles, positions=None):
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device="cuda")
    lse = torch.empty(q.shape[0] * q.shape[1], dtype=torch.float32, device="cuda")
    launches = A.vision_attn_launches(q, k, v, out, cu, None, positions, 10000.0, target, None, lse, tiles)
    run_launches(launches, q.device)
    torch.cuda.synchronize()
    return out, launches[-1].kwargs

def report(name, out, q, k, v, cu, positions=None):
    truth = A.vision_attn_reference(q.double(), k.double(), v.double(), cu, positions=positions)
    base = A.vision_attn_reference(q, k, v, cu, positions=positions)
    err = (out.double() - truth).abs()
    berr = (base.double() - truth).abs().max().item()
    b = cu.tolist()
    segs = [round(err[s:e].max().item(), 3) if e > s else 0 for s, e in zip(b[:-1], b[1:])]
    main = err[..., :64].max().item(); tail = err[..., 64:].max().item() if q.shape[-1] > 64 else 0.0
    bad = (err > 8 * berr + 0.05)
    rows = bad.any(-1).any(-1).nonzero().flatten().tolist()
    heads = bad.any(-1).any(0).nonzero().flatten().tolist()
    print(f"{name:48s} err {err.max().item():.3g} torch {berr:.3g} nan {bool(torch.isnan(out).any())} "
          f"segs {segs} main {main:.3g} tail {tail:.3g} badrows {len(rows)} {rows[:6]}..{rows[-3:]} heads {heads[:8]}",
          flush=True)

BASE = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, DESCRIPTORS=False)
CFGS = {
    "128x64w8s3": BASE,
    "128x64w8s2": {**BASE, "num_stages": 2},
    "128x64w8s1": {**BASE, "num_stages": 1},
    "128x64w4s3": {**BASE, "num_warps": 4},
    "64x64w4s2": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2, DESCRIPTORS=False),
    "64x32w4s3": dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=3, DESCRIPTORS=False),
    "pad128": {**BASE, "D_MAIN": 128, "D_TAIL": 0},
    "tail32": {**BASE, "D_TAIL": 32},
}

def forward_cases():
    for D, lens, cfgs in [
        (72, ["ragged", "aligned", "s257", "s33", "s1024"], ["128x64w8s3"]),
        (72, ["ragged"], list(CFGS)[1:]),
        (80, ["ragged", "aligned"], ["128x64w8s3", "128x64w8s1", "pad128", "64x32w4s3"]),
        (64, ["ragged"], ["128x64w8s3"]),
        (96, ["ragged"], ["128x64w8s3"]),
    ]:
        for L in lens:
            for c in cfgs:
                q, k, v, cu = inputs(LENGTHS[L], D, torch.bfloat16)
                t = time.time()
                try:
                    out, kw = run(q, k, v, cu, CFGS[c])
                    report(f"fwd bf16 D{D} {L} {c} ({time.time()-t:.1f}s)", out, q, k, v, cu)
                except Exception as e:
                    print(f"fwd bf16 D{D} {L} {c}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    for dtype in (torch.float16, torch.float32):
        q, k, v, cu = inputs(LENGTHS["ragged"], 72, dtype)
        out, kw = run(q, k, v, cu, {})
        report(f"fwd {dtype} D72 ragged heuristic {kw['BLOCK_M']}x{kw['BLOCK_N']}", out, q, k, v, cu)

def backward_cases():
    import qvl.kernels.attention.backward as B
    import qvl.kernels.attention.forward as F
    fwd0, bwd0 = F.launch_config, B.backward_launch_config
    for name, fpad, bpad in [("default", False, False), ("fwd pad128", True, False), ("both pad128", True, True)]:
        F.launch_config = (lambda *a: {**fwd0(*a), "D_MAIN": 128, "D_TAIL": 0}) if fpad else fwd0
        B.backward_launch_config = (lambda *a: {kk: {**vv, "D_MAIN": 128, "D_TAIL": 0} for kk, vv in bwd0(*a).items()}) if bpad else bwd0
        for L in ("ragged", "aligned"):
          try:
            q, k, v, cu = inputs(LENGTHS[L], 72, torch.bfloat16, seed=3)
            go = torch.randn_like(q)
            leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
            out = torch.ops.qvl.vision_attn(*leaves, cu)
            out.backward(go)
            d64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
            A.vision_attn_reference(*d64, cu).backward(go.double())
            d32 = [x.detach().clone().requires_grad_() for x in (q, k, v)]
            A.vision_attn_reference(*d32, cu).backward(go)
            errs = [(a.grad.double() - t.grad).abs().max().item() for a, t in zip(leaves, d64)]
            berrs = [(a.grad.double() - t.grad).abs().max().item() for a, t in zip(d32, d64)]
            ferr = (out.double() - A.vision_attn_reference(*[x.double() for x in (q, k, v)], cu)).abs().max().item()
            print(f"bwd D72 {L} {name}: out err {ferr:.3g}  dq dk dv err {[round(e,3) for e in errs]} torch {[round(e,3) for e in berrs]}", flush=True)
          except Exception as e:
            print(f"bwd D72 {L} {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    F.launch_config, B.backward_launch_config = fwd0, bwd0

def tma_case(which):
    lengths = {"ragged": [1, 257, 1024, 33, 0, 64], "aligned": [1024, 256], "windows": [64] * 20 + [37]}[which.split("-")[0]]
    q, k, v, cu = inputs(lengths, 72, torch.bfloat16)
    positions = torch.randint(0, 40, (sum(lengths), 2), dtype=torch.int32, device="cuda") if "rope" in which else None
    tiles = {**BASE, "DESCRIPTORS": True}
    if "pad" in which:
        tiles.update(D_MAIN=128, D_TAIL=0)
    out, kw = run(q, k, v, cu, tiles, positions)
    report(f"tma {which} DESCRIPTORS={kw['DESCRIPTORS']}", out, q, k, v, cu, positions)

if __name__ == "__main__":
    what = sys.argv[1]
    if what == "fwd": forward_cases()
    elif what == "bwd": backward_cases()
    else: tma_case(what)
