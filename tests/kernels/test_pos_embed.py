"""torch.ops.qvl.pos_embed_interp and pos_embed_interp_add_ against transformers' arithmetic.

Tests run the Triton kernel (through the interpreter on CPU) by default and the torch path under
``force_backend("torch")``. The blend is transformers' fp32 arithmetic in its order, rounded once, and every path
rounds to nearest (under the interpreter through ``round_to``, kernels/tiles.py), so forward results are held to
exact equality in every dtype; the table's gradient, a sum in another order, to the suite's rule.
"""

import contextlib

import pytest
import torch
from transformers.vision_utils import get_vision_interpolation_indices_and_weights

from guards import LAYOUTS, assert_clean, guarded, guarded_empty, layout_pads
from qvl.kernels.common import device_target, force_backend, run_launches
from qvl.kernels.pos_embed import (
    pos_embed_interp_backward_launches,
    pos_embed_interp_launches,
    pos_embed_interp_reference,
    table_row_runs,
)
from tolerance import assert_error_within, assert_grads_within

SIDE = 48
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def plan(grid, device, side=SIDE):
    """transformers' interpolation plan for ``grid``, as the op takes it (int32 indices, fp32 weights)."""
    indices, weights = get_vision_interpolation_indices_and_weights(
        torch.tensor(grid), num_grid_per_side=side, mode="bilinear", align_corners=True, spatial_merge_size=2
    )
    return indices.to(device=device, dtype=torch.int32), weights.to(device)


