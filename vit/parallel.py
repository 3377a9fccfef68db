"""One vision tower over several processes (torch.distributed): weight sharding or batch splitting.

Ask for a mode with ``VisionTransformer(config, parallel=..., group=...)`` (or the same arguments to
``from_hf`` / ``from_pretrained``); ``group`` defaults to the whole world.

* ``"weights"`` (tensor parallel): each rank keeps 1/world of every block's heads and MLP width and of
  every merger's hidden width, and runs the whole batch. qkv and every fc1 are split by output features
  (column parallel); attn.proj and every fc2 by input features (row parallel), their partial products
  summed by one all-reduce each: two per block, one per merger. Norms, patch embed and the position table
  are replicated, and the qvl ops run unchanged on the local heads. The all-reduces are functional
  collectives, so ``tower.compile()`` traces them into its graph.
* ``"data"``: each rank keeps all the weights and encodes a share of the batch, then one all-gather gives
  every rank every image's features in input order. Shares are balanced under a cost model that counts
  attention's quadratic term, and videos are split by temporal slice (:mod:`qvl.vit.balance`).

Every rank must call the tower with the same batch. Each call first exchanges a small fingerprint of it
(a hash of grid_thw and pixel_values' shape): a rank with a different or invalid batch then makes every
rank raise, instead of leaving the others waiting in a collective. The fingerprint travels between hosts
when the group has a CPU backend, so the check never waits for the GPU: ``init_from_env`` joins CUDA
ranks with ``"cpu:gloo,cuda:nccl"``, as does ``init_process_group()`` without a backend. A group with
nccl alone carries it on the tower's device, and reading it back is then one small device sync per call.
With one process either mode is exactly the single-process tower.

A strategy never reaches into the tower: the tower asks it for its local widths and its all-reduce when
it builds its parameters, for this rank's part of a state dict when it loads one, and hands it the
tower's own single-process encode to run on this rank's part of each batch (:class:`SingleProcess`).
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from .balance import SegmentCost, balance
from .config import TowerConfig
from .layers import AllReduce, needs_grad
from .metadata import check_grid, grid_as_numpy, to_device

__all__ = [
    "MODES",
    "DataParallel",
    "LocalWidths",
    "SingleProcess",
    "WeightsParallel",
    "has_cpu_backend",
    "init_from_env",
    "is_main_rank",
    "make_parallel",
]

MODES = ("weights", "data")
# Newer torch names the functional all-gather all_gather_single and deprecates all_gather_tensor.
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
# encode(pixel_values, grid) -> (merged, deepstack): the single-process encode of a batch (grid: int64
# (N, 3) rows of t, h, w), which a strategy calls on the part of the batch that this rank runs.
Encode = Callable[[torch.Tensor, np.ndarray], tuple[torch.Tensor, list[torch.Tensor]]]


def is_main_rank(group: dist.ProcessGroup | None = None) -> bool:
    """Whether this process should print and write results: rank 0 of ``group`` (default: the world), or
    the only process when torch.distributed is not initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        return True
    return dist.get_rank(group) == 0


def init_from_env(device: torch.device | str | None = None) -> torch.device:
    """Join the process group a launcher such as torchrun describes in the environment (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), unless already joined, and return this rank's device.

    ``device`` defaults to CUDA when available, else CPU; a CUDA device without an index becomes
    ``cuda:LOCAL_RANK``. The backend follows the device: nccl for CUDA tensors (with gloo for CPU
    tensors beside it), gloo for CPU. Without
    ``WORLD_SIZE`` in the environment nothing is joined (a single process).
    """
    device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # gloo beside nccl lets the per-call batch check run on the host (see the module docstring).
        dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo")
    return device


