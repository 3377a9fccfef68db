"""qvl.vit.VisionTransformer against transformers' Qwen3VLVisionModel, compile, memory, soak."""

import contextlib
import functools
import gc
import sys
from pathlib import Path

import pytest
import torch

from conftest import ON_GPU
from qvl.kernels import force_backend
from qvl.vit import VisionConfig, VisionTransformer
from qvl.vit.families import config_from_hf
from qvl.vit.runner import _size_oblivious_tracing
from tolerance import assert_error_within
from towers import (
    MODEL_STAGES,
    float64_vision_outputs,
    hf_vision_model,
    pixel_values_for,
    vision_config,
    vision_outputs,
)

# bench/ is a plain directory run from the repository root, not an installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.harness import cpu_allocation_sizes, peak_tensor_bytes  # noqa: E402

MIXED = [[1, 6, 10], [2, 4, 4], [1, 2, 2]]


def assert_matches(tower, hf, grid_thw, seed=0, pixel_values=None):
    """The tower against transformers' model on the same inputs, by the suite's rule (tolerance.py): the
    error of ``[merged, *deepstack]`` against a float64 copy of the model is at most twice the model's own
    error in its dtype, plus two units of the dtype's resolution at the output's scale."""
    if pixel_values is None:
        pixel_values = pixel_values_for(grid_thw, seed).to(tower.dtype)
    expected = vision_outputs(hf, pixel_values, grid_thw)
    with torch.no_grad():
        merged, deepstack = tower(pixel_values, grid_thw)
    got = [merged, *deepstack]
    assert [t.shape for t in got] == [t.shape for t in expected]
    truth = float64_vision_outputs(hf, pixel_values, grid_thw)
    assert_error_within(got, truth, expected, what=f"[merged, *deepstack] of {grid_thw}", stages=MODEL_STAGES)


def test_matches_transformers_fp32_with_video_and_one_merged_row():
    hf = hf_vision_model()
    tower = VisionTransformer.from_hf(hf).eval()
    assert_matches(tower, hf, MIXED + [[1, 2, 8], [1, 10, 2]])


def test_many_tiny_images_and_one_large_on_the_torch_path():
    hf = hf_vision_model(seed=1)
    tower = VisionTransformer.from_hf(hf).eval()
    with force_backend("torch"):
        assert_matches(tower, hf, [[1, 2, 2]] * 12 + [[1, 60, 52]] + [[3, 2, 4]])


def test_fp16_within_its_rounding():
    hf = hf_vision_model(seed=2).half()
    tower = VisionTransformer.from_hf(hf).eval()
    assert tower.dtype == torch.float16
    assert_matches(tower, hf, MIXED)


def test_bf16_within_its_rounding():
    """bf16 towers on CPU through the interpreter (bf16 dot operands, fp32 accumulation)."""
    hf = hf_vision_model(seed=3).bfloat16()
    tower = VisionTransformer.from_hf(hf).eval()
    assert_matches(tower, hf, MIXED[:2])


def test_autocast_over_fp32_weights_follows_transformers():
    """Under bf16 autocast (a mixed-precision loop) an fp32 tower follows autocast as transformers' model does: its
    outputs in the dtypes of transformers' autocast run and within the rule of it (judged at bf16's resolution, the
    roundings they carry), eager through the interpreter and compiled on the torch path, where a second batch of
    other sizes reuses the graph."""
    hf = hf_vision_model(seed=4, depth=2, deepstack_visual_indexes=[0, 1])
    eager = VisionTransformer.from_hf(hf).eval()
    compiled = VisionTransformer.from_hf(hf).eval().compile()
    for index, grid in enumerate([MIXED, [[1, 4, 6], [1, 2, 2]]]):
        pixels = pixel_values_for(grid, seed=4 + index)
        truth = float64_vision_outputs(hf, pixels, grid)
        stance = torch.compiler.set_stance("fail_on_recompile") if index else contextlib.nullcontext()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            expected = vision_outputs(hf, pixels, grid)
            merged, deepstack = eager(pixels, grid)
            with force_backend("torch"), stance:
                compiled_merged, compiled_deepstack = compiled(pixels, grid)
        for what, got in (("eager", [merged, *deepstack]), ("compiled", [compiled_merged, *compiled_deepstack])):
            assert [t.dtype for t in got] == [t.dtype for t in expected] == [torch.bfloat16] * 3
            assert_error_within(
                [t.bfloat16() for t in got],
                truth,
                expected,
                what=f"{what} under bf16 autocast, {grid}",
                stages=MODEL_STAGES,
            )


