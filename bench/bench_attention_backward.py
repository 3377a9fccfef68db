"""Attention forward + backward (one training step's attention): qvl's ``vision_attn`` through autograd against
the peers of ``bench_attention`` through theirs, on the same inputs and the same output gradient.

Each timed call runs the forward with q, k, v requiring grad, then ``torch.autograd.grad`` for dq, dk, dv. Peers,
each skipped with its reason where it cannot run: torch's ``varlen_attn`` (PyTorch's FlashAttention, FA2's
backward), ``flex_attention`` compiled (its backward kernel is compiled too), SDPA per image and flash-attn's
varlen function. qvl also runs with its fused rope (gradients reach the unrotated q and k) and with ``rotary_2d``
before it.

    python -m bench.bench_attention_backward [--dtype bf16] [--quick] [--json PATH] [--device auto|cuda|cpu]

Rates are useful TFLOP/s at the true head dim: the forward's 4*H*D*sum(S_i^2) plus 2.5 times that for the
backward (dV, dP, dQ, dK: four matmuls; plus the forward's QK^T recomputed), 3.5x the forward in all. The
max rel err column is the largest of the three gradients' against qvl's. On a CPU only the torch paths run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from . import bench_attention, harness
from .bench_attention import BASELINES, INFERENCE_ONLY, PEERS, QVL_VARIANTS, WITH_ROPE, Bind, Case, Inputs
from .harness import Device, Report, RunConfig
from .workloads import square

# Useful FLOPs of forward + backward over the forward's alone: the backward's dV = P^T dO, dP = dO V^T,
# dQ = dS K and dK = dS^T Q are 2x the forward's two matmuls, and counting the recomputed S = QK^T at half
# credit is the convention flash-attention's and torch's benchmarks use (backward = 2.5x forward).
TRAINING_WORK = 3.5


def with_backward(bind: Bind, device: Device) -> Bind:
    """An implementation's forward bound to leaf copies of q, k, v that require grad; the call returns the
    ``(dq, dk, dv)`` of one forward and backward for a fixed output gradient (the same for every implementation).
    The backward runs on qvl's path for ``device`` too (the forward's context has closed by then)."""

    def bound(x: Inputs) -> Callable[[], tuple[torch.Tensor, ...]]:
        q, k, v = (t.detach().requires_grad_(True) for t in (x.q, x.k, x.v))
        forward = bind(dataclasses.replace(x, q=q, k=k, v=v))
        generator = torch.Generator(device=x.q.device).manual_seed(1)
        grad_out = torch.randn(x.q.shape, generator=generator, device=x.q.device, dtype=x.q.dtype)

        def call() -> tuple[torch.Tensor, ...]:
            with harness.qvl_path(device):
                out = forward()
                return torch.autograd.grad(out, (q, k, v), grad_out.view(out.shape))

        return call

    return bound


def available_peers(
    device: Device, dtype: torch.dtype, skip: frozenset[str] = frozenset()
) -> tuple[dict[str, Bind], dict[str, str]]:
    """The peers that run forward and backward here (some have no backward in some torch releases)."""
    trial = bench_attention.make_inputs(Case(bench_attention.MODELS["8B"], bench_attention.MIXED_TINY), device, dtype)
    training = {name: lambda d, build=build: with_backward(build(d), d) for name, build in PEERS.items()}
    return harness.device_peers(training, device, trial[0], skip)


def cases(device: Device, quick: bool) -> list[Case]:
    """bench_attention's cases; quick on a GPU, the issue's training ones: long single images (S >= 4,096)."""
    if device.is_cuda and quick:
        models = bench_attention.MODELS
        return [Case(models["8B"], square(4096)), Case(models["8B"], square(16384)), Case(models["2B"], square(4096))]
    return bench_attention.cases(device, quick)


def run_case(report: Report, case: Case, peers: dict[str, Bind], device: Device, dtype: torch.dtype) -> None:
    sets = bench_attention.make_inputs(
        case, device, dtype, harness.rotation_count(bench_attention.set_bytes(case, dtype), device)
    )
    x = sets[0]
    variants = {name: build for name, build in QVL_VARIANTS.items() if name not in INFERENCE_ONLY}
    impls = {**{name: with_backward(build(device), device) for name, build in variants.items()}, **peers}
    ref = impls["qvl"](x)()
    # The rope variants' dq and dk are gradients of the unrotated q and k; rotated forward (the rotation is
    # orthogonal) they are the gradients of the rotated q and k, which plain qvl gives on pre-rotated inputs.
    with harness.qvl_path(device):
        q_rot, k_rot = torch.ops.qvl.rotary_2d(x.q, x.k, x.positions)
    rope_ref = impls["qvl"](dataclasses.replace(x, q=q_rot, k=k_rot))()

    def check(name: str, call: Callable[[], tuple[torch.Tensor, ...]]) -> float | None:
        if name == "qvl":
            return None
        grads = [g.reshape(x.q.shape) for g in call()]
        expected = ref
        if name in WITH_ROPE:
            with harness.qvl_path(device):
                grads[:2] = torch.ops.qvl.rotary_2d(*grads[:2], x.positions)
            expected = rope_ref
        return max(harness.max_rel_err(g, e) for g, e in zip(grads, expected, strict=True))

    flops = TRAINING_WORK * harness.attention_flops(case.dims.num_heads, case.dims.head_dim, x.seqlens)
    calls = {name: [bind(s) for s in sets] for name, bind in impls.items()}
    records = harness.check_then_time(report, case.name, flops, calls, check, rep_ms=200)
    bench_attention.note_best_peer(records, peers)


def benchmark(config: RunConfig) -> Report:
    report = Report("attention_backward", config.device, config.dtype, "flops", BASELINES)
    peers, report.skipped = available_peers(config.device, config.dtype, config.skip)
    report.notes.append(f"useful work: {TRAINING_WORK}x the forward's 4*H*D*sum(S^2) (backward = 2.5x forward)")
    return bench_attention.run_cases(report, peers, config, run_case, cases(config.device, config.quick))


def main(argv: Sequence[str] | None = None) -> Report:
    return harness.main(__doc__, benchmark, argv)


if __name__ == "__main__":
    main()
