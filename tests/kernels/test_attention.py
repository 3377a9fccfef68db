"""torch.ops.qvl.vision_attn against float64 references, transformers' attention, and torch.compile.

The Triton kernel runs through Triton's interpreter here (see conftest.py); shapes stay small for it.
"""

import copy
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ON_GPU
from qvl.kernels import attention, force_backend, verify
from qvl.kernels.attention import head_dim_tiles, launch_config
from qvl.kernels.common import HOPPER, device_target
from tolerance import assert_error_within
from towers import cu_seqlens_of


def packed_qkv(num_tokens, num_heads, head_dim, dtype, device="cpu", seed=0):
    """q, k, v as strided views of one packed projection, the way the tower produces them."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, 3, num_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    return qkv.unbind(1)


def assert_close_to_float64(out, q, k, v, cu_seqlens, softmax_scale=None, positions=None, target=None, max_seqlen=None):
    """The checks' rule (qvl.kernels.verify, the tolerance rule per segment): each segment's error against float64
    (torch's own attention, the rotary written from transformers') is at most twice that of torch's own attention
    in the same dtype on that segment (the rotary as transformers computes it first, rounding q and k to the
    dtype), plus two ulps of the dtype and the online softmax's fp32 roundings at the segment's scale, for the key
    blocks of the tiles the kernel ran with (``target``: the one it was launched for, default q's device's;
    ``max_seqlen``: the tile hint it was given)."""
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    target = target or device_target(q.device)
    for comparison in verify.check_attention(out, q, k, v, cu_seqlens, target, max_seqlen, softmax_scale, positions):
        assert comparison.passed, comparison.message()


LENGTHS = [1, 15, 16, 17, 63, 64, 65, 127, 128, 129]


@pytest.mark.parametrize("head_dim", [64, 72, 80, 96, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_boundary_lengths(head_dim, dtype):
    lengths = LENGTHS[head_dim % 5 :: 2] + [0]
    q, k, v = packed_qkv(sum(lengths), 2, head_dim, dtype, seed=head_dim)
    cu = cu_seqlens_of(lengths)
    assert_close_to_float64(torch.ops.qvl.vision_attn(q, k, v, cu), q, k, v, cu)


def test_every_boundary_length_alone():
    for n in LENGTHS:
        q, k, v = packed_qkv(n, 1, 72, torch.float16, seed=n)
        cu = cu_seqlens_of([n])
        assert_close_to_float64(torch.ops.qvl.vision_attn(q, k, v, cu, n), q, k, v, cu)


def test_long_single_image():
    q, k, v = packed_qkv(1030, 1, 64, torch.float16, seed=1)
    cu = cu_seqlens_of([1030])
    assert_close_to_float64(torch.ops.qvl.vision_attn(q, k, v, cu), q, k, v, cu)


def test_sixteen_heads_and_many_tiny_segments():
    lengths = [1, 2, 3, 0, 5, 4, 1, 0, 7, 3, 2, 1, 9, 1, 1, 4]
    q, k, v = packed_qkv(sum(lengths), 16, 80, torch.float32, seed=3)
    cu = cu_seqlens_of(lengths)
    assert_close_to_float64(torch.ops.qvl.vision_attn(q, k, v, cu), q, k, v, cu)


@pytest.mark.parametrize("head_dim", [8, 16, 24, 100, 136, 256])
def test_unusual_head_dims(head_dim):
    lengths = [33, 70]
    q, k, v = packed_qkv(sum(lengths), 1, head_dim, torch.float32, seed=head_dim)
    cu = cu_seqlens_of(lengths)
    assert_close_to_float64(torch.ops.qvl.vision_attn(q, k, v, cu), q, k, v, cu)


HEAD_DIMS = (8, 16, 24, 40, 64, 72, 80, 96, 112, 136, 200, 256)
TILES = {
    "split": [
        (16, 0), (16, 0), (32, 0), (32, 16), (64, 0), (64, 16), (64, 16), (64, 32), (128, 0), (128, 16), (256, 0),
        (256, 0),
    ],
    "split32": [
        (16, 0), (16, 0), (32, 0), (64, 0), (64, 0), (64, 32), (64, 32), (64, 32), (128, 0), (128, 32), (256, 0),
        (256, 0),
    ],
    "padded": [
        (16, 0), (16, 0), (32, 0), (64, 0), (64, 0), (128, 0), (128, 0), (128, 0), (128, 0), (256, 0), (256, 0),
        (256, 0),
    ],
}  # fmt: skip


@pytest.mark.parametrize("layout", attention.HEAD_DIM_LAYOUTS)
def test_head_dim_tiles_of_each_layout(layout):
    """A power of two is one tile in every layout. Otherwise split takes a power-of-two main tile and the narrowest
    tail (of at least 16 columns) flush with the head's end, split32 a tail of at least 32, padded one tile of the
    next power of two."""
    tiles = [tuple(head_dim_tiles(d, layout)) for d in HEAD_DIMS]
    assert tiles == TILES[layout]
    for head_dim, (main, tail) in zip(HEAD_DIMS, tiles):
        # The tail lies inside the head and covers every column the main tile leaves.
        assert main + tail >= head_dim and (tail == 0 or (head_dim - tail >= 0 and main < head_dim))


def test_dot_work_of_the_split_layouts():
    assert head_dim_tiles(72, "split").width / 72 <= 1.15 and head_dim_tiles(80, "split").width == 80
    assert head_dim_tiles(72, "split32").width == head_dim_tiles(80, "split32").width == 96


def test_head_dim_layout_switch(use_head_dim_layout):
    """The process's layout is the default of head_dim_tiles, the launch configuration's tiling and the tile table's
    key (a padded or split32 entry is its own); anything but the three layouts is refused by name."""
    use_head_dim_layout("split")
    assert head_dim_tiles(72) == (64, 16)
    split_key = attention.tile_key(HOPPER, 72, torch.bfloat16, None)
    use_head_dim_layout("padded")
    assert head_dim_tiles(72) == (128, 0)
    config = launch_config(72, torch.bfloat16, HOPPER)
    assert (config["D_MAIN"], config["D_TAIL"]) == (128, 0)
    backward = attention.backward_launch_config(80, torch.bfloat16, HOPPER)
    assert {(c["D_MAIN"], c["D_TAIL"]) for c in backward.values()} == {(128, 0)}
    assert attention.tile_key(HOPPER, 72, torch.bfloat16, None) == split_key + "/padded"
    assert attention.tile_key(HOPPER, 64, torch.bfloat16, None) == "cuda:90/bfloat16/D64/long"  # one layout
    use_head_dim_layout("split32")
    assert launch_config(72, torch.bfloat16, HOPPER)["D_TAIL"] == 32
    assert attention.tile_key(HOPPER, 72, torch.bfloat16, None) == split_key + "/split32"
    with pytest.raises(ValueError, match="layout must be one of 'split', 'split32', 'padded', got 'pad'"):
        attention.set_head_dim_layout("pad")
    assert attention.head_dim_layout() == "split32"
    with attention.head_dim_layout_in("padded"):
        assert head_dim_tiles(72) == (128, 0)
    assert attention.head_dim_layout() == "split32"


@pytest.mark.parametrize("value, layout", [("padded", "padded"), ("split32", "split32"), ("", "split"), ("wide", None)])
def test_head_dim_layout_from_the_environment(value, layout):
    code = "import qvl.kernels.attention as a; print(a.head_dim_layout(), a.head_dim_tiles(72))"
    env = {**os.environ, attention.HEAD_DIM_LAYOUT_VARIABLE: value}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    if layout is None:
        assert result.returncode != 0
        assert "QVL_ATTENTION_HEAD_DIM must be one of 'split', 'split32', 'padded', got 'wide'" in result.stderr
    else:
        assert result.stdout.split()[0] == layout, result.stderr


def test_softmax_scale_and_contiguous_inputs():
    lengths = [50, 20]
    q, k, v = (x.contiguous() for x in packed_qkv(70, 2, 64, torch.float32, seed=5))
    cu = cu_seqlens_of(lengths)
    out = torch.ops.qvl.vision_attn(q, k, v, cu, softmax_scale=0.3)
    assert_close_to_float64(out, q, k, v, cu, softmax_scale=0.3)


def test_empty_batch_and_all_empty_segments():
    q, k, v = packed_qkv(0, 2, 72, torch.float16)
    for cu in (cu_seqlens_of([]), cu_seqlens_of([0, 0, 0])):
        out = torch.ops.qvl.vision_attn(q, k, v, cu)
        assert out.shape == (0, 2, 72)


@settings(max_examples=12, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=0, max_value=150), min_size=1, max_size=6),
    num_heads=st.sampled_from([1, 2, 3]),
    head_dim=st.sampled_from([64, 72, 80]),
    seed=st.integers(0, 2**16),
)
def test_random_layouts(lengths, num_heads, head_dim, seed):
    q, k, v = packed_qkv(sum(lengths), num_heads, head_dim, torch.float16, seed=seed)
    cu = cu_seqlens_of(lengths)
    assert_close_to_float64(torch.ops.qvl.vision_attn(q, k, v, cu), q, k, v, cu)


def test_bf16_with_fp32_accumulating_dots():
    """bf16 attention as a user runs it (no test shim): on CPU the interpreter's dots take the bf16 operands exactly,
    widened to fp32 by the kernel (what tensor cores compute), elementwise bf16 is the interpreter's own."""
    lengths = [130, 17, 64]
    q, k, v = packed_qkv(sum(lengths), 2, 72, torch.bfloat16, seed=7)
    cu = cu_seqlens_of(lengths)
    assert_close_to_float64(torch.ops.qvl.vision_attn(q, k, v, cu), q, k, v, cu)