def has_cpu_backend(group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``group`` can run collectives on CPU tensors (its backend config names one for ``cpu``)."""
    entries = dict(entry.partition(":")[::2] for entry in dist.get_backend_config(group).split(","))
    return entries.get("cpu", "none") != "none"


def make_parallel(
    mode: str | None, config: TowerConfig, group: dist.ProcessGroup | None = None, caller: str = "VisionTransformer"
) -> SingleProcess:
    """The strategy a tower runs with: :class:`SingleProcess` for ``mode=None`` or a group of one process,
    else a :class:`WeightsParallel` or :class:`DataParallel`. Raises on every rank alike (nothing here
    communicates) when the mode is unknown, torch.distributed is not initialized, this process is not in
    ``group``, or (weights mode) a width does not divide by the group's size; ``caller`` names the API in
    those errors."""
    if mode is None:
        return SingleProcess(config)
    if mode not in MODES:
        raise ValueError(f"{caller}: parallel must be None or one of {MODES}, got {mode!r}")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{caller}(parallel={mode!r}) needs torch.distributed's process group: call "
            f"torch.distributed.init_process_group (or qvl.vit.parallel.init_from_env) first"
        )
    group = group if group is not None else dist.group.WORLD
    if dist.get_rank(group) < 0:
        raise ValueError(f"{caller}(parallel={mode!r}): this process is not a member of the group passed")
    if dist.get_world_size(group) == 1:
        return SingleProcess(config)
    return (WeightsParallel if mode == "weights" else DataParallel)(config, group)


class LocalWidths(NamedTuple):
    """The widths of the parameters one rank holds: its attention heads, MLP hidden width and mergers'
    hidden width (all of them, or 1/world of each under weight sharding)."""

    num_heads: int
    intermediate_size: int
    merged_width: int


class SingleProcess:
    """The tower on one process: every parameter, the whole batch, no collective.

    The interface every strategy offers the tower: :meth:`local_widths` and :attr:`all_reduce` say what
    to build, :meth:`local_state_dict` what to load, and :meth:`run` encodes a batch through the
    tower's own single-process encode.
    """

    mode: str | None = None
    all_reduce: AllReduce | None = None

    def __init__(self, config: TowerConfig):
        self.config = config

    def local_widths(self) -> LocalWidths:
        config = self.config
        return LocalWidths(config.num_heads, config.intermediate_size, config.merged_width)

    def local_state_dict(self, state_dict: dict[str, torch.Tensor], local_shapes: dict[str, torch.Size]):
        """This rank's part of a whole tower's state dict (``local_shapes``: the tower's own parameters)."""
        return state_dict

    def run(self, pixel_values: torch.Tensor, grid_thw, encode: Encode, device: torch.device):
        """Encode a batch (``grid_thw`` as any of :func:`~qvl.vit.build_metadata`'s forms) with ``encode``,
        called on this rank's part of it; returns ``(merged, deepstack)`` of the whole batch."""
        grid = grid_as_numpy(grid_thw)
        check_grid(grid, self.config.spatial_merge_size)
        return encode(pixel_values, grid)


class _Distributed(SingleProcess):
    """What both modes share: the group, and the check that every rank passes the same batch."""

    def __init__(self, config: TowerConfig, group: dist.ProcessGroup, host_group: dist.ProcessGroup | None = None):
        super().__init__(config)
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        # The batch check's exchange: on the host over host_group (the same ranks in the same order, with a CPU
        # backend: what engines keep beside an NCCL group, e.g. vLLM's cpu_group), or over group itself when it
        # has a CPU backend; else on the device.
        if host_group is None and has_cpu_backend(group):
            host_group = group
        self.host_group = host_group
        self.exchanges_on_host = host_group is not None

    def agree_on_batch(self, pixel_values, grid_thw, device: torch.device) -> np.ndarray:
        """``grid_thw`` as a checked ``(N, 3)`` int64 array, once every rank has shown it holds the same
        valid batch. The local checks run before the exchange and their error is raised after it, so a
        rank that fails them still takes part and the others learn of it instead of hanging. ``device``
        carries the exchange when the group has no CPU backend."""
        problem = None
        try:
            grid = grid_as_numpy(grid_thw)
            check_grid(grid, self.config.spatial_merge_size)
            shape = (int(np.prod(grid, axis=1).sum()), self.config.patch_dim)
            # Folded image rows (qvl.vit.layers.embed_patches) are checked with the batch by the tower runner.
            folded = (shape[0], self.config.folded_patch_dim)
            if not isinstance(pixel_values, torch.Tensor) or tuple(pixel_values.shape) not in (shape, folded):
                got = tuple(pixel_values.shape) if isinstance(pixel_values, torch.Tensor) else type(pixel_values)
                raise ValueError(f"parallel={self.mode!r}: pixel_values must have shape {shape}, got {got}")
            shape = tuple(pixel_values.shape)
            digest = hashlib.blake2b(np.ascontiguousarray(grid).tobytes(), digest_size=8).digest()
            fingerprint = [1, int.from_bytes(digest, "little", signed=True), *shape]
        except (TypeError, ValueError) as error:
            problem, fingerprint = error, [0, 0, 0, 0]
        local = torch.tensor(fingerprint, dtype=torch.int64, device="cpu" if self.exchanges_on_host else device)
        everyone = _all_gather(local, 0, self.host_group or self.group).view(self.world_size, -1).tolist()
        if problem is not None:
            raise problem
        invalid = [rank for rank, seen in enumerate(everyone) if not seen[0]]
        if invalid:
            raise ValueError(
                f"parallel={self.mode!r}: rank(s) {invalid} passed an invalid batch (their error says why); "
                f"every rank must pass the same batch"
            )
        if any(seen != everyone[0] for seen in everyone):
            described = "; ".join(
                f"rank {rank}: pixel_values {tuple(seen[2:])}, grid_thw hash {seen[1] & (2**64 - 1):016x}"
                for rank, seen in enumerate(everyone)
            )
            raise ValueError(f"parallel={self.mode!r}: every rank must pass the same batch, got {described}")
        return grid


# Parameter names of every tower kind: Qwen3-VL's (mlp / mergers' linear_fc1, linear_fc2), Qwen2.5-VL's
# (mlp.gate_proj / up_proj / down_proj, merger.mlp.0 / mlp.2) and Qwen2-VL's (mlp.fc1 / fc2, merger.mlp.0 / mlp.2).
_QKV = re.compile(r"blocks\.\d+\.attn\.qkv\.(weight|bias)")
_COLUMN = re.compile(
    r"((blocks\.\d+\.mlp|merger|deepstack_merger_list\.\d+)\.linear_fc1"
    r"|blocks\.\d+\.mlp\.(gate_proj|up_proj|fc1)|merger\.mlp\.0)\.(weight|bias)"
)
_ROW = re.compile(
    r"((blocks\.\d+\.mlp|merger|deepstack_merger_list\.\d+)\.linear_fc2"
    r"|blocks\.\d+\.mlp\.(down_proj|fc2)|merger\.mlp\.2|blocks\.\d+\.attn\.proj)\.weight"
)


class WeightsParallel(_Distributed):
    """Tensor parallelism: this rank's heads and widths, and the all-reduce of the row-parallel linears."""

    mode = "weights"

    def __init__(self, config: TowerConfig, group: dist.ProcessGroup):
        super().__init__(config, group)
        uneven = {
            name: width
            for name, width in zip(
                ("num_heads", "intermediate_size", "hidden_size * spatial_merge_size**2 (the mergers' width)"),
                super().local_widths(),
            )
            if width % self.world_size
        }
        if uneven:
            raise ValueError(
                f"VisionTransformer(parallel='weights') splits heads and widths evenly over the group's "
                f"{self.world_size} ranks, but {uneven} do not divide by {self.world_size}"
            )
        self.all_reduce = self._all_reduce

    def local_widths(self) -> LocalWidths:
        return LocalWidths(*(width // self.world_size for width in super().local_widths()))

    def _all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(partial, "sum", self.group)

    def local_state_dict(self, state_dict, local_shapes):
        local = {}
        for name, shape in local_shapes.items():
            if name not in state_dict:
                continue  # the caller reports what is missing
            tensor, dim = state_dict[name], self._split_dim(name)
            if dim is None:
                local[name] = tensor
                continue
            whole = list(shape)
            whole[dim] *= self.world_size
            if list(tensor.shape) != whole:
                raise ValueError(
                    f"VisionTransformer: {name} has shape {tuple(tensor.shape)}, expected the whole tower's "
                    f"{tuple(whole)} (parallel='weights' keeps 1/{self.world_size} of it on each rank)"
                )
            if _QKV.fullmatch(name):
                # Rows are laid out (3, heads, head_dim): this rank's heads are one contiguous run inside
                # each of q, k and v, not one run of the whole.
                local[name] = tensor.unflatten(0, (3, self.world_size, -1))[:, self.rank].flatten(0, 1)
            else:
                local[name] = tensor.chunk(self.world_size, dim)[self.rank]
        return local

    @staticmethod
    def _split_dim(name: str) -> int | None:
        if _QKV.fullmatch(name) or _COLUMN.fullmatch(name):
            return 0
        if _ROW.fullmatch(name):
            return 1
        return None

    def run(self, pixel_values, grid_thw, encode, device):
        return encode(pixel_values, self.agree_on_batch(pixel_values, grid_thw, device))


class _GatherShares(torch.autograd.Function):
    """The data mode's all-gather of every rank's (padded) features. Every rank holds the whole gathered batch and
    computes the same loss from it, so the gradient each rank receives for the gathered features is already the
    whole gradient: backward keeps this rank's rows (no sum, which would count each rank's loss world-size
    times)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, strategy: DataParallel) -> torch.Tensor:
        ctx.rows, ctx.rank = local.shape[0], strategy.rank
        return _all_gather(local, 0, strategy.group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        first = ctx.rank * ctx.rows
        return grad[first : first + ctx.rows], None


class DataParallel(_Distributed):
    """Data parallelism: replicated weights, the batch split by :func:`~qvl.vit.balance.balance`, one
    all-gather.

    Training: each rank's backward reaches the inputs and parameters through its own share of the batch only, so
    a rank's parameter gradients are its share's part; their sum over the ranks (``all_reduce`` with SUM, not
    DDP's average) is the single-process gradient."""

    mode = "data"

    def __init__(self, config: TowerConfig, group: dist.ProcessGroup, host_group: dist.ProcessGroup | None = None):
        super().__init__(config, group, host_group)
        self.cost = SegmentCost.from_config(config)

    def run(self, pixel_values, grid_thw, encode, device):
        """Encode this rank's share with ``encode`` and gather everyone's, in input order."""
        grid = self.agree_on_batch(pixel_values, grid_thw, device)
        merge = self.config.spatial_merge_size
        plan = balance(grid, self.world_size, self.cost)
        entry_rows = np.concatenate([[0], np.cumsum(np.prod(grid, axis=1))]).tolist()
        parts = []
        for piece in plan.shares[self.rank]:
            frame = plan.grid[piece.entry][1] * plan.grid[piece.entry][2]
            first = entry_rows[piece.entry] + piece.start * frame
            parts.append(pixel_values[first : first + (piece.stop - piece.start) * frame])
        stride = max(plan.merged_rows(rank, merge) for rank in range(self.world_size))
        if stride and not parts:
            merged, deepstack = self._idle_share(pixel_values, encode)
        else:
            # A new tensor, not a view: the compiled forward guards on its input's storage offset (0, 1 or more),
            # and a rank's share starts at a different row in every batch.
            local_pixels = torch.cat(parts or [pixel_values[:0]])
            local_grid = np.array(plan.local_grid(self.rank), dtype=np.int64).reshape(-1, 3)
            merged, deepstack = encode(local_pixels, local_grid)
        if stride == 0:
            return merged, deepstack  # an empty batch on every rank
        # Main and deepstack features travel together, each rank's rows padded to the longest share (the
        # padding is never read back).
        if needs_grad(merged, *deepstack):
            local = torch.cat([merged, *deepstack], dim=1)
            local = torch.nn.functional.pad(local, (0, 0, 0, stride - local.shape[0]))
            gathered = _GatherShares.apply(local, self)
        else:
            local = merged.new_empty(stride, merged.shape[1] * (1 + len(deepstack)))
            torch.cat([merged, *deepstack], dim=1, out=local[: merged.shape[0]])
            gathered = _all_gather(local, 0, self.group)
        order = to_device(torch.from_numpy(plan.gather_index(merge, stride)), gathered.device)
        merged, *deepstack = gathered.index_select(0, order).split(merged.shape[1], dim=1)
        return merged.contiguous(), [features.contiguous() for features in deepstack]

    def _idle_share(self, pixel_values: torch.Tensor, encode) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Empty outputs for a rank the plan gives no part of a batch (fewer frames than ranks), which still ran
        every module of the tower, forward and, where autograd records, backward: on one merge block of zero pixels,
        folded in at weight zero. A training stack's per-module parameter gathers and gradient reductions are
        collectives the other ranks make; a rank that skipped the modules would leave them waiting. Its gradients
        are zeros, the inputs' included."""
        merge = self.config.spatial_merge_size
        pixels = torch.cat([pixel_values[:0], pixel_values.new_zeros(merge * merge, pixel_values.shape[1])])
        merged, deepstack = encode(pixels, np.array([[1, merge, merge]], dtype=np.int64))
        zero = sum(features.sum() for features in (merged, *deepstack)) * 0
        return merged[:0] + zero, [features[:0] + zero for features in deepstack]
