"""Qwen2.5-VL's window attention: qvl's ``vision_attn`` on 64-token windows, against what a user would pick.

Qwen2.5-VL's tower (16 heads, head dim 80, patch 14, 2x2 merge) attends within 112-pixel windows (8 x 8
patches: 64 tokens, fewer on a frame's bottom and right edges when its size is not a multiple) in all but
four blocks, which attend over whole frames. Tokens are in window order and the segments are
``cu_window_seqlens`` from ``qvl.vit.metadata.build_window_metadata``; each case runs either the window
blocks' segments (``window ...``) or the full-attention blocks' (``full ...``: one segment per frame).

Implementations (peers are skipped with their reason where they cannot run):

- ``qvl``: ``vision_attn`` with the ``max_seqlen`` tile hint (the longest segment: 64 for windows), which
  picks 64 x 64 tiles in 16-bit dtypes; ``qvl no hint``: the same call with ``max_seqlen=None`` (128-row
  tiles), so the hint's effect shows;
- ``varlen_attn``: torch's varlen attention (its FlashAttention-2), the issue's yardstick;
- ``flash_attn``: flash-attn's ``flash_attn_varlen_func`` (transformers' Qwen2.5-VL path), when installed;
- ``flex_attention``: compiled, with a block mask built from the segments (built once per batch, outside
  the timing) at flex's default 128-token blocks: every block along the diagonal holds two windows and is
  evaluated with the mask;
- ``sdpa/window``: transformers' Qwen2.5-VL path without flash-attn, one SDPA call per segment;
- ``sdpa/batched``: what a user who knows the windows are mostly equal would write: segments grouped by
  length, one batched SDPA call per group (a strided view when one group is the whole batch, else a
  gather and a scatter whose indices are built once per batch).

    python -m bench.bench_window [--dtype bf16] [--quick] [--json PATH] [--device auto|cuda|cpu]
    python -m bench.bench_window --work [--dtype bf16]   # executed-work table only: no kernel runs, any machine

Rates are useful TFLOP/s, 4*H*D*sum(S_i^2) / time; speedups are against ``varlen_attn`` (``sdpa/window``
where it cannot run). The issue's GPU goal is qvl >= 1.5x ``varlen_attn`` on 64-token windows; the qvl
rows' notes say whether a run met it, and how much matmul work each launch executes per useful unit
(``qvl.kernels.attention.launch_work``: padding rows, keys and head-dim columns included). On a CPU only
the torch paths run, on tiny shapes.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import cached_property, partial

import numpy as np
import torch
import torch.nn.functional as F
import triton

import qvl.kernels  # noqa: F401 - registers torch.ops.qvl
from qvl.kernels.attention import head_dim_layout, head_dim_tiles, launch_config, launch_work
from qvl.kernels.common import HOPPER, device_target
from qvl.vit.metadata import WindowMetadata, build_window_metadata

from . import bench_attention, harness
from .bench_attention import Bind, Inputs
from .harness import Device, Report, RunConfig
from .workloads import VisionDims, positions

QWEN2_5 = VisionDims("Qwen2.5-VL", num_heads=16, head_dim=80, hidden=1280)
PATCH = 14  # pixels per patch side: layouts are labelled in pixels, as a user sizes images
GOAL = 1.5  # the target: qvl's speedup over varlen_attn on 64-token windows


@dataclass(frozen=True)
class Layout:
    """One batch: ``grid_thw`` rows (t, h, w) in patches, h and w even (the 2x2 merge)."""

    label: str
    grid_thw: tuple[tuple[int, int, int], ...]

    @cached_property
    def windows(self) -> WindowMetadata:
        return build_window_metadata(self.grid_thw, patch_size=PATCH)

    def cu_seqlens(self, window: bool) -> np.ndarray:
        """Segment bounds in window order: the windows, or one segment per frame (windows never cross frames,
        so the frames stay contiguous in window order)."""
        if window:
            return self.windows.cu_window_seqlens.numpy().astype(np.int64)
        frames = np.repeat([h * w for _, h, w in self.grid_thw], [t for t, _, _ in self.grid_thw])
        return np.concatenate([[0], np.cumsum(frames)])


def image(h: int, w: int, count: int = 1) -> Layout:
    """``count`` single-frame images of h x w patches, labelled by their size in pixels."""
    name = f"{h * PATCH}x{w * PATCH}"
    return Layout(name if count == 1 else f"{count}x {name}", ((1, h, w),) * count)


# GPU layouts. 1344 px is 96 x 96 patches: 144 whole windows per image; 1036 x 756 px (74 x 54 patches)
# leaves edge windows of 48, 16 and 12 tokens; sixteen 1344 px images give 2304 windows in one launch; the
# mixed batch is a chat request's spread (448 px to 1372 x 1960 px, a 2-frame video among them).
BIG_BATCH = image(96, 96, count=16)
LAYOUTS = {
    layout.label: layout
    for layout in (
        image(32, 32),
        image(96, 96),
        image(74, 54),
        Layout("video 4x 644x868", ((4, 46, 62),)),
        Layout("mixed 5", ((1, 32, 32), (1, 74, 54), (2, 46, 62), (1, 12, 20), (1, 98, 140))),
        BIG_BATCH,
    )
}
# CPU: the same kinds of layout at a few hundred tokens (whole windows; edge windows in a two-image batch).
CPU_LAYOUTS = (image(16, 16), Layout("mixed 2", ((1, 16, 16), (1, 12, 20))))


@dataclass(frozen=True)
class Case:
    layout: Layout
    window: bool  # the window blocks' segments, else the full-attention blocks' (one per frame)

    @property
    def kind(self) -> str:
        return "window" if self.window else "full"

    @cached_property
    def cu(self) -> np.ndarray:
        return self.layout.cu_seqlens(self.window)

    @property
    def seqlens(self) -> tuple[int, ...]:
        return tuple(int(s) for s in np.diff(self.cu))

    @property
    def name(self) -> str:
        count = len(self.seqlens)
        return f"{self.kind} {self.layout.label} ({count} seg{'s' if count > 1 else ''})"


def cases(device: Device, quick: bool) -> list[Case]:
    if not device.is_cuda:
        return [Case(CPU_LAYOUTS[0], True), Case(CPU_LAYOUTS[1], True), Case(CPU_LAYOUTS[1], False)]
    if quick:  # device_check.sh's run: whole windows, edge windows, thousands of windows, one frame
        return [Case(LAYOUTS[name], True) for name in ("1344x1344", "1036x756", BIG_BATCH.label)] + [
            Case(LAYOUTS["1344x1344"], False)
        ]
    windows = [Case(layout, True) for layout in LAYOUTS.values()]
    return windows + [Case(LAYOUTS[name], False) for name in ("1344x1344", "mixed 5", BIG_BATCH.label)]


def make_inputs(case: Case, device: Device, dtype: torch.dtype, count: int = 1, seed: int = 0) -> list[Inputs]:
    """``count`` sets of random q, k, v in window order sharing the case's segments. Rotary positions are
    the tower's own (merge units permuted into window order) though no timed call applies them."""
    dev = device.torch_device
    frames = [(h, w) for t, h, w in case.layout.grid_thw for _ in range(t)]
    unit = positions(frames, torch.device("cpu")).view(-1, 4, 2)  # a 2x2 merge unit's tokens are consecutive
    pos = unit[case.layout.windows.window_index].view(-1, 2).to(dev)
    cu = torch.from_numpy(case.cu.astype(np.int32)).to(dev)
    lengths = case.seqlens
    shape = (sum(lengths), QWEN2_5.num_heads, QWEN2_5.head_dim)
    gen = torch.Generator(device=dev).manual_seed(seed)
    sets = []
    for _ in range(count):
        q, k, v = (torch.randn(shape, generator=gen, device=dev, dtype=dtype) for _ in range(3))
        sets.append(Inputs(q, k, v, cu, max(lengths), pos, lengths))
    return sets