def test_segments_do_not_leak():
    """Changing one segment's keys and values leaves every other segment's output bit-identical."""
    lengths = [40, 70, 25]
    q, k, v = (x.contiguous() for x in packed_qkv(sum(lengths), 2, 64, torch.float32, seed=11))
    cu = cu_seqlens_of(lengths)
    before = torch.ops.qvl.vision_attn(q, k, v, cu)
    k[40:110] += 5.0
    v[40:110] *= -3.0
    after = torch.ops.qvl.vision_attn(q, k, v, cu)
    assert torch.equal(before[:40], after[:40]) and torch.equal(before[110:], after[110:])
    assert not torch.equal(before[40:110], after[40:110])


def test_torch_path_matches_interpreter():
    lengths = [90, 3, 200]
    q, k, v = packed_qkv(sum(lengths), 2, 72, torch.float32, seed=13)
    cu = cu_seqlens_of(lengths)
    kernel = torch.ops.qvl.vision_attn(q, k, v, cu)
    with force_backend("torch"):
        reference = torch.ops.qvl.vision_attn(q, k, v, cu)
    # Both within rounding of float64, by the same yardstick, hence of each other.
    assert_close_to_float64(kernel, q, k, v, cu)
    assert_close_to_float64(reference, q, k, v, cu)


