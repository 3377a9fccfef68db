"""Attention over packed image patches: qvl's ``vision_attn`` against what a user would pick instead.

Peers, each skipped with its reason where it cannot run: torch's ``varlen_attn`` (PyTorch's own
FlashAttention), ``flex_attention`` compiled with a per-image block mask, SDPA called once per image
(transformers' path when flash-attn is absent) with each CUDA backend named through ``sdpa_kernel``
(``sdpa/cudnn``, ``sdpa/flash``; on a CPU ``sdpa/image``, torch's own choice), flash-attn's
``flash_attn_varlen_func`` (FA2) and FlashAttention 3's (``flash_attn_interface``, Hopper), and SGLang's
``triton_attn`` ViT backend (``context_attention_fwd``, where sglang imports; CUDA only). qvl also
runs with its fused rotary (``positions=``, the call the towers make), with ``rotary_2d`` on q and k before it, and
with ``rotary_2d_`` rotating them in place inside a packed qkv first (what an inference tower could do instead), to
show what rope costs each way.

    python -m bench.bench_attention [--dtype bf16] [--quick] [--json PATH] [--device auto|cuda|cpu] [--skip PEERS]

Rates are useful TFLOP/s, 4*H*D*sum(S_i^2) / time at the true head dim. On a CPU only the torch paths
run, on tiny shapes.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

import qvl.kernels  # noqa: F401 - registers torch.ops.qvl

from . import harness
from .harness import Device, Report, RunConfig
from .workloads import (
    MIXED_8,
    MIXED_TINY,
    MODELS,
    VIDEO_16,
    Grid,
    VisionDims,
    cu_seqlens,
    label,
    positions,
    seqlens,
    square,
)


@dataclass(frozen=True)
class Case:
    dims: VisionDims
    grids: tuple[Grid, ...]

    @property
    def name(self) -> str:
        return f"{self.dims.name} {label(self.grids)}"


@dataclass(frozen=True)
class Inputs:
    q: torch.Tensor  # (T, H, D)
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    positions: torch.Tensor
    seqlens: tuple[int, ...]


# An implementation binds one input set to a zero-argument call returning the (T, H, D) output (or a
# view of that shape): binding does what a tower does once per batch, the call what it does per block.
Bind = Callable[[Inputs], Callable[[], torch.Tensor]]


def cases(device: Device, quick: bool) -> list[Case]:
    if not device.is_cuda:
        return [Case(MODELS["8B"], square(64)), Case(MODELS["8B"], MIXED_TINY), Case(MODELS["2B"], square(64))]
    if quick:  # device_check.sh's: the cases, Qwen3-VL 8B's D 72 first
        return [Case(MODELS["8B"], g) for g in (square(1024), square(4096), square(16384), MIXED_8, VIDEO_16)] + [
            Case(MODELS["2B"], g) for g in (square(4096), square(16384), MIXED_8)
        ]
    grids = [*(square(s) for s in (256, 1024, 4096, 16384)), MIXED_8, VIDEO_16]
    return [Case(MODELS[m], g) for m in ("8B", "2B") for g in grids]


def make_inputs(case: Case, device: Device, dtype: torch.dtype, count: int = 1, seed: int = 0) -> list[Inputs]:
    """``count`` input sets of random q, k, v sharing one batch layout."""
    dev = device.torch_device
    lengths = tuple(seqlens(case.grids))
    cu, pos = cu_seqlens(case.grids, dev), positions(case.grids, dev)
    shape = (sum(lengths), case.dims.num_heads, case.dims.head_dim)
    gen = torch.Generator(device=dev).manual_seed(seed)
    sets = []
    for _ in range(count):
        q, k, v = (torch.randn(shape, generator=gen, device=dev, dtype=dtype) for _ in range(3))
        sets.append(Inputs(q, k, v, cu, max(lengths), pos, lengths))
    return sets


def set_bytes(case: Case, dtype: torch.dtype) -> int:
    return 3 * sum(seqlens(case.grids)) * case.dims.num_heads * case.dims.head_dim * dtype.itemsize


# --------------------------------------------------------------------------------------------------
# Implementations
# --------------------------------------------------------------------------------------------------
def qvl_attn(device: Device, rope: bool = False, hint: bool = True) -> Bind:
    """``hint=False`` leaves out the ``max_seqlen`` tile hint (bench_window shows what it buys)."""

    def bind(x: Inputs) -> Callable[[], torch.Tensor]:
        pos = x.positions if rope else None
        max_seqlen = x.max_seqlen if hint else None

        def call() -> torch.Tensor:
            with harness.qvl_path(device):
                return torch.ops.qvl.vision_attn(x.q, x.k, x.v, x.cu_seqlens, max_seqlen, positions=pos)

        return call

    return bind


def qvl_rotary_then_attn(device: Device) -> Bind:
    """The unfused alternative: ``rotary_2d`` writes rotated q and k, then plain ``vision_attn``."""

    def bind(x: Inputs) -> Callable[[], torch.Tensor]:
        def call() -> torch.Tensor:
            with harness.qvl_path(device):
                q, k = torch.ops.qvl.rotary_2d(x.q, x.k, x.positions)
                return torch.ops.qvl.vision_attn(q, k, x.v, x.cu_seqlens, x.max_seqlen)

        return call

    return bind


def qvl_rotary_in_place_then_attn(device: Device) -> Bind:
    """Rope where an inference tower could put it instead: ``rotary_2d_`` rotating q and k in place inside the qkv
    projection's output (the towers' packed ``(T, 3, H, D)`` layout, a copy of the inputs made here: rotating the
    shared ones would change what the other implementations read), then plain ``vision_attn`` on its views. Each
    call rotates the copy again; that changes its values, not the work."""

    def bind(x: Inputs) -> Callable[[], torch.Tensor]:
        q, k, v = torch.stack((x.q, x.k, x.v), 1).unbind(1)

        def call() -> torch.Tensor:
            with harness.qvl_path(device):
                torch.ops.qvl.rotary_2d_(q, k, x.positions)
                return torch.ops.qvl.vision_attn(q, k, v, x.cu_seqlens, x.max_seqlen)

        return call

    return bind


def varlen_attn(device: Device) -> Bind:
    harness.require_cuda(device)
    from torch.nn.attention.varlen import varlen_attn as op

    # Positional arguments only: the keyword set changed between torch releases, the default scale is D**-0.5.
    return lambda x: lambda: op(x.q, x.k, x.v, x.cu_seqlens, x.cu_seqlens, x.max_seqlen, x.max_seqlen)


def flash_attn_varlen(device: Device) -> Bind:
    harness.require_cuda(device)
    from flash_attn import flash_attn_varlen_func as op

    return lambda x: lambda: op(x.q, x.k, x.v, x.cu_seqlens, x.cu_seqlens, x.max_seqlen, x.max_seqlen)


def flash_attn_3_varlen(device: Device) -> Bind:
    """FlashAttention 3 (the Hopper build's ``flash_attn_interface``), which returns ``(out, lse)`` in some
    releases and ``out`` in others."""
    harness.require_cuda(device)
    from flash_attn_interface import flash_attn_varlen_func as op

    def bind(x: Inputs) -> Callable[[], torch.Tensor]:
        def call() -> torch.Tensor:
            out = op(x.q, x.k, x.v, x.cu_seqlens, x.cu_seqlens, x.max_seqlen, x.max_seqlen)
            return out[0] if isinstance(out, tuple) else out

        return call

    return bind


def sglang_triton_attn(device: Device) -> Bind:
    """SGLang's ``triton_attn`` ViT backend as ``VisionTritonAttention`` calls it: non-causal
    ``context_attention_fwd`` with each segment's start and length."""
    harness.require_cuda(device)
    from sglang.kernels.ops.attention.prefill_attention import context_attention_fwd

    def bind(x: Inputs) -> Callable[[], torch.Tensor]:
        starts, lengths = x.cu_seqlens[:-1], x.cu_seqlens.diff()
        out = torch.empty_like(x.q)

        def call() -> torch.Tensor:
            context_attention_fwd(x.q, x.k, x.v, out, starts, lengths, x.max_seqlen, is_causal=False)
            return out

        return call

    return bind


# Eager create_block_mask materializes the whole T x T mask (about 10 bytes per query-key pair at its peak,
# measured on CPU with torch 2.13: 228 GB for bench_window's 147k-token batch); compiled, it evaluates the mask block
# by block in little memory but compiles once per shape. Eager up to 2**30 pairs (32k tokens, ~11 GB).
FLEX_EAGER_MASK_PAIRS = 2**30


def flex_attention(device: Device) -> Bind:
    harness.require_cuda(device)
    from torch.nn.attention.flex_attention import create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as op

    # Every case is a new static shape; past dynamo's recompile limit flex would fall back to its eager
    # path, which materializes the scores.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    compiled = torch.compile(op, dynamic=False)
    masks = {}

    def block_mask(x: Inputs):
        if x.seqlens not in masks:
            dev = x.q.device
            lengths = torch.tensor(x.seqlens, device=dev)
            image = torch.repeat_interleave(torch.arange(len(x.seqlens), device=dev), lengths)
            total = len(image)
            build = create_block_mask if total * total <= FLEX_EAGER_MASK_PAIRS else torch.compile(create_block_mask)
            masks[x.seqlens] = build(
                lambda b, h, q_idx, kv_idx: image[q_idx] == image[kv_idx], None, None, total, total, device=dev
            )
        return masks[x.seqlens]

    def bind(x: Inputs) -> Callable[[], torch.Tensor]:
        mask = block_mask(x)  # built once per batch and shared by all blocks: outside the timed call
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (x.q, x.k, x.v))
        return lambda: compiled(q, k, v, block_mask=mask)[0].transpose(0, 1)

    return bind


