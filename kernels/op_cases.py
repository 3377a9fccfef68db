"""What a right result of qvl's non-attention ops is, for ``qvl check``: every out-of-place op that has a backward
(bias + GELU in its erf, tanh and quick forms, LayerNorm and RMSNorm with and without the fused residual add, bias +
SwiGLU, the 2D rotary and the position table's resampling), run forward and backward on the user's device and judged
by the package's one rule (:mod:`.tolerance`). The attention op has its own (:mod:`.verify`).

Each :class:`OpCase` builds its inputs from a seeded generator on the CPU (the same values on every machine) and
moves them to the device, runs the op under autograd with a random gradient for each output, and compares every
output and every input's gradient with

* the truth: the same computation in float64 on the same (already rounded) inputs, written from torch's own
  functions (``F.gelu``, ``F.layer_norm``, ``F.rms_norm``, ``F.silu``, :func:`.verify.float64_rotary`,
  ``F.embedding``), its gradients from float64 autograd. Never from qvl's ``*_reference`` code or its kernels: a
  misreading that a kernel and its reference share would pass a check against the reference;
* the baseline: torch's own computation in the inputs' dtype, forward and autograd, as the tower computes it
  without qvl (transformers' arithmetic where it differs from torch's fused function: RMSNorm's two roundings,
  QuickGELU's, the rotary's and the position blend's fp32 steps). Its error sets the bound.

The op is called through :data:`OPS` at each call, so that a test can put a deliberately wrong op in its place and
see the check fail. ``small`` inputs are sized for Triton's interpreter on a CPU (rows that end inside a row block,
widths that end inside a column tile); the others are the towers' (4,096 tokens, Qwen3-VL's hidden 1,152 and MLP
4,304, 16 heads of 72, its 48 x 48 position table resampled to its grids). :attr:`OpCase.timed` gives the op and
torch's equivalent on the towers' inputs, for timing the forward elsewhere.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .tolerance import Comparison, compare
from .verify import float64_rotary, rotary_in_fp32

__all__ = ["OPS", "OP_CASES", "OpCase", "grid_positions", "interpolation_plan"]

# The ops under test, looked up at each call (the tests' seam for deliberately wrong ops).
OPS: dict[str, Callable] = {
    name: getattr(torch.ops.qvl, name)
    for name in (
        "bias_gelu",
        "layer_norm",
        "add_layer_norm",
        "rms_norm",
        "add_rms_norm",
        "bias_swiglu",
        "rotary_2d",
        "pos_embed_interp",
    )
}


class OpCase(NamedTuple):
    """One op's check: ``check(device, dtype, small)`` runs it forward and backward and returns the rule applied to
    each output and gradient (``what`` names the op and the output, e.g. ``"add_layer_norm h"``, or the gradient,
    ``"add_layer_norm dweight"``); ``timed(device, dtype)`` builds tower-sized inputs once and returns two
    zero-argument calls of the forward, qvl's op and torch's equivalent."""

    op: str
    check: Callable[[torch.device, torch.dtype, bool], list[Comparison]]
    timed: Callable[[torch.device, torch.dtype], tuple[Callable[[], object], Callable[[], object]]]


class _Problem(NamedTuple):
    """A case's inputs in the op's argument order, the differentiable ones first, and one output gradient per
    output (CPU tensors in their final dtypes)."""

    inputs: list[torch.Tensor]
    grad_outputs: list[torch.Tensor]


class _Spec(NamedTuple):
    op: str
    call: Callable  # the qvl op, through OPS
    eager: Callable  # torch's own computation in the inputs' dtype: the baseline, and what timed() races
    truth: Callable  # (dtype under test, *float64 inputs) -> float64 outputs
    problem: Callable[[torch.Generator, torch.dtype, bool], _Problem]
    outputs: tuple[str, ...]
    grads: tuple[str, ...]  # the gradients' names, of the first len(grads) inputs
    wide_ulps: Callable[..., float]  # (*inputs) -> fp32 ulps at the output's scale (tolerance.compare)


def _randn(generator: torch.Generator, *shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    return torch.randn(*shape, generator=generator) * scale + shift


def _as_tuple(outputs) -> tuple[torch.Tensor, ...]:
    return tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)


def _differentiate(fn: Callable, inputs: Sequence[torch.Tensor], num_grads: int, grad_outputs) -> list[torch.Tensor]:
    """``fn``'s outputs on fresh leaves of ``inputs`` (the first ``num_grads`` requiring grad), then autograd's
    gradients of those leaves for ``grad_outputs``."""
    leaves = [x.detach().requires_grad_() if i < num_grads else x for i, x in enumerate(inputs)]
    outputs = _as_tuple(fn(*leaves))
    grads = torch.autograd.grad(outputs, leaves[:num_grads], grad_outputs)
    return [out.detach() for out in outputs] + list(grads)


def _check(spec: _Spec, device: torch.device, dtype: torch.dtype, small: bool) -> list[Comparison]:
    device = torch.device(device)
    problem = spec.problem(torch.Generator().manual_seed(0), dtype, small)
    inputs = [x.to(device) for x in problem.inputs]
    grad_outputs = [g.to(device) for g in problem.grad_outputs]
    wide = [x.double() if x.is_floating_point() else x for x in inputs]
    num_grads = len(spec.grads)
    with torch.enable_grad():
        with warnings.catch_warnings():
            # Triton's interpreter evaluates the kernels' exp2 in numpy, which warns where it overflows to inf: the
            # GELU and SiLU tails, where the kernels take the inf by design (x / (1 + inf) is the tail's 0).
            warnings.filterwarnings("ignore", "overflow encountered in exp2", RuntimeWarning)
            got = _differentiate(spec.call, inputs, num_grads, grad_outputs)
        truth = _differentiate(partial(spec.truth, dtype), wide, num_grads, [g.double() for g in grad_outputs])
        baseline = _differentiate(spec.eager, inputs, num_grads, grad_outputs)
    wide_ulps = spec.wide_ulps(*inputs)
    return [
        compare(actual, true, base, wide_ulps=wide_ulps, what=f"{spec.op} {name}")
        for name, actual, true, base in zip(spec.outputs + spec.grads, got, truth, baseline, strict=True)
    ]


def _timed(spec: _Spec, device: torch.device, dtype: torch.dtype) -> tuple[Callable[[], object], Callable[[], object]]:
    inputs = [x.to(device) for x in spec.problem(torch.Generator().manual_seed(0), dtype, False).inputs]
    return (lambda: spec.call(*inputs)), (lambda: spec.eager(*inputs))


def _case(spec: _Spec) -> OpCase:
    return OpCase(spec.op, partial(_check, spec), partial(_timed, spec))


def _same_in_float64(eager: Callable) -> Callable:
    """The truth of an op whose eager computation, run in float64, is the truth."""
    return lambda dtype, *inputs: eager(*inputs)


def _no_wide_ulps(*inputs) -> float:
    """Every case but the rotary: the op computes in fp32 and rounds once on the store (the norms keep their
    statistics in fp32, as torch's own do; RMSNorm rounds where transformers does), so against float64 its error is
    its output's rounding plus fp32 roundings far below it; in fp32 itself those are roundings of the kind and
    number torch's own computation makes, which the baseline's error counts. The rule's default eps
    (:data:`~.tolerance.DEFAULT_ULPS` of the dtype at the output's scale) covers the rest: a final rounding on the
    other side of a tie, a sum in another order."""
    return 0


def _rounded_sum(x: torch.Tensor, delta: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 ``x + delta`` rounded to ``dtype`` as the fused ops store ``h`` (and eager torch's sum rounds it), the
    norm's input in their contract; differentiable as the identity, so the gradients are the exact ones at it."""
    exact = x + delta
    return exact + (exact.detach().to(dtype).double() - exact.detach())


# GELU: v = x + bias of scale 3, over the range where the three forms differ and where tanh's and erf's tails
# saturate. Widths: 200 ends inside the interpreter's 256-column tile; the towers' are the GELU MLPs' (Qwen3-VL's
# merger 4,608 for erf, its blocks' 4,304 for tanh, Qwen2-VL's blocks' 5,120 for QuickGELU).


def _gelu_problem(width: int, generator: torch.Generator, dtype: torch.dtype, small: bool) -> _Problem:
    rows, cols = (37, 200) if small else (4096, width)
    x = _randn(generator, rows, cols, scale=3.0)
    bias = _randn(generator, cols, scale=0.5)
    return _Problem([x.to(dtype), bias.to(dtype)], [_randn(generator, rows, cols).to(dtype)])


def _eager_gelu(approximate: str, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """torch's GELU of ``x + bias`` in x's dtype; QuickGELU as transformers' ``QuickGELUActivation`` writes it."""
    v = x + bias
    return v * torch.sigmoid(1.702 * v) if approximate == "quick" else F.gelu(v, approximate=approximate)


def _gelu_spec(label: str, approximate: str, width: int) -> _Spec:
    eager = partial(_eager_gelu, approximate)
    return _Spec(
        op=f"bias_gelu {label}",
        call=lambda x, bias: OPS["bias_gelu"](x, bias, approximate),
        eager=eager,
        truth=_same_in_float64(eager),
        problem=partial(_gelu_problem, width),
        outputs=("y",),
        grads=("dx", "dbias"),
        wide_ulps=_no_wide_ulps,
    )


# The norms: rows with a mean larger than their spread (a norm that does not centre, or centres when it should not,
# is off by O(1)), weight and bias away from 1 and 0 (a dropped or swapped one shows). 37 rows end inside a row block;
# widths 200 and 72 inside the norm's power-of-two tile; the towers' are Qwen3-VL's hidden 1,152 (LayerNorm) and
# Qwen2.5-VL's 1,280 (RMSNorm). Eps 1e-6, the towers'.
_NORM_EPS = 1e-6


def _norm_problem(
    centred: bool, add: bool, width: int, generator: torch.Generator, dtype: torch.dtype, small: bool
) -> _Problem:
    rows, cols = (37, 72 if add else 200) if small else (4096, width)
    x = _randn(generator, rows, cols, scale=2.0, shift=3.0 if centred else 1.0)
    delta = [_randn(generator, rows, cols)] if add else []
    weight = _randn(generator, cols, scale=0.3, shift=1.0)
    bias = [_randn(generator, cols, scale=0.2)] if centred else []
    grads = [_randn(generator, rows, cols) for _ in range(2 if add else 1)]
    return _Problem([t.to(dtype) for t in (x, *delta, weight, *bias)], [g.to(dtype) for g in grads])


def _eager_layer_norm(x, weight, bias):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, _NORM_EPS)


def _eager_add_layer_norm(x, delta, weight, bias):
    h = x + delta
    return h, _eager_layer_norm(h, weight, bias)


def _add_layer_norm_truth(dtype, x, delta, weight, bias):
    """``h`` exact, and the norm of ``h`` as the op stores it (:func:`_rounded_sum`)."""
    return x + delta, _eager_layer_norm(_rounded_sum(x, delta, dtype), weight, bias)


def _eager_rms_norm(x, weight):
    """transformers' ``Qwen2RMSNorm`` (Qwen2.5-VL's vision norms) in x's dtype: statistics in fp32, the normalised row
    rounded to x's dtype, then multiplied by the weight and rounded again."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + _NORM_EPS)
    return weight * h.to(x.dtype)


def _rms_norm_truth(dtype, x, weight):
    """``F.rms_norm`` in float64: transformers' module would take fp32 statistics even there."""
    return F.rms_norm(x, (x.shape[-1],), weight, _NORM_EPS)


def _eager_add_rms_norm(x, delta, weight):
    h = x + delta
    return h, _eager_rms_norm(h, weight)


def _add_rms_norm_truth(dtype, x, delta, weight):
    """As :func:`_add_layer_norm_truth`."""
    return x + delta, _rms_norm_truth(dtype, _rounded_sum(x, delta, dtype), weight)


def _norm_spec(op: str, call: Callable, eager: Callable, truth: Callable, width: int) -> _Spec:
    centred, add = op.endswith("layer_norm"), op.startswith("add_")
    inputs = ("x", "delta") if add else ("x",)
    params = ("weight", "bias") if centred else ("weight",)
    return _Spec(
        op=op,
        call=call,
        eager=eager,
        truth=truth,
        problem=partial(_norm_problem, centred, add, width),
        outputs=("h", "y") if add else ("y",),
        grads=tuple(f"d{name}" for name in inputs + params),
        wide_ulps=_no_wide_ulps,
    )


# SwiGLU: gate of scale 3 over SiLU's bend and tails, up of scale 2, biases away from 0. Width 140 ends inside the
# interpreter's 256-column tile (and, as Qwen2.5-VL's 3,420 does, is no multiple of 8); the towers' is that MLP's.


def _swiglu_problem(generator: torch.Generator, dtype: torch.dtype, small: bool) -> _Problem:
    rows, cols = (37, 140) if small else (4096, 3420)
    gate, up = _randn(generator, rows, cols, scale=3.0), _randn(generator, rows, cols, scale=2.0)
    biases = [_randn(generator, cols, scale=0.5) for _ in range(2)]
    return _Problem([t.to(dtype) for t in (gate, up, *biases)], [_randn(generator, rows, cols).to(dtype)])


def _eager_swiglu(gate, up, gate_bias, up_bias):
    return F.silu(gate + gate_bias) * (up + up_bias)


# The rotary: q and k of Qwen3-VL's head dim 72 at the positions of a few grids in transformers' token order (merge
# blocks of 2 x 2), wider than tall so that rows and columns differ; 2 heads in the interpreter, 16 on a GPU.


def grid_positions(grids: Sequence[Sequence[int]], merge: int = 2) -> torch.Tensor:
    """int32 ``(T, 2)``: each token's (row, col) on its image's patch grid for ``grids`` of ``(t, h, w)``, in
    transformers' token order (``get_vision_position_ids``: merge blocks of ``merge x merge`` patches in raster
    order, raster order inside each, each of the ``t`` frames alike)."""
    frames = []
    for t, h, w in grids:
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        blocks = (h // merge, merge, w // merge, merge)
        frame = torch.stack([axis.reshape(blocks).transpose(1, 2).flatten() for axis in (rows, cols)], dim=-1)
        frames.append(frame.repeat(t, 1))
    return torch.cat(frames).to(torch.int32)


def _rotary_problem(generator: torch.Generator, dtype: torch.dtype, small: bool) -> _Problem:
    grids, heads = ([(1, 6, 10), (1, 4, 4)], 2) if small else ([(1, 64, 64)], 16)
    positions = grid_positions(grids)
    q, k, grad_q, grad_k = (_randn(generator, positions.shape[0], heads, 72).to(dtype) for _ in range(4))
    return _Problem([q, k, positions], [grad_q, grad_k])


def _rotary_angle_ulps(q, k, positions) -> float:
    """The op and torch compute the angles in fp32, the truth in float64: an angle ``a = position * frequency``
    (frequencies at most 1) is rounded, so its cos and sin are off by up to ``a * eps / 2`` each, and each output sums
    two such products at the output's scale: ``2 * (1 + max position)`` fp32 ulps (the backward applies one rotation
    too, the inverse)."""
    return 2 * (1 + int(positions.max()))


# The position table's resampling: a table of 8 x 8 rows of 72 channels in the interpreter (grids larger than it in
# one axis, and a two-frame video), Qwen3-VL's 48 x 48 rows of 1,152 on a GPU at 4,096 and 960 tokens. The blend's
# weights are the op's fp32 inputs, so the truth blends with them in float64.


def _linear_taps(size: int, side: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Along one axis of ``size`` patches, each patch's two table taps and the second's weight, as Qwen3-VL's
    ``fast_pos_embed_interpolate`` computes them in fp32: align-corners coordinates ``linspace(0, side - 1, size)``."""
    coords = torch.linspace(0, side - 1, size)
    floor = coords.long()
    return floor, (floor + 1).clamp(max=side - 1), coords - floor


def interpolation_plan(grids: Sequence[Sequence[int]], side: int, merge: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 table rows ``(T, 4)`` and fp32 weights ``(T, 4)`` resampling a learned ``side x side`` position table
    bilinearly (align corners) to every token of ``grids`` in :func:`grid_positions`' order, taps in the order (top,
    left), (top, right), (bottom, left), (bottom, right): Qwen3-VL's ``fast_pos_embed_interpolate``."""
    indices, weights = [], []
    for grid in grids:
        (top, bottom, down), (left, right, across) = (_linear_taps(size, side) for size in grid[1:])
        row, col = grid_positions([grid], merge).long().unbind(-1)
        top, bottom, down, left, right, across = top[row], bottom[row], down[row], left[col], right[col], across[col]
        indices.append(
            torch.stack([top * side + left, top * side + right, bottom * side + left, bottom * side + right], -1)
        )
        weights.append(
            torch.stack([(1 - down) * (1 - across), (1 - down) * across, down * (1 - across), down * across], -1)
        )
    return torch.cat(indices).to(torch.int32), torch.cat(weights)


def _pos_embed_problem(generator: torch.Generator, dtype: torch.dtype, small: bool) -> _Problem:
    side, channels, grids = (8, 72, [(1, 6, 10), (2, 4, 4)]) if small else (48, 1152, [(1, 64, 64), (1, 24, 40)])
    indices, weights = interpolation_plan(grids, side)
    table = _randn(generator, side * side, channels).to(dtype)
    return _Problem([table, indices, weights], [_randn(generator, indices.shape[0], channels).to(dtype)])


def _eager_blend(table, indices, weights):
    """transformers' Qwen3-VL blend, ``(pos_embed(idx) * w[:, :, None]).sum(1)`` (fp32 products and sum for a 16-bit
    table, float64 for the truth's), in the table's dtype."""
    return (F.embedding(indices.long(), table) * weights[:, :, None]).sum(1).to(table.dtype)


_SPECS = (
    _gelu_spec("erf", "none", 4608),
    _gelu_spec("tanh", "tanh", 4304),
    _gelu_spec("quick", "quick", 5120),
    _norm_spec(
        "layer_norm",
        lambda x, weight, bias: OPS["layer_norm"](x, weight, bias, _NORM_EPS),
        _eager_layer_norm,
        _same_in_float64(_eager_layer_norm),
        1152,
    ),
    _norm_spec(
        "add_layer_norm",
        lambda x, delta, weight, bias: OPS["add_layer_norm"](x, delta, weight, bias, _NORM_EPS),
        _eager_add_layer_norm,
        _add_layer_norm_truth,
        1152,
    ),
    _norm_spec(
        "rms_norm", lambda x, weight: OPS["rms_norm"](x, weight, _NORM_EPS), _eager_rms_norm, _rms_norm_truth, 1280
    ),
    _norm_spec(
        "add_rms_norm",
        lambda x, delta, weight: OPS["add_rms_norm"](x, delta, weight, _NORM_EPS),
        _eager_add_rms_norm,
        _add_rms_norm_truth,
        1280,
    ),
    _Spec(
        op="bias_swiglu",
        call=lambda *inputs: OPS["bias_swiglu"](*inputs),
        eager=_eager_swiglu,
        truth=_same_in_float64(_eager_swiglu),
        problem=_swiglu_problem,
        outputs=("y",),
        grads=("dgate", "dup", "dgate_bias", "dup_bias"),
        wide_ulps=_no_wide_ulps,
    ),
    _Spec(
        op="rotary_2d",
        call=lambda q, k, positions: OPS["rotary_2d"](q, k, positions),
        eager=rotary_in_fp32,
        truth=lambda dtype, q, k, positions: float64_rotary(q, k, positions),
        problem=_rotary_problem,
        outputs=("q", "k"),
        grads=("dq", "dk"),
        wide_ulps=_rotary_angle_ulps,
    ),
    _Spec(
        op="pos_embed_interp",
        call=lambda *inputs: OPS["pos_embed_interp"](*inputs),
        eager=_eager_blend,
        truth=_same_in_float64(_eager_blend),
        problem=_pos_embed_problem,
        outputs=("pos",),
        grads=("dtable",),
        wide_ulps=_no_wide_ulps,
    ),
)
OP_CASES: tuple[OpCase, ...] = tuple(_case(spec) for spec in _SPECS)
