"""The checks bite: for each non-attention kernel family, the kernel's result passes the check its tests apply, and
each plausible misreading of the computation fails that same check.

A misreading (a mutant) is a deliberately wrong result written here from torch functions in float64 and rounded once
to the dtype, as a kernel with the wrong formula and perfect arithmetic would return it. It is held to exactly what
the family's tests hold the kernel to: :func:`tolerance.compare` against the same float64 truth and torch baseline,
with the same arguments (the rotary's ``wide_ulps``), or exact equality where the tests ask for it (pos_embed's
blends). Inputs are small, and chosen so that each misreading moves the output by a good fraction of its scale, many
times a bound of a few of the dtype's ulps: where a misreading cannot move it that far in a dtype (erf for tanh GELU
changes it by 5e-4 of its scale, below 16-bit resolution), it is tried only in the dtypes that resolve it, and the
comment there says why.
"""

import pytest
import torch
import torch.nn.functional as F
from test_gelu import eager_gelu
from test_layer_norm import eager_layer_norm
from test_pos_embed import blend_in_tap_order, eager_interp, make_table, plan
from test_rms_norm import eager_rms_norm
from test_rotary import angle_ulps, grid_positions, transformers_rotary
from test_swiglu import eager_swiglu

from conftest import float64_rotary, norm_params, row_strided
from tolerance import compare

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def assert_check_bites(actual, truth, baseline, mutants: dict, **rule) -> None:
    """``actual`` passes ``compare(actual, truth, baseline, **rule)``, and every mutant (a float64 tensor, rounded
    here to actual's dtype) fails it with a baseline that agrees with the truth: its error is above the bound."""
    comparison = compare(actual, truth, baseline, what="kernel", **rule)
    assert comparison.passed, comparison.message()
    assert mutants
    for name, mutant in mutants.items():
        comparison = compare(mutant.to(actual.dtype), truth, baseline, what=name, **rule)
        assert comparison.baseline_agrees and not comparison.passed, comparison.message()


# GELU: v = x + bias in [-3, 1], where the GELUs (erf, tanh, quick, SiLU) differ most while the output stays below
# 1 in magnitude, which keeps the bound (a few ulps at the output's scale) small.