# --------------------------------------------------------------------------------------------------
# Executed work (analytic: no kernel runs)
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Work:
    case: str
    hint: int | None  # the max_seqlen passed to vision_attn
    tiles: str  # BLOCK_M x BLOCK_N the hint selects
    programs: int  # per head
    busy_programs: int
    ratio: float  # executed / useful matmul work


def executed_work(case: Case, dtype: torch.dtype, target=HOPPER) -> list[Work]:
    """What qvl's attention launch executes for the case's segments, with the hint and without it. Defaults
    to sm_90 (the H200 the goal is set on); in 16-bit dtypes the tiles do not depend on the target."""
    rows = []
    for hint in (max(case.seqlens), None):
        config = launch_config(QWEN2_5.head_dim, dtype, target, hint)
        work = launch_work(case.cu, config)
        tiles = f"{config['BLOCK_M']}x{config['BLOCK_N']}"
        rows.append(Work(case.name, hint, tiles, work.programs, work.busy_programs, work.ratio))
    return rows


def work_table(dtype: torch.dtype = torch.bfloat16) -> str:
    """Executed / useful matmul work of every GPU layout, window and full segments, with and without the
    hint: the table ``--work`` prints (and bench/results/window-work-*.txt keeps)."""
    all_cases = [Case(layout, window) for window in (True, False) for layout in LAYOUTS.values()]
    header = ("case", "tokens", "longest", "max_seqlen", "tiles", "programs/head", "busy", "executed/useful")
    rows = []
    for case in all_cases:
        for w in executed_work(case, dtype):
            hint = "none" if w.hint is None else str(w.hint)
            rows.append((w.case, str(case.cu[-1]), str(max(case.seqlens)), hint, w.tiles, str(w.programs),
                         str(w.busy_programs), f"{w.ratio:.3f}"))  # fmt: skip
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines = [header, tuple("-" * w for w in widths), *rows]
    title = (
        f"vision_attn executed / useful matmul work per launch (qvl.kernels.attention.launch_work): Qwen2.5-VL "
        f"H {QWEN2_5.num_heads}, D {QWEN2_5.head_dim} (the {head_dim_layout(HOPPER)} layout: tiles "
        f"{head_dim_tiles(QWEN2_5.head_dim, target=HOPPER).width} columns wide), "
        f"{str(dtype).removeprefix('torch.')}, sm_90 launch config; counted on the host, no kernel runs"
    )
    return "\n".join([title, ""] + ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines])