def test_torch_path_large_image():
    q, k, v = packed_qkv(4096 + 600, 2, 72, torch.float32, seed=17)
    cu = cu_seqlens_of([4096, 600])
    with force_backend("torch"):
        out = torch.ops.qvl.vision_attn(q, k, v, cu)
    truth = verify.attention_truth(q, k, v, cu)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for start, end in ((0, 4096), (4096, 4696)):
        expected = sdpa(*(x[start:end].transpose(0, 1) for x in (q, k, v))).transpose(0, 1)
        assert_error_within(out[start:end], truth[start:end], expected, what=f"tokens {start}:{end} against sdpa")


@pytest.mark.parametrize("head_dim", [64, 72, 80])
def test_fused_rotary_equals_rotary_then_attention(head_dim):
    lengths = [36, 0, 100]
    q, k, v = packed_qkv(sum(lengths), 2, head_dim, torch.float16, seed=head_dim)
    cu = cu_seqlens_of(lengths)
    positions = torch.randint(0, 48, (sum(lengths), 2), dtype=torch.int32)
    fused = torch.ops.qvl.vision_attn(q, k, v, cu, positions=positions)
    q_rot, k_rot = torch.ops.qvl.rotary_2d(q, k, positions)
    separate = torch.ops.qvl.vision_attn(q_rot, k_rot, v, cu)
    # Not bit-equal: the separate path rounds the rotated q and k to fp16. Both are held to one yardstick.
    assert_close_to_float64(fused, q, k, v, cu, positions=positions)
    assert_close_to_float64(separate, q, k, v, cu, positions=positions)


