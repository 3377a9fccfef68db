"""TowerBase.capture and qvl.vit.graphs: batches padded on the host to a token budget give the unpadded batch's
features, for Qwen3-VL's tower and both Qwen2 towers (Qwen2.5-VL's window attention included), images and a video.

Padded and unpadded runs cannot be compared bit for bit on the CPU: the real rows are computed from the same
values, but a GEMM's rounding may depend on its row count (MKL picks other kernels for some small M, e.g. 10 rows
against 16), so the comparison with the unpadded batch uses the suite's rule (tests/tolerance.py) against
transformers in float64. What holds by construction is checked exactly: the same padded shapes with other pad
pixels (large garbage) give identical outputs, so the pad never reaches a real token; ``tower(...)`` after
``capture`` equals the padded forward it runs."""

from __future__ import annotations

import torch

from qvl.kernels import force_backend, set_value_checks
from qvl.vit import VisionConfig, VisionTransformer
from qvl.vit.graphs import (
    PAD_FRAME_UNITS,
    SMALL_FRAME_SLOTS,
    cover_pad_rows,
    pad_batch,
    pad_grid,
    pad_pixels,
    segment_slots,
)

# Two images and a two-frame video: 112 tokens (28 merged) in 4 frames; with window_size 56 (2 x 2 merge blocks)
# the 6 x 10 image leaves partial windows.
GRID = [[1, 6, 10], [2, 4, 6], [1, 2, 2]]
TOKENS, FRAMES = 112, 4
# (budget, max_segments): an exact fit (no pad), one pad block, one full pad frame, seven pad frames, and the
# same pad in a single 400-token frame when only one segment slot is left.
PADDINGS = [(112, None), (116, None), (112 + 4 * PAD_FRAME_UNITS, None), (512, None), (512, FRAMES + 1)]
FAMILY_NAMES = ["qwen3_vl", "qwen2_5_vl", "qwen2_vl"]
# The data mode's tower: Qwen3-VL's shape as tests/towers.py builds it, without importing transformers in the ranks.
DATA_CONFIG = VisionConfig(
    depth=2,
    hidden_size=64,
    num_heads=2,
    intermediate_size=96,
    out_hidden_size=32,
    deepstack_visual_indexes=(0,),
    num_position_embeddings=64,
)
DATA_BUDGETS = [64, 128]