# --------------------------------------------------------------------------------------------------
# Implementations qvl's own bench_attention does not have
# --------------------------------------------------------------------------------------------------
def sdpa_batched(device: Device) -> Bind:
    """Segments grouped by length, one (n, H, S, D) SDPA call per group."""

    def bind(x: Inputs) -> Callable[[], torch.Tensor]:
        tokens, heads, dim = x.q.shape
        lengths = np.asarray(x.seqlens)
        starts = np.cumsum(lengths) - lengths
        groups = []
        for length in np.unique(lengths[lengths > 0]):
            first = starts[lengths == length]
            rows = (first[:, None] + np.arange(length)).reshape(-1)
            groups.append((int(length), first.size, torch.from_numpy(rows).to(x.q.device)))

        def attend(q, k, v, count, length):
            q, k, v = (t.view(count, length, heads, dim).transpose(1, 2) for t in (q, k, v))
            return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(count * length, heads, dim)

        if len(groups) == 1 and groups[0][0] * groups[0][1] == tokens:
            # Every segment the same length: the packed tensors are already the batch (no copy in).
            return lambda: attend(x.q, x.k, x.v, groups[0][1], groups[0][0])

        def call() -> torch.Tensor:
            out = torch.empty_like(x.q)
            for length, count, rows in groups:
                q, k, v = (t.index_select(0, rows) for t in (x.q, x.k, x.v))
                out.index_copy_(0, rows, attend(q, k, v, count, length))
            return out

        return call

    return bind


PEERS: dict[str, Callable[[Device], Bind]] = {
    "varlen_attn": bench_attention.varlen_attn,
    "flash_attn": bench_attention.flash_attn_varlen,
    "flex_attention": bench_attention.flex_attention,  # its document mask is the segments' mask
    # one SDPA call per segment, lengths read back per call: cuDNN's backend by name on CUDA, torch's choice on a CPU
    "sdpa/window/cudnn": partial(bench_attention.sdpa_per_image, backend="CUDNN_ATTENTION"),
    "sdpa/window": bench_attention.sdpa_per_image,
    "sdpa/batched": sdpa_batched,
}
BASELINES = ("varlen_attn", "sdpa/window")  # sdpa/window stands in where varlen_attn cannot run (CPU)