def test_matches_transformers_vision_attention():
    """qkv projection -> fused rotary + vision_attn -> proj equals Qwen3VLVisionAttention (sdpa)."""
    from transformers import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import (
        Qwen3VLVisionAttention,
        Qwen3VLVisionRotaryEmbedding,
    )
    from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids

    config = Qwen3VLVisionConfig(hidden_size=144, num_heads=2, depth=1)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    attn = Qwen3VLVisionAttention(config).eval()
    rotary = Qwen3VLVisionRotaryEmbedding(config)
    grid_thw = torch.tensor([[1, 6, 10], [2, 4, 4]])
    cu = get_vision_cu_seqlens(grid_thw)
    positions = get_vision_position_ids(grid_thw, 2)
    hidden = torch.randn(int(cu[-1]), 144)
    with torch.no_grad():
        expected = attn(hidden, cu, position_embeddings=rotary(hidden, positions))
        q, k, v = attn.qkv(hidden).view(-1, 3, 2, 72).unbind(1)
        out = torch.ops.qvl.vision_attn(q, k, v, cu, positions=positions.to(torch.int32))
        got = attn.proj(out.flatten(1))
        # float64 truth: the module's projections in float64 around the float64 reference attention
        # (transformers' rotary computes in fp32 whatever the dtype, so the module alone cannot give it).
        attn64 = copy.deepcopy(attn).double()
        q64, k64, v64 = attn64.qkv(hidden.double()).view(-1, 3, 2, 72).unbind(1)
        truth = attn64.proj(verify.attention_truth(q64, k64, v64, cu, positions=positions).flatten(1))
    assert_error_within(got, truth, expected, what="Qwen3VLVisionAttention")


def test_opcheck():
    lengths = [20, 0, 45]
    q, k, v = packed_qkv(sum(lengths), 2, 72, torch.float32)
    cu = cu_seqlens_of(lengths)
    positions = torch.randint(0, 9, (sum(lengths), 2), dtype=torch.int32)
    torch.library.opcheck(torch.ops.qvl.vision_attn.default, (q, k, v, cu))
    torch.library.opcheck(torch.ops.qvl.vision_attn.default, (q, k, v, cu, 45, 0.25, positions, 100.0))


def test_compile_fullgraph_without_recompiles():
    def attend(qkv, cu_seqlens, positions):
        q, k, v = qkv.unbind(1)
        return torch.ops.qvl.vision_attn(q, k, v, cu_seqlens, positions=positions).flatten(1) * 2.0

    compiled = torch.compile(attend, fullgraph=True, dynamic=True)

    def check(lengths, seed):
        q, k, v = packed_qkv(sum(lengths), 2, 72, torch.float32, seed=seed)
        qkv = torch.stack([q, k, v], dim=1)
        cu = cu_seqlens_of(lengths)
        positions = torch.randint(0, 20, (sum(lengths), 2), dtype=torch.int32)
        out = compiled(qkv, cu, positions)
        assert_close_to_float64(out.view(q.shape) / 2.0, q, k, v, cu, positions=positions)  # halving is exact

    check([30, 40, 50], seed=1)
    with torch.compiler.set_stance("fail_on_recompile"):
        check([7, 90, 0, 33, 1], seed=2)
        check([129], seed=3)
        check([2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2], seed=4)


