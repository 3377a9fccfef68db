"""vision_attn (and the rotary kernel it launches) on every layout: rows all 16-byte aligned, which take the
kernels' provably aligned strides, and layouts that are not, which take the plain ones.

Both paths run through Triton's interpreter on the same cases (see conftest.py) and are judged against
float64 with the suite's tolerance rule (tests/tolerance.py); shapes stay small for the interpreter.
"""

import pytest
import torch
from test_attention import assert_close_to_float64

import qvl.kernels.attention as attention
import qvl.kernels.rotary as rotary
from qvl.kernels.common import ADA, HOPPER, INTERPRETER, rows_16_byte_aligned, run_launches

LENGTHS = [37, 0, 70]
NUM_TOKENS = sum(LENGTHS)
CU_SEQLENS = torch.tensor([0, 37, 37, 107], dtype=torch.int32)
NUM_HEADS = 2


def randn(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def packed(head_dim, dtype, seed):
    """Views of one packed ``(T, 3, H, D)`` qkv projection, the tower's layout."""
    return randn(NUM_TOKENS, 3, NUM_HEADS, head_dim, dtype=dtype, seed=seed).unbind(1)


def contiguous(head_dim, dtype, seed):
    return tuple(x.contiguous() for x in packed(head_dim, dtype, seed))


def offset_base(head_dim, dtype, seed):
    """Packed views of a buffer that starts one element past a 16-byte boundary."""
    buffer = randn(1 + NUM_TOKENS * 3 * NUM_HEADS * head_dim, dtype=dtype, seed=seed)[1:]
    return buffer.view(NUM_TOKENS, 3, NUM_HEADS, head_dim).unbind(1)


def odd_head_stride(head_dim, dtype, seed):
    """Each head padded by one element: head stride D + 1."""
    return tuple(x[..., :head_dim] for x in randn(3, NUM_TOKENS, NUM_HEADS, head_dim + 1, dtype=dtype, seed=seed))


def odd_token_stride(head_dim, dtype, seed):
    """Tokens padded by three elements: token stride H * D + 3."""
    row = NUM_HEADS * head_dim + 3
    buffers = randn(3, NUM_TOKENS * row, dtype=dtype, seed=seed)
    return tuple(b.as_strided((NUM_TOKENS, NUM_HEADS, head_dim), (row, head_dim, 1)) for b in buffers)


def one_misaligned(head_dim, dtype, seed):
    """q and v packed, k offset by one element: a single tensor sends the whole launch down the plain path."""
    q, _, v = packed(head_dim, dtype, seed)
    return q, offset_base(head_dim, dtype, seed + 1)[1], v


# (layout, head dim, dtype, whether every row is 16-byte aligned)
CASES = [
    (packed, 72, torch.float16, True),
    (packed, 64, torch.float32, True),
    (contiguous, 72, torch.float16, True),
    (contiguous, 36, torch.float32, True),  # 144-byte rows
    (offset_base, 72, torch.float16, False),
    (odd_head_stride, 72, torch.float16, False),
    (odd_token_stride, 72, torch.float32, False),
    (contiguous, 36, torch.float16, False),  # 72-byte rows
    (one_misaligned, 72, torch.float16, False),
]
CASE_IDS = [f"{layout.__name__}-D{d}-{str(dtype).removeprefix('torch.')}" for layout, d, dtype, _ in CASES]
ALIGNED_CASES = [pytest.param(*case[:3], id=case_id) for case, case_id in zip(CASES, CASE_IDS) if case[3]]


def positions_for(rope):
    if not rope:
        return None
    return torch.randint(0, 24, (NUM_TOKENS, 2), dtype=torch.int32, generator=torch.Generator().manual_seed(5))


def attention_flags(q, k, v, positions):
    """The STRIDES_ALIGNED flag of each launch vision_attn makes for these inputs."""
    out = torch.empty(q.shape, dtype=q.dtype)
    launches = attention.vision_attn_launches(q, k, v, out, CU_SEQLENS, None, positions, 10000.0, INTERPRETER)
    return [launch.kwargs["STRIDES_ALIGNED"] for launch in launches]


@pytest.mark.parametrize("layout, head_dim, dtype, aligned", CASES, ids=CASE_IDS)
def test_layout_is_classified_from_host_metadata(layout, head_dim, dtype, aligned):
    q, k, v = layout(head_dim, dtype, seed=head_dim)
    assert rows_16_byte_aligned(q, k, v) == aligned
    assert attention_flags(q, k, v, None) == [aligned]


@pytest.mark.parametrize("rope", [False, True], ids=["plain", "rope"])
@pytest.mark.parametrize("layout, head_dim, dtype, aligned", CASES, ids=CASE_IDS)
def test_every_layout_against_float64(layout, head_dim, dtype, aligned, rope):
    q, k, v = layout(head_dim, dtype, seed=head_dim + rope)
    positions = positions_for(rope)
    out = torch.ops.qvl.vision_attn(q, k, v, CU_SEQLENS, positions=positions)
    assert_close_to_float64(out, q, k, v, CU_SEQLENS, positions=positions)


@pytest.mark.parametrize("rope", [False, True], ids=["plain", "rope"])
@pytest.mark.parametrize("layout, head_dim, dtype", ALIGNED_CASES)
def test_aligned_layouts_give_the_plain_path_result(layout, head_dim, dtype, rope, monkeypatch, fresh_attention_plans):
    """The provably aligned strides are the same strides: forcing the plain path changes no bit."""
    q, k, v = layout(head_dim, dtype, seed=head_dim + rope)
    positions = positions_for(rope)
    assert all(attention_flags(q, k, v, positions))
    aligned = torch.ops.qvl.vision_attn(q, k, v, CU_SEQLENS, positions=positions)
    monkeypatch.setattr(attention.config, "strides_16_byte_aligned", lambda *args: False)
    monkeypatch.setattr(rotary, "rows_16_byte_aligned", lambda *tensors: False)
    attention.reload_tile_table()
    assert not any(attention_flags(q, k, v, positions))
    plain = torch.ops.qvl.vision_attn(q, k, v, CU_SEQLENS, positions=positions)
    assert torch.equal(aligned, plain)


def test_bf16_packed_qkv():
    """The tower's own case, bf16 packed qkv with rope, on the aligned path."""
    q, k, v = packed(72, torch.bfloat16, seed=9)
    positions = positions_for(True)
    assert attention_flags(q, k, v, positions) == [True, True]
    out = torch.ops.qvl.vision_attn(q, k, v, CU_SEQLENS, positions=positions)
    assert_close_to_float64(out, q, k, v, CU_SEQLENS, positions=positions)


@pytest.mark.parametrize("layout, head_dim, dtype, aligned", CASES, ids=CASE_IDS)
def test_rotary_in_place_on_every_layout(layout, head_dim, dtype, aligned):
    """The rotary kernel in place on the layout gives, bit for bit, what it gives on contiguous copies."""
    q, k, _ = layout(head_dim, dtype, seed=head_dim)
    positions = positions_for(True)
    launches = rotary.rotary_launches(q, k, q, k, positions, 10000.0, INTERPRETER)
    assert [launch.kwargs["STRIDES_ALIGNED"] for launch in launches] == [rows_16_byte_aligned(q, k)]
    expected_q, expected_k = torch.ops.qvl.rotary_2d(q.contiguous(), k.contiguous(), positions)
    torch.ops.qvl.rotary_2d_(q, k, positions)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)


@pytest.mark.parametrize("target", [HOPPER, ADA], ids=["sm_90", "sm_89"])
def test_each_targets_tiles_compute_the_same_attention(target):
    """fp32 at D 256 gets smaller tiles where a block has less shared memory (launch_config): every target's
    tiles, run through the interpreter, meet the same bound against float64."""
    q, k, v = packed(256, torch.float32, seed=11)
    out = torch.empty(q.shape, dtype=q.dtype)
    launches = attention.vision_attn_launches(q, k, v, out, CU_SEQLENS, None, None, 10000.0, target)
    run_launches(launches, q.device)
    assert_close_to_float64(out, q, k, v, CU_SEQLENS, target=target)
