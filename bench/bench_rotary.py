"""Qwen3-VL's 2D rotary embedding: qvl's ``rotary_2d`` (and in-place ``rotary_2d_``) against
transformers' eager ``apply_rotary_pos_emb_vision`` and ``torch.compile`` of it.

transformers builds cos/sin once per forward (``Qwen3VLVisionRotaryEmbedding``) and every block
applies them; the peers here time that per-block apply, with cos/sin built outside the timing. qvl
computes cos/sin from the int32 positions inside the kernel.

    python -m bench.bench_rotary [--dtype bf16] [--quick] [--json PATH] [--device auto|cuda|cpu]

Rates are GB/s of the minimum traffic (q and k read and written once, positions read once) on the
8B head shape (H=16, D=72); "copy" moves as many bytes with ``Tensor.copy_`` (issue 31's goal: 85 % of its rate).
On a CPU only the torch paths run, on tiny shapes.
"""

from __future__ import annotations

import importlib.metadata
import inspect
from collections.abc import Callable, Sequence
from functools import partial

import torch

import qvl.kernels  # noqa: F401 - registers torch.ops.qvl

from . import harness
from .harness import Device, Report, RunConfig
from .workloads import MODELS, Grid, positions, square

DIMS = MODELS["8B"]
ROPE_THETA = 10000.0

Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # q, k (T, H, D) and positions (T, 2)
Bind = Callable[[Inputs], Callable[[], object]]


def cases(device: Device, quick: bool) -> list[tuple[Grid, ...]]:
    if not device.is_cuda:
        return [square(64), square(256)]
    return [square(t) for t in ((1024, 4096) if quick else (1024, 4096, 16384))]


def make_inputs(grids: tuple[Grid, ...], device: Device, dtype: torch.dtype, count: int = 1) -> list[Inputs]:
    """``count`` sets of random q, k sharing one positions tensor."""
    dev = device.torch_device
    pos = positions(grids, dev)
    shape = (pos.shape[0], DIMS.num_heads, DIMS.head_dim)
    gen = torch.Generator(device=dev).manual_seed(0)
    sets = []
    for _ in range(count):
        q, k = (torch.randn(shape, generator=gen, device=dev, dtype=dtype) for _ in range(2))
        sets.append((q, k, pos))
    return sets


def set_bytes(grids: tuple[Grid, ...], dtype: torch.dtype) -> int:
    return 2 * sum(h * w for h, w in grids) * DIMS.num_heads * DIMS.head_dim * dtype.itemsize


def min_bytes(x: Inputs) -> int:
    q, k, pos = x
    return 2 * harness.tensor_bytes(q, k) + harness.tensor_bytes(pos)


# --------------------------------------------------------------------------------------------------
# Implementations
# --------------------------------------------------------------------------------------------------
def qvl_rotary(device: Device, in_place: bool = False) -> Bind:
    op = torch.ops.qvl.rotary_2d_ if in_place else torch.ops.qvl.rotary_2d

    def bind(x: Inputs) -> Callable[[], object]:
        def call() -> object:
            with harness.qvl_path(device):
                return op(*x, ROPE_THETA)

        return call

    return bind


def hf_cos_sin(pos: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``(T, D)`` as transformers' vision tower builds them, through its own rotary module.

    transformers 5.x changed the module: older releases take ``(dim, theta)`` and return a frequency
    table the model indexes with the positions; newer ones take the vision config and the positions.
    """
    from transformers.models.qwen3_vl import modeling_qwen3_vl as hf

    module_cls = hf.Qwen3VLVisionRotaryEmbedding
    if "config" in inspect.signature(module_cls.__init__).parameters:
        config = hf.Qwen3VLVisionConfig(
            hidden_size=DIMS.num_heads * head_dim, num_heads=DIMS.num_heads, depth=1,
            rope_parameters={"rope_type": "axial", "rope_theta": ROPE_THETA},
        )  # fmt: skip
        module = module_cls(config).to(pos.device)
        return module(torch.empty(0, device=pos.device), pos)
    module = module_cls(head_dim // 2, ROPE_THETA).to(pos.device)
    freqs = module(int(pos.max()) + 1)[pos.long()].flatten(1)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def hf_eager(device: Device, compiled: bool = False) -> Bind:
    from transformers.models.qwen3_vl.modeling_qwen3_vl import apply_rotary_pos_emb_vision

    if compiled:
        harness.require_cuda(device)
        # Each case is a new static shape; stay below dynamo's recompile limit rather than fall back to eager.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    apply = torch.compile(apply_rotary_pos_emb_vision, dynamic=False) if compiled else apply_rotary_pos_emb_vision
    tables = {}  # id(positions) -> (positions, cos, sin); holding positions keeps its id unique

    def bind(x: Inputs) -> Callable[[], object]:
        q, k, pos = x
        if id(pos) not in tables:
            tables[id(pos)] = (pos, *hf_cos_sin(pos, q.shape[-1]))
        _, cos, sin = tables[id(pos)]
        return lambda: apply(q, k, cos, sin)

    return bind


PEERS: dict[str, Callable[[Device], Bind]] = {
    "hf eager": hf_eager,
    "hf compiled": partial(hf_eager, compiled=True),
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
        "qvl": qvl_rotary(device),
        "qvl in-place": qvl_rotary(device, in_place=True),
        "copy": lambda x: harness.copy_call(x[0], min_bytes(x)),
        **peers,
    }
    q_ref, k_ref = impls["qvl"](sets[0])()

    def check(name: str, call: Callable[[], object]) -> float | None:
        if name in ("qvl", "copy"):
            return None
        if name == "qvl in-place":
            q, k, pos = (t.clone() for t in sets[0])
            impls[name]((q, k, pos))()
        else:
            q, k = call()
        return max(harness.max_rel_err(q, q_ref), harness.max_rel_err(k, k_ref))

    calls = {name: [bind(s) for s in sets] for name, bind in impls.items()}
    harness.check_then_time(report, f"T={sets[0][2].shape[0]}", min_bytes(sets[0]), calls, check)


def benchmark(config: RunConfig) -> Report:
    device, dtype = config.device, config.dtype
    report = Report("rotary", device, dtype, "bytes", BASELINES)
    trial = make_inputs(square(16), device, dtype)[0]
    peers, report.skipped = harness.device_peers(PEERS, device, trial, config.skip)
    report.notes.append("hf peers: per-block apply with cos/sin built once outside the timing, as transformers does")
    if "hf eager" in peers:  # its rotary module's API changed across releases
        report.meta["transformers"] = importlib.metadata.version("transformers")
    for grids in cases(device, config.quick):
        print(f"rotary: {sum(h * w for h, w in grids)} tokens", flush=True)
        run_case(report, grids, peers, device, dtype)
    return report


def main(argv: Sequence[str] | None = None) -> Report:
    return harness.main(__doc__, benchmark, argv)


if __name__ == "__main__":
    main()