@pytest.mark.parametrize("approximate", ["none", "tanh", "quick"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu(dtype, approximate, device):
    torch.manual_seed(20)
    x = (3.0 * torch.rand(16, 64, device=device) - 2.5).to(dtype)
    bias = (torch.rand(64, device=device) - 0.5).to(dtype)
    truth, v = eager_gelu(x.double(), bias.double(), approximate), x.double() + bias.double()
    mutants = {"bias dropped": eager_gelu(x.double(), 0.0, approximate)}
    if approximate == "quick":
        # v sigmoid(c v) with SiLU's c = 1, or with 1.702 read as a divisor: 0.2 and more of the output's scale.
        mutants["SiLU's constant 1 for 1.702"] = v * torch.sigmoid(v)
        mutants["v / 1.702 in the sigmoid"] = v * torch.sigmoid(v / 1.702)
        # QuickGELU and the erf GELU differ by up to 0.02: beyond fp32's and fp16's rounding, within bf16's.
        if dtype != torch.bfloat16:
            mutants["erf GELU for QuickGELU"] = F.gelu(v)
    # The erf and tanh GELUs differ by at most 5e-4, within fp16's and bf16's rounding: only fp32 resolves them.
    elif dtype == torch.float32:
        other = {"none": "tanh", "tanh": "none"}[approximate]
        mutants[f"{other} GELU for {approximate}"] = F.gelu(v, approximate=other)
    y = torch.ops.qvl.bias_gelu(x, bias, approximate)
    assert_check_bites(y, truth, eager_gelu(x, bias, approximate), mutants)


# LayerNorm and RMSNorm: rows whose standard deviation goes from 0.03 to 3, each row's mean twice its standard
# deviation. eps = 1e-2 is above the smallest rows' variance (1e-3), so where eps goes matters there; the mean is
# most of each row's root mean square, so whether the statistics are centred matters everywhere. 16 columns make the
# unbiased variance 16/15 of the biased one.
NORM_EPS = 1e-2


def spread_rows(dtype, device) -> torch.Tensor:
    spread = torch.logspace(-1.5, 0.5, 16, device=device)[:, None]
    return (spread * (2.0 + torch.randn(16, 16, device=device))).to(dtype)


def mean_square(x: torch.Tensor, centred: bool = False, unbiased: bool = False) -> torch.Tensor:
    """Each row's mean square, or with ``centred`` its variance (biased, or ``unbiased``)."""
    if centred:
        x = x - x.mean(-1, keepdim=True)
    return x.pow(2).sum(-1, keepdim=True) / (x.shape[-1] - unbiased)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm(dtype, device):
    torch.manual_seed(21)
    x = spread_rows(dtype, device)
    weight, bias = norm_params(16, dtype, device)
    x64, w64, b64 = x.double(), weight.double(), bias.double()
    centred, variance = x64 - x64.mean(-1, keepdim=True), mean_square(x64, centred=True)
    x_hat = centred / torch.sqrt(variance + NORM_EPS)
    mutants = {
        "not centred (RMSNorm's statistics)": x64 / torch.sqrt(mean_square(x64) + NORM_EPS) * w64 + b64,
        "eps added outside the square root": centred / (torch.sqrt(variance) + NORM_EPS) * w64 + b64,
        "weight and bias swapped": x_hat * b64 + w64,
        "bias dropped": x_hat * w64,
    }
    # torch.var's default: a factor sqrt(16/15), 3% of the output's scale, beyond fp32's and fp16's rounding but
    # within bf16's (2^-8 per rounding, and torch's bf16 LayerNorm rounds more than once).
    if dtype != torch.bfloat16:
        unbiased = mean_square(x64, centred=True, unbiased=True)
        mutants["unbiased variance"] = centred / torch.sqrt(unbiased + NORM_EPS) * w64 + b64
    y = torch.ops.qvl.layer_norm(x, weight, bias, NORM_EPS)
    baseline = eager_layer_norm(x, weight, bias, NORM_EPS)
    assert_check_bites(y, eager_layer_norm(x64, w64, b64, NORM_EPS), baseline, mutants)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(dtype, device):
    torch.manual_seed(22)
    x = spread_rows(dtype, device)
    weight, _ = norm_params(16, dtype, device)
    x64, w64 = x.double(), weight.double()
    centred, variance = x64 - x64.mean(-1, keepdim=True), mean_square(x64, centred=True)
    mutants = {
        "centred (LayerNorm's statistics)": centred / torch.sqrt(variance + NORM_EPS) * w64,
        "centred variance": x64 / torch.sqrt(variance + NORM_EPS) * w64,
        "eps added outside the square root": x64 / (torch.sqrt(mean_square(x64)) + NORM_EPS) * w64,
        "weight dropped": x64 / torch.sqrt(mean_square(x64) + NORM_EPS),
    }
    y = torch.ops.qvl.rms_norm(x, weight, NORM_EPS)
    baseline = eager_rms_norm(x, weight, NORM_EPS)
    assert_check_bites(y, eager_rms_norm(x64, w64, NORM_EPS), baseline, mutants)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu(dtype, device):
    torch.manual_seed(23)
    gate, up = (row_strided(16, 64, dtype, device, scale=scale) for scale in (3.0, 2.0))
    gate_bias, up_bias = ((0.5 * torch.randn(64, device=device)).to(dtype) for _ in range(2))
    gate64, up64, gate_bias64, up_bias64 = (t.double() for t in (gate, up, gate_bias, up_bias))
    g, u = gate64 + gate_bias64, up64 + up_bias64
    mutants = {
        "gate and up swapped": F.silu(u) * g,
        "sigmoid for silu": torch.sigmoid(g) * u,
        "biases swapped": eager_swiglu(gate64, up64, up_bias64, gate_bias64),
    }
    y = torch.ops.qvl.bias_swiglu(gate, up, gate_bias, up_bias)
    truth = eager_swiglu(gate64, up64, gate_bias64, up_bias64)
    assert_check_bites(y, truth, eager_swiglu(gate, up, gate_bias, up_bias), mutants)


def in_adjacent_pairs(rotate, q, k, positions):
    """``rotate`` (a rotate-half rotary) turned into the interleaved one, dims (2i, 2i + 1) rotated by angle i
    instead of (i, i + D/2): rotate-half applied to the dims reordered evens first, then put back."""
    evens_first = [torch.cat((x[..., 0::2], x[..., 1::2]), -1) for x in (q, k)]
    half = q.shape[-1] // 2
    return tuple(torch.stack((x[..., :half], x[..., half:]), -1).flatten(-2) for x in rotate(*evens_first, positions))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary(dtype):
    """Grids of unequal sides, so that rows and columns differ; angles up to 9 radians at the highest frequency."""
    torch.manual_seed(24)
    positions = grid_positions([[1, 6, 10], [1, 4, 4]])
    q, k = torch.randn(2, positions.shape[0], 2, 64).to(dtype).unbind(0)
    q64, k64 = q.double(), k.double()

    def rotate(q, k, positions, inverse=False):
        return transformers_rotary(q, k, positions, 64, inverse=inverse)

    mutants = {
        "rotate_half's sign flipped (the opposite angles)": rotate(q64, k64, positions, inverse=True),
        "row and column positions swapped": rotate(q64, k64, positions.flip(-1)),
        "adjacent dims paired (interleaved)": in_adjacent_pairs(rotate, q64, k64, positions),
    }
    got = torch.ops.qvl.rotary_2d(q, k, positions)
    truth, baseline = float64_rotary(q, k, positions), rotate(q, k, positions)
    for index in range(2):  # q, then k: the tests compare them apart
        pair_mutants = {name: mutant[index] for name, mutant in mutants.items()}
        assert_check_bites(got[index], truth[index], baseline[index], pair_mutants, wide_ulps=angle_ulps(positions))


# pos_embed: each token's four taps are the corners (top left, top right, bottom left, bottom right) around its
# point of the table; a misread plan pairs a corner's row with another corner's weight.
CORNERS_MIRRORED = {"left and right corners swapped": [1, 0, 3, 2], "top and bottom corners swapped": [2, 3, 0, 1]}


def table_gradient(table, indices, weights, grad):
    """torch's autograd of transformers' blend (eager_interp) for the output gradient ``grad``."""
    leaf = table.detach().requires_grad_()
    return torch.autograd.grad(eager_interp(leaf, indices, weights), leaf, grad)[0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_pos_embed(dtype, device):
    """The blends are held to exact equality (test_pos_embed), the table's gradient to the rule: a 6 x 10 and an 8 x 8
    grid upsampled from an 8 x 8 table, so most tokens blend four rows with unequal weights."""
    torch.manual_seed(25)
    indices, weights = plan([(1, 6, 10), (2, 8, 8)], device, side=8)
    table = make_table(40, dtype, device, side=8)
    hidden = torch.randn(indices.shape[0], 40, device=device).to(dtype)
    blend = blend_in_tap_order(table, indices, weights)
    out, added = torch.ops.qvl.pos_embed_interp(table, indices, weights), hidden.clone()
    torch.ops.qvl.pos_embed_interp_add_(added, table, indices, weights)
    assert torch.equal(out, blend.to(dtype)) and torch.equal(added, hidden + blend.to(dtype))
    for order in CORNERS_MIRRORED.values():
        assert not torch.equal(out, blend_in_tap_order(table, indices, weights[:, order]).to(dtype))
    # The model rounds the blend to the hidden dtype before adding it; adding it unrounded rounds once, not twice
    # (in fp32, where the blend is computed, the first rounding is none).
    if dtype != torch.float32:
        assert not torch.equal(added, (hidden.float() + blend).to(dtype))

    grad = torch.randn(indices.shape[0], 40, device=device).to(dtype)
    leaf = table.detach().requires_grad_()
    (got,) = torch.autograd.grad(torch.ops.qvl.pos_embed_interp(leaf, indices, weights), leaf, grad)
    table64, weights64, grad64 = table.double(), weights.double(), grad.double()
    mutants = {
        name: table_gradient(table64, indices, weights64[:, order], grad64) for name, order in CORNERS_MIRRORED.items()
    }
    truth = table_gradient(table64, indices, weights64, grad64)
    assert_check_bites(got, truth, table_gradient(table, indices, weights, grad), mutants)
