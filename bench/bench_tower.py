"""The whole vision tower, pixels to merged tokens, as inference (a forward) and as one training step (forward
and backward to every parameter's gradient): qvl's ``VisionTransformer`` (eager, ``tower.compile()`` and, forward
only, replayed from CUDA graphs at token budgets, ``tower.capture``) against transformers' ``Qwen3VLVisionModel``
with SDPA (eager and, forward only, under ``torch.compile``) and, where flash-attn is installed, FlashAttention-2.

Every implementation of a model is built from the same random weights: a transformers tower is
randomized, and qvl's towers are ``VisionTransformer.from_hf`` copies of it. Each call is a whole
forward as a caller makes it, per-batch metadata included (qvl builds it on the host from a CPU
``grid_thw``; transformers from the device ``grid_thw``, with host syncs). A training step's call is that
forward, then ``torch.autograd.grad`` of the merged and deepstack outputs, for a fixed random gradient of each
(the same for every implementation), with respect to all the tower's parameters (the pixels need none). Before
any timing each output (merged tokens and deepstack features) is checked against transformers+SDPA's; each
training step's parameter gradients against those of an fp32 copy of transformers+SDPA (its own included).

Workloads: one 1024x1024 image (64x64 patches), a batch of 8 mixed images (16016 patches), a 16-frame 512x512
video (grid 8x32x32) and 4 small 448x448 images (28x28 patches each: where host time shows), on Qwen3-VL-2B and -8B
shapes; each as a forward case and as a training-step case (named "... training"). The replayed tower's budgets are
the workloads' token counts rounded up to multiples of 1,024 (:data:`REPLAY_BUDGET_STEP`).

    python -m bench.bench_tower [--dtype bf16] [--quick] [--json PATH] [--device auto|cuda|cpu]

Rates are TFLOP/s of the tower's matmuls and attention (useful work, true head dim; a training step counts the
backward too, see :func:`training_flops`). Notes give images (or frames) per second and peak memory: what
``torch.cuda.max_memory_allocated()`` would read with only that implementation loaded, i.e. its weights and the
inputs plus the call's measured rise above them (a training step's includes the gradients it returns), and, for a
forward on a GPU, its GPU time: the profiler's sum of the call's kernel times, beside the wall time the rate
comes from (a forward whose wall time exceeds its GPU time is host-bound). On a CPU a tiny tower (depth 2, hidden
128) runs the torch paths, trains on the smallest workload only, and memory is not measured ("-").
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.metadata
import importlib.util
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from qvl.vit import VisionConfig, VisionTransformer
from qvl.vit.families import config_from_hf

from . import harness
from .bench_attention_backward import TRAINING_WORK
from .harness import Device, Report, RunConfig
from .workloads import MIXED_8, MIXED_TINY, randomize

Output = tuple[torch.Tensor, list[torch.Tensor]]  # merged tokens, deepstack features
GiB = 2**30

TOWERS = {
    "2B": VisionConfig(
        depth=24, hidden_size=1024, num_heads=16, intermediate_size=4096, out_hidden_size=2048,
        deepstack_visual_indexes=(5, 11, 17),
    ),
    "8B": VisionConfig(),
}  # fmt: skip
TINY = VisionConfig(depth=2, hidden_size=128, num_heads=2, intermediate_size=256, out_hidden_size=64,
                    deepstack_visual_indexes=(0,))  # fmt: skip
REFERENCE = "hf sdpa"
BASELINES = ("hf flash_attention_2", "hf sdpa compiled", REFERENCE)
# rows of a case, top down
ORDER = ("qvl", "qvl compiled", "qvl replayed", REFERENCE, "hf sdpa compiled", "hf flash_attention_2")
# Implementations timed on forward cases only: a replay records nothing for autograd (a training step would run
# qvl's eager path again), and transformers' compiled training step would spend minutes of a GPU lease compiling.
FORWARD_ONLY = frozenset({"qvl replayed", "hf sdpa compiled"})
# The replayed tower's budgets: each workload's tokens rounded up to a multiple of this.
REPLAY_BUDGET_STEP = 1024


@dataclass(frozen=True)
class Workload:
    name: str
    grid_thw: tuple[tuple[int, int, int], ...]
    items: int  # images, or video frames (two per temporal patch)
    unit: str


@dataclass(frozen=True)
class Case:
    model: str
    config: VisionConfig
    workload: Workload
    training: bool = False  # one training step instead of a forward

    @property
    def name(self) -> str:
        return f"{self.model} {self.workload.name}" + (" training" if self.training else "")

    @property
    def flops(self) -> float:
        count = training_flops if self.training else tower_flops
        return count(self.config, self.workload.grid_thw)


@dataclass(frozen=True)
class Inputs:
    pixels: torch.Tensor  # (T, 3 * 2 * 16 * 16) patches in merge-block order
    grid_host: torch.Tensor  # (N, 3) int64 on the CPU
    grid_device: torch.Tensor  # the same on the device, as a model's forward receives it


@dataclass(frozen=True)
class Impl:
    module: nn.Module  # whose parameters and buffers count as this implementation's weights
    run: Callable[[Inputs], Output]


def workloads(device: Device) -> list[Workload]:
    if not device.is_cuda:
        return [
            Workload("1 img 8x8", ((1, 8, 8),), 1, "img/s"),
            Workload("4 imgs mixed", tuple((1, h, w) for h, w in MIXED_TINY), len(MIXED_TINY), "img/s"),
            Workload("video 4 frames 4x4", ((2, 4, 4),), 4, "frames/s"),
        ]  # fmt: skip
    return [
        Workload("1 img 1024x1024", ((1, 64, 64),), 1, "img/s"),
        Workload("8 imgs mixed", tuple((1, h, w) for h, w in MIXED_8), 8, "img/s"),
        Workload("video 16 frames 512x512", ((8, 32, 32),), 16, "frames/s"),
        Workload("4 imgs 448x448", ((1, 28, 28),) * 4, 4, "img/s"),
    ]


def cases(device: Device, quick: bool) -> list[Case]:
    """Per model, its forward cases, then its training cases (a model's towers change mode once)."""
    models = {"tiny": TINY} if not device.is_cuda else {m: TOWERS[m] for m in (("8B",) if quick else ("2B", "8B"))}
    forward = workloads(device)
    # transformers' bf16 Conv3d backward takes most of a second on a CPU even for the tiny workloads.
    training = forward if device.is_cuda else [min(forward, key=lambda w: sum(map(math.prod, w.grid_thw)))]
    return [Case(m, config, w, train) for m, config in models.items()
            for train, ws in ((False, forward), (True, training)) for w in ws]  # fmt: skip


def make_inputs(config: VisionConfig, grid_thw: Sequence[tuple[int, int, int]], device: Device, dtype) -> Inputs:
    dev = device.torch_device
    grid = torch.tensor(grid_thw, dtype=torch.int64)
    width = config.in_channels * config.temporal_patch_size * config.patch_size**2
    gen = torch.Generator(device=dev).manual_seed(0)
    pixels = torch.randn(int(grid.prod(-1).sum()), width, generator=gen, device=dev, dtype=dtype)
    return Inputs(pixels, grid, grid.to(dev))


@dataclass(frozen=True)
class ForwardWork:
    """Useful FLOPs of one forward, by the backward each part needs."""

    patch_embed: float  # its input, the pixels, needs no gradient
    linears: float  # per block qkv/proj/MLP, the mergers
    attention: float


def forward_work(config: VisionConfig, grid_thw: Sequence[tuple[int, int, int]]) -> ForwardWork:
    tokens = sum(t * h * w for t, h, w in grid_thw)
    c, inter = config.hidden_size, config.intermediate_size
    patch = config.in_channels * config.temporal_patch_size * config.patch_size**2
    merged_width = c * config.spatial_merge_size**2
    segments = [h * w for t, h, w in grid_thw for _ in range(t)]  # attention stays within a frame
    mergers = (1 + len(config.deepstack_visual_indexes)) * 2 * (tokens // config.spatial_merge_size**2)
    mergers *= merged_width * (merged_width + config.out_hidden_size)
    return ForwardWork(
        patch_embed=2.0 * tokens * patch * c,
        linears=config.depth * 2 * tokens * (4 * c * c + 2 * c * inter) + mergers,
        attention=config.depth * harness.attention_flops(config.num_heads, config.head_dim, segments),
    )


def tower_flops(config: VisionConfig, grid_thw: Sequence[tuple[int, int, int]]) -> float:
    """Useful FLOPs of one forward: patch embed, per block qkv/proj/MLP and attention, the mergers."""
    work = forward_work(config, grid_thw)
    return work.patch_embed + work.linears + work.attention


def training_flops(config: VisionConfig, grid_thw: Sequence[tuple[int, int, int]]) -> float:
    """Useful FLOPs of one training step: the forward's plus the backward's. The patch embed's backward is its
    weight's gradient only (2x its forward in all), every other matmul's its input's and its weight's (3x), and
    attention's TRAINING_WORK times its forward (backward = 2.5x forward, :mod:`bench.bench_attention_backward`)."""
    work = forward_work(config, grid_thw)
    return 2 * work.patch_embed + 3 * work.linears + TRAINING_WORK * work.attention


# --------------------------------------------------------------------------------------------------
# Implementations
# --------------------------------------------------------------------------------------------------
def hf_tower(config: VisionConfig, device: Device, dtype: torch.dtype, attn: str) -> nn.Module:
    """transformers' tower of ``config``'s shape with ``attn`` attention (weights left as initialized)."""
    from transformers import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    fields = dataclasses.asdict(config)
    fields["deepstack_visual_indexes"] = list(config.deepstack_visual_indexes)
    fields["rope_parameters"] = {"rope_type": "axial", "rope_theta": fields.pop("rope_theta")}
    fields.pop("layer_norm_eps")  # transformers hard-codes 1e-6, as does every released config
    hf_config = Qwen3VLVisionConfig(**fields)
    hf_config._attn_implementation = attn  # transformers checks that the backend is usable right here
    with torch.device(device.torch_device):
        model = Qwen3VLVisionModel(hf_config)
    return model.to(dtype).eval().requires_grad_(False)


def hf_impl(model: nn.Module) -> Impl:
    def run(x: Inputs) -> Output:
        out = model(x.pixels, grid_thw=x.grid_device)
        return out.pooler_output, list(out.deepstack_features)

    return Impl(model, run)


def hf_flash_attention_2(device: Device, reference: nn.Module) -> Impl:
    harness.require_cuda(device)
    if importlib.util.find_spec("flash_attn") is None:
        raise harness.Unavailable("flash-attn is not installed")
    config = config_from_hf(reference.config)[1]
    model = hf_tower(config, device, reference.dtype, "flash_attention_2")
    model.load_state_dict(reference.state_dict())
    return hf_impl(model)


def replay_budgets(device: Device) -> list[int]:
    """The token budgets the replayed tower captures: every workload fits the smallest one at or above it."""
    step = REPLAY_BUDGET_STEP
    return sorted({-(-sum(t * h * w for t, h, w in w.grid_thw) // step) * step for w in workloads(device)})


def qvl_tower(device: Device, reference: nn.Module, compiled: bool = False, replayed: bool = False) -> Impl:
    if compiled or replayed:
        harness.require_cuda(device)
    tower = VisionTransformer.from_hf(reference).requires_grad_(False)
    if compiled:
        tower.compile()
    if replayed:
        tower.capture(replay_budgets(device))

    def run(x: Inputs) -> Output:
        with harness.qvl_path(device):
            return tower(x.pixels, x.grid_host)

    return Impl(tower, run)


def hf_sdpa_compiled(device: Device, reference: nn.Module) -> Impl:
    """transformers' tower under ``torch.compile`` (defaults: what a user writes), sharing the reference's
    weights."""
    harness.require_cuda(device)
    compiled = torch.compile(reference)
    return Impl(reference, hf_impl(compiled).run)


PEERS: dict[str, Callable[[Device, nn.Module], Impl]] = {
    "qvl": qvl_tower,
    "qvl compiled": partial(qvl_tower, compiled=True),
    "qvl replayed": partial(qvl_tower, replayed=True),
    "hf sdpa compiled": hf_sdpa_compiled,
    "hf flash_attention_2": hf_flash_attention_2,
}


# --------------------------------------------------------------------------------------------------
# Run
# --------------------------------------------------------------------------------------------------
def weight_bytes(module: nn.Module) -> int:
    return harness.tensor_bytes(*itertools.chain(module.parameters(), module.buffers()))


def output_grads(config: VisionConfig, x: Inputs) -> list[torch.Tensor]:
    """A fixed random gradient of each output of a forward on ``x``: the merged tokens, then each deepstack
    feature (every implementation's backward starts from the same)."""
    rows = x.pixels.shape[0] // config.spatial_merge_size**2
    shape = (1 + len(config.deepstack_visual_indexes), rows, config.out_hidden_size)
    gen = torch.Generator(device=x.pixels.device).manual_seed(1)
    return list(torch.randn(shape, generator=gen, device=x.pixels.device, dtype=x.pixels.dtype).unbind(0))


def bound_call(
    impl: Impl, x: Inputs, device: Device, out_grads: list[torch.Tensor] | None = None
) -> Callable[[], list[torch.Tensor]]:
    """``impl``'s call on ``x``. Without ``out_grads`` a forward, returning its outputs (merged tokens, then the
    deepstack features); with them (:func:`output_grads`) a training step, returning the parameters' gradients
    ordered by parameter name (qvl's tower keeps transformers' names): ``impl.module``'s parameters must require
    grad."""
    if out_grads is None:

        def forward() -> list[torch.Tensor]:
            merged, deepstack = impl.run(x)
            return [merged, *deepstack]

        return forward
    params = [param for _, param in sorted(impl.module.named_parameters())]

    def step() -> list[torch.Tensor]:
        # The backward runs on qvl's path for ``device`` too (impl.run's own context has closed by then).
        with harness.qvl_path(device):
            merged, deepstack = impl.run(x)
            return list(torch.autograd.grad([merged, *deepstack], params, out_grads))

    return step


def peak_memory(module: nn.Module, call: Callable[[], object], x: Inputs, device: Device) -> int | None:
    """Peak bytes with only ``module`` loaded: its weights and the inputs, plus ``call``'s rise over what is
    allocated now (other implementations' weights sit there too, so they are subtracted)."""
    if not device.is_cuda:
        return None
    torch.cuda.synchronize(device.torch_device)
    before = torch.cuda.memory_allocated(device.torch_device)
    torch.cuda.reset_peak_memory_stats(device.torch_device)
    out = call()
    torch.cuda.synchronize(device.torch_device)
    rise = torch.cuda.max_memory_allocated(device.torch_device) - before
    del out
    return weight_bytes(module) + harness.tensor_bytes(x.pixels, x.grid_device) + rise


def run_trial(impl: Impl, x: Inputs) -> Output:
    return impl.run(x)


def max_err(out: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> float:
    return max(harness.max_rel_err(o, r) for o, r in zip(out, ref, strict=True))


def fp32_gradients(
    reference: nn.Module, x: Inputs, device: Device, out_grads: list[torch.Tensor]
) -> list[torch.Tensor]:
    """The training step's gradients through an fp32 copy of ``reference`` on ``x`` and ``out_grads`` (upcast):
    what every implementation's are checked against, transformers' own too: in bf16 on a CPU its LayerNorm and
    patch-embed weight gradients are 2-3e-2 off float64's, beyond the tolerance."""
    model = copy.deepcopy(reference).float().requires_grad_(True)
    x32 = dataclasses.replace(x, pixels=x.pixels.float())
    return bound_call(hf_impl(model), x32, device, [g.float() for g in out_grads])()


def run_case(report: Report, case: Case, impls: dict[str, Impl], device: Device, dtype: torch.dtype) -> None:
    if case.training:
        impls = {name: impl for name, impl in impls.items() if name not in FORWARD_ONLY}
    x = make_inputs(case.config, case.workload.grid_thw, device, dtype)
    # The towers are built frozen: a training case's gradients need the parameters to require grad.
    for impl in impls.values():
        impl.module.requires_grad_(case.training)
    out_grads = output_grads(case.config, x) if case.training else None
    # One input set: the weights (hundreds of MB at 2B and 8B) stream through L2 in every call anyway.
    calls = {name: [bound_call(impl, x, device, out_grads)] for name, impl in impls.items()}
    if case.training:
        ref = fp32_gradients(impls[REFERENCE].module, x, device, out_grads)
    else:
        ref = calls[REFERENCE][0]()

    def check(name: str, call: Callable[[], list[torch.Tensor]]) -> float | None:
        return max_err(call(), ref) if case.training or name != REFERENCE else None

    records = harness.check_then_time(report, case.name, case.flops, calls, check, rep_ms=500)
    if case.training and records.get(REFERENCE) is not None and records[REFERENCE].max_rel_err is not None:
        # In 16-bit dtypes transformers' own gradients miss the fp32 copy's by more than the tolerance (norm and
        # patch-embed weights): an implementation agrees within twice that error too, the suite's rule.
        bound = max(harness.TOLERANCE[dtype], 2 * records[REFERENCE].max_rel_err)
        for record in records.values():
            record.agrees = record.max_rel_err is None or (
                math.isfinite(record.max_rel_err) and record.max_rel_err <= bound
            )
    peaks = {name: peak_memory(impls[name].module, calls[name][0], x, device) for name in records}
    base = next((r.baseline for r in records.values() if r.baseline), None)
    for name, record in records.items():
        throughput = case.workload.items / (record.ms * 1e-3)
        memory = "-" if peaks[name] is None else f"{peaks[name] / GiB:.2f} GiB"
        if peaks[name] is not None and base is not None and name != base:
            memory += f" ({peaks[name] / peaks[base]:.2f}x {base})"
        record.note = f"{throughput:.4g} {case.workload.unit}, peak {memory}"
        if device.is_cuda and not case.training:
            gpu_ms = harness.cuda_kernel_ms(calls[name][0])
            record.note += ", GPU time not recorded" if gpu_ms is None else f", GPU {gpu_ms:.3g} ms"
            report.meta.setdefault("gpu_ms", {}).setdefault(case.name, {})[name] = gpu_ms
        report.meta.setdefault("throughput", {}).setdefault(case.name, {})[name] = [throughput, case.workload.unit]
        report.meta.setdefault("peak_memory_bytes", {}).setdefault(case.name, {})[name] = peaks[name]


def benchmark(config: RunConfig) -> Report:
    device, dtype = config.device, config.dtype
    report = Report("tower", device, dtype, "flops", BASELINES)
    report.notes.append(
        f"max rel err: of the merged and deepstack outputs against {REFERENCE}'s; training: the largest over the "
        f"parameters' gradients, against an fp32 copy of {REFERENCE}'s, agreeing within the tolerance or twice "
        f"{REFERENCE}'s own error"
    )
    report.notes.append(
        f"training work: 2x the patch embed's forward FLOPs, 3x the other matmuls' (dX, dW), {TRAINING_WORK}x "
        "attention's (backward = 2.5x forward)"
    )
    report.notes.append(
        f"goals (H200, bf16, 8B, against {REFERENCE}): qvl eager >= 1.4x on one image, 1.6x on the 8 mixed, 1.5x on "
        "the video and on the 4 small images; GPU time of the one-image forward <= 13 ms; a training step >= 1.3x; "
        "peak memory no higher; qvl's best row >= 1.3x hf sdpa compiled in every case"
    )
    report.meta["transformers"] = importlib.metadata.version("transformers")
    all_cases = cases(device, config.quick)
    report.meta["towers"] = {c.model: dataclasses.asdict(c.config) for c in all_cases}
    for model in dict.fromkeys(c.model for c in all_cases):
        model_cases = [c for c in all_cases if c.model == model]
        tower_config = model_cases[0].config
        print(f"tower: building {model}", flush=True)
        reference = randomize(hf_tower(tower_config, device, dtype, "sdpa"))
        trial = make_inputs(tower_config, ((1, 4, 4),), device, dtype)
        builders = {name: partial(build, device, reference) for name, build in PEERS.items()}
        peers, skipped = harness.peers(builders, partial(run_trial, x=trial), config.skip)
        report.skipped.update(skipped)
        ready = {**peers, REFERENCE: hf_impl(reference)}
        impls = {name: ready[name] for name in ORDER if name in ready}
        for previous, case in zip([None, *model_cases], model_cases):
            if previous is not None and case.training != previous.training:
                # The towers' parameters change requires_grad here. On an H200 with torch 2.11 the compiled tower's
                # training step then returned outputs without grad, as if it ran its frozen inference graph (compiled
                # frames that do not guard on the flag: pytorch/pytorch#139476). Dropping the compiled frames makes the
                # training case compile its own.
                torch._dynamo.reset()
            print(f"tower: {case.name}", flush=True)
            run_case(report, case, impls, device, dtype)
        del peers, ready, impls, reference
        if device.is_cuda:
            torch.cuda.empty_cache()
    if importlib.util.find_spec("flash_attn") is not None:
        report.meta["flash_attn"] = importlib.metadata.version("flash_attn")
    return report


def main(argv: Sequence[str] | None = None) -> Report:
    return harness.main(__doc__, benchmark, argv)


if __name__ == "__main__":
    main()
