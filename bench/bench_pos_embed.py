"""The learned position embedding, resampled to each image and added to the patch embeddings: qvl's
``pos_embed_interp_add_`` (one launch for the whole batch) against transformers' eager path and
``torch.compile`` of it.

transformers does this in every forward: ``get_vision_interpolation_indices_and_weights`` on the
device ``grid_thw`` (int64 indices, several small launches and a host sync), then
``(pos_embed(idx) * w[:, :, None]).sum(1)``, which materializes ``(T, 4, C)`` in fp32, and an
out-of-place add. The peers time that whole path ("hf eager") and the gather+add alone with the
indices built outside the timing ("hf gather+add"), each also compiled. qvl's metadata is built
once per batch on the host; "qvl+metadata" adds that build (all of it: segments and rotary
positions too) to the launch.

    python -m bench.bench_pos_embed [--dtype bf16] [--quick] [--json PATH] [--device auto|cuda|cpu]

Rates are GB/s of the minimum traffic: hidden states read and written once, int32 indices and fp32
weights read once, the table read once; "copy" moves as many bytes with ``Tensor.copy_`` (issue 31's goal: 85 %
of its rate). 8B sizes (C=1152, a 48x48 table). On a CPU only the eager paths run, on tiny shapes.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.nn.functional as F

import qvl.kernels  # noqa: F401 - registers torch.ops.qvl
from qvl.vit.metadata import VisionMetadata, build_metadata

from . import harness
from .harness import Device, Report, RunConfig
from .workloads import MIXED_8, MIXED_TINY, MODELS, Grid, label, seqlens, square

CHANNELS = MODELS["8B"].hidden
SIDE = 48  # num_grid_per_side of every released Qwen3-VL
MERGE = 2


@dataclass(frozen=True)
class Inputs:
    hidden: torch.Tensor  # (T, C) patch embeddings; qvl adds to them in place
    table: torch.Tensor  # (SIDE^2, C) learned position embedding
    grid_host: torch.Tensor  # (N, 3) int64 on the CPU, what qvl's metadata is built from
    grid_device: torch.Tensor  # the same on the device, as transformers' forward receives it
    meta: VisionMetadata


Bind = Callable[[Inputs], Callable[[], torch.Tensor | None]]


def cases(device: Device, quick: bool) -> list[tuple[Grid, ...]]:
    if not device.is_cuda:
        return [square(64), MIXED_TINY]
    sizes = (1024, 4096) if quick else (1024, 4096, 16384)
    return [*(square(s) for s in sizes), MIXED_8]


def make_inputs(grids: tuple[Grid, ...], device: Device, dtype: torch.dtype, count: int = 1) -> list[Inputs]:
    """``count`` sets of random hidden states sharing one table and one batch layout."""
    dev = device.torch_device
    gen = torch.Generator(device=dev).manual_seed(0)
    table = torch.randn(SIDE * SIDE, CHANNELS, generator=gen, device=dev, dtype=dtype)
    grid_host = torch.tensor([(1, h, w) for h, w in grids], dtype=torch.int64)
    meta = build_metadata(grid_host, MERGE, SIDE, device=dev)
    shape = (meta.num_tokens, CHANNELS)
    return [
        Inputs(torch.randn(shape, generator=gen, device=dev, dtype=dtype), table, grid_host, grid_host.to(dev), meta)
        for _ in range(count)
    ]


def set_bytes(grids: tuple[Grid, ...], dtype: torch.dtype) -> int:
    return sum(seqlens(grids)) * CHANNELS * dtype.itemsize


def min_bytes(x: Inputs) -> int:
    metadata = harness.tensor_bytes(x.meta.interp_indices, x.meta.interp_weights)
    return 2 * harness.tensor_bytes(x.hidden) + metadata + harness.tensor_bytes(x.table)


# --------------------------------------------------------------------------------------------------
# Implementations
# --------------------------------------------------------------------------------------------------
def qvl_add(device: Device, with_metadata: bool = False) -> Bind:
    def bind(x: Inputs) -> Callable[[], None]:
        def call() -> None:
            meta = build_metadata(x.grid_host, MERGE, SIDE, device=x.hidden.device) if with_metadata else x.meta
            with harness.qvl_path(device):
                torch.ops.qvl.pos_embed_interp_add_(x.hidden, x.table, meta.interp_indices, meta.interp_weights)

        return call

    return bind


def hf_indices(grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights

    # The arguments Qwen3VLVisionModel.forward passes.
    return get_vision_interpolation_indices_and_weights(
        grid_thw, num_grid_per_side=SIDE, mode="bilinear", align_corners=True, spatial_merge_size=MERGE
    )


def hf_gather_add(hidden: torch.Tensor, table: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor):
    pos = (F.embedding(indices, table) * weights[:, :, None]).sum(1)
    return hidden + pos.to(hidden.dtype)


def hf_forward_part(hidden: torch.Tensor, table: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    return hf_gather_add(hidden, table, *hf_indices(grid_thw))


def hf_eager(device: Device, compiled: bool = False, with_indices: bool = True) -> Bind:
    if compiled:
        harness.require_cuda(device)
        # Each case is a new static shape; stay below dynamo's recompile limit rather than fall back to eager.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    fn = hf_forward_part if with_indices else hf_gather_add
    # The index computation syncs on data-dependent sizes, so the whole path compiles with graph breaks.
    fn = torch.compile(fn, dynamic=False) if compiled else fn
    if with_indices:
        return lambda x: lambda: fn(x.hidden, x.table, x.grid_device)
    tables = {}  # id(grid_device) -> (grid_device, indices, weights); holding the grid keeps its id unique

    def bind(x: Inputs) -> Callable[[], torch.Tensor]:
        if id(x.grid_device) not in tables:
            tables[id(x.grid_device)] = (x.grid_device, *hf_indices(x.grid_device))
        _, indices, weights = tables[id(x.grid_device)]
        return lambda: fn(x.hidden, x.table, indices, weights)

    return bind


PEERS: dict[str, Callable[[Device], Bind]] = {
    "hf eager": hf_eager,
    "hf gather+add": partial(hf_eager, with_indices=False),
    "hf compiled": partial(hf_eager, compiled=True),
    "hf compiled gather+add": partial(hf_eager, compiled=True, with_indices=False),
}
BASELINES = ("hf eager",)


# --------------------------------------------------------------------------------------------------
# Run
# --------------------------------------------------------------------------------------------------
def run_case(
    report: Report, grids: tuple[Grid, ...], peers: dict[str, Bind], device: Device, dtype: torch.dtype
) -> None:
    sets = make_inputs(grids, device, dtype, harness.rotation_count(set_bytes(grids, dtype), device))
    impls = {
        "qvl": qvl_add(device),
        "qvl+metadata": qvl_add(device, with_metadata=True),
        "copy": lambda x: harness.copy_call(x.hidden, min_bytes(x)),
        **peers,
    }

    def fresh() -> Inputs:
        # The qvl rows add in place: checks run on copies, so the timed sets stay as made.
        return replace(sets[0], hidden=sets[0].hidden.clone())

    ref = fresh()
    impls["qvl"](ref)()

    def check(name: str, call: Callable[[], torch.Tensor | None]) -> float | None:
        if name in ("qvl", "copy"):
            return None
        if name.startswith("qvl"):
            x = fresh()
            impls[name](x)()
            return harness.max_rel_err(x.hidden, ref.hidden)
        return harness.max_rel_err(call(), ref.hidden)

    calls = {name: [bind(s) for s in sets] for name, bind in impls.items()}
    harness.check_then_time(report, label(grids), min_bytes(sets[0]), calls, check)


def benchmark(config: RunConfig) -> Report:
    device, dtype = config.device, config.dtype
    report = Report("pos_embed", device, dtype, "bytes", BASELINES)
    trial = make_inputs(MIXED_TINY, device, dtype)[0]
    peers, report.skipped = harness.device_peers(PEERS, device, trial, config.skip)
    report.notes.append(
        "hf eager: transformers' per-forward path (indices from the device grid_thw, gather, add); "
        "hf gather+add: indices built outside the timing; qvl+metadata: qvl's whole host metadata build plus the launch"
    )
    report.notes.append("goal (H200): qvl >= 10x hf eager")
    if "hf eager" in peers:  # vision_utils is recent in transformers
        report.meta["transformers"] = importlib.metadata.version("transformers")
    for grids in cases(device, config.quick):
        print(f"pos_embed: {label(grids)}", flush=True)
        run_case(report, grids, peers, device, dtype)
    return report


def main(argv: Sequence[str] | None = None) -> Report:
    return harness.main(__doc__, benchmark, argv)


if __name__ == "__main__":
    main()