def _rank_main(out_dir: str) -> None:
    """One rank of the data mode (this file run under torch.distributed.run): the captured tower's features and the
    token counts its device part ran on."""
    import torch.distributed as dist

    from qvl.vit.parallel import init_from_env

    init_from_env("cpu")
    tower = VisionTransformer(DATA_CONFIG, parallel="data").init_random_weights().capture(DATA_BUDGETS)
    runs = []
    run_device = tower._runner.run_device

    def counted(pixel_values, *inputs):
        runs.append(pixel_values.shape[0])
        return run_device(pixel_values, *inputs)

    tower._runner.run_device = counted
    pixels = torch.randn(TOKENS, DATA_CONFIG.patch_dim, generator=torch.Generator().manual_seed(7))
    with torch.no_grad(), force_backend("torch"):
        merged, deepstack = tower(pixels, GRID)
    torch.save({"merged": merged, "deepstack": deepstack, "runs": runs}, f"{out_dir}/rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    from ranks import run_rank

    run_rank(_rank_main)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from test_hf_patch import float64_run  # noqa: E402
from test_qwen2_towers import vision_model  # noqa: E402

from conftest import ON_GPU  # noqa: E402
from qvl.vit import Qwen2VisionTransformer  # noqa: E402
from ranks import run_two_ranks  # noqa: E402
from tolerance import assert_error_within  # noqa: E402
from towers import (  # noqa: E402
    MODEL_STAGES,
    float64_vision_outputs,
    hf_vision_model,
    hf_vision_model_of,
    pixel_values_for,
    vision_outputs,
)


def family(name: str, seed: int = 0, **overrides):
    """``(tower, hf, run, rotary)``: a tiny random qvl tower, transformers' model with its weights, ``run(model,
    pixels, grid) -> [merged, *deepstack]`` of that model, and the ``rotary`` ``float64_run`` takes for it."""
    if name == "qwen3_vl":
        hf = hf_vision_model(seed, **overrides)
        tower = VisionTransformer.from_hf(hf).eval()
        return tower, hf, lambda model, pixels, grid: vision_outputs(model, pixels, grid), ()
    hf, rotary = vision_model(name, seed)
    tower = Qwen2VisionTransformer.from_hf(hf).eval()

    def run(model, pixels, grid):
        with torch.no_grad():
            return [model(pixels.to(model.dtype), grid_thw=torch.tensor(grid)).pooler_output]

    return tower, hf, run, rotary


def padded_outputs(tower, pixels: torch.Tensor, batch) -> list[torch.Tensor]:
    """``[merged, *deepstack]`` of the padded batch's device forward on ``pixels``, cut to the real rows."""
    _, merged, deepstack = batch.real_outputs(tower._runner.run_device(pixels, batch.inputs()))
    return [merged, *deepstack]


def device_runs(monkeypatch, tower) -> list[tuple[int, int]]:
    """``(tokens, segments)`` of every run of the tower's device part from now on."""
    counts = []
    run_device = tower._runner.run_device

    def counted(pixel_values, inputs):
        counts.append((pixel_values.shape[0], inputs.cu_seqlens.shape[0] - 1))
        return run_device(pixel_values, inputs)

    monkeypatch.setattr(tower._runner, "run_device", counted)
    return counts


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_padded_batches_give_the_unpadded_features(name, monkeypatch):
    tower, hf, run, rotary = family(name)
    pixels = pixel_values_for(GRID, channels=tower.config.patch_dim)
    truth = float64_run(hf, lambda model: run(model, pixels, GRID), *rotary)
    baseline = run(hf, pixels, GRID)
    garbage = 1e3 * torch.randn(512, tower.config.patch_dim, generator=torch.Generator().manual_seed(1))
    counts = device_runs(monkeypatch, tower)
    with force_backend("torch"), torch.no_grad():
        for budget, max_segments in PADDINGS:
            what = f"{name}, budget {budget}, max_segments {max_segments}"
            batch = pad_batch(tower, GRID, budget, max_segments)
            padded = pad_pixels(pixels, budget)
            assert padded.shape == (budget, tower.config.patch_dim) and not padded[TOKENS:].any()
            expected = padded_outputs(tower, padded, batch)
            assert_error_within(expected, truth, baseline, what=what, stages=MODEL_STAGES)

            padded[TOKENS:] = garbage[: budget - TOKENS]
            poisoned = padded_outputs(tower, padded, batch)
            assert all(torch.equal(a, b) for a, b in zip(poisoned, expected, strict=True)), (
                f"{what}: the pad reached the output"
            )

            tower.capture([budget], max_segments=max_segments)
            del counts[:]
            merged, deepstack = tower(pixels, GRID)
            assert counts == [(budget, batch.meta.cu_seqlens.shape[0] - 1)], what
            assert all(torch.equal(a, b) for a, b in zip([merged, *deepstack], expected, strict=True)), what


@pytest.mark.parametrize("name", ["qwen3_vl", "qwen2_5_vl"])
def test_padded_last_hidden_state_is_the_real_tokens(name):
    """The pad frames come last in the blocks' token order too (window order: windows never cross frames), so the
    padded run's last hidden state cut to the real tokens is transformers' (window order for Qwen2.5-VL)."""
    tower, hf, _, rotary = family(name)
    pixels = pixel_values_for(GRID, channels=tower.config.patch_dim)
    grid = torch.tensor(GRID)

    def last_hidden(model):
        with torch.no_grad():
            return model(pixels.to(model.dtype), grid_thw=grid).last_hidden_state

    truth = float64_run(hf, last_hidden, *rotary)
    tower.capture([512])
    with force_backend("torch"), torch.no_grad():
        got = tower._runner.encode_batch(pixels, np.array(GRID)).last_hidden_state
    assert got.shape == (TOKENS, tower.config.hidden_size)
    assert_error_within(got, truth, last_hidden(hf), what=f"{name} padded last hidden state", stages=MODEL_STAGES)


def test_interpreter_kernels_on_a_padded_batch():
    """One small Qwen2.5-VL batch (an image, a two-frame video) through the Triton interpreter: two pad frames, cut
    into windows like any frame (the windowed blocks' tile hint is the config's window, which no pad window
    exceeds)."""
    name, grid = "qwen2_5_vl", [[1, 2, 4], [2, 2, 2]]
    tower, hf, run, rotary = family(name, seed=3)
    pixels = pixel_values_for(grid, channels=tower.config.patch_dim)
    tower.capture([16 + 4 * (PAD_FRAME_UNITS + 2)])  # the 16 tokens, then two pad frames of 9 merge blocks
    with torch.no_grad():
        merged, deepstack = tower(pixels, grid)
    got = [merged, *deepstack]
    truth = float64_run(hf, lambda model: run(model, pixels, grid), *rotary)
    assert_error_within(
        got, truth, run(hf, pixels, grid), what=f"{name} padded through the interpreter", stages=MODEL_STAGES
    )


@pytest.mark.parametrize("name", ["qwen3_vl", "qwen2_5_vl"])
def test_every_batch_of_a_budget_has_the_same_shapes(name):
    """What a graph needs: the device inputs of any batch padded to a budget have the same shapes (segment and
    window offsets extended by zero-length segments), and the pad frames are whole merge blocks, at most
    PAD_FRAME_UNITS of them each while slots are free."""
    tower = family(name)[0]
    budget = 256
    grids = [GRID, [[1, 2, 2]], [[8, 2, 8]], [[1, 16, 16]], []]
    batches = [pad_batch(tower, grid, budget) for grid in grids]
    inputs = [batch.inputs() for batch in batches]
    shapes = {tuple(t.shape for t in tensors if isinstance(t, torch.Tensor)) for tensors in inputs}
    assert len(shapes) == 1
    for grid, batch in zip(grids, batches):
        assert batch.grid[: len(grid)].tolist() == grid and int(np.prod(batch.grid, axis=1).sum()) == budget
        pad = batch.grid[len(grid) :]
        assert (pad[:, 1] == 2).all() and (pad[:, 2] <= 2 * PAD_FRAME_UNITS).all()
        assert batch.num_merged_tokens == batch.num_tokens // 4 == sum(t * h * w for t, h, w in grid) // 4
        offsets = batch.meta.cu_seqlens
        assert offsets.shape == (segment_slots(budget, 2, None) + 1,) and int(offsets[-1]) == budget
        assert bool((offsets[1:] >= offsets[:-1]).all())
    assert batches[2].grid[1:].tolist() == [[2, 2, 2 * PAD_FRAME_UNITS]]  # after a 128-token video: 2 full pad frames
    assert batches[3].grid.tolist() == [[1, 16, 16]]  # an exact fit: no pad frame
    tight = pad_batch(tower, GRID, budget, max_segments=FRAMES + 1)  # one slot left: one pad frame of 36 blocks
    assert tight.grid[3:].tolist() == [[1, 2, 72]] and tight.meta.cu_seqlens.shape == (FRAMES + 2,)


def test_default_slots_fit_every_batch_of_frames_no_smaller_than_a_pad_frame():
    """The default segment slots stay near the budget's tile count (each slot is an attention program per head)
    yet hold any batch whose frames have at least PAD_FRAME_UNITS merge blocks, with its pad frames, plus up to
    SMALL_FRAME_SLOTS smaller frames; the padded batch's tile hint is its budget."""
    assert segment_slots(16384, 2, None) == 16384 // (4 * PAD_FRAME_UNITS) + SMALL_FRAME_SLOTS
    assert segment_slots(64, 2, None) == 16 and segment_slots(16384, 2, 10**6) == 4096
    rng = np.random.default_rng(0)
    for budget in (256, 1024, 4096, 16384):
        slots = segment_slots(budget, 2, None)
        for _ in range(200):
            frames = []
            while True:  # frames of 16..80 merge blocks (2 rows), then up to SMALL_FRAME_SLOTS single blocks
                units = int(rng.integers(PAD_FRAME_UNITS, 5 * PAD_FRAME_UNITS))
                if 4 * (sum(frames) + units) > budget:
                    break
                frames.append(units)
            small = int(rng.integers(0, SMALL_FRAME_SLOTS + 1))
            frames = frames[: len(frames) - (small > 0)]  # room for the small frames
            grid = np.array([(1, 2, 2 * u) for u in frames] + [(1, 2, 2)] * small, dtype=np.int64).reshape(-1, 3)
            if 4 * int(np.prod(grid, axis=1).sum()) > 4 * budget:
                continue
            padded = pad_grid(grid, budget, 2, slots)
            assert padded is not None, (budget, frames, small)
            assert int(np.prod(padded, axis=1).sum()) == budget and padded[:, 0].sum() <= slots
    tower = family("qwen3_vl")[0]
    assert pad_batch(tower, GRID, 512).inputs().max_seqlen == 512


def test_cover_pad_rows_puts_every_row_in_a_segment():
    offsets = torch.tensor([0, 24, 28], dtype=torch.int32)
    covered = cover_pad_rows(offsets, 200, 2)
    assert covered.dtype == torch.int32 and covered.tolist() == [0, 24, 28, 92, 156, 200, 200]
    assert cover_pad_rows(torch.tensor([0, 64], dtype=torch.int32), 64, 2).tolist() == [0, 64, 64]


def test_batches_the_budgets_do_not_serve_take_the_normal_path(monkeypatch):
    tower = family("qwen3_vl")[0]
    pixels = pixel_values_for(GRID, channels=tower.config.patch_dim)
    two_entries = [[1, 6, 10], [2, 4, 6]]  # 108 tokens in 3 frames
    counts = device_runs(monkeypatch, tower)
    with force_backend("torch"):
        tower.capture([64, 4096, 128], max_segments=FRAMES)
        assert tower.captured_budgets == (64, 128, 4096)
        with torch.no_grad():
            tower(pixels, GRID)  # 4 frames and a pad frame: more than 4 slots in every budget that holds 112 tokens
            tower.capture([112, 64], max_segments=FRAMES + 2)
            tower(pixels, GRID)  # an exact fit: no pad frame, 6 segment slots
            tower(pixels[:108], two_entries)  # one pad frame
            tower(pixel_values_for([[1, 16, 16]], channels=tower.config.patch_dim), [[1, 16, 16]])  # too large
            empty = tower(torch.zeros(0, tower.config.patch_dim), [])
            tower.encode(pixels, tower.metadata(GRID))
        assert counts == [(112, 4), (112, 6), (112, 6), (256, 1), (112, 6)]
        assert empty[0].shape == (0, tower.config.out_hidden_size)

        # A replay records nothing for autograd: with grad mode on and parameters or pixels requiring grad, the
        # normal path.
        del counts[:]
        merged, _ = tower(pixels, GRID)
        assert merged.requires_grad
        tower.requires_grad_(False)
        tower(pixels, GRID)
        tower(pixels.clone().requires_grad_(), GRID)
        assert counts == [(112, 4), (112, 6), (112, 4)]


@pytest.mark.parametrize(
    ("budgets", "max_segments", "error", "pattern"),
    [
        ([], None, ValueError, r"token_budgets must hold at least one budget"),
        ([64, 30], None, ValueError, r"token_budgets\[1\] = 30 must be a multiple of spatial_merge_size\*\*2 = 4"),
        ([0], None, ValueError, r"token_budgets\[0\] must be >= 1, got 0"),
        ([2**31], None, ValueError, r"token_budgets\[0\] = 2147483648 must be below 2\*\*31"),
        ([True], None, TypeError, r"token_budgets\[0\] must be an int, got bool"),
        ([64.0], None, TypeError, r"token_budgets\[0\] must be an int, got float"),
        (64, None, TypeError, r"token_budgets must be a sequence of ints, got int"),
        ("64", None, TypeError, r"token_budgets must be a sequence of ints, got str"),
        ([64], 0, ValueError, r"max_segments must be >= 1, got 0"),
        ([64], 2.0, TypeError, r"max_segments must be an int, got float"),
    ],
)
def test_bad_arguments_raise_naming_them(budgets, max_segments, error, pattern):
    tower = family("qwen2_vl")[0]
    with pytest.raises(error, match=rf"Qwen2VisionTransformer\.capture: {pattern}"):
        tower.capture(budgets, max_segments=max_segments)
    assert tower.captured_budgets == ()


def test_other_refusals(monkeypatch):
    tower = family("qwen3_vl")[0]
    with pytest.raises(ValueError, match=r"pad_batch: budget = 30 must be a multiple of spatial_merge_size\*\*2"):
        pad_batch(tower, GRID, 30)
    with pytest.raises(ValueError, match=r"pad_batch: max_segments must be >= 1"):
        pad_batch(tower, GRID, 128, max_segments=0)
    with pytest.raises(ValueError, match=r"pad_batch: grid_thw row 0 = \(1, 3, 4\): h and w must be divisible"):
        pad_batch(tower, [[1, 3, 4]], 128)
    assert pad_batch(tower, GRID, 108) is None and pad_batch(tower, GRID, 128, max_segments=FRAMES) is None

    # Moving or casting the tower leaves the graphs reading the old weights' memory: the next forward says so.
    pixels = pixel_values_for(GRID, channels=tower.config.patch_dim)
    stale = r"at capture \(on cpu in torch.float32\).*now on cpu in torch.float64.*call VisionTransformer\.capture "
    tower.capture([128]).double()
    with pytest.raises(RuntimeError, match=stale):
        tower(pixels.double(), GRID)
    # So does a round trip back to the captured dtype (new storage, same device and dtype) and weights loaded
    # into new storage; weights copied in place keep theirs and the graphs read them.
    tower.float().capture([128])
    tower.double().float()
    with pytest.raises(RuntimeError, match=r"weights have moved since \(now on cpu in torch.float32"):
        tower(pixels, GRID)
    tower.capture([128])
    tower.load_state_dict(tower.state_dict())
    tower(pixels, GRID)
    tower.load_state_dict({name: value.clone() for name, value in tower.state_dict().items()}, assign=True)
    with pytest.raises(RuntimeError, match=r"weights have moved since"):
        tower(pixels, GRID)

    # Weights mode needs a process group of two ranks to build; the refusal reads only the strategy's mode.
    monkeypatch.setattr(tower._parallel, "mode", "weights")
    with pytest.raises(ValueError, match=r"VisionTransformer\.capture: parallel='weights' is not supported"):
        tower.capture([128])


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a CUDA GPU (and TRITON_INTERPRET=0)")
def test_cuda_graph_replay_equals_eager_without_syncs():
    hf = hf_vision_model(seed=5).cuda()
    tower = VisionTransformer.from_hf(hf).eval()
    grids = [GRID, [[1, 16, 16], [1, 2, 2]]]
    with torch.no_grad():
        eager = []
        for grid in grids:
            pixels = pixel_values_for(grid, channels=tower.config.patch_dim).cuda()
            batch = pad_batch(tower, grid, 512)
            eager.append(padded_outputs(tower, pad_pixels(pixels, 512), batch))
        tower.capture([128, 512])
        replayed = []
        for grid in grids:
            pixels = pixel_values_for(grid, channels=tower.config.patch_dim)
            on_device = pixels.cuda()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                from_device = tower(on_device, grid)
                from_host = tower(pixels, grid)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            replayed.append([from_device[0], *from_device[1]])
            assert all(torch.equal(a, b) for a, b in zip([from_host[0], *from_host[1]], replayed[-1], strict=True))
        # The first batch fits 128 tokens: its graph is not the eager run's 512, so within rounding; the second is
        # the 512 graph, the same kernels on the same shapes as the eager padded run: equal.
        truth = float64_vision_outputs(hf.cpu(), pixel_values_for(GRID, channels=tower.config.patch_dim), GRID)
        baseline = vision_outputs(hf.cuda(), pixel_values_for(GRID, channels=tower.config.patch_dim).cuda(), GRID)
        assert_error_within(replayed[0], truth, baseline, what="replayed 128-token graph", stages=MODEL_STAGES)
        assert all(torch.equal(a, b) for a, b in zip(replayed[1], eager[1], strict=True))


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a CUDA GPU (and TRITON_INTERPRET=0)")
def test_graphs_captured_in_inference_mode_replay_under_no_grad():
    """Capturing inside torch.inference_mode, then replaying under no_grad (generate's mode), with value checks on
    (their host reads stand aside during the capture): the static buffers are normal tensors, which a replay
    outside inference mode may write, and the replay equals the eager padded run of the same budget."""
    hf = hf_vision_model(seed=5).cuda()
    tower = VisionTransformer.from_hf(hf).eval()
    pixels = pixel_values_for(GRID, channels=tower.config.patch_dim).cuda()
    set_value_checks(True)
    try:
        with torch.inference_mode():
            tower.capture([128])
    finally:
        set_value_checks(False)
    with torch.no_grad():
        eager = padded_outputs(tower, pad_pixels(pixels, 128), pad_batch(tower, GRID, 128))
        merged, deepstack = tower(pixels, GRID)
    assert all(torch.equal(a, b) for a, b in zip([merged, *deepstack], eager, strict=True))


def test_data_mode_pads_each_ranks_share(tmp_path):
    """parallel="data" on two gloo ranks: each rank pads its own share (60 and 52 tokens) to the 64-token budget,
    and every rank gets the whole batch's features within rounding of transformers."""
    run_two_ranks(__file__, tmp_path)
    hf = hf_vision_model_of(VisionTransformer(DATA_CONFIG).init_random_weights())
    pixels = torch.randn(TOKENS, DATA_CONFIG.patch_dim, generator=torch.Generator().manual_seed(7))
    truth, baseline = float64_vision_outputs(hf, pixels, GRID), vision_outputs(hf, pixels, GRID)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        assert results["runs"] == [64], f"rank {rank}"
        got = [results["merged"], *results["deepstack"]]
        assert_error_within(
            got, truth, baseline, what=f"rank {rank}: data mode through the 64-token budget", stages=MODEL_STAGES
        )
