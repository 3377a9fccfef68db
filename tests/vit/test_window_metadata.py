"""qvl.vit.metadata.build_window_metadata against transformers' window index of Qwen2.5-VL's vision tower."""

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_metadata import python_lines_run
from transformers.vision_utils import get_vision_window_index

from qvl.vit.metadata import WindowMetadata, build_window_metadata

# (t, h, w) patch grids; at patch 14, merge 2 and 112-pixel windows a window is 4 x 4 merge units.
GRIDS = [
    [(1, 2, 2)],  # one unit: a window of 4 tokens
    [(1, 8, 8)],  # one whole window
    [(1, 16, 16)],  # sides multiples of the window: transformers pads a whole empty window row and column
    [(1, 32, 32)],  # 448 x 448 px
    [(1, 74, 54)],  # 1036 x 756 px: edge windows of 3 x 4, 1 x 4 and 1 x 3 units
    [(1, 54, 74)],
    [(1, 6, 10)],
    [(3, 18, 34)],  # video
    [(4, 46, 62), (1, 2, 100)],
    [(1, 2, 2), (2, 16, 16), (1, 74, 54), (3, 6, 10), (1, 2, 2), (2, 16, 16)],  # mixed, repeated shapes
]


def assert_matches_transformers(meta: WindowMetadata, grid, merge=2, window_size=112, patch_size=14) -> None:
    grid_t = torch.as_tensor(np.asarray(grid, dtype=np.int64).reshape(-1, 3))
    window_index, cu_window_seqlens = get_vision_window_index(grid_t, merge, window_size, patch_size)
    assert meta.window_index.dtype == torch.int64 and torch.equal(meta.window_index, window_index)
    assert meta.cu_window_seqlens.dtype == torch.int32 and torch.equal(meta.cu_window_seqlens, cu_window_seqlens)
    assert meta.reverse_index.dtype == torch.int64 and torch.equal(meta.reverse_index, torch.argsort(window_index))
    lengths = cu_window_seqlens.diff()
    assert meta.max_window_seqlen == (int(lengths.max()) if lengths.numel() else 0)
    assert meta.num_windows == lengths.numel() and meta.window_size == window_size
    for tensor in (meta.window_index, meta.reverse_index, meta.cu_window_seqlens):
        assert tensor.is_contiguous()


@pytest.mark.parametrize("grid", GRIDS, ids=str)
def test_matches_transformers(grid):
    assert_matches_transformers(build_window_metadata(grid), grid)


@pytest.mark.parametrize(
    "merge, window_size, patch_size",
    [(2, 224, 14), (2, 56, 14), (2, 28, 14), (1, 112, 14), (2, 128, 16), (2, 120, 14), (3, 100, 10)],
)
def test_other_window_patch_and_merge_sizes(merge, window_size, patch_size):
    grid = [(1, merge, merge), (2, 6 * merge, 10 * merge), (1, 37 * merge, 27 * merge), (1, 16 * merge, 8 * merge)]
    meta = build_window_metadata(grid, merge, window_size, patch_size)
    assert_matches_transformers(meta, grid, merge, window_size, patch_size)


@settings(max_examples=30, deadline=None)
@given(
    blocks=st.lists(st.tuples(st.integers(1, 3), st.integers(1, 30), st.integers(1, 30)), min_size=1, max_size=6),
    merge=st.sampled_from([1, 2]),
    window_units=st.integers(1, 6),
)
def test_random_grids_match_transformers(blocks, merge, window_units):
    grid = [(t, hb * merge, wb * merge) for t, hb, wb in blocks]
    window_size = window_units * merge * 14
    meta = build_window_metadata(grid, merge, window_size, 14)
    assert_matches_transformers(meta, grid, merge, window_size, 14)


@pytest.mark.parametrize("empty", [[], np.zeros((0, 3), dtype=np.int64), torch.empty(0, 3, dtype=torch.int64)])
def test_empty_batch(empty):
    meta = build_window_metadata(empty)
    assert meta.cu_window_seqlens.tolist() == [0] and meta.cu_window_seqlens.dtype == torch.int32
    assert meta.window_index.shape == meta.reverse_index.shape == (0,)
    assert meta.max_window_seqlen == 0 and meta.num_windows == 0


def test_window_lengths_of_a_1036_by_756_image():
    """37 x 27 merge units in 4 x 4 windows: 9 x 6 whole ones, then the edges (in tokens, 4 a unit)."""
    meta = build_window_metadata([(1, 74, 54)])
    lengths = meta.cu_window_seqlens.diff().reshape(10, 7)
    assert (lengths[:9, :6] == 64).all() and (lengths[:9, 6] == 48).all()
    assert (lengths[9, :6] == 16).all() and lengths[9, 6] == 12
    assert meta.max_window_seqlen == 64


