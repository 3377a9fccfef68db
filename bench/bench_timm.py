"""timm's Qwen3-VL backbone in a training step under AMP: ``qvl.vit.patch_model`` against timm eager and timm compiled.

    python -m bench.bench_timm [--variant qwen3_vit_88m] [--batch 4] [--image-size 224] [--rounds 3]
                               [--device auto|cpu|cuda] [--skip "timm compiled,qvl compiled"] [--quick] [--json PATH]

One step is what timm's train script does with ``--amp``: gradients cleared, the forward under ``torch.autocast`` to
bf16 over fp32 weights, cross-entropy to fixed labels, backward (no optimizer step: the same for every row). The
model is ``--variant`` at its real size with random weights (timm's own init; ``num_classes=1000``), on ``--batch``
images of ``--image-size`` pixels. Rows, all on the same weights and images:

* ``timm``: the model as timm builds it, eager (the baseline);
* ``timm compiled``: ``torch.compile(model)`` (Inductor; one image size, compiled once in the warm-up);
* ``qvl``: ``patch_model(model)``, eager: the tower on qvl's ops (the CPU's torch path; Triton kernels on a GPU);
* ``qvl compiled``: ``torch.compile(patch_model(model))``.

Timing: each row's step runs twice to warm up (the compiled ones compile there), then the rows take turns for
``--rounds`` rounds; ``ms`` is the median, the range min..max, ``speedup`` the baseline's median over the row's.
``max rel err``: the logits against timm eager's (max|diff| / max|timm|); the note has the parameter gradients' (the
largest difference over the largest gradient, all parameters at one scale) and the step's peak tensor bytes above the
start (the profiler's allocations on a CPU, the allocator's peak on a GPU). Work: the step's useful FLOPs (forward
matmuls and attention, backward 2x the matmuls', 2.5x attention's).

``--quick``: a 2-block, 64-wide model of the variant on two 64 x 64 images, one round, the compiled rows through
Dynamo alone (``backend="eager"``, no C++ compile): the test suite's smoke run, whose numbers mean nothing.
Without timm (``pip install timm==1.0.31``) it prints why and exits with status 2.
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from . import harness
from .bench_attention_backward import TRAINING_WORK

BASELINE = "timm"
IMPLS = (BASELINE, "timm compiled", "qvl", "qvl compiled")
QUICK_MODEL = dict(depth=2, embed_dim=64, num_heads=2, pos_embed_grid_size=8)
CLASSES = 1000
MiB = 2**20

Step = Callable[[], tuple[torch.Tensor, list[torch.Tensor]]]  # one training step -> (logits, parameter gradients)


def build_model(variant: str, quick: bool, device: torch.device) -> nn.Module:
    import timm

    model = timm.create_model(variant, pretrained=False, num_classes=CLASSES, **(QUICK_MODEL if quick else {}))
    return model.to(device).train()


def step_flops(model: nn.Module, batch: int, rows: int, cols: int) -> float:
    """Useful FLOPs of one training step of a qwen3_vit classifier on ``batch`` images of ``rows x cols`` patches."""
    encoder = model.encoder
    block = encoder.blocks[0]
    width, hidden = encoder.embed_dim, block.mlp.fc1.out_features
    tokens = batch * rows * cols
    patch = encoder.patch_embed.proj
    embed = 2.0 * tokens * patch.in_channels * patch.kernel_size[0] * patch.kernel_size[1] * width
    linears = 2.0 * tokens * (4 * width * width + 2 * width * hidden) * len(encoder.blocks)
    if encoder.merger is not None:
        merged = encoder.merger.hidden_size
        linears += 2.0 * tokens / encoder.merge_size**2 * merged * (merged + encoder.merger.out_features)
    linears += 2.0 * batch * model.num_features * CLASSES
    heads = block.attn.num_heads
    attention = harness.attention_flops(heads, width // heads, [rows * cols] * batch) * len(encoder.blocks)
    return 2 * embed + 3 * linears + TRAINING_WORK * attention


def training_step(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, device: harness.Device) -> Step:
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        with torch.autocast(device.torch_device.type, dtype=torch.bfloat16), harness.qvl_path(device):
            logits = model(images)
            loss = nn.functional.cross_entropy(logits.float(), labels)
        loss.backward()
        return logits.detach(), [p.grad for p in params]

    return step


def implementations(model: nn.Module, images, labels, device: harness.Device, quick: bool, skip: frozenset[str]):
    """Every row's step that runs here (each on its own copy of the weights), and why the others do not."""
    from qvl.vit import patch_model

    options = {"backend": "eager"} if quick else {}
    builders = {
        BASELINE: lambda: training_step(model, images, labels, device),
        "timm compiled": lambda: training_step(torch.compile(copy.deepcopy(model), **options), images, labels, device),
        "qvl": lambda: training_step(patch_model(copy.deepcopy(model)), images, labels, device),
        "qvl compiled": lambda: training_step(
            torch.compile(patch_model(copy.deepcopy(model)), **options), images, labels, device
        ),
    }
    return harness.peers(builders, skip=skip)


