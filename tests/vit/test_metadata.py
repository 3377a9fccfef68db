"""qvl.vit.metadata.build_metadata against transformers' own vision_utils functions."""

import dataclasses
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounter
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
from transformers.vision_utils import (
    get_vision_cu_seqlens,
    get_vision_interpolation_indices_and_weights,
    get_vision_position_ids,
)

from qvl.vit.families import config_from_hf
from qvl.vit.metadata import VisionMetadata, build_metadata
from qvl.vit.runner import build_tower_metadata

GRIDS = [
    [(1, 2, 2)],
    [(1, 6, 10)],
    [(1, 50, 34)],
    [(2, 8, 8)],
    [(4, 16, 12)],
    [(1, 48, 48)],
    [(1, 96, 64)],
    [(3, 2, 100)],
    # mixed batch; repeated shapes share one frame plan inside build_metadata
    [(1, 2, 2), (2, 8, 8), (1, 50, 34), (4, 16, 12), (1, 6, 10), (2, 8, 8), (1, 2, 2)],
]


def assert_matches_transformers(meta: VisionMetadata, grid, merge: int = 2, side: int = 48) -> None:
    grid_t = torch.as_tensor(np.asarray(grid, dtype=np.int64).reshape(-1, 3))
    cu_seqlens = get_vision_cu_seqlens(grid_t)
    positions = get_vision_position_ids(grid_t, merge)
    indices, weights = get_vision_interpolation_indices_and_weights(
        grid_t, num_grid_per_side=side, mode="bilinear", align_corners=True, spatial_merge_size=merge
    )
    assert meta.cu_seqlens.dtype == torch.int32 and torch.equal(meta.cu_seqlens, cu_seqlens)
    assert meta.positions.dtype == torch.int32 and torch.equal(meta.positions.long(), positions)
    assert meta.interp_indices.dtype == torch.int32 and torch.equal(meta.interp_indices.long(), indices)
    assert meta.interp_weights.dtype == torch.float32
    # bit-identical, not merely close
    assert torch.equal(meta.interp_weights.view(torch.int32), weights.view(torch.int32))

    hw = grid_t[:, 1] * grid_t[:, 2]
    counts = grid_t[:, 0] * hw
    assert meta.max_seqlen == int(hw.max())
    assert meta.num_tokens == int(counts.sum())
    assert meta.num_segments == int(grid_t[:, 0].sum())
    assert meta.token_counts == tuple(counts.tolist())
    assert meta.merged_token_counts == tuple((counts // merge**2).tolist())
    assert meta.num_merged_tokens == meta.num_tokens // merge**2
    assert meta.grid_thw.dtype == torch.int64 and meta.grid_thw.device.type == "cpu"
    assert torch.equal(meta.grid_thw, grid_t)
    for tensor in (meta.cu_seqlens, meta.positions, meta.interp_indices, meta.interp_weights):
        assert tensor.is_contiguous()


@pytest.mark.parametrize("grid", GRIDS, ids=str)
def test_matches_transformers(grid):
    assert_matches_transformers(build_metadata(grid), grid)


@pytest.mark.parametrize("merge, side", [(1, 48), (1, 7), (2, 1), (2, 5), (3, 48), (4, 16)])
def test_other_merge_sizes_and_tables(merge, side):
    grid = [(1, merge, merge), (2, 3 * merge, 5 * merge), (1, 20 * merge, 7 * merge)]
    meta = build_metadata(grid, spatial_merge_size=merge, num_grid_per_side=side)
    assert_matches_transformers(meta, grid, merge, side)
    assert int(meta.interp_indices.max()) < side * side


@pytest.mark.parametrize(
    "make",
    [
        lambda g: g,
        lambda g: tuple(tuple(row) for row in g),
        lambda g: np.asarray(g, dtype=np.int32),
        lambda g: np.asarray(g, dtype=np.uint16),
        lambda g: torch.tensor(g, dtype=torch.int32),
        lambda g: torch.tensor(g, dtype=torch.int64),
    ],
    ids=["list", "tuple", "np-int32", "np-uint16", "torch-int32", "torch-int64"],
)
def test_input_forms(make):
    grid = [(2, 8, 8), (1, 6, 10)]
    assert_matches_transformers(build_metadata(make(grid)), grid)


def test_grid_is_copied():
    source = torch.tensor([[1, 4, 4]])
    meta = build_metadata(source)
    source[0, 1] = 8
    assert meta.grid_thw.tolist() == [[1, 4, 4]]


@pytest.mark.parametrize(
    "empty",
    [[], np.zeros((0, 3), dtype=np.int64), torch.empty(0, 3, dtype=torch.int64)],
    ids=["list", "numpy", "tensor"],
)
def test_empty_batch(empty):
    meta = build_metadata(empty)
    assert meta.cu_seqlens.tolist() == [0] and meta.cu_seqlens.dtype == torch.int32
    assert meta.max_seqlen == 0 and meta.num_tokens == 0 and meta.num_segments == 0
    assert meta.positions.shape == (0, 2) and meta.positions.dtype == torch.int32
    assert meta.interp_indices.shape == (0, 4) and meta.interp_indices.dtype == torch.int32
    assert meta.interp_weights.shape == (0, 4) and meta.interp_weights.dtype == torch.float32
    assert meta.grid_thw.shape == (0, 3)
    assert meta.token_counts == () and meta.merged_token_counts == () and meta.num_merged_tokens == 0


@settings(max_examples=25, deadline=None)
@given(
    blocks=st.lists(st.tuples(st.integers(1, 3), st.integers(1, 30), st.integers(1, 30)), min_size=1, max_size=6),
    merge=st.sampled_from([1, 2]),
    side=st.sampled_from([2, 5, 48]),
)
def test_random_grids_match_transformers(blocks, merge, side):
    grid = [(t, hb * merge, wb * merge) for t, hb, wb in blocks]
    meta = build_metadata(grid, spatial_merge_size=merge, num_grid_per_side=side)
    assert_matches_transformers(meta, grid, merge, side)


def python_lines_run(call):
    """``(call(), the number of lines of Python it executed)``, counting every Python function it reaches;
    numpy's and torch's compiled code runs none."""
    lines = 0

    def trace(frame, event, arg):
        nonlocal lines
        lines += event == "line"
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        result = call()
    finally:
        sys.settrace(previous)
    return result, lines


def test_many_frames_vectorised_and_correct():
    """No Python runs per entry or per token: a batch with 100 times the entries and tokens executes fewer
    extra lines of Python than it has extra entries (a loop body runs at least one line per iteration).
    Counted rather than timed, so that a slow or loaded machine cannot fail it."""
    grid = [(1, 16, 16)] * 2000 + [(500, 8, 8), (1, 50, 34)]
    small = [(1, 16, 16)] * 20 + [(5, 8, 8), (1, 50, 34)]
    build_metadata(small)  # one-off imports and caches
    _, small_lines = python_lines_run(lambda: build_metadata(small))
    meta, lines = python_lines_run(lambda: build_metadata(grid))
    assert lines - small_lines < len(grid) - len(small), (lines, small_lines)
    assert_matches_transformers(meta, grid)


def test_merged_counts_split_outputs():
    grid = [(2, 8, 8), (1, 6, 10), (1, 2, 2)]
    meta = build_metadata(grid)
    merged = torch.arange(meta.num_merged_tokens)
    parts = torch.split(merged, list(meta.merged_token_counts))
    assert [p.numel() for p in parts] == [32, 15, 1]


def test_to_and_frozen():
    meta = build_metadata([(2, 8, 8)])
    moved = meta.to("cpu")
    assert moved.device == torch.device("cpu") == meta.device
    for name in ("cu_seqlens", "positions", "interp_indices", "interp_weights"):
        assert torch.equal(getattr(moved, name), getattr(meta, name))
    assert moved.max_seqlen == meta.max_seqlen and moved.token_counts == meta.token_counts
    with pytest.raises(dataclasses.FrozenInstanceError):
        meta.max_seqlen = 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_device():
    grid = [(2, 8, 8), (1, 50, 34)]
    meta = build_metadata(grid, device="cuda")
    for tensor in (meta.cu_seqlens, meta.positions, meta.interp_indices, meta.interp_weights):
        assert tensor.device.type == "cuda"
    assert meta.grid_thw.device.type == "cpu"
    assert_matches_transformers(meta.to("cpu"), grid)


@pytest.mark.parametrize(
    "grid, error, pattern",
    [
        ([(1, 2)], ValueError, r"grid_thw must have shape \(N, 3\)"),
        ([(1, 2, 2, 2)], ValueError, r"grid_thw must have shape \(N, 3\)"),
        (np.ones((2, 3, 1), dtype=np.int64), ValueError, r"grid_thw must have shape \(N, 3\)"),
        (torch.ones(3, dtype=torch.int64), ValueError, r"grid_thw must have shape \(N, 3\)"),
        ([(1, 0, 2)], ValueError, r"grid_thw row 0 = \(1, 0, 2\) must be positive"),
        ([(1, 2, 2), (0, 2, 2)], ValueError, r"grid_thw row 1 = \(0, 2, 2\) must be positive"),
        ([(1, 2, 2), (1, 2, -4)], ValueError, r"grid_thw row 1 .* must be positive"),
        ([(1, 2, 2), (1, 3, 4)], ValueError, r"grid_thw row 1 = \(1, 3, 4\).*divisible by spatial_merge_size 2"),
        ([(1, 4, 2), (2, 4, 6), (1, 4, 5)], ValueError, r"grid_thw row 2 .*divisible"),
        ([(1, 65536, 32768)], ValueError, r"grid_thw holds .* fewer than 2\*\*31"),
        ([(1.0, 2.0, 2.0)], TypeError, r"grid_thw must hold integers"),
        (torch.ones(1, 3), TypeError, r"grid_thw must hold integers"),
        (torch.ones(1, 3, dtype=torch.bool), TypeError, r"grid_thw must hold integers"),
        (7, TypeError, r"grid_thw must be a CPU tensor"),
        (torch.ones(1, 3, dtype=torch.int64, device="meta"), ValueError, r"grid_thw must be a CPU tensor.*meta"),
    ],
)
def test_bad_grid(grid, error, pattern):
    with pytest.raises(error, match=pattern):
        build_metadata(grid)


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        (dict(spatial_merge_size=0), ValueError, "spatial_merge_size must be >= 1"),
        (dict(spatial_merge_size=2.0), TypeError, "spatial_merge_size must be an int"),
        (dict(spatial_merge_size=True), TypeError, "spatial_merge_size must be an int"),
        (dict(num_grid_per_side=0), ValueError, "num_grid_per_side must be >= 1"),
        (dict(num_grid_per_side="48"), TypeError, "num_grid_per_side must be an int"),
        (dict(num_grid_per_side=50000), ValueError, "num_grid_per_side 50000"),
    ],
)
def test_bad_parameters(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        build_metadata([(1, 2, 2)], **kwargs)


def test_without_a_position_table():
    """num_grid_per_side=None (Qwen2-VL's and Qwen2.5-VL's towers): the same segments and positions, no
    interpolation plan."""
    grid = [[2, 4, 6], [1, 2, 2]]
    with_table, without = build_metadata(grid), build_metadata(grid, num_grid_per_side=None)
    assert without.interp_indices is None and without.interp_weights is None and without.num_grid_per_side is None
    torch.testing.assert_close(without.positions, with_table.positions, rtol=0, atol=0)
    torch.testing.assert_close(without.cu_seqlens, with_table.cu_seqlens, rtol=0, atol=0)
    assert without.to("cpu").interp_indices is None


def test_a_compiled_caller_builds_the_tower_metadata_eagerly():
    """The runner's host metadata is numpy: under a caller's torch.compile it runs as it is, never as an Inductor
    kernel (whose CPU code for it died of SIGFPE under torch 2.11 with dynamic shapes). What Dynamo compiles is at
    most the caller's own add (traced, the metadata came to 147 ops in 21 frames)."""
    config = config_from_hf(Qwen3VLVisionConfig())[1]
    counter = CompileCounter()

    def caller(grid: torch.Tensor) -> torch.Tensor:
        return build_tower_metadata(grid, config).cu_seqlens + 1

    grid = torch.tensor([[1, 4, 6], [2, 2, 2]])
    got = torch.compile(caller, backend=counter, dynamic=True)(grid)
    torch.testing.assert_close(got, build_metadata(grid, 2, config.num_grid_per_side).cu_seqlens + 1)
    assert counter.op_count <= 1, (counter.op_count, counter.frame_count)