def sdpa_per_image(device: Device, backend: str | None = None) -> Bind:
    """transformers' vision attention without flash-attn: (1, H, T, D) views split per image, one SDPA
    call each, the lengths read back to the host in every block. ``backend``: the ``SDPBackend`` name every
    call is pinned to with ``sdpa_kernel`` (CUDA: each backend a peer of its own); None, torch's own choice,
    which stands in on a CPU, where the named CUDA backends cannot run."""
    if backend is not None:
        harness.require_cuda(device)
    elif device.is_cuda:
        raise harness.Unavailable("on CUDA the SDPA backends run by name (sdpa/cudnn, sdpa/flash)")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    pinned = (lambda: sdpa_kernel(getattr(SDPBackend, backend))) if backend else contextlib.nullcontext

    def bind(x: Inputs) -> Callable[[], torch.Tensor]:
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (x.q, x.k, x.v))

        def call() -> torch.Tensor:
            lengths = (x.cu_seqlens[1:] - x.cu_seqlens[:-1]).tolist()
            with pinned():
                outs = [
                    F.scaled_dot_product_attention(qi, ki, vi).transpose(1, 2).contiguous()
                    for qi, ki, vi in zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2), strict=True)
                ]
            return torch.cat(outs, dim=1)[0]

        return call

    return bind


