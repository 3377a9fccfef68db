"""Inductor freezing (torch._inductor.config.freezing: weights as constants, oneDNN prepacked linears with the bias
and the residual add fused in) against the shipped compiled tower; the frozen tower holds its tree as a module
attribute, since freezing only folds parameters Dynamo sees as a module's own. With a third argument
``max-autotune``, the frozen tower also gets max-autotune's GEMM backends (C++ template and ATen).

Arguments: dtype (fp32 or bf16), rounds[, max-autotune]. Run through run.sh."""

import sys

import torch
from torch import nn

from bench.bench_cpu import qvl_run, transformers_run
from qvl.vit import VisionTransformer
from timing import compare, reference_tower


class Held(nn.Module):
    def __init__(self, forward, tree):
        super().__init__()
        self.forward_of_tree = forward
        self.tree = tree

    def forward(self, tree, pixel_values, inputs):
        return self.forward_of_tree(self.tree, pixel_values, inputs)


options = {"freezing": True}
if sys.argv[3:] == ["max-autotune"]:
    options.update(max_autotune=True, max_autotune_gemm_backends="CPP,ATEN")
reference, dtype = reference_tower()
base = VisionTransformer.from_hf(reference).requires_grad_(False).compile()
frozen = VisionTransformer.from_hf(reference).requires_grad_(False)
runner = frozen._runner
runner._compiled = torch.compile(Held(runner._forward, runner.tree), fullgraph=True, dynamic=True)
frozen_run = qvl_run(frozen)


def run_frozen(pixels, grid):
    # Dynamo reads the freezing flag while it traces, which the first call does.
    with torch._inductor.config.patch(**options):
        return frozen_run(pixels, grid)


compare({"hf": transformers_run(reference), "base": qvl_run(base), "frz": run_frozen}, dtype, int(sys.argv[2]))
