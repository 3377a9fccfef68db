"""Host time per call of qvl's ops against torch's equivalents (issue 31): what a small call costs the CPU that
enqueues it, which bounds a tower's speed at small batches (six qvl calls per block, 27 blocks).

    python -m bench.bench_host [--dtype bf16] [--quick] [--json PATH] [--device auto|cuda|cpu]

Each implementation enqueues ``CALLS`` calls on a small input (64 tokens of Qwen3-VL 8B's shapes) without a
sync, timed on the host (``time.perf_counter`` around the loop, the device synchronized before and after), after
a warm-up that compiles every kernel; the median, 20th and 80th percentiles over ``ROUNDS`` rounds are reported as
milliseconds per call (µs in the note). The GPU time of each call is a few µs, below its host time, so the
launch queue never fills and the loop measures the host. Implementations per op:

* ``qvl``: ``torch.ops.qvl.<op>``, launching through qvl's fast launch path;
* ``qvl triton-launch``: the same with the fast path off (:func:`qvl.kernels.common.set_fast_launch`), every
  launch through Triton's ``kernel[grid](...)``: the A/B of the fast path;
* ``qvl direct``: the op's body called as a function (:mod:`qvl.kernels.direct`), as the towers' layers call it
  wherever autograd has nothing to record: what the dispatcher and torch.library's wrappers add is ``qvl`` minus this;
* ``torch``: torch's own equivalent (``F.layer_norm``, ``F.rms_norm``, ``F.gelu(x + b)``, ``F.silu(g + gb) * (u +
  ub)``, a transformers-style rotary on precomputed cos/sin, a gather-and-add for the position table,
  ``F.scaled_dot_product_attention`` for attention), the baseline; ``varlen_attn`` too for attention where torch
  has it.

Needs CUDA: on a CPU nothing is timed (the report says so).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

import qvl.kernels  # noqa: F401 - registers torch.ops.qvl
from qvl.kernels import common, direct

from . import harness
from .harness import Device, Report, RunConfig, Timing
from .workloads import MODELS

DIMS = MODELS["8B"]
TOKENS, MLP = 64, 4304
CALLS, ROUNDS, WARMUP = 100, 30, 20
QUICK_ROUNDS = 10
ROPE_THETA = 10000.0
CUDA_NEEDED = "host times need CUDA (on a CPU qvl runs its torch paths)"

Call = Callable[[], Any]


def host_timing(call: Call, rounds: int, fast_launch: bool = True) -> Timing:
    """Milliseconds of host time per call: ``CALLS`` calls enqueued back to back per round, the device idle
    before each round; ``fast_launch`` sets qvl's fast launch path for the rounds."""
    previous = common.fast_launch_enabled()
    common.set_fast_launch(fast_launch)
    gc_was_enabled = gc.isenabled()
    gc.disable()  # a collection inside a round would be charged to whichever call it interrupts
    try:
        for _ in range(WARMUP):
            call()
        samples = []
        for _ in range(rounds):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(CALLS):
                call()
            samples.append((time.perf_counter() - start) / CALLS * 1e3)
            torch.cuda.synchronize()
    finally:
        common.set_fast_launch(previous)
        if gc_was_enabled:
            gc.enable()
    deciles = statistics.quantiles(samples, n=10)
    return Timing(statistics.median(samples), deciles[1], deciles[7])


def rotate_half_rotary(q, k, cos, sin):
    """transformers' ``apply_rotary_pos_emb_vision`` on ``(T, H, D)`` q and k with ``(T, D)`` cos and sin."""

    def rotate(x):
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin


