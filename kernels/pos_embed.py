"""Qwen3-VL's learned position embedding, resampled to each image's grid:
``torch.ops.qvl.pos_embed_interp`` and ``torch.ops.qvl.pos_embed_interp_add_``.

Semantics (transformers' ``Qwen3VLVisionModel.forward``): each token blends 4 rows of the learned
``(G*G, C)`` table, ``pos = (pos_embed[idx] * w[:, :, None]).sum(1)``, in fp32: the rows upcast, each
multiplied by its fp32 weight and rounded, the 4 products summed in tap order 0, 1, 2, 3 starting from
0 (as torch's reduction does). The model then adds it to the patch embeddings,
``hidden = hidden + pos.to(hidden.dtype)``; the in-place op fuses that add, rounding ``pos`` to the
hidden dtype first exactly as that expression does.

The indices and weights are host-side metadata built once per batch (``qvl.vit.metadata``), so one
launch covers every image of the batch whatever its size; the grid is (token blocks, channel blocks).

Backward (``torch.ops.qvl.pos_embed_interp_backward``, pos_embed_interp's autograd formula): the table's
gradient is a scatter-add, ``d_table[idx[t, k]] += w[t, k] * grad[t]``, computed without atomics and
deterministically, bit for bit from run to run: a stable device-side sort of the ``4T`` (token, tap) pairs
by table row and a binary search for each row's run (no device-to-host sync), then one program per
(table row, channel block) sums its run in (token, tap) order in fp32 and writes the row once, rounded once.
So ``torch.use_deterministic_algorithms(True)`` needs nothing more. No gradient flows to ``interp_weights``
(geometry metadata); ``pos_embed_interp_add_`` has no backward and refuses calls that would need one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

from .autocast import follow_autocast
from .common import (
    FLOAT_DTYPES,
    KernelLaunch,
    backend_for,
    cached_config,
    cdiv,
    check_no_internal_overlap,
    check_same_device,
    check_tensor,
    device_target,
    next_power_of_2,
    refuse_autograd,
    run_launches,
    runs_torch,
    value_checks_enabled,
)
from .tiles import last_dim_contiguous, round_to

__all__ = [
    "launch_config",
    "pos_embed_interp",
    "pos_embed_interp_add_",
    "pos_embed_interp_backward",
    "pos_embed_interp_backward_launches",
    "pos_embed_interp_add_reference",
    "pos_embed_interp_add_torch_",
    "pos_embed_interp_backward_reference",
    "pos_embed_interp_launches",
    "pos_embed_interp_reference",
    "pos_embed_interp_torch",
    "table_row_runs",
]

NUM_TAPS = 4


@triton.jit
def _pos_embed_interp_kernel(
    # pointers
    Table,
    Indices,
    Weights,
    Out,
    # sizes
    num_tokens,
    channels,
    # strides; the tables' and outputs' last dims are contiguous
    stride_tv,
    stride_it,
    stride_ik,
    stride_wt,
    stride_wk,
    stride_ot,
    # meta-parameters
    ADD: tl.constexpr,
    NUM_TAPS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_t = offs_t < num_tokens
    mask = mask_t[:, None] & (offs_c < channels)[None, :]
    tokens = offs_t.to(tl.int64)

    # Zero start: torch's sum starts from 0 too, which turns a lone -0.0 product into +0.0.
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for tap in tl.static_range(NUM_TAPS):
        rows = tl.load(Indices + tokens * stride_it + tap * stride_ik, mask=mask_t, other=0).to(tl.int64)
        weight = tl.load(Weights + tokens * stride_wt + tap * stride_wk, mask=mask_t, other=0.0)
        values = tl.load(Table + rows[:, None] * stride_tv + offs_c[None, :], mask=mask, other=0.0)
        acc += values.to(tl.float32) * weight[:, None]

    out_ptrs = Out + tokens[:, None] * stride_ot + offs_c[None, :]
    if ADD:
        # round(x + round(pos)): the model rounds pos to the hidden dtype before adding.
        pos = round_to(acc, Out.dtype.element_ty).to(tl.float32)
        hidden = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptrs, round_to(hidden + pos, Out.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptrs, round_to(acc, Out.dtype.element_ty), mask=mask)


@triton.jit
def _pos_embed_interp_backward_kernel(
    # pointers
    GradOut,
    Order,
    RunStarts,
    Weights,
    GradTable,
    # sizes
    channels,
    # strides; the gradients' last dims are contiguous
    stride_gt,
    stride_wt,
    stride_wk,
    stride_dv,
    # meta-parameters
    NUM_TAPS: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # Program (r, j): table row r, channel block j. Order holds the flat (token * NUM_TAPS + tap) pairs sorted
    # stably by table row; row r's pairs are Order[RunStarts[r]:RunStarts[r + 1]], in (token, tap) order.
    row = tl.program_id(0).to(tl.int64)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < channels
    start = tl.load(RunStarts + row)
    end = tl.load(RunStarts + row + 1)
    acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for i in range(start, end):
        pair = tl.load(Order + i)
        token = pair // NUM_TAPS
        weight = tl.load(Weights + token * stride_wt + (pair % NUM_TAPS) * stride_wk)
        grad = tl.load(GradOut + token * stride_gt + offs_c, mask=mask_c, other=0.0)
        acc += grad.to(tl.float32) * weight
    tl.store(GradTable + row * stride_dv + offs_c, round_to(acc, GradTable.dtype.element_ty), mask=mask_c)


def _interp_fp32(pos_embed: torch.Tensor, interp_indices: torch.Tensor, interp_weights: torch.Tensor) -> torch.Tensor:
    """The blended rows in fp32, ``(T, C)``, with transformers' arithmetic."""
    rows = torch.nn.functional.embedding(interp_indices.long(), pos_embed)  # (T, 4, C)
    return (rows * interp_weights[:, :, None]).sum(1)


