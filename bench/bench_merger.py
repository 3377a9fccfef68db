"""The tower's bandwidth kernels (norms, activations) and the patch merger: qvl's ops against eager torch,
``torch.compile`` of it and, for the bandwidth kernels, a plain copy of the same bytes (what the device moves at
best: the "x copy" of each qvl row).

Cases at Qwen3-VL-8B widths for T patches:

* ``layer_norm`` T x 1152 (the blocks' norm1/norm2, the main merger's norm) and T/4 x 4608 (the
  deepstack mergers' post-shuffle norm), against ``F.layer_norm``;
* ``add_layer_norm`` T x 1152 (residual add fused with the next norm), against ``h = x + d`` then
  ``F.layer_norm(h)``;
* ``rms_norm`` and ``add_rms_norm`` T x 1152 (Qwen2.5-VL's norms, at the same width), against transformers'
  ``Qwen2RMSNorm`` arithmetic;
* ``bias_gelu`` tanh at T x 4304 (the blocks' MLP), erf at T/4 x 4608 (the mergers' fc1) and quick at T x 4304
  (Qwen2-VL's MLP), qvl out of place and in place (``bias_gelu_``, the epilogue qvl runs after a bias-less fc1),
  against ``F.gelu(x + b)`` (``x * sigmoid(1.702 x)`` for quick);
* ``bias_swiglu`` T x 4304 (the gated MLP's epilogue at the tower's MLP width) and, as vLLM's Qwen2.5-VL
  ``gate_up_proj`` hands it over, ``bias_swiglu stacked`` T x 3420 (Qwen2.5-VL's width; gate and up the column
  halves of one (T, 6840) output, the biases the halves of one (6840,) vector, the up halves 8 bytes off a
  16-byte boundary), against ``F.silu(g + gb) * (u + ub)``;
* the whole ``merger`` and ``deepstack merger``: qvl's ``patch_merger`` against transformers'
  ``Qwen3VLVisionPatchMerger`` (8B shape, random weights).

    python -m bench.bench_merger [--dtype bf16] [--quick] [--json PATH] [--device auto|cuda|cpu]

Norm and activation rates are GB/s of the minimum traffic (inputs read once, outputs written once, the
parameter vectors once); "copy" moves as many bytes (half read, half written) with ``Tensor.copy_``. Merger rates
are TFLOP/s of its two matmuls. On a CPU only the eager paths and the copy run, on few tokens, and the mergers at a
tiny width.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

import qvl.kernels  # noqa: F401 - registers torch.ops.qvl
from qvl.vit.layers import patch_merger

from . import harness
from .harness import Device, Report, RunConfig
from .workloads import MODELS, randomize

HIDDEN = MODELS["8B"].hidden
MERGED = 4 * HIDDEN  # 2x2 spatial merge
INTERMEDIATE = 4304
QWEN25_INTERMEDIATE = 3420  # Qwen2.5-VL's vision MLP
OUT_HIDDEN = 4096
TINY_HIDDEN, TINY_OUT = 128, 64  # CPU mergers: their matmuls would dominate a CPU smoke run at 8B
EPS = 1e-6


@dataclass(frozen=True)
class Case:
    op: str  # "layer_norm", "add_layer_norm", "rms_norm", "add_rms_norm", "bias_gelu", "bias_swiglu" or "merger"
    rows: int
    cols: int
    variant: str = (
        ""  # bias_gelu: "tanh", "none" or "quick"; bias_swiglu: "" or "stacked"; merger: "main" or "deepstack"
    )
    out: int = 0  # merger output width

    @property
    def name(self) -> str:
        if self.op == "merger":
            return f"{'' if self.variant == 'main' else 'deepstack '}merger T={self.rows} C={self.cols}"
        variant = {"tanh": " tanh", "none": " erf", "quick": " quick", "stacked": " stacked"}.get(self.variant, "")
        return f"{self.op}{variant} {self.rows}x{self.cols}"


@dataclass(frozen=True)
class Inputs:
    case: Case
    x: torch.Tensor  # bias_swiglu: the gate
    delta: torch.Tensor | None  # add_*_norm's residual branch; bias_swiglu's up
    weight: torch.Tensor | None  # norm scale
    bias: torch.Tensor | None  # norm, GELU or SwiGLU gate bias
    up_bias: torch.Tensor | None  # bias_swiglu's up bias
    merger: nn.Module | None  # transformers' Qwen3VLVisionPatchMerger, shared by every set of a case


Bind = Callable[[Inputs], Callable[[], object]]


def cases(device: Device, quick: bool) -> list[Case]:
    if not device.is_cuda:
        return cases_at(64, TINY_HIDDEN, TINY_OUT)
    # The goals' sizes (16,384 tokens: 16,384 x 1,152, 4,096 x 4,608, 16,384 x 4,304) first, so that a call cut
    # short by its time limit has measured them.
    return [case for t in ((16384, 1024) if quick else (16384, 4096, 1024)) for case in cases_at(t)]


def cases_at(tokens: int, merger_hidden: int = HIDDEN, merger_out: int = OUT_HIDDEN) -> list[Case]:
    """Every op at the sizes one batch of ``tokens`` patches gives it."""
    return [
        Case("layer_norm", tokens, HIDDEN),
        Case("layer_norm", tokens // 4, MERGED),
        Case("add_layer_norm", tokens, HIDDEN),
        Case("rms_norm", tokens, HIDDEN),
        Case("add_rms_norm", tokens, HIDDEN),
        Case("bias_gelu", tokens, INTERMEDIATE, "tanh"),
        Case("bias_gelu", tokens // 4, MERGED, "none"),
        Case("bias_gelu", tokens, INTERMEDIATE, "quick"),
        Case("bias_swiglu", tokens, INTERMEDIATE),
        Case("bias_swiglu", tokens, QWEN25_INTERMEDIATE, "stacked"),
        Case("merger", tokens, merger_hidden, "main", merger_out),
        Case("merger", tokens, merger_hidden, "deepstack", merger_out),
    ]


def make_merger(case: Case, device: Device, dtype: torch.dtype) -> nn.Module:
    from transformers import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionPatchMerger

    config = Qwen3VLVisionConfig(hidden_size=case.cols, out_hidden_size=case.out, spatial_merge_size=2)
    with torch.device(device.torch_device):
        module = Qwen3VLVisionPatchMerger(config, use_postshuffle_norm=case.variant == "deepstack")
    return randomize(module.to(dtype).eval().requires_grad_(False))


def make_inputs(case: Case, device: Device, dtype: torch.dtype, count: int = 1) -> list[Inputs]:
    """``count`` sets of random activations sharing one set of parameters."""
    dev = device.torch_device
    gen = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=dev, dtype=dtype)

    weight = 1 + 0.1 * randn(case.cols) if "norm" in case.op else None
    bias = 0.1 * randn(case.cols) if case.op not in ("merger", "rms_norm", "add_rms_norm") else None
    up_bias = 0.1 * randn(case.cols) if case.op == "bias_swiglu" else None
    stacked = case.variant == "stacked"
    if stacked:
        bias, up_bias = (0.1 * randn(2 * case.cols)).chunk(2)
    merger = make_merger(case, device, dtype) if case.op == "merger" else None
    sets = []
    for _ in range(count):
        if stacked:
            x, delta = randn(case.rows, 2 * case.cols).chunk(2, dim=1)
        else:
            x = randn(case.rows, case.cols)
            delta = randn(case.rows, case.cols) if _two_inputs(case) else None
        sets.append(Inputs(case, x, delta, weight, bias, up_bias, merger))
    return sets


def _two_inputs(case: Case) -> bool:
    return case.op in ("add_layer_norm", "add_rms_norm", "bias_swiglu")


def set_bytes(case: Case, dtype: torch.dtype) -> int:
    return (2 if _two_inputs(case) else 1) * case.rows * case.cols * dtype.itemsize


def min_work(x: Inputs) -> tuple[float, str]:
    """The case's useful work and its metric: bytes for the memory-bound ops, FLOPs for the merger."""
    if x.case.op == "merger":
        rows, width = x.x.shape[0] // 4, 4 * x.case.cols
        return 2.0 * rows * width * (width + x.case.out), "flops"
    # add_*_norm reads x and d and writes h and y; bias_swiglu reads gate and up and writes y.
    io = {"add_layer_norm": 4, "add_rms_norm": 4, "bias_swiglu": 3}.get(x.case.op, 2)
    params = harness.tensor_bytes(*(t for t in (x.weight, x.bias, x.up_bias) if t is not None))
    return float(io * harness.tensor_bytes(x.x) + params), "bytes"