@pytest.mark.parametrize(
    "mutate, error, words",
    [
        (lambda a: {**a, "q": a["q"][0]}, ValueError, "q must be 3-D"),
        (lambda a: {**a, "k": a["k"][:-1]}, ValueError, "k must have q's shape"),
        (lambda a: {**a, "v": a["v"].double()}, TypeError, "v must be one of"),
        (lambda a: {**a, "v": a["v"].half()}, TypeError, "v must have q's dtype"),
        (lambda a: {**a, "q": a["q"].transpose(1, 2)}, ValueError, "q must have a contiguous last dimension"),
        (lambda a: {**a, "cu_seqlens": a["cu_seqlens"].long()}, TypeError, "cu_seqlens must be one of"),
        (lambda a: {**a, "cu_seqlens": a["cu_seqlens"][None]}, ValueError, "cu_seqlens must be 1-D"),
        (
            lambda a: {**a, "cu_seqlens": torch.tensor([[0, 9], [4, 9], [10, 9]], dtype=torch.int32)[:, 0]},
            ValueError,
            "cu_seqlens must be contiguous, got stride 2",
        ),
        (lambda a: {**a, "cu_seqlens": cu_seqlens_of([5, 4])}, ValueError, "cu_seqlens must end at"),
        (lambda a: {**a, "cu_seqlens": torch.tensor([0, 8, 4, 10], dtype=torch.int32)}, ValueError, "non-decreasing"),
        (lambda a: {**a, "cu_seqlens": torch.tensor([1, 10], dtype=torch.int32)}, ValueError, "start at 0"),
        (lambda a: {**a, "softmax_scale": 0.0}, ValueError, "softmax_scale"),
        (lambda a: {**a, "softmax_scale": -1.0}, ValueError, "softmax_scale"),
        (lambda a: {**a, "max_seqlen": -3}, ValueError, "max_seqlen"),
        (lambda a: {**a, "positions": torch.zeros(10, 3, dtype=torch.int32)}, ValueError, "positions must have shape"),
        (lambda a: {**a, "positions": torch.zeros(10, 2)}, TypeError, "positions must be one of"),
        (lambda a: {**a, "positions": torch.full((10, 2), -1, dtype=torch.int32)}, ValueError, "non-negative"),
        (
            lambda a: {**a, "positions": torch.zeros(10, 2, dtype=torch.int32), "rope_theta": 0.5},
            ValueError,
            "rope_theta",
        ),
    ],
)
def test_bad_input(mutate, error, words):
    q, k, v = packed_qkv(10, 2, 72, torch.float32)
    args = dict(q=q, k=k, v=v, cu_seqlens=cu_seqlens_of([4, 6]))
    with pytest.raises(error, match=words):
        torch.ops.qvl.vision_attn(**mutate(args))