def pos_embed_interp_reference(
    pos_embed: torch.Tensor, interp_indices: torch.Tensor, interp_weights: torch.Tensor
) -> torch.Tensor:
    """Pure-torch :func:`pos_embed_interp`: ``(T, C)`` in pos_embed's dtype (materialises ``(T, 4, C)``)."""
    return _interp_fp32(pos_embed, interp_indices, interp_weights).to(pos_embed.dtype)


def pos_embed_interp_add_reference(
    hidden_states: torch.Tensor, pos_embed: torch.Tensor, interp_indices: torch.Tensor, interp_weights: torch.Tensor
) -> None:
    """Pure-torch :func:`pos_embed_interp_add_`: adds the fp32 blend, rounded to hidden_states' dtype, in place
    (materialises ``(T, 4, C)``)."""
    hidden_states.add_(_interp_fp32(pos_embed, interp_indices, interp_weights).to(hidden_states.dtype))


def pos_embed_interp_torch(
    pos_embed: torch.Tensor, interp_indices: torch.Tensor, interp_weights: torch.Tensor
) -> torch.Tensor:
    """:func:`pos_embed_interp` on the ops' torch path: the reference's blend (fp32 products summed in tap order, the
    same bits) one tap at a time, so it holds ``(T, C)`` rows where the reference holds two ``(T, 4, C)`` tensors."""
    return _blend_by_tap(pos_embed, interp_indices, interp_weights).to(pos_embed.dtype)


def pos_embed_interp_add_torch_(
    hidden_states: torch.Tensor, pos_embed: torch.Tensor, interp_indices: torch.Tensor, interp_weights: torch.Tensor
) -> None:
    """:func:`pos_embed_interp_add_` on the ops' torch path: :func:`pos_embed_interp_torch`'s blend added in place."""
    hidden_states.add_(_blend_by_tap(pos_embed, interp_indices, interp_weights).to(hidden_states.dtype))


