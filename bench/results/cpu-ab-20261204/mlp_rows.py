"""The MLP as one opaque op over row chunks (fc1 + bias into a scratch of ``rows`` rows kept between calls, GELU in
place, fc2 + bias into the output's rows) against the shipped runner, whose (T, intermediate) fc1 output is a fresh
allocation each call (70 MB at 4,096 tokens: above glibc's 32 MiB mmap ceiling, so its pages fault in anew): one
compiled tower, the variant swapped in per call (Dynamo guards on the function, so each keeps its own graph).
Prints minor page faults per call beside the times.

Arguments: dtype (fp32 or bf16), rounds, rows per chunk. Run through run.sh."""

import sys

import torch

from bench.bench_cpu import qvl_run, transformers_run
from qvl.vit import VisionTransformer
from qvl.vit import runner as R
from timing import compare, reference_tower

ROWS = int(sys.argv[3])
_scratch: dict[torch.dtype, torch.Tensor] = {}


@torch.library.custom_op("qvl_ab::mlp_rows", mutates_args=())
def mlp_rows(
    x: torch.Tensor, fc1_weight: torch.Tensor, fc1_bias: torch.Tensor, fc2_weight: torch.Tensor,
    fc2_bias: torch.Tensor, approximate: str,
) -> torch.Tensor:  # fmt: skip
    tokens, width = x.shape[0], fc1_weight.shape[0]
    out = x.new_empty(tokens, fc2_weight.shape[0])
    rows = min(ROWS, tokens)
    scratch = _scratch.get(x.dtype)
    if scratch is None or scratch.numel() < rows * width:
        scratch = _scratch[x.dtype] = x.new_empty(rows * width)
    for start in range(0, tokens, rows):
        stop = min(tokens, start + rows)
        h = scratch[: (stop - start) * width].view(stop - start, width)
        torch.addmm(fc1_bias, x[start:stop], fc1_weight.t(), out=h)
        torch.ops.aten.gelu_(h, approximate=approximate)
        torch.addmm(fc2_bias, h, fc2_weight.t(), out=out[start:stop])
    return out


@mlp_rows.register_fake
def _(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, approximate):
    return x.new_empty(x.shape[0], fc2_weight.shape[0])


shipped = R.vision_mlp


def rows_mlp(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, all_reduce=None, approximate="tanh"):
    return mlp_rows(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, approximate)


def with_mlp(mlp):
    def run(pixels, grid):
        R.vision_mlp = mlp
        return tower_run(pixels, grid)

    return run


torch._dynamo.config.cache_size_limit = 16
reference, dtype = reference_tower()
tower_run = qvl_run(VisionTransformer.from_hf(reference).requires_grad_(False).compile())
compare(
    {"hf": transformers_run(reference), "base": with_mlp(shipped), "rows": with_mlp(rows_mlp)},
    dtype,
    int(sys.argv[2]),
    faults=True,
)