def test_value_checks_stand_aside_while_a_cuda_graph_is_captured(monkeypatch):
    """Opt-in value checks read CUDA tensors on the host, a sync a capture forbids: none runs during one."""
    from qvl.kernels import common

    cuda = torch.device("cuda")
    monkeypatch.setattr(common, "_value_checks", True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert common.value_checks_enabled(cuda)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not common.value_checks_enabled(cuda) and common.value_checks_enabled(torch.device("cpu"))


@pytest.mark.parametrize("head_dim, error", [(0, ValueError), (257, ValueError)])
def test_bad_head_dim(head_dim, error):
    q = torch.zeros(4, 1, head_dim)
    with pytest.raises(error, match="head dim"):
        torch.ops.qvl.vision_attn(q, q, q, cu_seqlens_of([4]))


def test_rotary_needs_head_dim_divisible_by_four():
    q, k, v = packed_qkv(4, 1, 70, torch.float32)
    with pytest.raises(ValueError, match="divisible by 4"):
        torch.ops.qvl.vision_attn(q, k, v, cu_seqlens_of([4]), positions=torch.zeros(4, 2, dtype=torch.int32))


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (the interpreter cannot hold 2**31-element tensors here)")
def test_int64_offsets_past_2_pow_31():
    """A packed qkv whose token stride times token count passes 2**31 elements."""
    num_tokens, head_dim, num_heads = 700_000, 72, 16
    qkv = torch.randn(num_tokens, 3, num_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(1)
    assert num_tokens * q.stride(0) > 2**31
    cu = torch.tensor([0, num_tokens - 300, num_tokens], dtype=torch.int32, device="cuda")
    out = torch.ops.qvl.vision_attn(q, k, v, cu)
    tail = slice(num_tokens - 300, num_tokens)
    assert_close_to_float64(out[tail], q[tail], k[tail], v[tail], cu_seqlens_of([300], "cuda"))


GPU_CASES = [pytest.param(case, id=case.name) for case in verify.ATTENTION_CASES]


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("rope", [False, True], ids=["plain", "rope"])
@pytest.mark.parametrize("head_dim", [64, 72, 80])
@pytest.mark.parametrize("attention_case", GPU_CASES)
def test_bf16_on_gpu(attention_case, head_dim, rope):
    """The layouts that computed wrong results on a GPU before (qvl.kernels.verify.ATTENTION_CASES: a lone 33-token
    segment, segments ending inside key blocks, windows with the hint 64), at 16 heads, with and without rope."""
    lengths, hint = attention_case.lengths, attention_case.max_seqlen
    q, k, v = packed_qkv(sum(lengths), 16, head_dim, torch.bfloat16, device="cuda", seed=head_dim)
    cu = cu_seqlens_of(lengths, "cuda")
    positions = torch.randint(0, 40, (sum(lengths), 2), dtype=torch.int32, device="cuda") if rope else None
    out = torch.ops.qvl.vision_attn(q, k, v, cu, hint, positions=positions)
    assert_close_to_float64(out, q, k, v, cu, positions=positions, max_seqlen=hint)


def test_wide_offset_variant(monkeypatch, fresh_attention_plans):
    """The 64-bit in-batch offsets taken when T * stride can pass 2**31 compute the same result."""
    from qvl.kernels.attention import config

    assert config.needs_wide_offsets(700_000, torch.empty(0, 3 * 16 * 72).view(0, 3, 16, 72)[:, 0])
    assert not config.needs_wide_offsets(100_000, torch.empty(0, 3 * 16 * 72).view(0, 3, 16, 72)[:, 0])
    lengths = [70, 0, 33]
    q, k, v = packed_qkv(sum(lengths), 2, 72, torch.float16, seed=21)
    cu = cu_seqlens_of(lengths)
    positions = torch.randint(0, 30, (sum(lengths), 2), dtype=torch.int32)
    narrow = torch.ops.qvl.vision_attn(q, k, v, cu, positions=positions)
    monkeypatch.setattr(config, "wide_token_offsets", lambda *args: True)
    config.reload_tile_table()
    plan = config.attention_plan
    flags = []

    def recording(*args, **kwargs):
        made = plan(*args, **kwargs)
        flags.append(made.kwargs["WIDE_OFFSETS"])
        return made

    monkeypatch.setattr(attention.forward, "attention_plan", recording)
    wide = torch.ops.qvl.vision_attn(q, k, v, cu, positions=positions)
    assert flags == [True]  # the launch took the 64-bit offsets
    assert torch.equal(narrow, wide)