QVL_VARIANTS: dict[str, Callable[[Device], Bind]] = {
    "qvl": qvl_attn,
    "qvl+rope": partial(qvl_attn, rope=True),
    "rotary_2d+qvl": qvl_rotary_then_attn,
    "rotary_2d_+qvl": qvl_rotary_in_place_then_attn,
}
# Variants autograd cannot record (an in-place op on q and k): the forward benchmark's only.
INFERENCE_ONLY = frozenset({"rotary_2d_+qvl"})
# Variants that compute attention of the rotated q and k.
WITH_ROPE = frozenset({"qvl+rope", "rotary_2d+qvl", "rotary_2d_+qvl"})
PEERS: dict[str, Callable[[Device], Bind]] = {
    "varlen_attn": varlen_attn,
    "flex_attention": flex_attention,
    "sdpa/cudnn": partial(sdpa_per_image, backend="CUDNN_ATTENTION"),
    "sdpa/flash": partial(sdpa_per_image, backend="FLASH_ATTENTION"),
    "sdpa/image": sdpa_per_image,
    "flash_attn": flash_attn_varlen,
    "flash_attn_3": flash_attn_3_varlen,
    "sglang/triton_attn": sglang_triton_attn,
}
BASELINES = ("varlen_attn", "sdpa/image")  # sdpa/image stands in where varlen_attn cannot run (CPU)