def test_autocast_to_the_weights_dtype_changes_nothing():
    """A bf16 tower under bf16 autocast runs as without autocast (switched off inside: the same computation)."""
    tower = VisionTransformer.from_hf(hf_vision_model(seed=5, depth=2, deepstack_visual_indexes=[1])).bfloat16()
    pixels = pixel_values_for(MIXED[:2], seed=5).bfloat16()
    with torch.no_grad():
        plain = tower(pixels, MIXED[:2])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = tower(pixels, MIXED[:2])
    assert all(torch.equal(a, b) for a, b in zip([plain[0], *plain[1]], [autocast[0], *autocast[1]], strict=True))


def test_head_dim_64_and_80():
    for hidden, heads in ((128, 2), (160, 2)):
        hf = hf_vision_model(seed=4, hidden_size=hidden, num_heads=heads)
        tower = VisionTransformer.from_hf(hf).eval()
        with force_backend("torch"):
            assert_matches(tower, hf, MIXED)


def test_empty_batch():
    tower = VisionTransformer(config_from_hf(vision_config())[1]).init_random_weights()
    merged, deepstack = tower(torch.empty(0, 1536), torch.empty(0, 3, dtype=torch.long))
    assert merged.shape == (0, 96) and [d.shape for d in deepstack] == [(0, 96), (0, 96)]


def test_bad_inputs():
    tower = VisionTransformer(config_from_hf(vision_config())[1]).init_random_weights()
    with pytest.raises(ValueError, match="pixel_values must have shape"):
        tower(torch.zeros(5, 1536), [[1, 2, 2]])
    with pytest.raises(ValueError, match="grid_thw"):
        tower(torch.zeros(6, 1536), [[1, 2, 3]])
    with pytest.raises(ValueError, match="hidden_size"):
        VisionConfig(hidden_size=100, num_heads=3)


def test_compile_no_recompiles_across_batches():
    hf = hf_vision_model(seed=5)
    tower = VisionTransformer.from_hf(hf).eval().compile()
    with force_backend("torch"):
        assert_matches(tower, hf, MIXED)
        with torch.compiler.set_stance("fail_on_recompile"):
            for grids in ([[1, 2, 2]], [[4, 8, 6], [1, 2, 2], [1, 2, 2]], [[1, 16, 12]] * 3, [[2, 2, 2]]):
                assert_matches(tower, hf, grids)
            # A view into a larger buffer (a slice of a processor batch) uses the same graph.
            assert_matches(tower, hf, [[1, 4, 4]], pixel_values=pixel_values_for([[1, 8, 8]])[40:56])


def test_compiled_tower_through_the_interpreter():
    hf = hf_vision_model(seed=6)
    tower = VisionTransformer.from_hf(hf).eval().compile()
    assert_matches(tower, hf, [[1, 4, 4]])
    with torch.compiler.set_stance("fail_on_recompile"):
        assert_matches(tower, hf, [[2, 2, 4], [1, 6, 2]])


def test_size_oblivious_switch_is_optional(monkeypatch):
    """The compiled tower turns on torch's private size-oblivious tracing switch when it exists; a torch
    without it gets a no-op (one more compile for a batch of one merged token), not an error."""
    import torch.fx.experimental
    from torch.fx.experimental import _config as fx_config

    with _size_oblivious_tracing():
        assert fx_config.backed_size_oblivious
    monkeypatch.delattr(torch.fx.experimental, "_config")
    monkeypatch.setitem(sys.modules, "torch.fx.experimental._config", None)
    with _size_oblivious_tracing():
        assert not fx_config.backed_size_oblivious