def timed(step: Step, device: harness.Device) -> float:
    """Milliseconds of one step (the device synchronized around it)."""
    if device.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    if device.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def grads_err(grads: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """The gradients' max|diff| over every parameter, over their max|reference|: one scale for all (a parameter
    whose true gradient is 0, as the key bias's, would make its own relative error noise)."""
    diff = max(float((g - r).abs().max()) for g, r in zip(grads, reference, strict=True))
    return diff / max(float(r.abs().max()) for r in reference)


def benchmark(args: argparse.Namespace) -> harness.Report:
    device = harness.get_device(args.device)
    quick = args.quick
    batch, size = (2, 64) if quick else (args.batch, args.image_size)
    rounds = 1 if quick else args.rounds
    torch.manual_seed(0)
    model = build_model(args.variant, quick, device.torch_device)
    patch = model.encoder.patch_embed.proj.kernel_size[0]
    images = torch.randn(batch, 3, size, size, device=device.torch_device)
    labels = torch.arange(batch, device=device.torch_device) % CLASSES
    report = harness.Report("timm", device, torch.bfloat16, "flops", (BASELINE,))
    params = sum(p.numel() for p in model.parameters())
    report.notes.append(
        f"{args.variant}{' (--quick: 2 blocks of 64)' if quick else ''}: {params / 1e6:.1f}M parameters (fp32),"
        f" {len(model.encoder.blocks)} blocks of {model.encoder.embed_dim}; {batch} images of {size}x{size}"
        f" ({size // patch}x{size // patch} patches); bf16 autocast; {torch.get_num_threads()} torch threads"
    )
    report.notes.append(
        f"ms: median of {rounds} interleaved rounds after 2 warm-up steps (compiles); note: the gradients' max rel err"
        " (all parameters at one scale), peak tensor bytes of one step"
    )
    if quick:
        report.notes.append("--quick: tiny model, compiled through Dynamo alone; the numbers mean nothing")
    skip = frozenset(name for name in args.skip.split(",") if name)
    steps, skipped = implementations(model, images, labels, device, quick, skip)
    report.skipped.update(skipped)
    case = f"{batch} x {size}px"
    work = step_flops(model, batch, size // patch, size // patch)
    results = {}
    for name, step in steps.items():
        print(f"{name}: warm-up", flush=True)
        step()
        logits, grads = step()
        results[name] = (logits.float().clone(), [g.float().clone() for g in grads])
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            times[name].append(timed(step, device))
    peaks = {}
    for name, step in steps.items():  # after the timing: a step just after the profiler ran slow on a CPU
        gc.collect()
        peaks[name] = harness.peak_tensor_bytes(step, device.torch_device.type)
    reference = results.get(BASELINE)
    for name in steps:
        logits, grads = results[name]
        err = None if name == BASELINE or reference is None else harness.max_rel_err(logits, reference[0])
        note = "" if err is None else f"grads {grads_err(grads, reference[1]):.1e}; "
        note += f"peak {peaks[name] / MiB:.0f} MiB"
        timing = harness.Timing(statistics.median(times[name]), min(times[name]), max(times[name]))
        report.add(case, name, timing, work, err, note=note)
    return report


def main(argv: Sequence[str] | None = None) -> harness.Report | None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", default="qwen3_vit_88m", help="a timm qwen3_vit classifier (default: the 88M)")
    parser.add_argument("--batch", type=int, default=4, help="images a step (default 4)")
    parser.add_argument("--image-size", type=int, default=224, help="image side in pixels (default 224)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after the warm-up (default 3)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--skip", default="", help=f"comma-separated rows to leave out, of: {', '.join(IMPLS[1:])}")
    parser.add_argument("--quick", action="store_true", help="tiny model: a smoke run, numbers meaningless")
    parser.add_argument(
        "--json", type=Path, help="results file (default: bench/results/timm-<device>-<date>.json; --quick: none)"
    )
    args = parser.parse_args(argv)
    try:
        import timm  # noqa: F401
    except ImportError as error:
        print(f"bench_timm: timm does not import ({error}); pip install timm==1.0.31", flush=True)
        raise SystemExit(2) from None
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_timm: --device cuda, but there is no CUDA device", flush=True)
        raise SystemExit(2)
    report = benchmark(args)
    report.finish(args.json, args.quick, f"timm-{report.device.slug}")
    return report


if __name__ == "__main__":
    main()