# --------------------------------------------------------------------------------------------------
# Run
# --------------------------------------------------------------------------------------------------
def run_case(report: Report, case: Case, peers: dict[str, Bind], device: Device, dtype: torch.dtype) -> None:
    set_bytes = 3 * int(case.cu[-1]) * QWEN2_5.num_heads * QWEN2_5.head_dim * dtype.itemsize
    sets = make_inputs(case, device, dtype, harness.rotation_count(set_bytes, device))
    impls = {"qvl": bench_attention.qvl_attn(device), "qvl no hint": bench_attention.qvl_attn(device, hint=False)}
    calls = {}
    for name, bind in {**impls, **peers}.items():
        try:
            calls[name] = [bind(s) for s in sets]
        except Exception as exc:  # noqa: BLE001 - e.g. a block mask too big for this batch: report, go on
            report.skipped[f"{name} ({case.name})"] = harness.reason(exc)
    ref = calls["qvl"][0]()

    def check(name: str, call: Callable[[], torch.Tensor]) -> float | None:
        return None if name == "qvl" else harness.max_rel_err(call().reshape(ref.shape), ref)

    flops = harness.attention_flops(QWEN2_5.num_heads, QWEN2_5.head_dim, case.seqlens)
    records = harness.check_then_time(report, case.name, flops, calls, check)

    # The kernel's tiles are chosen for the device it runs on; a CPU run prices the H200's (sm_90) launch.
    target = device_target(device.torch_device) if device.is_cuda else HOPPER
    hinted, plain = executed_work(case, dtype, target)
    report.meta.setdefault("executed_work", []).extend(asdict(w) for w in (hinted, plain))
    for name, work in (("qvl", hinted), ("qvl no hint", plain)):
        if name in records:
            records[name].note = f"exec/useful {work.ratio:.2f} ({work.tiles} tiles)"
    qvl = records.get("qvl")
    if case.window and qvl is not None and qvl.baseline == "varlen_attn" and qvl.speedup is not None:
        qvl.note += f"; goal {GOAL}x varlen_attn {'met' if qvl.speedup >= GOAL else 'NOT met'}"


def benchmark(config: RunConfig) -> Report:
    device, dtype = config.device, config.dtype
    report = Report("window", device, dtype, "flops", BASELINES)
    trial = make_inputs(Case(CPU_LAYOUTS[1], True), device, dtype)[0]
    peers, report.skipped = harness.device_peers(PEERS, device, trial, config.skip)
    if "flash_attn" in peers:
        report.meta["flash_attn"] = importlib.metadata.version("flash_attn")
    report.notes.append(
        f"Qwen2.5-VL attention, H {QWEN2_5.num_heads}, D {QWEN2_5.head_dim}: 'window' cases are the window blocks' "
        "segments (112 px = 64 tokens, fewer at frame edges), 'full' the full-attention blocks' (one per frame)"
    )
    report.notes.append("qvl: max_seqlen hint = longest segment; qvl no hint: max_seqlen=None")
    if not device.is_cuda:
        report.notes.append("exec/useful notes price the sm_90 launch the CPU did not run (torch path here)")
    if "flex_attention" in peers:
        report.notes.append("flex_attention: segment block mask at 128-token blocks, built outside the timing")
    report.notes.append("sdpa/batched: one SDPA call per distinct segment length (gather/scatter unless one)")
    for case in cases(device, config.quick):
        print(f"window: {case.name}", flush=True)
        run_case(report, case, peers, device, dtype)
    return report


def main(argv: Sequence[str] | None = None) -> Report | None:
    """The benchmark (see the module docstring); with ``--work``, only the executed-work table."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--work" in args:
        args.remove("--work")
        config = harness.parse_args(__doc__, args)
        print(f"torch {torch.__version__} | triton {triton.__version__}")
        print(work_table(config.dtype), flush=True)
        return None
    return harness.main(__doc__, benchmark, args)


if __name__ == "__main__":
    main()