# --------------------------------------------------------------------------------------------------
# Implementations
# --------------------------------------------------------------------------------------------------
def qvl_merger(x: Inputs) -> torch.Tensor:
    m = x.merger
    return patch_merger(
        x.x, m.norm.weight, m.norm.bias, m.linear_fc1.weight, m.linear_fc1.bias, m.linear_fc2.weight,
        m.linear_fc2.bias, spatial_merge_size=2, postshuffle_norm=m.use_postshuffle_norm, eps=m.norm.eps,
    )  # fmt: skip


QVL_OPS: dict[str, Callable[[Inputs], object]] = {
    "layer_norm": lambda x: torch.ops.qvl.layer_norm(x.x, x.weight, x.bias, EPS),
    "add_layer_norm": lambda x: torch.ops.qvl.add_layer_norm(x.x, x.delta, x.weight, x.bias, EPS),
    "rms_norm": lambda x: torch.ops.qvl.rms_norm(x.x, x.weight, EPS),
    "add_rms_norm": lambda x: torch.ops.qvl.add_rms_norm(x.x, x.delta, x.weight, EPS),
    "bias_gelu": lambda x: torch.ops.qvl.bias_gelu(x.x, x.bias, x.case.variant),
    "bias_swiglu": lambda x: torch.ops.qvl.bias_swiglu(x.x, x.delta, x.bias, x.up_bias),
    "merger": qvl_merger,
}


