"""MKL's packed sgemm (torch.ops.mkl._mkl_linear, the weight packed once for a fixed row count) in row chunks of
that count (the rest through F.linear, pieces concatenated) against F.linear, on the tower's GEMM shapes (M, K, N), fp32:
best of 7 ms each, and each result's max error against float64. _mkl_linear falls back to an unpacked GEMM when its
input's rows differ from the packed count, hence the chunks. Run: .venv/bin/python bench/results/cpu-ab-20261204/packed_linear.py"""
import torch, time
import torch.nn.functional as F
torch.manual_seed(0)
mkl = torch.ops.mkl
def t(f):
    f(); b = 1e9
    for _ in range(7):
        s = time.perf_counter(); f(); b = min(b, time.perf_counter() - s)
    return b * 1e3
def packed_linear(x, pw, w, b, chunk):
    M = x.shape[0]
    full = M // chunk * chunk
    pieces = [mkl._mkl_linear(x[i:i + chunk], pw, w, b, chunk) for i in range(0, full, chunk)]
    if full < M:
        pieces.append(F.linear(x[full:], w, b))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
for chunk in (256, 512):
    for M, K, N in ((1024, 1152, 3456), (1024, 1152, 4304), (1024, 4304, 1152), (1024, 1152, 1152), (256, 4608, 4608), (256, 4608, 4096), (1024, 1536, 1152), (4096, 1152, 3456), (4096, 4304, 1152), (1024, 4608, 4608), (1000, 1152, 4304)):
        x = torch.randn(M, K); w = torch.randn(N, K) / K**0.5; b = torch.randn(N)
        pw = mkl._mkl_reorder_linear_weight(w, chunk)
        a = t(lambda: F.linear(x, w, b)); p = t(lambda: packed_linear(x, pw, w, b, chunk))
        err = (packed_linear(x, pw, w, b, chunk) - F.linear(x.double(), w.double(), b.double())).abs().max().item()
        err0 = (F.linear(x, w, b) - F.linear(x.double(), w.double(), b.double())).abs().max().item()
        print(chunk, M, K, N, "linear %.1f packed %.1f ratio %.3f  err %.1e vs %.1e" % (a, p, p / a, err, err0), flush=True)