def make_table(channels, dtype, device, side=SIDE, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(side * side, channels, generator=generator).to(device=device, dtype=dtype)


def blend_in_tap_order(table, indices, weights):
    """The fp32 blend with its order spelled out: products rounded, summed from 0 in tap order."""
    acc = torch.zeros(indices.shape[0], table.shape[1], dtype=torch.float32, device=table.device)
    for tap in range(indices.shape[1]):
        acc = acc + table[indices[:, tap].long()].float() * weights[:, tap, None]
    return acc


def test_transformers_blend_is_tap_order():
    """The semantics the kernel implements: transformers' ``(pos_embed(idx) * w[..., None]).sum(1)``
    is the fp32 blend summed in tap order."""
    indices, weights = plan([(1, 6, 10), (2, 8, 8)], "cpu")
    for dtype in DTYPES:
        table = make_table(96, dtype, "cpu")
        hf = (torch.nn.functional.embedding(indices.long(), table) * weights[:, :, None]).sum(1)
        assert hf.dtype == torch.float32
        assert torch.equal(hf, blend_in_tap_order(table, indices, weights))
        assert torch.equal(pos_embed_interp_reference(table, indices, weights), hf.to(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("channels", [64, 200])
@pytest.mark.parametrize("grid", [[(1, 6, 10), (2, 8, 8)], [(1, 2, 2), (1, 16, 12), (1, 10, 4)]], ids=str)
def test_interp_kernel(device, dtype, channels, grid):
    indices, weights = plan(grid, device)
    table = make_table(channels, dtype, device)
    out = torch.ops.qvl.pos_embed_interp(table, indices, weights)
    assert out.shape == (indices.shape[0], channels) and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out, blend_in_tap_order(table, indices, weights).to(dtype))


def test_interp_kernel_grid_larger_than_table(device):
    indices, weights = plan([(1, 50, 34)], device)
    table = make_table(32, torch.float32, device)
    out = torch.ops.qvl.pos_embed_interp(table, indices, weights)
    assert torch.equal(out, blend_in_tap_order(table, indices, weights))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_interp_torch_backend_exact(dtype):
    indices, weights = plan([(1, 6, 10), (2, 8, 8)], "cpu")
    table = make_table(200, dtype, "cpu")
    with force_backend("torch"):
        out = torch.ops.qvl.pos_embed_interp(table, indices, weights)
    assert torch.equal(out, blend_in_tap_order(table, indices, weights).to(dtype))


@pytest.mark.parametrize(
    "hidden_dtype, table_dtype",
    [
        (torch.float32, torch.float32),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.bfloat16),
    ],
    ids=str,
)
@pytest.mark.parametrize("backend", ["default", "torch"])
def test_add_in_place(device, hidden_dtype, table_dtype, backend):
    if backend == "torch" and device != "cpu":
        pytest.skip("the torch path is the CPU fallback")
    indices, weights = plan([(1, 6, 10), (2, 8, 8)], device)
    table = make_table(160, table_dtype, device)
    generator = torch.Generator().manual_seed(1)
    # A view with a row stride wider than its width: the op must honour strides and leave the rest alone.
    storage = torch.randn(indices.shape[0], 200, generator=generator).to(device=device, dtype=hidden_dtype)
    hidden = storage[:, 20:180]
    before = storage.clone()
    if backend == "torch":
        with force_backend("torch"):
            result = torch.ops.qvl.pos_embed_interp_add_(hidden, table, indices, weights)
    else:
        result = torch.ops.qvl.pos_embed_interp_add_(hidden, table, indices, weights)
    assert result is None
    assert hidden.data_ptr() == storage[:, 20:].data_ptr()
    assert torch.equal(storage[:, :20], before[:, :20]) and torch.equal(storage[:, 180:], before[:, 180:])
    # The model's ``hidden + pos.to(hidden.dtype)``: pos rounded to the hidden dtype, then the add rounded.
    assert torch.equal(hidden, before[:, 20:180] + blend_in_tap_order(table, indices, weights).to(hidden_dtype))


def test_strided_plan(device):
    """Indices and weights given as transposed views (strides (1, T)) read the same values."""
    indices, weights = plan([(2, 8, 8)], device)
    table = make_table(64, torch.float32, device)
    out = torch.ops.qvl.pos_embed_interp(table, indices.t().contiguous().t(), weights.t().contiguous().t())
    assert torch.equal(out, blend_in_tap_order(table, indices, weights))


def test_empty_batch(device):
    indices = torch.empty(0, 4, dtype=torch.int32, device=device)
    weights = torch.empty(0, 4, dtype=torch.float32, device=device)
    table = make_table(64, torch.bfloat16, device)
    out = torch.ops.qvl.pos_embed_interp(table, indices, weights)
    assert out.shape == (0, 64) and out.dtype == torch.bfloat16
    hidden = torch.empty(0, 64, dtype=torch.float32, device=device)
    torch.ops.qvl.pos_embed_interp_add_(hidden, table, indices, weights)


def test_opcheck(device):
    indices, weights = plan([(1, 6, 10)], device)
    table = make_table(64, torch.float16, device)
    hidden = torch.randn(indices.shape[0], 64, device=device)
    torch.library.opcheck(torch.ops.qvl.pos_embed_interp.default, (table, indices, weights))
    torch.library.opcheck(torch.ops.qvl.pos_embed_interp_add_.default, (hidden, table, indices, weights))


def test_compile_dynamic_no_recompile(device):
    """One compiled graph serves every token count: a second batch size does not recompile."""
    torch._dynamo.reset()
    table = make_table(64, torch.float32, device)

    def embed(hidden, table, indices, weights):
        pos = torch.ops.qvl.pos_embed_interp(table, indices, weights)
        torch.ops.qvl.pos_embed_interp_add_(hidden, table, indices, weights)
        return hidden * 2.0 - pos

    compiled = torch.compile(embed, fullgraph=True, dynamic=True)
    # Token counts unlike every other size in play, so duck sizing ties no symbol to them.
    first, second = [(1, 6, 10), (2, 8, 8)], [(1, 10, 10), (1, 2, 6)]
    for grid, stance in ((first, "default"), (second, "fail_on_recompile")):
        indices, weights = plan(grid, device)
        hidden = torch.randn(indices.shape[0], 64, device=device)
        expected_hidden = hidden.clone()
        expected = embed(expected_hidden, table, indices, weights)
        with torch.compiler.set_stance(stance):
            out = compiled(hidden, table, indices, weights)
        assert torch.equal(hidden, expected_hidden)
        assert torch.equal(out, expected)


BAD_INPUTS = [
    # (what to change, error, message pattern)
    (dict(table=lambda t: t.double()), TypeError, r"pos_embed must be one of"),
    (dict(table=lambda t: t[0]), ValueError, r"pos_embed must be 2-D"),
    (dict(table=lambda t: t.t().contiguous().t()), ValueError, r"pos_embed must have a contiguous last"),
    (dict(indices=lambda i: i.long()), TypeError, r"interp_indices must be one of \(int32\)"),
    (dict(indices=lambda i: i[:, :3]), ValueError, r"interp_indices must have shape \(T, 4\)"),
    (dict(indices=lambda i: i.flatten()), ValueError, r"interp_indices must be 2-D"),
    (dict(weights=lambda w: w.half()), TypeError, r"interp_weights must be one of \(float32\)"),
    (dict(weights=lambda w: w[1:]), ValueError, r"interp_weights must have interp_indices' shape"),
    (dict(indices=lambda i: torch.where(i == 0, SIDE * SIDE, i)), ValueError, r"interp_indices must index rows"),
    (dict(indices=lambda i: i - 1), ValueError, r"interp_indices must index rows of pos_embed, in \[0, 2304\)"),
]


@pytest.mark.parametrize("change, error, pattern", BAD_INPUTS)
@pytest.mark.parametrize("op", ["interp", "add"])
def test_bad_inputs(change, error, pattern, op):
    indices, weights = plan([(1, 2, 2)], "cpu")
    table = make_table(16, torch.float32, "cpu")
    table = change.get("table", lambda t: t)(table)
    indices = change.get("indices", lambda i: i)(indices)
    weights = change.get("weights", lambda w: w)(weights)
    with pytest.raises(error, match=pattern):
        if op == "interp":
            torch.ops.qvl.pos_embed_interp(table, indices, weights)
        else:
            torch.ops.qvl.pos_embed_interp_add_(torch.zeros(4, 16), table, indices, weights)


@pytest.mark.parametrize(
    "hidden, error, pattern",
    [
        (torch.zeros(4, 16, dtype=torch.int32), TypeError, r"hidden_states must be one of"),
        (torch.zeros(4, 16, dtype=torch.float64), TypeError, r"hidden_states must be one of"),
        (torch.zeros(4, 8), ValueError, r"hidden_states must have shape \(T, C\) = \(4, 16\)"),
        (torch.zeros(5, 16), ValueError, r"hidden_states must have shape \(T, C\) = \(4, 16\)"),
        (torch.zeros(16), ValueError, r"hidden_states must be 2-D"),
        (torch.zeros(16, 4).t(), ValueError, r"hidden_states must have a contiguous last dimension"),
    ],
)
def test_bad_hidden_states(hidden, error, pattern):
    indices, weights = plan([(1, 2, 2)], "cpu")
    with pytest.raises(error, match=pattern):
        torch.ops.qvl.pos_embed_interp_add_(hidden, make_table(16, torch.float32, "cpu"), indices, weights)


def test_add_refuses_hidden_states_that_overlap_themselves():
    """An expanded row: the blend would be added to it once per row. Refused on every path, as torch's in-place
    ops refuse it."""
    indices, weights = plan([(1, 2, 2)], "cpu")
    hidden = torch.zeros(1, 16).expand(4, 16)
    for path in ("torch", "reference", None):
        with force_backend(path) if path else contextlib.nullcontext():
            with pytest.raises(ValueError, match=r"hidden_states is written in place"):
                torch.ops.qvl.pos_embed_interp_add_(hidden, make_table(16, torch.float32, "cpu"), indices, weights)


def test_mixed_devices():
    indices, weights = plan([(1, 2, 2)], "cpu")
    table = make_table(16, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"interp_weights is on meta but pos_embed is on cpu"):
        torch.ops.qvl.pos_embed_interp(table, indices, weights.to("meta"))
    with pytest.raises(ValueError, match=r"hidden_states is on meta but pos_embed is on cpu"):
        torch.ops.qvl.pos_embed_interp_add_(torch.zeros(4, 16, device="meta"), table, indices, weights)


# Backward: the table's gradient (a scatter-add over the 4 taps of every token).


def eager_interp(table, indices, weights):
    """transformers' arithmetic, differentiable: ``(embedding(idx) * w[..., None]).sum(1)`` in the table's
    dtype."""
    rows = torch.nn.functional.embedding(indices.long(), table)
    return (
        (rows * weights[:, :, None].to(rows.dtype if table.dtype == torch.float64 else torch.float32))
        .sum(1)
        .to(table.dtype)
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", ["default", "torch"])
def test_interp_backward(device, dtype, backend):
    """Against float64 autograd of transformers' arithmetic; torch's own autograd in the dtype is the baseline.
    A small table (side 8) upsampled to larger grids makes many tokens share each row."""
    indices, weights = plan([(1, 6, 10), (2, 8, 8)], device, side=8)
    table = make_table(40, dtype, device, side=8).requires_grad_()
    grad = torch.randn(indices.shape[0], 40 + 3, device=device).to(dtype)[:, :40]
    with force_backend("torch") if backend == "torch" else contextlib.nullcontext():
        (got,) = torch.autograd.grad(torch.ops.qvl.pos_embed_interp(table, indices, weights), table, grad)
    table64 = table.detach().double().requires_grad_()
    (truth,) = torch.autograd.grad(eager_interp(table64, indices, weights.double()), table64, grad.double())
    (baseline,) = torch.autograd.grad(eager_interp(table, indices, weights), table, grad)
    assert_error_within(got, truth, baseline, what="pos_embed grad")


def test_interp_backward_deterministic_unused_rows_zero(device):
    indices, weights = plan([(1, 2, 2)], device, side=8)
    table = make_table(24, torch.float32, device, side=8).requires_grad_()
    grads = [torch.autograd.grad(torch.ops.qvl.pos_embed_interp(table, indices, weights).sum(), table)[0] for _ in "ab"]
    assert torch.equal(grads[0], grads[1])
    unused = torch.ones(table.shape[0], dtype=torch.bool, device=device)
    unused[indices.flatten().long()] = False
    assert unused.any() and not grads[0][unused].any()


def test_opcheck_autograd(device):
    indices, weights = plan([(1, 6, 10)], device, side=8)
    table = make_table(24, torch.float16, device, side=8).requires_grad_()
    torch.library.opcheck(torch.ops.qvl.pos_embed_interp.default, (table, indices, weights))
    grad = torch.randn(indices.shape[0], 24, device=device).half()
    torch.library.opcheck(torch.ops.qvl.pos_embed_interp_backward.default, (grad, table.detach(), indices, weights))


def test_compile_forward_backward_no_recompile(device):
    """The table's gradient through a compiled graph: one graph serves every token count."""
    torch._dynamo.reset()
    table = make_table(32, torch.float32, device, side=8).requires_grad_()

    def embed(hidden, indices, weights):
        return (hidden + torch.ops.qvl.pos_embed_interp(table, indices, weights)).square().sum()

    compiled = torch.compile(embed, fullgraph=True, dynamic=True)
    # Token counts unlike every other size in play; both with T * C above 4096, a size threshold that AOT
    # autograd guards on.
    for grid, stance in (([(1, 6, 10), (2, 8, 8)], "default"), ([(1, 10, 14), (1, 2, 6)], "fail_on_recompile")):
        indices, weights = plan(grid, device, side=8)
        hidden = torch.randn(indices.shape[0], 32, device=device, requires_grad=True)
        with torch.compiler.set_stance(stance):
            got = torch.autograd.grad(compiled(hidden, indices, weights), (hidden, table))
        expected = torch.autograd.grad(embed(hidden, indices, weights), (hidden, table))
        assert torch.equal(got[0], expected[0])
        torch.testing.assert_close(got[1], expected[1], rtol=1e-5, atol=1e-5)


def test_autograd_refusals():
    indices, weights = plan([(1, 2, 2)], "cpu")
    table = make_table(16, torch.float32, "cpu").requires_grad_()
    hidden = torch.zeros(4, 16)
    with pytest.raises(RuntimeError, match=r"qvl::pos_embed_interp_add_ .*hidden_states \+ torch\.ops\.qvl\.pos_emb"):
        torch.ops.qvl.pos_embed_interp_add_(hidden, table, indices, weights)
    assert not hidden.any()
    with torch.no_grad():
        torch.ops.qvl.pos_embed_interp_add_(hidden, table, indices, weights)
    assert torch.equal(hidden, torch.ops.qvl.pos_embed_interp(table.detach(), indices, weights))
    with pytest.raises(RuntimeError, match="no gradient flows to interp_weights"):
        torch.ops.qvl.pos_embed_interp(table, indices, weights.clone().requires_grad_())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_guard_bands(device, dtype, layout):
    """pos_embed_interp, pos_embed_interp_add_ and the table's gradient with the table, the weights, the gradients
    and every output a view inside a NaN-filled buffer (tests/guards.py; the int32 indices stay plain), on 72
    tokens (a whole and a ragged token block) of 200 channels (a whole and a ragged channel block): the blends
    exact, the gradient within the suite's rule, all finite, nothing written outside a view."""
    torch.manual_seed(13)
    pads = layout_pads(layout, dtype)
    indices, weights = plan([(1, 6, 10), (1, 2, 6)], device, side=8)
    table = guarded(make_table(200, dtype, device, side=8), pad=next(pads))
    weights = guarded(weights, pad=next(pads))
    hidden, grad_out = (
        guarded(torch.randn(indices.shape[0], 200, device=device).to(dtype), pad=next(pads)) for _ in "ab"
    )
    before = hidden.clone()
    out = guarded_empty(hidden.shape, dtype, device, pad=next(pads))
    grad_table = guarded_empty(table.shape, dtype, device, pad=next(pads))
    target = device_target(table.device)
    order, run_starts = table_row_runs(indices, table.shape[0])
    run_launches(
        pos_embed_interp_launches(table, indices, weights, out, False, target)
        + pos_embed_interp_launches(table, indices, weights, hidden, True, target)
        + pos_embed_interp_backward_launches(grad_out, order, run_starts, weights, grad_table, target),
        table.device,
    )
    assert_clean(table, weights, hidden, grad_out, out, grad_table)

    pos = blend_in_tap_order(table, indices, weights)
    assert torch.equal(out, pos.to(dtype))
    assert torch.equal(hidden, before + pos.to(dtype))
    assert_grads_within((grad_table,), lambda t: eager_interp(t, indices, weights), [table], [grad_out], "table grad")