def cases(device: Device, dtype: torch.dtype) -> dict[str, tuple[tuple, Call]]:
    """Per op: qvl's arguments and torch's equivalent call."""
    dev = device.torch_device
    gen = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape, dtype=dtype):
        return torch.randn(shape, generator=gen, device=dev, dtype=dtype)

    hidden, heads, head_dim = DIMS.num_heads * DIMS.head_dim, DIMS.num_heads, DIMS.head_dim
    x, delta = randn(TOKENS, hidden), randn(TOKENS, hidden)
    weight, bias = 1 + 0.1 * randn(hidden), 0.1 * randn(hidden)
    mlp, mlp_up, mlp_bias, up_bias = randn(TOKENS, MLP), randn(TOKENS, MLP), randn(MLP), randn(MLP)
    q, k, v = randn(TOKENS, 3, heads, head_dim).unbind(1)
    side = int(TOKENS**0.5)
    rows, cols = torch.meshgrid(torch.arange(side, device=dev), torch.arange(side, device=dev), indexing="ij")
    positions = torch.stack([rows.flatten(), cols.flatten()], dim=1).to(torch.int32)
    angles = positions.float().repeat_interleave(head_dim // 4, dim=1) * 0.01
    cos, sin = torch.cat([angles, angles], 1).cos().to(dtype), torch.cat([angles, angles], 1).sin().to(dtype)
    table = randn(48 * 48, hidden)
    indices = torch.randint(0, 48 * 48, (TOKENS, 4), generator=gen, device=dev, dtype=torch.int32)
    weights = torch.rand((TOKENS, 4), generator=gen, device=dev)
    cu_seqlens = torch.tensor([0, TOKENS], dtype=torch.int32, device=dev)
    eps = 1e-6

    def gather_add():
        x.add_((table[indices.long()] * weights.unsqueeze(-1).to(dtype)).sum(1))

    def sdpa():
        return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))

    return {
        "layer_norm": ((x, weight, bias, eps), lambda: F.layer_norm(x, (hidden,), weight, bias, eps)),
        "add_layer_norm": (
            (x, delta, weight, bias, eps),
            lambda: F.layer_norm(x + delta, (hidden,), weight, bias, eps),
        ),
        "rms_norm": ((x, weight, eps), lambda: F.rms_norm(x, (hidden,), weight, eps)),
        "add_rms_norm": ((x, delta, weight, eps), lambda: F.rms_norm(x + delta, (hidden,), weight, eps)),
        "bias_gelu": ((mlp, mlp_bias, "tanh"), lambda: F.gelu(mlp + mlp_bias, approximate="tanh")),
        "bias_swiglu": ((mlp, mlp_up, mlp_bias, up_bias), lambda: F.silu(mlp + mlp_bias) * (mlp_up + up_bias)),
        "rotary_2d": ((q, k, positions, ROPE_THETA), lambda: rotate_half_rotary(q, k, cos, sin)),
        "pos_embed_interp_add_": ((x, table, indices, weights), gather_add),
        "vision_attn": ((q, k, v, cu_seqlens, TOKENS), sdpa),
    }


def varlen_attn(q, k, v, cu_seqlens, max_seqlen) -> Call:
    """torch's ``varlen_attn`` on the attention case's arguments (ImportError where torch lacks it)."""
    from torch.nn.attention.varlen import varlen_attn as op

    return lambda: op(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)


def benchmark(config: RunConfig) -> Report:
    device = config.device
    report = Report("host", device, config.dtype, "calls", ("torch",))
    if not device.is_cuda:
        report.skipped["all"] = CUDA_NEEDED
        print(f"host: {CUDA_NEEDED}", flush=True)
        return report
    rounds = QUICK_ROUNDS if config.quick else ROUNDS
    report.notes.append(f"host time per call: {CALLS} calls per round without a sync, {rounds} rounds, {TOKENS} tokens")
    for name, (args, torch_call) in cases(device, config.dtype).items():
        print(f"host: {name}", flush=True)
        op = getattr(torch.ops.qvl, name)
        impls: dict[str, tuple[Call, bool]] = {
            "qvl": (lambda op=op, args=args: op(*args), True),
            "qvl triton-launch": (lambda op=op, args=args: op(*args), False),
        }
        function = getattr(direct, name)
        impls["qvl direct"] = (lambda function=function, args=args: function(*args), True)
        impls["torch"] = (torch_call, True)
        if name == "vision_attn":
            try:
                impls["varlen_attn"] = (varlen_attn(*args), True)
                impls["varlen_attn"][0]()
            except Exception as exc:  # noqa: BLE001 - a missing or failing peer is reported, not fatal
                impls.pop("varlen_attn", None)
                report.skipped["varlen_attn"] = harness.reason(exc)
        for impl, (call, fast) in impls.items():
            timing = host_timing(call, rounds, fast)
            report.add(name, impl, timing, 1.0, note=f"{timing.ms * 1e3:.1f} us/call")
    return report


def main(argv: Sequence[str] | None = None) -> Report:
    return harness.main(__doc__, benchmark, argv)


if __name__ == "__main__":
    main()