def available_peers(
    device: Device, dtype: torch.dtype, skip: frozenset[str] = frozenset()
) -> tuple[dict[str, Bind], dict[str, str]]:
    trial = make_inputs(Case(MODELS["8B"], MIXED_TINY), device, dtype)[0]
    return harness.device_peers(PEERS, device, trial, skip)


# --------------------------------------------------------------------------------------------------
# Run
# --------------------------------------------------------------------------------------------------
def run_case(report: Report, case: Case, peers: dict[str, Bind], device: Device, dtype: torch.dtype) -> None:
    sets = make_inputs(case, device, dtype, harness.rotation_count(set_bytes(case, dtype), device))
    x = sets[0]
    impls = {**{name: build(device) for name, build in QVL_VARIANTS.items()}, **peers}
    ref = impls["qvl"](x)()
    with harness.qvl_path(device):
        q_rot, k_rot = torch.ops.qvl.rotary_2d(x.q, x.k, x.positions)
    rope_ref = impls["qvl"](Inputs(q_rot, k_rot, x.v, x.cu_seqlens, x.max_seqlen, x.positions, x.seqlens))()

    def check(name: str, call: Callable[[], torch.Tensor]) -> float | None:
        if name == "qvl":
            return None
        return harness.max_rel_err(call().reshape(ref.shape), rope_ref if name in WITH_ROPE else ref)

    flops = harness.attention_flops(case.dims.num_heads, case.dims.head_dim, x.seqlens)
    calls = {name: [bind(s) for s in sets] for name, bind in impls.items()}
    records = harness.check_then_time(report, case.name, flops, calls, check)
    for name, what in (
        ("qvl+rope", "fused rope"),
        ("rotary_2d+qvl", "separate rope"),
        ("rotary_2d_+qvl", "in-place rope"),
    ):
        if "qvl" in records and name in records:
            overhead = 100 * (records[name].ms / records["qvl"].ms - 1)
            records[name].note = f"{what} {overhead:+.1f}% vs qvl"
    note_best_peer(records, peers)


def note_best_peer(records: dict[str, harness.Record], peers: dict[str, Bind]) -> None:
    """Append to each qvl variant's note its speedup over the fastest peer timed in the same case."""
    timed = [(records[name].ms, name) for name in peers if name in records]
    if not timed:
        return
    best_ms, best = min(timed)
    for name in QVL_VARIANTS:
        if name in records:
            record = records[name]
            record.note = "; ".join(filter(None, [record.note, f"{best_ms / record.ms:.2f}x best peer ({best})"]))


def run_cases(
    report: Report, peers: dict[str, Bind], config: RunConfig, run=run_case, case_list: Sequence[Case] | None = None
) -> Report:
    """Every case of ``case_list`` (default :func:`cases`) through ``run`` (this module's :func:`run_case`, or the
    training benchmark's), with the notes the peers that ran need; returns ``report``."""
    if "flash_attn" in peers:
        report.meta["flash_attn"] = importlib.metadata.version("flash_attn")
    if "sglang/triton_attn" in peers:
        report.meta["sglang"] = importlib.metadata.version("sglang")
    if "flex_attention" in peers:
        report.notes.append("flex_attention: head dim padded to a power of two; block mask built outside the timing")
    for case in cases(config.device, config.quick) if case_list is None else case_list:
        print(f"{report.bench}: {case.name}", flush=True)
        run(report, case, peers, config.device, config.dtype)
    return report


def benchmark(config: RunConfig) -> Report:
    report = Report("attention", config.device, config.dtype, "flops", BASELINES)
    peers, report.skipped = available_peers(config.device, config.dtype, config.skip)
    return run_cases(report, peers, config)


def main(argv: Sequence[str] | None = None) -> Report:
    return harness.main(__doc__, benchmark, argv)


if __name__ == "__main__":
    main()
