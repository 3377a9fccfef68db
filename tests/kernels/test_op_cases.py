"""qvl.kernels.op_cases, the non-attention part of ``qvl check``: every case passes with the real kernels (here through
Triton's interpreter, at the interpreter's sizes) in fp32, fp16 and bf16; a deliberately wrong op put in the real
one's place fails its case's check; ``timed`` gives two calls that run; and the inputs the cases build are what
transformers builds (token positions, the position table's bilinear resampling)."""

import pytest
import torch
import torch.nn.functional as F
from transformers.vision_utils import get_vision_position_ids

from qvl.kernels import force_backend
from qvl.kernels.op_cases import OP_CASES, OPS, grid_positions, interpolation_plan

CASES = {case.op: case for case in OP_CASES}
REAL = dict(OPS)


def test_every_out_of_place_op_with_a_backward_has_a_case():
    assert list(CASES) == [
        "bias_gelu erf",
        "bias_gelu tanh",
        "bias_gelu quick",
        "layer_norm",
        "add_layer_norm",
        "rms_norm",
        "add_rms_norm",
        "bias_swiglu",
        "rotary_2d",
        "pos_embed_interp",
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op", list(CASES))
def test_the_kernels_pass(op, dtype):
    comparisons = CASES[op].check(torch.device("cpu"), dtype, True)
    assert comparisons and all(c.what.startswith(f"{op} ") for c in comparisons)
    failed = [c.message() for c in comparisons if not c.passed]
    assert not failed, failed


# One plausible misreading per case, each a real op called with one thing wrong (so that it has a backward too),
# and the inputs' feature it needs: a mean (the norms), rows unlike columns (the rotary), weights unlike their mirror
# image (the blend). erf and tanh GELU differ by 5e-4 of the output's scale, which only fp32 resolves: the
# misreadings are tried in fp32.
MISREADINGS = {
    "bias_gelu erf": ("bias_gelu", "tanh GELU", lambda x, bias, approximate: REAL["bias_gelu"](x, bias, "tanh")),
    "bias_gelu tanh": ("bias_gelu", "erf GELU", lambda x, bias, approximate: REAL["bias_gelu"](x, bias, "none")),
    "bias_gelu quick": ("bias_gelu", "SiLU's constant 1 for 1.702", lambda x, bias, approximate: F.silu(x + bias)),
    "layer_norm": (
        "layer_norm",
        "not centred (RMS for the variance)",
        lambda x, weight, bias, eps: REAL["rms_norm"](x, weight, eps) + bias,
    ),
    "add_layer_norm": (
        "add_layer_norm",
        "weight and bias swapped",
        lambda x, delta, weight, bias, eps: REAL["add_layer_norm"](x, delta, bias, weight, eps),
    ),
    "rms_norm": (
        "rms_norm",
        "centred (LayerNorm's variance)",
        lambda x, weight, eps: REAL["layer_norm"](x, weight, torch.zeros_like(weight), eps),
    ),
    "add_rms_norm": (
        "add_rms_norm",
        "the norm of x, not of x + delta",
        lambda x, delta, weight, eps: (x + delta, REAL["rms_norm"](x, weight, eps)),
    ),
    "bias_swiglu": (
        "bias_swiglu",
        "gate and up swapped",
        lambda gate, up, gate_bias, up_bias: REAL["bias_swiglu"](up, gate, up_bias, gate_bias),
    ),
    "rotary_2d": (
        "rotary_2d",
        "rows and columns swapped",
        lambda q, k, positions: REAL["rotary_2d"](q, k, positions.flip(-1).contiguous()),
    ),
    "pos_embed_interp": (
        "pos_embed_interp",
        "corners mirrored",
        lambda table, indices, weights: REAL["pos_embed_interp"](table, indices, weights.flip(-1).contiguous()),
    ),
}


@pytest.mark.parametrize("op", list(CASES))
def test_a_misreading_fails(op, monkeypatch):
    name, misreading, wrong = MISREADINGS[op]
    monkeypatch.setitem(OPS, name, wrong)
    comparisons = CASES[op].check(torch.device("cpu"), torch.float32, True)
    assert all(c.baseline_agrees for c in comparisons)
    assert any(not c.passed for c in comparisons), f"{op}, {misreading}: {[c.message() for c in comparisons]}"


def test_timed_gives_two_calls_that_run():
    """On the torch path (the towers' sizes are too large for the interpreter): each case's qvl call and torch's
    equivalent run and give results of the same shapes."""
    with force_backend("torch"):
        for case in OP_CASES:
            qvl_call, torch_call = case.timed(torch.device("cpu"), torch.float32)
            ours, theirs = qvl_call(), torch_call()
            if isinstance(ours, torch.Tensor):
                ours, theirs = (ours,), (theirs,)
            assert [x.shape for x in ours] == [x.shape for x in theirs], case.op


GRIDS = [(1, 6, 10), (2, 4, 4), (1, 64, 64), (1, 24, 40)]


def test_positions_are_transformers():
    assert torch.equal(grid_positions(GRIDS), get_vision_position_ids(torch.tensor(GRIDS), 2).to(torch.int32))


@pytest.mark.parametrize("side", [8, 48])
def test_the_plan_resamples_bilinearly(side):
    """The plan's blend (in float64) is torch's own bilinear align-corners resampling of the table to each grid, in
    the token order of :func:`grid_positions`, within its fp32 weights' rounding: coordinates up to ``side - 1``
    rounded in fp32 move the weights by a few ulps of ``side``, and the blend by that times a difference of two
    table rows."""
    table = torch.randn(side * side, 16, dtype=torch.float64)
    indices, weights = interpolation_plan(GRIDS, side)
    blend = (table[indices.long()] * weights.double()[:, :, None]).sum(1)
    image = table.t().reshape(1, 16, side, side)
    expected = []
    for t, h, w in GRIDS:
        resampled = F.interpolate(image, size=(h, w), mode="bilinear", align_corners=True)[0]
        rows, cols = grid_positions([(t, h, w)]).long().unbind(-1)
        expected.append(resampled[:, rows, cols].t())
    bound = 8 * side * torch.finfo(torch.float32).eps * table.abs().max().item()
    assert (blend - torch.cat(expected)).abs().max().item() <= bound
