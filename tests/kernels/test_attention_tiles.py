"""vision_attn's ``max_seqlen`` tile hint: the short-segment tiles of window attention (launch_config), the matmul
work they execute on Qwen2.5-VL's window layouts (launch_work), and their results through Triton's interpreter
against float64 with the suite's tolerance rule (tests/tolerance.py)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_attention import assert_close_to_float64, cu_seqlens_of, packed_qkv

from qvl.kernels.attention import SHORT_SEGMENT_MAX, head_dim_tiles, launch_config, launch_work, vision_attn_launches
from qvl.kernels.common import ADA, HOPPER, INTERPRETER
from qvl.vit.metadata import build_metadata, build_window_metadata

LONG_TILES = (128, 64, 8, 3)
SHORT_TILES = (64, 64, 4, 2)


# The hint's tiles are the heuristic's (a device's table entries for sm_90 would replace them).
pytestmark = pytest.mark.usefixtures("empty_tile_table")


def tiles(config):
    return config["BLOCK_M"], config["BLOCK_N"], config["num_warps"], config["num_stages"]


@pytest.mark.parametrize("target", [HOPPER, ADA, INTERPRETER], ids=["sm_90", "sm_89", "interpreter"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 72, 80, 96, 128])
def test_short_hint_picks_64_row_tiles_in_16_bit(head_dim, dtype, target):
    for hint in (None, SHORT_SEGMENT_MAX + 1, 129, 10**6):
        assert tiles(launch_config(head_dim, dtype, target, hint)) == LONG_TILES, hint
    for hint in (0, 1, 32, SHORT_SEGMENT_MAX):
        assert tiles(launch_config(head_dim, dtype, target, hint)) == SHORT_TILES, hint
    # The hint changes the tiles only: head-dim tiling, precision and compile options stay.
    ignore = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
    short, long = launch_config(head_dim, dtype, target, 64), launch_config(head_dim, dtype, target)
    assert {k: v for k, v in short.items() if k not in ignore} == {k: v for k, v in long.items() if k not in ignore}


@pytest.mark.parametrize("target", [HOPPER, ADA, INTERPRETER], ids=["sm_90", "sm_89", "interpreter"])
@pytest.mark.parametrize("dtype, head_dim", [(torch.float32, 80), (torch.float32, 256), (torch.bfloat16, 256)])
def test_hint_leaves_tiles_that_are_64_rows_or_fewer_already(dtype, head_dim, target):
    assert launch_config(head_dim, dtype, target)["BLOCK_M"] <= 64
    assert launch_config(head_dim, dtype, target, 64) == launch_config(head_dim, dtype, target)


def test_launch_takes_the_hinted_tiles_and_the_same_grid_formula():
    lengths = [64, 48, 0, 16, 64, 1]
    q, k, v = packed_qkv(sum(lengths), 3, 80, torch.float16)
    cu = cu_seqlens_of(lengths)
    out = torch.empty(q.shape, dtype=q.dtype)
    for hint, block_m in ((None, 128), (64, 64)):
        (launch,) = vision_attn_launches(q, k, v, out, cu, None, None, 10000.0, HOPPER, hint)
        assert launch.kwargs["BLOCK_M"] == block_m
        assert launch.grid == (sum(lengths) // block_m + len(lengths), 3)


def test_launch_work_counts_tiles_keys_and_padded_columns(use_head_dim_layout):
    use_head_dim_layout("split")
    config = launch_config(72, torch.float16, HOPPER, 64)  # 64 x 64 tiles, D 72 as 64 + 16 columns
    work = launch_work(np.array([0, 64, 64, 65, 165]), config)
    # 64 tokens: one 64 x 64 tile; 0: none; 1: one 64-row tile over 64 keys; 100: two over 128 keys.
    assert work.executed == (64 * 64 + 64 * 64 + 2 * 64 * 128) * 80 * 4
    assert work.useful == (64**2 + 1 + 100**2) * 72 * 4
    assert work.programs == 165 // 64 + 4 and work.busy_programs == 4
    assert launch_work(np.array([0]), config) == (0, 0, 0, 0) and launch_work(np.array([0]), config).ratio == 1.0


# Qwen2.5-VL: patch 14, merge 2, 112-pixel windows of 8 x 8 patches (64 tokens), head dim 80, bf16. Images are
# (height x width) pixels; windows on the bottom and right edges are smaller where the grid is not a multiple.
WINDOW_LAYOUTS = {
    "448x448": [(1, 32, 32)],  # 16 whole windows
    "1036x756": [(1, 74, 54)],  # 37 x 27 merge units: edge windows of 48, 16 and 12 tokens
    "756x1036": [(1, 54, 74)],
    "video 644x868, 4 frames": [(4, 46, 62)],
    "mixed batch": [(1, 32, 32), (1, 74, 54), (2, 46, 62), (1, 12, 20), (1, 98, 140)],
}


@pytest.mark.parametrize("grid", WINDOW_LAYOUTS.values(), ids=WINDOW_LAYOUTS.keys())
def test_window_layouts_execute_at_most_1_3_times_the_useful_work_with_the_hint(grid):
    windows = build_window_metadata(grid)
    cu = windows.cu_window_seqlens.numpy()
    assert windows.max_window_seqlen == 64
    hinted = launch_work(cu, launch_config(80, torch.bfloat16, HOPPER, windows.max_window_seqlen))
    plain = launch_work(cu, launch_config(80, torch.bfloat16, HOPPER))
    # Rows and keys padded to tiles, over the head-dim tiles' columns (64 + 16 = 80: none extra) in both.
    columns = head_dim_tiles(80, target=HOPPER).width / 80
    assert hinted.ratio <= 1.3 * columns, hinted
    assert 1.9 * columns <= plain.ratio <= 2.5 * columns, plain  # 2 on whole windows; edge windows pad more
    assert hinted.busy_programs == plain.busy_programs == windows.num_windows  # one tile per window either way


def test_whole_windows_pad_only_the_head_dim_columns():
    cu = build_window_metadata([(1, 32, 32)]).cu_window_seqlens.numpy()
    columns = head_dim_tiles(80, target=HOPPER).width / 80
    assert launch_work(cu, launch_config(80, torch.bfloat16, HOPPER, 64)).ratio == columns
    assert launch_work(cu, launch_config(80, torch.bfloat16, HOPPER)).ratio == 2.0 * columns


# Window-like layouts through the interpreter: whole and edge windows, zero-length and 1-token segments.
WINDOW_LENGTHS = [64, 48, 0, 16, 1, 64, 12, 33, 0]


@pytest.mark.parametrize("head_dim", [80, 72])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_window_lengths_with_the_hint(head_dim, dtype):
    q, k, v = packed_qkv(sum(WINDOW_LENGTHS), 2, head_dim, dtype, seed=head_dim)
    cu = cu_seqlens_of(WINDOW_LENGTHS)
    out = torch.ops.qvl.vision_attn(q, k, v, cu, 64)
    assert_close_to_float64(out, q, k, v, cu, max_seqlen=64)


@settings(max_examples=8, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=0, max_value=64), min_size=1, max_size=7),
    head_dim=st.sampled_from([72, 80]),
    dtype=st.sampled_from([torch.float16, torch.float32]),
    seed=st.integers(0, 2**16),
)
def test_random_window_layouts_with_the_hint(lengths, head_dim, dtype, seed):
    hint = max(lengths)
    q, k, v = packed_qkv(sum(lengths), 2, head_dim, dtype, seed=seed)
    cu = cu_seqlens_of(lengths)
    assert_close_to_float64(torch.ops.qvl.vision_attn(q, k, v, cu, hint), q, k, v, cu, max_seqlen=hint)


def test_hint_smaller_than_a_segment_is_still_correct():
    """The hint is never checked against cu_seqlens: segments longer than it run on more 64-row tiles."""
    lengths = [150, 64, 1, 0, 65]
    q, k, v = packed_qkv(sum(lengths), 2, 80, torch.float16, seed=2)
    cu = cu_seqlens_of(lengths)
    for hint in (0, 16, 64):
        assert_close_to_float64(torch.ops.qvl.vision_attn(q, k, v, cu, hint), q, k, v, cu, max_seqlen=hint)


def test_windowed_qwen25_layout_with_rope():
    """A 1036x756-like layout scaled down (10 x 14 merge units, windows of 4 x 4 units), q, k, v and positions
    permuted into window order with the window metadata, fused rotary; hinted and unhinted tiles."""
    grid = [(1, 20, 28)]
    windows = build_window_metadata(grid)
    num_tokens = 20 * 28
    order = (windows.window_index[:, None] * 4 + torch.arange(4)).reshape(-1)  # merge units -> tokens
    q, k, v = (x[order] for x in packed_qkv(num_tokens, 1, 80, torch.float16, seed=5))
    positions = build_metadata(grid).positions[order]
    cu = windows.cu_window_seqlens
    assert windows.max_window_seqlen == 64 and cu.numel() - 1 == 3 * 4
    for hint in (windows.max_window_seqlen, None):
        out = torch.ops.qvl.vision_attn(q, k, v, cu, hint, positions=positions)
        assert_close_to_float64(out, q, k, v, cu, positions=positions, max_seqlen=hint)


def test_bf16_window_tiles():
    lengths = [64, 16, 48, 1]
    q, k, v = packed_qkv(sum(lengths), 2, 80, torch.bfloat16, seed=9)
    cu = cu_seqlens_of(lengths)
    assert_close_to_float64(torch.ops.qvl.vision_attn(q, k, v, cu, 64), q, k, v, cu, max_seqlen=64)


def test_opcheck_and_fullgraph_compile_with_the_hint():
    lengths = [64, 0, 17]
    q, k, v = packed_qkv(sum(lengths), 2, 80, torch.float32)
    cu = cu_seqlens_of(lengths)
    torch.library.opcheck(torch.ops.qvl.vision_attn.default, (q, k, v, cu, 64))

    compiled = torch.compile(lambda q, k, v, cu: torch.ops.qvl.vision_attn(q, k, v, cu, 64) * 2.0, fullgraph=True)
    assert_close_to_float64(compiled(q, k, v, cu) / 2.0, q, k, v, cu, max_seqlen=64)