def _blend_by_tap(pos_embed: torch.Tensor, interp_indices: torch.Tensor, interp_weights: torch.Tensor) -> torch.Tensor:
    """``sum_k pos_embed[idx_k] * w_k`` in fp32, ``(T, C)``, accumulated tap by tap in tap order."""
    indices = interp_indices.long()
    blend = pos_embed[indices[:, 0]] * interp_weights[:, :1]
    for tap in range(1, NUM_TAPS):
        blend += pos_embed[indices[:, tap]] * interp_weights[:, tap : tap + 1]
    return blend


def pos_embed_interp_backward_reference(
    grad_out: torch.Tensor, pos_embed: torch.Tensor, interp_indices: torch.Tensor, interp_weights: torch.Tensor
) -> torch.Tensor:
    """Pure-torch table gradient: ``index_add`` of ``w[t, k] * grad_out[t]`` (fp32; float64 stays float64)
    into the rows ``idx[t, k]``, rounded once to pos_embed's dtype."""
    compute = torch.float64 if grad_out.dtype == torch.float64 else torch.float32
    contributions = grad_out.to(compute)[:, None, :] * interp_weights.to(compute)[:, :, None]  # (T, 4, C)
    grad = torch.zeros(pos_embed.shape, dtype=compute, device=pos_embed.device)
    grad.index_add_(0, interp_indices.flatten().long(), contributions.flatten(0, 1))
    return grad.to(pos_embed.dtype)


