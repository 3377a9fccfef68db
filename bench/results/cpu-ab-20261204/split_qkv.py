"""qkv as three projections (q, k, v from row slices of the qkv weight, each output a third of the packed one,
under glibc's 32 MiB mmap ceiling up to ~7,000 tokens) against the shipped runner: one compiled tower, the variant
swapped in per call (Dynamo guards on the function, so each keeps its own graph).

Arguments: dtype (fp32 or bf16), rounds. Run through run.sh."""

import sys

import torch
import torch.nn.functional as F

from bench.bench_cpu import qvl_run, transformers_run
from qvl.kernels import ops_for
from qvl.vit import VisionTransformer
from qvl.vit import runner as R
from timing import compare, reference_tower

shipped = R._attention


def split(block, h, windowed, spec, inputs, all_reduce, linear):
    weight, bias = linear(R.part(block, spec.names.attn_qkv))
    q, k, v = (
        F.linear(h, w, b).view(h.shape[0], spec.num_heads, spec.head_dim)
        for w, b in zip(weight.chunk(3), bias.chunk(3), strict=True)
    )
    a = ops_for(q.device).vision_attn(
        q, k, v, inputs.cu_seqlens, max_seqlen=inputs.max_seqlen, positions=inputs.positions, rope_theta=spec.rope_theta
    )
    return R.row_parallel_linear(a.flatten(1), *linear(block.attn.proj), all_reduce)


torch._dynamo.config.cache_size_limit = 16
reference, dtype = reference_tower()
tower_run = qvl_run(VisionTransformer.from_hf(reference).requires_grad_(False).compile())


def with_attention(attention):
    def run(pixels, grid):
        R._attention = attention
        return tower_run(pixels, grid)

    return run


compare({"hf": transformers_run(reference), "base": with_attention(shipped), "split": with_attention(split)}, dtype, int(sys.argv[2]))