def qvl_op(device: Device, in_place: bool = False) -> Bind:
    """qvl's op for the case; ``in_place``: ``bias_gelu_`` (bias_gelu cases only)."""

    def bind(x: Inputs) -> Callable[[], object]:
        def call() -> object:
            with harness.qvl_path(device):
                if in_place:
                    return torch.ops.qvl.bias_gelu_(x.x, x.bias, x.case.variant)
                return QVL_OPS[x.case.op](x)

        return call

    return bind


def eager_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], weight, bias, EPS)


def eager_add_layer_norm(x, delta, weight, bias) -> tuple[torch.Tensor, torch.Tensor]:
    h = x + delta
    return h, F.layer_norm(h, h.shape[-1:], weight, bias, EPS)


def eager_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """transformers' ``Qwen2RMSNorm``: fp32 mean square, the normed row rounded, then the weight."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def eager_add_rms_norm(x, delta, weight) -> tuple[torch.Tensor, torch.Tensor]:
    h = x + delta
    return h, eager_rms_norm(h, weight)


def eager_bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str) -> torch.Tensor:
    if approximate == "quick":
        h = x + bias
        return h * torch.sigmoid(1.702 * h)
    return F.gelu(x + bias, approximate=approximate)


def eager_bias_swiglu(gate, up, gate_bias, up_bias) -> torch.Tensor:
    return F.silu(gate + gate_bias) * (up + up_bias)


def torch_peer(device: Device, compiled: bool = False) -> Bind:
    """The eager torch a model runs for the case (transformers' module for the mergers), or its compile."""
    if compiled:
        harness.require_cuda(device)
        # Each case is a new static shape; stay below dynamo's recompile limit rather than fall back to eager.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    functions: dict[object, Callable] = {}  # compiled once per op, and per merger module

    def bind(x: Inputs) -> Callable[[], object]:
        op = x.case.op
        fn, args = {
            "layer_norm": (eager_layer_norm, (x.x, x.weight, x.bias)),
            "add_layer_norm": (eager_add_layer_norm, (x.x, x.delta, x.weight, x.bias)),
            "rms_norm": (eager_rms_norm, (x.x, x.weight)),
            "add_rms_norm": (eager_add_rms_norm, (x.x, x.delta, x.weight)),
            "bias_gelu": (eager_bias_gelu, (x.x, x.bias, x.case.variant)),
            "bias_swiglu": (eager_bias_swiglu, (x.x, x.delta, x.bias, x.up_bias)),
            "merger": (x.merger, (x.x,)),
        }[op]
        key = x.merger if op == "merger" else op
        if key not in functions:
            functions[key] = torch.compile(fn, dynamic=False) if compiled else fn
        return partial(functions[key], *args)

    return bind


PEERS: dict[str, Callable[[Device], Bind]] = {
    "eager": torch_peer,
    "compiled": partial(torch_peer, compiled=True),
}
BASELINES = ("eager",)


# --------------------------------------------------------------------------------------------------
# Run
# --------------------------------------------------------------------------------------------------
def outputs(result: object) -> tuple[torch.Tensor, ...]:
    return result if isinstance(result, tuple) else (result,)


def run_case(report: Report, case: Case, peers: dict[str, Bind], device: Device, dtype: torch.dtype) -> None:
    sets = make_inputs(case, device, dtype, harness.rotation_count(set_bytes(case, dtype), device))
    impls = {"qvl": qvl_op(device)}
    if case.op == "bias_gelu":
        impls["qvl in-place"] = qvl_op(device, in_place=True)
    impls.update(peers)
    if case.op != "merger":
        # Tensor.copy_ of the case's minimum traffic: the ceiling a bandwidth kernel is held against (unchecked).
        impls["copy"] = lambda x: harness.copy_call(x.x, min_work(x)[0])
    ref = outputs(impls["qvl"](sets[0])())

    def check(name: str, call: Callable[[], object]) -> float | None:
        if name in ("qvl", "copy"):
            return None
        if name == "qvl in-place":
            # Overwrites its input: run it on a copy, so the timed sets stay as made.
            x = replace(sets[0], x=sets[0].x.clone())
            impls[name](x)()
            got = (x.x,)
        else:
            got = outputs(call())
        return max(harness.max_rel_err(g, r) for g, r in zip(got, ref, strict=True))

    calls = {name: [bind(s) for s in sets] for name, bind in impls.items()}
    work, metric = min_work(sets[0])
    harness.check_then_time(report, case.name, work, calls, check, metric=metric)


def benchmark(config: RunConfig) -> Report:
    device, dtype = config.device, config.dtype
    report = Report("merger", device, dtype, "bytes", BASELINES)
    trial = make_inputs(Case("layer_norm", 8, 64), device, dtype)[0]
    peers, report.skipped = harness.device_peers(PEERS, device, trial, config.skip)
    report.notes.append(
        "eager: F.layer_norm; x + d then F.layer_norm; Qwen2RMSNorm's arithmetic; F.gelu(x + b) (quick: "
        "h * sigmoid(1.702 h)); F.silu(g + gb) * (u + ub); transformers' Qwen3VLVisionPatchMerger. compiled: "
        "torch.compile of the same (dynamic=False). copy: Tensor.copy_ of the case's minimum traffic"
    )
    report.notes.append(
        "goals (H200): every bandwidth kernel >= 85% of copy's rate and never below eager or compiled; the mergers "
        ">= eager at 1,024 tokens"
    )
    for case in cases(device, config.quick):
        print(f"merger: {case.name}", flush=True)
        run_case(report, case, peers, device, dtype)
    return report


def main(argv: Sequence[str] | None = None) -> Report:
    return harness.main(__doc__, benchmark, argv)


if __name__ == "__main__":
    main()