def _check_interp_args(op: str, pos_embed, interp_indices, interp_weights, read_values: bool = True) -> None:
    check_tensor(op, "pos_embed", pos_embed, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    check_tensor(op, "interp_indices", interp_indices, ndim=2, dtypes=(torch.int32,))
    check_tensor(op, "interp_weights", interp_weights, ndim=2, dtypes=(torch.float32,))
    if interp_indices.shape[1] != NUM_TAPS:
        raise ValueError(f"{op}: interp_indices must have shape (T, 4), got {tuple(interp_indices.shape)}")
    if interp_weights.shape != interp_indices.shape:
        raise ValueError(
            f"{op}: interp_weights must have interp_indices' shape {tuple(interp_indices.shape)}, "
            f"got {tuple(interp_weights.shape)}"
        )
    check_same_device(op, {"pos_embed": pos_embed, "interp_indices": interp_indices, "interp_weights": interp_weights})
    if read_values and value_checks_enabled(pos_embed.device) and interp_indices.numel():
        low, high = (int(v) for v in torch.aminmax(interp_indices))
        if low < 0 or high >= pos_embed.shape[0]:
            raise ValueError(
                f"{op}: interp_indices must index rows of pos_embed, in [0, {pos_embed.shape[0]}), "
                f"got values in [{low}, {high}]"
            )


def _check_add_args(op: str, hidden_states, pos_embed, interp_indices, interp_weights, read_values: bool = True):
    _check_interp_args(op, pos_embed, interp_indices, interp_weights, read_values)
    check_tensor(op, "hidden_states", hidden_states, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    expected = (interp_indices.shape[0], pos_embed.shape[1])
    if hidden_states.shape != expected:
        raise ValueError(
            f"{op}: hidden_states must have shape (T, C) = {expected} (T from interp_indices, C from "
            f"pos_embed), got {tuple(hidden_states.shape)}"
        )
    check_same_device(op, {"pos_embed": pos_embed, "hidden_states": hidden_states})


@cached_config
def launch_config(channels: int, target: GPUTarget) -> dict:
    """Everything the interpolation launch passes besides tensors, scalars and the add flag, for ``channels``
    on ``target``: up to 128 channels and about 4096 values per program, and compile options. Every target
    gets the same values (the interpreter ignores warps and options)."""
    block_c = min(128, next_power_of_2(channels))
    # No fused multiply-add: each product is rounded before it is summed, as torch's separate multiply and sum
    # do, so the result matches transformers bit for bit.
    return dict(
        NUM_TAPS=NUM_TAPS, BLOCK_T=max(1, 4096 // block_c), BLOCK_C=block_c, num_warps=4, enable_fp_fusion=False
    )


def pos_embed_interp_launches(
    pos_embed, interp_indices, interp_weights, out, add: bool, target: GPUTarget
) -> list[KernelLaunch]:
    """The launch writing (``add``: adding) the blended rows for checked arguments into ``out`` ``(T, C)``;
    empty when ``out`` is. Reads shapes and strides only (no device sync)."""
    num_tokens, channels = out.shape
    if num_tokens == 0 or channels == 0:
        return []
    config = launch_config(channels, target)
    grid = (cdiv(num_tokens, config["BLOCK_T"]), cdiv(channels, config["BLOCK_C"]))
    args = dict(
        # pointers
        Table=pos_embed,
        Indices=interp_indices,
        Weights=interp_weights,
        Out=out,
        # sizes
        num_tokens=num_tokens,
        channels=channels,
        # strides
        stride_tv=pos_embed.stride(0),
        stride_it=interp_indices.stride(0),
        stride_ik=interp_indices.stride(1),
        stride_wt=interp_weights.stride(0),
        stride_wk=interp_weights.stride(1),
        stride_ot=out.stride(0),
    )
    return [KernelLaunch(_pos_embed_interp_kernel, grid, args, {**config, "ADD": add})]


def pos_embed_interp_backward_launches(grad_out, order, run_starts, interp_weights, grad_table, target: GPUTarget):
    """The launch writing every row of ``grad_table`` ``(R, C)`` from ``grad_out`` ``(T, C)`` for checked
    arguments: ``order`` (int64 ``(4T,)``, the flat (token, tap) pairs sorted stably by table row) and
    ``run_starts`` (int64 ``(R + 1,)``, where each row's run starts in ``order``). Mutates grad_table only;
    empty when it is. Reads shapes and strides only (no device sync)."""
    num_rows, channels = grad_table.shape
    if num_rows == 0 or channels == 0:
        return []
    config = launch_config(channels, target)
    grid = (num_rows, cdiv(channels, config["BLOCK_C"]))
    args = dict(
        # pointers
        GradOut=grad_out,
        Order=order,
        RunStarts=run_starts,
        Weights=interp_weights,
        GradTable=grad_table,
        # sizes
        channels=channels,
        # strides
        stride_gt=grad_out.stride(0),
        stride_wt=interp_weights.stride(0),
        stride_wk=interp_weights.stride(1),
        stride_dv=grad_table.stride(0),
    )
    # The run loop adds products in fp32 one at a time; only the tile sizes of the forward apply.
    kwargs = dict(NUM_TAPS=NUM_TAPS, BLOCK_C=config["BLOCK_C"], num_warps=1, enable_fp_fusion=False)
    return [KernelLaunch(_pos_embed_interp_backward_kernel, grid, args, kwargs)]


def table_row_runs(interp_indices: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order, run_starts)`` of :func:`pos_embed_interp_backward_launches` for ``interp_indices`` into a table of
    ``num_rows`` rows, on the indices' device without a sync."""
    # A stable sort keeps each row's pairs in (token, tap) order: the summation order, so the bits, are fixed.
    sorted_rows, order = torch.sort(interp_indices.flatten(), stable=True)
    bounds = torch.arange(num_rows + 1, dtype=sorted_rows.dtype, device=sorted_rows.device)
    return order, torch.searchsorted(sorted_rows, bounds)


def _launch_interp(pos_embed, interp_indices, interp_weights, out, add: bool) -> None:
    target = device_target(out.device)
    run_launches(pos_embed_interp_launches(pos_embed, interp_indices, interp_weights, out, add, target), out.device)


@torch.library.custom_op("qvl::pos_embed_interp", mutates_args=(), device_types=("cpu", "cuda"))
def pos_embed_interp(
    pos_embed: torch.Tensor, interp_indices: torch.Tensor, interp_weights: torch.Tensor
) -> torch.Tensor:
    """Resample the learned position table to every token of a batch; returns a new ``(T, C)`` tensor.

    Args:
        pos_embed: ``(G*G, C)`` fp16/bf16/fp32 learned table, last dim contiguous.
        interp_indices: int32 ``(T, 4)`` table rows per token, each in ``[0, G*G)`` (checked on CPU, and on
            CUDA only with value checks on).
        interp_weights: fp32 ``(T, 4)`` bilinear weights per token.

    Returns contiguous ``(T, C)`` in pos_embed's dtype: the fp32 blend ``sum_k pos_embed[idx_k] * w_k``
    (products rounded, summed in tap order) cast once. All on one device. Nothing is mutated.
    Differentiable in pos_embed (:func:`pos_embed_interp_backward`, deterministic; saves the three inputs);
    interp_weights must not require grad (RuntimeError).
    """
    _check_interp_args("pos_embed_interp", pos_embed, interp_indices, interp_weights)
    backend = backend_for(pos_embed.device)
    if backend == "torch":
        return pos_embed_interp_torch(pos_embed, interp_indices, interp_weights)
    if backend == "reference":
        return pos_embed_interp_reference(pos_embed, interp_indices, interp_weights)
    out = torch.empty((interp_indices.shape[0], pos_embed.shape[1]), dtype=pos_embed.dtype, device=pos_embed.device)
    _launch_interp(pos_embed, interp_indices, interp_weights, out, add=False)
    return out


@pos_embed_interp.register_fake
def _(pos_embed, interp_indices, interp_weights):
    _check_interp_args("pos_embed_interp", pos_embed, interp_indices, interp_weights, read_values=False)
    return pos_embed.new_empty((interp_indices.shape[0], pos_embed.shape[1]))


@torch.library.custom_op("qvl::pos_embed_interp_add_", mutates_args=("hidden_states",), device_types=("cpu", "cuda"))
def pos_embed_interp_add_(
    hidden_states: torch.Tensor, pos_embed: torch.Tensor, interp_indices: torch.Tensor, interp_weights: torch.Tensor
) -> None:
    """Add the resampled position embedding to ``hidden_states`` in place (the model's
    ``hidden = hidden + pos.to(hidden.dtype)``, without materialising ``pos``).

    Args:
        hidden_states: ``(T, C)`` fp16/bf16/fp32, last dim contiguous (row stride free); any float dtype,
            independent of pos_embed's. Mutated.
        pos_embed, interp_indices, interp_weights: as for :func:`pos_embed_interp`.

    Each element becomes ``round(x + round(pos))``, rounding to hidden_states' dtype, where ``pos`` is
    the fp32 blend. Returns nothing. hidden_states must not overlap pos_embed.

    No backward: torch.library supports autograd for functional custom ops only. Called with grad mode on
    and an input requiring grad it raises a RuntimeError pointing to the out-of-place
    ``hidden_states + pos_embed_interp(...).to(hidden_states.dtype)`` (differentiable in both), instead of
    mutating ``hidden_states`` behind autograd's back; under ``torch.no_grad()`` or with inputs that need no
    grad it runs as before.
    """
    _check_add_args("pos_embed_interp_add_", hidden_states, pos_embed, interp_indices, interp_weights)
    check_no_internal_overlap("pos_embed_interp_add_", "hidden_states", hidden_states)
    backend = backend_for(hidden_states.device)
    if backend == "torch":
        pos_embed_interp_add_torch_(hidden_states, pos_embed, interp_indices, interp_weights)
        return
    if backend == "reference":
        pos_embed_interp_add_reference(hidden_states, pos_embed, interp_indices, interp_weights)
        return
    _launch_interp(pos_embed, interp_indices, interp_weights, hidden_states, add=True)


@pos_embed_interp_add_.register_fake
def _(hidden_states, pos_embed, interp_indices, interp_weights):
    _check_add_args(
        "pos_embed_interp_add_", hidden_states, pos_embed, interp_indices, interp_weights, read_values=False
    )


refuse_autograd(
    "pos_embed_interp_add_",
    "hidden_states + torch.ops.qvl.pos_embed_interp(pos_embed, interp_indices, interp_weights).to(hidden_states.dtype)",
)


@torch.library.custom_op("qvl::pos_embed_interp_backward", mutates_args=(), device_types=("cpu", "cuda"))
def pos_embed_interp_backward(
    grad_out: torch.Tensor, pos_embed: torch.Tensor, interp_indices: torch.Tensor, interp_weights: torch.Tensor
) -> torch.Tensor:
    """Backward of :func:`pos_embed_interp` to the table.

    Args:
        grad_out: ``(T, C)`` gradient of the output, pos_embed's dtype, last dim contiguous (row stride free).
        pos_embed, interp_indices, interp_weights: the forward's inputs (pos_embed for its shape, dtype and
            device only), checked as :func:`pos_embed_interp` checks them, indices' values not read.

    Returns a new ``(G*G, C)`` tensor in pos_embed's dtype: ``sum over (t, k) with idx[t, k] == r`` of
    ``w[t, k] * grad_out[t]`` in fp32, in (token, tap) order, rounded once; rows no token uses are 0.
    Deterministic (no atomics; see the module docstring) and free of device-to-host syncs. Nothing is mutated.
    """
    _check_interp_backward_args(grad_out, pos_embed, interp_indices, interp_weights)
    if runs_torch(pos_embed.device):
        return pos_embed_interp_backward_reference(grad_out, pos_embed, interp_indices, interp_weights)
    order, run_starts = table_row_runs(interp_indices, pos_embed.shape[0])
    grad_table = torch.empty(pos_embed.shape, dtype=pos_embed.dtype, device=pos_embed.device)
    target = device_target(pos_embed.device)
    launches = pos_embed_interp_backward_launches(grad_out, order, run_starts, interp_weights, grad_table, target)
    run_launches(launches, pos_embed.device)
    return grad_table


def _check_interp_backward_args(grad_out, pos_embed, interp_indices, interp_weights) -> None:
    op = "pos_embed_interp_backward"
    _check_interp_args(op, pos_embed, interp_indices, interp_weights, read_values=False)
    check_tensor(op, "grad_out", grad_out, ndim=2, dtypes=(pos_embed.dtype,), last_dim_contiguous=True)
    expected = (interp_indices.shape[0], pos_embed.shape[1])
    if grad_out.shape != expected:
        raise ValueError(f"{op}: grad_out must have shape (T, C) = {expected}, got {tuple(grad_out.shape)}")
    check_same_device(op, {"pos_embed": pos_embed, "grad_out": grad_out})


@pos_embed_interp_backward.register_fake
def _(grad_out, pos_embed, interp_indices, interp_weights):
    _check_interp_backward_args(grad_out, pos_embed, interp_indices, interp_weights)
    return torch.empty_like(pos_embed)


def _pos_embed_interp_setup_context(ctx, inputs, output):
    pos_embed, interp_indices, interp_weights = inputs
    if interp_weights.requires_grad:
        raise RuntimeError(
            "pos_embed_interp: no gradient flows to interp_weights (interpolation metadata); pass them "
            "without requires_grad (e.g. interp_weights.detach())"
        )
    # The table is saved for its shape, dtype and device (a reference to the parameter, no copy).
    ctx.save_for_backward(pos_embed, interp_indices, interp_weights)


def _pos_embed_interp_backward(ctx, grad_out):
    grad_table = pos_embed_interp_backward(last_dim_contiguous(grad_out), *ctx.saved_tensors)
    return grad_table, None, None


pos_embed_interp.register_autograd(_pos_embed_interp_backward, setup_context=_pos_embed_interp_setup_context)
# A table lookup and blend: no cast, as an embedding lookup (the result in the table's dtype).
for _op in ("pos_embed_interp", "pos_embed_interp_add_", "pos_embed_interp_backward"):
    follow_autocast(_op)