def test_reverse_index_undoes_the_window_order():
    meta = build_window_metadata([(2, 16, 12), (1, 74, 54)])
    units = torch.arange(meta.window_index.numel())
    assert torch.equal(meta.window_index[meta.reverse_index], units)
    assert torch.equal(meta.reverse_index[meta.window_index], units)


def test_many_frames_vectorised_and_correct():
    """No Python runs per entry, frame, window or token: a batch with 100 times the entries and tokens executes
    fewer extra lines of Python than it has extra entries (counted, not timed; see test_metadata.py)."""
    grid = [(1, 16, 16)] * 2000 + [(500, 8, 8), (1, 74, 54)]
    small = [(1, 16, 16)] * 20 + [(5, 8, 8), (1, 74, 54)]
    build_window_metadata(small)  # one-off imports and caches
    _, small_lines = python_lines_run(lambda: build_window_metadata(small))
    meta, lines = python_lines_run(lambda: build_window_metadata(grid))
    assert lines - small_lines < len(grid) - len(small), (lines, small_lines)
    assert_matches_transformers(meta, grid)


def test_tiny_transformers_tower_gives_the_same_output_with_qvl_window_metadata():
    """transformers' Qwen2.5-VL tower (tiny config, random weights) takes precomputed ``window_index``,
    ``cu_window_seqlens`` and ``max_window_seqlen``: with qvl's its output is bit-identical to its own."""
    from transformers import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    config = Qwen2_5_VLVisionConfig(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=24, patch_size=2,
        temporal_patch_size=1, in_channels=1, window_size=16, fullatt_block_indexes=[1],
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    tower = Qwen2_5_VisionTransformerPretrainedModel(config).eval()
    grid = [(1, 10, 14), (2, 8, 8), (1, 2, 6)]  # edge windows, whole windows in a video, one small window
    meta = build_window_metadata(grid, config.spatial_merge_size, config.window_size, config.patch_size)
    grid_t = torch.tensor(grid)
    pixels = torch.randn(int(grid_t.prod(1).sum()), 1 * 1 * 2 * 2)
    with torch.no_grad():
        expected = tower(pixels, grid_t)
        got = tower(
            pixels, grid_t, window_index=meta.window_index, cu_window_seqlens=meta.cu_window_seqlens,
            max_window_seqlen=meta.max_window_seqlen,
        )  # fmt: skip
    assert torch.equal(got.last_hidden_state, expected.last_hidden_state)
    assert torch.equal(got.pooler_output, expected.pooler_output)
    # qvl's reverse index puts the window-ordered merger output back, as transformers' argsort does.
    merged = tower.merger(expected.last_hidden_state)
    assert torch.equal(merged[meta.reverse_index], expected.pooler_output)


def test_to_and_frozen():
    meta = build_window_metadata([(2, 8, 8)])
    moved = meta.to("cpu")
    for name in ("window_index", "reverse_index", "cu_window_seqlens"):
        assert torch.equal(getattr(moved, name), getattr(meta, name))
    assert moved.max_window_seqlen == meta.max_window_seqlen
    with pytest.raises(dataclasses.FrozenInstanceError):
        meta.max_window_seqlen = 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_device():
    grid = [(2, 8, 8), (1, 74, 54)]
    meta = build_window_metadata(grid, device="cuda")
    for tensor in (meta.window_index, meta.reverse_index, meta.cu_window_seqlens):
        assert tensor.device.type == "cuda"
    assert_matches_transformers(meta.to("cpu"), grid)


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        (dict(window_size=27), ValueError, r"window_size 27 must be at least spatial_merge_size \* patch_size = 28"),
        (dict(window_size=0), ValueError, "window_size must be >= 1"),
        (dict(patch_size=14.0), TypeError, "patch_size must be an int"),
        (dict(spatial_merge_size=0), ValueError, "spatial_merge_size must be >= 1"),
        (dict(grid_thw=[(1, 3, 4)]), ValueError, "divisible by spatial_merge_size 2"),
        (dict(grid_thw=torch.ones(1, 3, dtype=torch.int64, device="meta")), ValueError, "must be a CPU tensor"),
    ],
)
def test_bad_arguments(kwargs, error, pattern):
    with pytest.raises(error, match=f"^build_window_metadata: .*{pattern}"):
        build_window_metadata(**{"grid_thw": [(1, 2, 2)], **kwargs})
