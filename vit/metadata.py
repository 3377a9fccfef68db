"""Host-side metadata for one forward of the vision tower, built once per batch from ``grid_thw``.

Everything here depends only on the patch-grid sizes, so it is computed on the host with numpy and
moved to the device in one go before the forward starts. The forward then never reads a device tensor
back to the host (no ``.item()``, ``.tolist()`` or ``.max()`` syncs), which keeps it CUDA-graph and
``torch.compile`` friendly whatever the image sizes.

The layouts are transformers' (``transformers.vision_utils``), in merge-block token order
``[t][block_row][block_col][row_in_block][col_in_block]``:

* ``cu_seqlens``: one attention segment per temporal slice (``get_vision_cu_seqlens``);
* ``positions``: each token's (row, col) on its grid (``get_vision_position_ids``);
* ``interp_indices`` / ``interp_weights``: the bilinear, align-corners resampling of the learned
  ``num_grid_per_side ** 2`` position table (``get_vision_interpolation_indices_and_weights``), with
  the same fp32 arithmetic, so the weights are bit-identical to transformers'.

For Qwen2.5-VL's window attention, :func:`build_window_metadata` gives transformers'
``get_vision_window_index`` (the merge-unit permutation into window order and ``cu_window_seqlens``),
the inverse permutation and the longest window, the same way: numpy, once per batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

__all__ = [
    "DeviceInputs",
    "VisionMetadata",
    "WindowMetadata",
    "build_metadata",
    "build_window_metadata",
    "check_grid",
    "check_int",
    "equal_images_inputs",
    "grid_as_numpy",
    "to_device",
]

# Token counts, segment offsets, positions and table indices all travel as int32.
_INT32_LIMIT = 2**31
_TORCH_DTYPES = {np.dtype(np.int32): torch.int32, np.dtype(np.float32): torch.float32}


@dataclasses.dataclass(frozen=True, eq=False)
class VisionMetadata:
    """Per-batch metadata for the vision tower (see :func:`build_metadata`).

    Attributes:
        grid_thw: CPU int64 ``(N, 3)``: (t, h, w) patch counts per image/video.
        cu_seqlens: int32 ``(S + 1,)``, one segment of ``h * w`` tokens per temporal slice (S = sum t).
        max_seqlen: longest segment (Python int; 0 for an empty batch).
        positions: int32 ``(T, 2)``: (row, col) of every token.
        interp_indices: int32 ``(T, 4)``: rows of the learned position table to blend per token (None
            without a table, ``num_grid_per_side=None``).
        interp_weights: fp32 ``(T, 4)``: their bilinear weights (None without a table).
        spatial_merge_size: merge block side the token order was built for.
        num_grid_per_side: side of the learned position grid the indices point into.
        token_counts: ``t * h * w`` per entry (Python ints).
        merged_token_counts: ``t * h * w // spatial_merge_size ** 2`` per entry, for splitting the
            merger's output per image.
        window: a windowed tower's window layout (:class:`WindowMetadata`; ``positions`` are then in window
            order), None for other towers (see :func:`qvl.vit.runner.build_tower_metadata`).
    """

    grid_thw: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    positions: torch.Tensor
    interp_indices: torch.Tensor | None
    interp_weights: torch.Tensor | None
    spatial_merge_size: int
    num_grid_per_side: int | None
    token_counts: tuple[int, ...]
    merged_token_counts: tuple[int, ...]
    window: WindowMetadata | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def num_merged_tokens(self) -> int:
        return sum(self.merged_token_counts)

    @property
    def num_segments(self) -> int:
        return int(self.cu_seqlens.shape[0]) - 1

    @property
    def device(self) -> torch.device:
        return self.cu_seqlens.device

    def to(self, device: torch.device | str) -> VisionMetadata:
        """A copy with the device tensors on ``device`` (``grid_thw`` stays on the CPU), moved by
        :func:`to_device` (no sync)."""
        device = torch.device(device)
        return dataclasses.replace(
            self,
            cu_seqlens=to_device(self.cu_seqlens, device),
            positions=to_device(self.positions, device),
            interp_indices=_to(self.interp_indices, device),
            interp_weights=_to(self.interp_weights, device),
            window=None if self.window is None else self.window.to(device),
        )


class DeviceInputs(NamedTuple):
    """The metadata the device forward takes, on the tower's device (see :class:`VisionMetadata`): tensors, None
    where the tower has no use for them, and the host int ``max_seqlen`` (the full-attention blocks' tile hint, an
    upper bound of every segment's length; None: no hint)."""

    cu_seqlens: torch.Tensor
    positions: torch.Tensor
    interp_indices: torch.Tensor | None
    interp_weights: torch.Tensor | None
    window_index: torch.Tensor | None
    reverse_index: torch.Tensor | None
    cu_window_seqlens: torch.Tensor | None
    max_seqlen: int | None

    @classmethod
    def of(cls, meta: VisionMetadata) -> DeviceInputs:
        """``meta``'s device tensors and its longest segment as the hint."""
        window = meta.window
        return cls(
            meta.cu_seqlens,
            meta.positions,
            meta.interp_indices,
            meta.interp_weights,
            None if window is None else window.window_index,
            None if window is None else window.reverse_index,
            None if window is None else window.cu_window_seqlens,
            meta.max_seqlen,
        )


def _to(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if tensor is None else to_device(tensor, device)


def check_int(caller: str, name: str, value: object, minimum: int = 1) -> int:
    """``value`` as an int; TypeError / ValueError naming ``caller`` and ``name`` unless it is an int (numpy's too,
    not a bool) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{caller}: {name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{caller}: {name} must be >= {minimum}, got {value}")
    return int(value)


def grid_as_numpy(grid_thw: object, caller: str = "build_metadata") -> np.ndarray:
    """``grid_thw`` as an int64 ``(N, 3)`` array, without ever touching a device tensor's values; errors name
    ``caller``."""
    if isinstance(grid_thw, torch.Tensor):
        if grid_thw.device.type != "cpu":
            raise ValueError(
                f"{caller}: grid_thw must be a CPU tensor, numpy array or list, got a tensor on "
                f"{grid_thw.device}; reading it would sync the device. Pass the processor's CPU grid_thw "
                f"(or call .cpu() yourself, accepting the sync)."
            )
        if grid_thw.dtype.is_floating_point or grid_thw.dtype.is_complex or grid_thw.dtype == torch.bool:
            raise TypeError(f"{caller}: grid_thw must hold integers, got {grid_thw.dtype}")
        array = grid_thw.detach().numpy()
    elif isinstance(grid_thw, np.ndarray):
        array = grid_thw
    elif isinstance(grid_thw, Sequence):
        array = np.asarray(grid_thw)
        if array.size == 0:
            # An empty list carries no shape and becomes float64: it is the empty batch.
            array = np.zeros((0, 3), dtype=np.int64)
    else:
        raise TypeError(
            f"{caller}: grid_thw must be a CPU tensor, numpy array or sequence of (t, h, w), "
            f"got {type(grid_thw).__name__}"
        )
    if array.dtype.kind not in "iu":
        raise TypeError(f"{caller}: grid_thw must hold integers, got dtype {array.dtype}")
    if array.ndim != 2 or array.shape[1] != 3:
        raise ValueError(f"{caller}: grid_thw must have shape (N, 3), got {tuple(array.shape)}")
    return array.astype(np.int64)


def check_grid(grid: np.ndarray, merge: int, caller: str = "build_metadata") -> None:
    """Raise ValueError naming ``caller`` and the row unless every (t, h, w) of ``grid`` (from
    :func:`grid_as_numpy`) is positive with h and w divisible by ``merge``, and the batch holds fewer than 2**31
    patches."""
    non_positive = np.flatnonzero((grid <= 0).any(axis=1))
    if non_positive.size:
        row = int(non_positive[0])
        raise ValueError(f"{caller}: grid_thw row {row} = {tuple(grid[row].tolist())} must be positive")
    misaligned = np.flatnonzero((grid[:, 1:] % merge != 0).any(axis=1))
    if misaligned.size:
        row = int(misaligned[0])
        raise ValueError(
            f"{caller}: grid_thw row {row} = {tuple(grid[row].tolist())}: h and w must be divisible "
            f"by spatial_merge_size {merge}"
        )
    # float64 products cannot overflow and are exact near the limit, unlike int64 ones on absurd rows.
    total = float(np.prod(grid, axis=1, dtype=np.float64).sum())
    if total >= _INT32_LIMIT:
        raise ValueError(
            f"{caller}: grid_thw holds {total:.0f} patches; qvl indexes tokens with int32, so a "
            f"batch must hold fewer than 2**31"
        )


def _axis_taps(index: np.ndarray, size: np.ndarray, side: int):
    """Bilinear align-corners taps ``(tap0, tap1)`` and weights ``(w0, w1)`` along one axis.

    Each fp32 operation mirrors transformers' ``_interpolation_axis_taps_weights`` one for one
    (IEEE fp32 ops round identically in numpy and torch), which is what makes the weights
    bit-identical: ``src = index * (side - 1) / max(size - 1, 1)``, then weights
    ``max(1 - |src - floor - k|, 0)`` for k = 0, 1.
    """
    src = index.astype(np.float32) * np.float32(side - 1) / np.maximum(size - 1, 1).astype(np.float32)
    floor = np.floor(src)
    frac = src - floor
    weights = (np.maximum(np.float32(1) - frac, 0), np.maximum(np.float32(1) - np.abs(frac - np.float32(1)), 0))
    base = floor.astype(np.int32)  # src >= 0, so only the upper clamp can bite
    taps = (np.minimum(base, side - 1), np.minimum(base + 1, side - 1))
    return taps, weights


def _frame_plans(heights: np.ndarray, widths: np.ndarray, merge: int, side: int | None):
    """Positions ``(R, 2)``, interpolation indices ``(R, 4)`` and weights ``(R, 4)`` for one frame of
    each (h, w), concatenated (R = sum h * w); positions alone when ``side`` is None.

    Works in int32 (every value fits, see ``check_grid``): numpy divides int32 several times faster.
    Columns are written one by one because numpy broadcasts over a length-2 inner axis slowly.
    """
    heights, widths = heights.astype(np.int32), widths.astype(np.int32)
    frame_sizes = heights * widths
    owner = np.repeat(np.arange(frame_sizes.size, dtype=np.int32), frame_sizes)
    starts = np.cumsum(frame_sizes, dtype=np.int32) - frame_sizes
    within = np.arange(owner.size, dtype=np.int32) - starts[owner]
    frame_h, frame_w = heights[owner], widths[owner]

    # Merge-block order: the flat index within a frame decodes as (block_row, block_col, in_row, in_col).
    block, in_block = np.divmod(within, merge * merge)
    in_row, in_col = np.divmod(in_block, merge)
    block_row, block_col = np.divmod(block, frame_w // merge)
    row = block_row * merge + in_row
    col = block_col * merge + in_col
    positions = np.empty((owner.size, 2), dtype=np.int32)
    positions[:, 0], positions[:, 1] = row, col
    if side is None:
        return (positions,)

    h_taps, h_weights = _axis_taps(row, frame_h, side)
    w_taps, w_weights = _axis_taps(col, frame_w, side)
    indices = np.empty((owner.size, 4), dtype=np.int32)
    weights = np.empty((owner.size, 4), dtype=np.float32)
    # Tap order (h0, w0), (h0, w1), (h1, w0), (h1, w1): the outer product transformers flattens.
    for tap, (i, j) in enumerate(((0, 0), (0, 1), (1, 0), (1, 1))):
        indices[:, tap] = h_taps[i] * side + w_taps[j]
        weights[:, tap] = h_weights[i] * w_weights[j]
    return positions, indices, weights


def build_metadata(
    grid_thw: torch.Tensor | np.ndarray | Sequence[Sequence[int]],
    spatial_merge_size: int = 2,
    num_grid_per_side: int | None = 48,
    device: torch.device | str | None = None,
) -> VisionMetadata:
    """Build the metadata of one vision-tower batch on the host and move it to ``device`` once.

    Args:
        grid_thw: ``(N, 3)`` (t, h, w) patch counts per image/video: a CPU integer tensor, a numpy array
            or a list of triples. ``N = 0`` is a valid empty batch. A tensor on any other device is
            rejected (reading it would sync). h and w must be divisible by ``spatial_merge_size``.
        spatial_merge_size: merge block side (2 in every released Qwen3-VL).
        num_grid_per_side: side of the learned position grid (``sqrt(num_position_embeddings)``, 48); None for
            a tower without one (Qwen2-VL, Qwen2.5-VL): no interpolation plan is built.
        device: where the tensors go (default CPU). CUDA copies are staged in pinned memory and issued
            non-blocking on the current stream, so work queued after them on that stream sees them.

    Returns a :class:`VisionMetadata`. Raises ValueError/TypeError naming the offending argument (and
    for grid_thw the offending row).
    """
    merge = check_int("build_metadata", "spatial_merge_size", spatial_merge_size)
    side = None if num_grid_per_side is None else check_int("build_metadata", "num_grid_per_side", num_grid_per_side)
    if side is not None and side * side >= _INT32_LIMIT:
        raise ValueError(f"build_metadata: num_grid_per_side {side} gives a table too large for int32 indices")
    grid = grid_as_numpy(grid_thw)
    check_grid(grid, merge)
    device = torch.device("cpu") if device is None else torch.device(device)

    temporal, heights, widths = grid[:, 0], grid[:, 1], grid[:, 2]
    frame_sizes = heights * widths
    token_counts = temporal * frame_sizes

    # Frames of equal (h, w) share one plan: compute each distinct shape's frame once, then gather it
    # into every temporal slice of every entry that has that shape (videos and same-size image batches
    # cost one frame's arithmetic, plus the copy).
    shape_keys = heights * (int(widths.max(initial=0)) + 1) + widths
    _, first, shape_of_entry = np.unique(shape_keys, return_index=True, return_inverse=True)
    unique_sizes = frame_sizes[first]
    plans = _frame_plans(heights[first], widths[first], merge, side)
    plan_starts = np.cumsum(unique_sizes) - unique_sizes

    slice_shape = np.repeat(shape_of_entry.reshape(-1), temporal)
    slice_sizes = unique_sizes[slice_shape]
    cu_seqlens = np.zeros(slice_sizes.size + 1, dtype=np.int32)
    np.cumsum(slice_sizes, out=cu_seqlens[1:])
    num_tokens = int(cu_seqlens[-1])
    source_rows = np.repeat(plan_starts[slice_shape] - cu_seqlens[:-1], slice_sizes) + np.arange(num_tokens)

    gathered = [_gather_to(plan, source_rows, device) for plan in plans]
    positions, interp_indices, interp_weights = gathered if side is not None else (gathered[0], None, None)
    return VisionMetadata(
        grid_thw=torch.from_numpy(grid),
        cu_seqlens=to_device(torch.from_numpy(cu_seqlens), device),
        max_seqlen=int(frame_sizes.max(initial=0)),
        positions=positions,
        interp_indices=interp_indices,
        interp_weights=interp_weights,
        spatial_merge_size=merge,
        num_grid_per_side=side,
        token_counts=tuple(token_counts.tolist()),
        merged_token_counts=tuple((token_counts // (merge * merge)).tolist()),
    )


def equal_images_inputs(
    batch: int,
    height: int,
    width: int,
    spatial_merge_size: int,
    num_grid_per_side: int | None,
    device: torch.device | str,
) -> DeviceInputs:
    """The device inputs of ``batch`` images of ``height x width`` patches each (a library's batch of equal-size
    images: ``batch`` segments), built on ``device`` with torch ops from the sizes alone: what :func:`build_metadata`
    gives for ``[[1, height, width]] * batch``, bit for bit (the same fp32 arithmetic), without host work, so that a
    caller's ``torch.compile`` traces it, sizes symbolic, into the same graph as the forward (no graph break, no
    recompile as sizes change). ``spatial_merge_size`` 1 gives raster order. The sizes are not checked (h and w
    divisible by the merge size: the caller's)."""
    merge = spatial_merge_size
    tokens = height * width
    cu_seqlens = torch.arange(batch + 1, dtype=torch.int32, device=device) * tokens
    rows = torch.arange(height, dtype=torch.int32, device=device)
    cols = torch.arange(width, dtype=torch.int32, device=device)

    def merge_order(per_token: torch.Tensor) -> torch.Tensor:
        """``(h, w, k)`` in raster order -> ``(batch * h * w, k)`` in merge-block order, every image alike."""
        blocks = per_token.view(height // merge, merge, width // merge, merge, -1).permute(0, 2, 1, 3, 4)
        return blocks.reshape(1, tokens, -1).expand(batch, -1, -1).reshape(batch * tokens, -1)

    positions = merge_order(torch.stack(torch.meshgrid(rows, cols, indexing="ij"), dim=-1))
    if num_grid_per_side is None:
        return DeviceInputs(cu_seqlens, positions, None, None, None, None, None, tokens)
    side = num_grid_per_side
    (h_taps, h_weights), (w_taps, w_weights) = (_axis_taps_torch(axis, side) for axis in (rows, cols))
    # Tap order (h0, w0), (h0, w1), (h1, w0), (h1, w1), each weight one fp32 product: as _frame_plans.
    indices = h_taps[:, None, :, None] * side + w_taps[None, :, None, :]
    weights = h_weights[:, None, :, None] * w_weights[None, :, None, :]
    return DeviceInputs(
        cu_seqlens,
        positions,
        merge_order(indices.reshape(height, width, 4)),
        merge_order(weights.reshape(height, width, 4)),
        None,
        None,
        None,
        tokens,
    )


def _axis_taps_torch(index: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_axis_taps` in torch for one axis of ``n`` positions ``index = arange(n)``: taps ``(n, 2)`` int32 and
    weights ``(n, 2)`` fp32, with the same fp32 operations in the same order."""
    size = index.shape[0]
    src = index.to(torch.float32) * float(side - 1) / float(max(size - 1, 1))
    floor = torch.floor(src)
    frac = src - floor
    weights = torch.stack(((1 - frac).clamp_min(0), (1 - (frac - 1).abs()).clamp_min(0)), dim=-1)
    base = floor.to(torch.int32)
    taps = torch.stack((base.clamp_max(side - 1), (base + 1).clamp_max(side - 1)), dim=-1)
    return taps, weights


@dataclasses.dataclass(frozen=True, eq=False)
class WindowMetadata:
    """Per-batch metadata of Qwen2.5-VL's window attention (see :func:`build_window_metadata`).

    Merge units (``spatial_merge_size ** 2`` consecutive tokens, U = T / merge**2 of them) move as wholes.

    Attributes:
        window_index: int64 ``(U,)``: the merge unit at each position of window order, transformers'
            ``window_index`` (``x.view(U, merge**2, -1)[window_index]`` puts the tokens in window order).
        reverse_index: int64 ``(U,)``: its inverse (``argsort(window_index)``), which puts window-ordered
            merge units (the merger's output) back in the original order.
        cu_window_seqlens: int32 ``(W + 1,)``: token offsets of the W non-empty windows in window order,
            transformers' ``cu_window_seqlens`` (duplicates removed as its ``unique_consecutive`` does).
        max_window_seqlen: the longest window in tokens (Python int, 0 for an empty batch), a bound for
            ``vision_attn``'s ``max_seqlen`` tile hint. The runner's windowed blocks pass the window size in tokens
            instead (``TowerSpec.window_tokens``): the same for every batch, so a compiled forward never
            specializes on it.
        window_size: the window side in pixels the layout was built for.
    """

    window_index: torch.Tensor
    reverse_index: torch.Tensor
    cu_window_seqlens: torch.Tensor
    max_window_seqlen: int
    window_size: int

    @property
    def num_windows(self) -> int:
        return int(self.cu_window_seqlens.shape[0]) - 1

    def to(self, device: torch.device | str) -> WindowMetadata:
        """A copy with the tensors on ``device``, moved by :func:`to_device` (no sync)."""
        device = torch.device(device)
        return dataclasses.replace(
            self,
            window_index=to_device(self.window_index, device),
            reverse_index=to_device(self.reverse_index, device),
            cu_window_seqlens=to_device(self.cu_window_seqlens, device),
        )


def build_window_metadata(
    grid_thw: torch.Tensor | np.ndarray | Sequence[Sequence[int]],
    spatial_merge_size: int = 2,
    window_size: int = 112,
    patch_size: int = 14,
    device: torch.device | str | None = None,
) -> WindowMetadata:
    """Build the window-attention metadata of one batch on the host and move it to ``device`` once.

    Each frame's ``(h / merge, w / merge)`` grid of merge units is cut into windows of
    ``window_size // merge // patch_size`` units a side from its top-left corner (the last row and column
    of windows are smaller where the side is not a multiple); windows are ordered frame by frame, row-major,
    and units row-major inside a window: transformers' ``get_vision_window_index``, computed without a
    Python loop over entries, windows or tokens. Every value follows from the shapes: the position of unit
    (r, c) in window order is closed-form (windows above it and to its left, then its row and column inside
    its own), so the permutation is one scatter rather than a sort.

    Args are :func:`build_metadata`'s, plus Qwen2.5-VL's ``window_size`` (pixels, 112) and ``patch_size``
    (14); ``window_size`` must be at least ``spatial_merge_size * patch_size``. Returns a
    :class:`WindowMetadata`.
    """
    caller = "build_window_metadata"
    merge = check_int(caller, "spatial_merge_size", spatial_merge_size)
    window_size = check_int(caller, "window_size", window_size)
    patch_size = check_int(caller, "patch_size", patch_size)
    side = window_size // merge // patch_size  # transformers' vit_merger_window_size
    if side < 1:
        raise ValueError(
            f"{caller}: window_size {window_size} must be at least spatial_merge_size * patch_size "
            f"= {merge * patch_size}"
        )
    grid = grid_as_numpy(grid_thw, caller)
    check_grid(grid, merge, caller)
    device = torch.device("cpu") if device is None else torch.device(device)

    # One row per frame (temporal slice): its merge-unit grid and where its units start.
    temporal = grid[:, 0]
    rows = np.repeat(grid[:, 1] // merge, temporal)
    cols = np.repeat(grid[:, 2] // merge, temporal)
    units = rows * cols
    unit_starts = np.cumsum(units) - units
    num_units = int(units.sum())
    window_rows, window_cols = -(-rows // side), -(-cols // side)

    # Every unit's frame, row and column, then its position in window order.
    frame = np.repeat(np.arange(units.size), units)
    within = np.arange(num_units) - unit_starts[frame]
    row, col = np.divmod(within, cols[frame])
    window_row, row_in = np.divmod(row, side)
    window_col, col_in = np.divmod(col, side)
    height = np.minimum(side, rows[frame] - window_row * side)  # of the unit's window
    width = np.minimum(side, cols[frame] - window_col * side)
    position = unit_starts[frame] + window_row * side * cols[frame] + window_col * side * height
    position += row_in * width + col_in
    window_index = np.empty(num_units, dtype=np.int64)
    window_index[position] = np.arange(num_units)

    # Window sizes in window order: frame by frame, row-major; none is empty.
    windows = window_rows * window_cols
    owner = np.repeat(np.arange(windows.size), windows)
    window_row, window_col = np.divmod(np.arange(int(windows.sum())) - (np.cumsum(windows) - windows)[owner],
                                       window_cols[owner])  # fmt: skip
    sizes = np.minimum(side, rows[owner] - window_row * side) * np.minimum(side, cols[owner] - window_col * side)
    cu_window_seqlens = np.zeros(sizes.size + 1, dtype=np.int32)
    np.cumsum(sizes * (merge * merge), out=cu_window_seqlens[1:])

    return WindowMetadata(
        window_index=to_device(torch.from_numpy(window_index), device),
        reverse_index=to_device(torch.from_numpy(position.astype(np.int64, copy=False)), device),
        cu_window_seqlens=to_device(torch.from_numpy(cu_window_seqlens), device),
        max_window_seqlen=int(sizes.max(initial=0)) * merge * merge,
        window_size=window_size,
    )


def _gather_to(plan: np.ndarray, rows: np.ndarray, device: torch.device) -> torch.Tensor:
    """``plan[rows]`` as a tensor on ``device``, gathered straight into the (for CUDA, pinned) staging
    tensor. np.take copies whole rows where 2-D fancy indexing is several times slower, and
    ``mode="clip"`` (the rows are in range by construction) lets it write into ``out`` unbuffered."""
    staged = torch.empty(rows.size, plan.shape[1], dtype=_TORCH_DTYPES[plan.dtype], pin_memory=device.type == "cuda")
    np.take(plan, rows, axis=0, out=staged.numpy(), mode="clip")
    return to_device(staged, device)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` (on the CPU) on ``device``; a CUDA copy is staged in pinned memory and never syncs."""
    if device.type == "cuda":
        # Pinned source, so the copy runs asynchronously; the caching host allocator keeps the staging
        # buffer alive until the copy has completed, so it may be dropped as soon as it is queued.
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