@contextlib.contextmanager
def one_intra_op_thread():
    """torch's CPU kernels allocate per-thread scratch buffers, and their order across threads varies: with
    one thread the byte counts below do not depend on the machine's core count or scheduling."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def test_compiled_peak_memory_not_above_eager(device):
    """Peak tensor memory of one forward after warm-up: the compiled tower must not use more than eager."""
    torch.manual_seed(0)
    config = VisionConfig(
        depth=2,
        hidden_size=256,
        num_heads=4,
        intermediate_size=1024,
        out_hidden_size=512,
        deepstack_visual_indexes=(1,),
    )
    eager = VisionTransformer(config, device=device).init_random_weights().eval()
    compiled = VisionTransformer(config, device=device).eval()
    compiled.load_state_dict(eager.state_dict())
    compiled.compile()
    # One image large enough that attention scores dominate on the torch path, plus a video.
    grid = [[1, 64, 64], [2, 32, 24]]
    pixels = torch.randn(sum(t * h * w for t, h, w in grid), 1536, device=device)
    meta = eager.metadata(grid)
    peaks = {}
    # On CPU the interpreter would take minutes at this size: both modes run the torch path.
    path = force_backend("torch") if device == "cpu" else contextlib.nullcontext()
    # The warm-up compiles under the same single thread as the measured forward.
    with torch.no_grad(), path, one_intra_op_thread():
        for name, tower in (("eager", eager), ("compiled", compiled)):
            tower.encode(pixels, meta)
            gc.collect()
            peaks[name] = peak_tensor_bytes(functools.partial(tower.encode, pixels, meta), device)
    print(f"peak tensor bytes of one forward on {device}: {peaks}")
    assert peaks["compiled"] <= peaks["eager"], peaks


def test_eager_peak_memory_on_the_torch_path_below_transformers():
    """On a CPU, one image through Qwen3-VL-8B's block proportions (head dim 72, MLP width 3.7 x hidden): the eager
    tower on the torch path holds at most 90% of the tensor bytes transformers' model with sdpa holds at once.

    Counted in ``(T, C)`` units: qvl peaks in attention with about 10 alive (the stream, its norm, qkv's 3, the
    rotated q, k and v's head-major copy, the output, a few small ones), transformers in its MLP with about 12.4 (its
    stream and norm and leftovers, then the MLP's activation twice at 3.7 each, GELU not being in place). Each
    block releases its qkv and attention output before its MLP's activation is allocated; with them alive beside
    it, qvl held 98% of transformers' bytes here (and 101% at the full 8B width)."""
    hf = hf_vision_model(
        depth=2, hidden_size=288, num_heads=4, intermediate_size=1076, out_hidden_size=256, deepstack_visual_indexes=[0]
    )
    tower = VisionTransformer.from_hf(hf).eval()
    grid = [[1, 32, 32]]
    pixels, grid_thw = pixel_values_for(grid), torch.tensor(grid)
    runs = {"qvl": lambda: tower(pixels, grid_thw), "transformers": lambda: hf(pixels, grid_thw=grid_thw)}
    peaks = {}
    with torch.no_grad(), force_backend("torch"), one_intra_op_thread():
        for name, run in runs.items():
            run()
            gc.collect()
            peaks[name] = peak_tensor_bytes(run, "cpu")
    assert peaks["qvl"] <= 0.9 * peaks["transformers"], peaks


def test_soak_memory_does_not_grow():
    """Hundreds of small batches of varying sizes in one process leave no tensor memory behind.

    Counted as tensor bytes allocated and not freed (:func:`cpu_allocation_sizes`), not as resident memory,
    which also counts malloc's arenas and fragmentation and so depends on the machine, its thread count
    and the run. The batches run twice, the same shapes in the same order: the first pass fills whatever
    is kept per shape, and the second must free everything it allocates.
    """
    tower = VisionTransformer(config_from_hf(vision_config(depth=1, deepstack_visual_indexes=[0]))[1])
    tower.init_random_weights().eval()
    generator = torch.Generator().manual_seed(0)

    def draw(low, high):
        return int(torch.randint(low, high, (1,), generator=generator))

    grids = [[[draw(1, 3), 2 * draw(1, 6), 2 * draw(1, 6)] for _ in range(draw(1, 4))] for _ in range(150)]

    def run_batches():
        for grid in grids:
            with torch.no_grad():
                merged, _ = tower(pixel_values_for(grid), grid)
            assert merged.shape[0] == sum(t * h * w for t, h, w in grid) // 4
        gc.collect()

    with force_backend("torch"), one_intra_op_thread():
        run_batches()
        retained = sum(cpu_allocation_sizes(run_batches))
    assert retained <= 0, f"{retained} bytes of tensors allocated over {len(grids)} batches were not freed"


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_cuda_forward_makes_no_host_sync():
    hf = hf_vision_model(seed=7).cuda().bfloat16()
    tower = VisionTransformer.from_hf(hf).eval()
    grid = MIXED
    pixels = pixel_values_for(grid).cuda().bfloat16()
    meta = tower.metadata(grid)
    with torch.no_grad():
        tower.encode(pixels, meta)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            tower.encode(pixels, meta)
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_attention_gets_the_longest_frame_as_tile_hint(monkeypatch):
    """The Qwen3-VL tower passes its host metadata's longest segment to vision_attn as the max_seqlen tile hint
    (no device read), so small images get short-segment tiles as Qwen2.5-VL's windows do."""
    tower = VisionTransformer(config_from_hf(vision_config(depth=1, deepstack_visual_indexes=[0]))[1])
    hints = []
    vision_attn = torch.ops.qvl.vision_attn

    def spy(*args, **kwargs):
        hints.append(kwargs["max_seqlen"])
        return vision_attn(*args, **kwargs)

    monkeypatch.setattr(torch.ops.qvl, "vision_attn", spy)
    grid = [[1, 4, 6], [2, 2, 2]]
    with torch.no_grad(), force_backend("torch"):
        tower.init_random_weights()(pixel_values_for(grid), grid)
    assert hints == [24]
