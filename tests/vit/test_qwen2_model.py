"""qvl.vit.Qwen2VisionTransformer, qvl's own Qwen2.5-VL / Qwen2-VL towers: built from transformers modules and from
checkpoints (the tower class read from config.json), config dicts as released checkpoints spell them, compile
without recompiles over image and video batches, and the weights / data modes over two gloo ranks (this file run
under torch.distributed.run is one rank), against transformers in float64 (nothing downloaded)."""

from __future__ import annotations

import contextlib

import torch
from test_qwen2_towers import (
    FAMILIES,
    GRID,
    PATCH_DIM,
    qwen2_5_full_config,
    qwen2_full_config,
    vision_model,
)

from qvl.kernels import force_backend
from qvl.vit import (
    Qwen2VisionConfig,
    Qwen2VisionTransformer,
    VisionConfig,
    VisionTransformer,
    load_tower,
    patch_model,
    tower_from_hf,
)
from qvl.vit.families import config_from_dict, config_from_hf
from ranks import run_two_ranks
from towers import MODEL_STAGES, pixel_values_for, randomize

# Batches for the ranks and the compiled tower: images with partial windows, a video (its frames split over the
# ranks in data mode), one small image (the other rank gets nothing), the empty batch.
CASES = {"images": GRID, "video": [[3, 4, 6], [1, 2, 4]], "one_image": [[1, 2, 2]], "empty": []}


def inputs(case: str) -> tuple[torch.Tensor, list[list[int]]]:
    grid = CASES[case]
    return (pixel_values_for(grid, seed=len(case), channels=PATCH_DIM) if grid else torch.zeros(0, PATCH_DIM)), grid


def _rank_main(out_dir: str) -> None:
    import torch.distributed as dist

    from qvl.vit.parallel import init_from_env

    init_from_env("cpu")
    results = {}
    with torch.no_grad(), force_backend("torch"):
        for name in FAMILIES:
            hf, _ = vision_model(name, seed=21)
            for mode in ("weights", "data"):
                tower = Qwen2VisionTransformer.from_hf(hf, parallel=mode)
                for case in CASES:
                    results[f"{name}/{mode}/{case}"] = tower(*inputs(case))[0]
            patch_model(hf, parallel="data")
            for case in ("images", "video"):
                pixels, grid = inputs(case)
                results[f"{name}/patched/{case}"] = hf(pixels, grid_thw=torch.tensor(grid)).pooler_output
    torch.save(results, f"{out_dir}/rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    from ranks import run_rank

    run_rank(_rank_main)

import pytest  # noqa: E402
from test_hf_patch import float64_run  # noqa: E402
from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration  # noqa: E402

from tolerance import assert_error_within  # noqa: E402


def reference(name: str, seed: int, case: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(truth, baseline)`` of one batch's merged features: transformers' tower in float64 and in fp32."""
    hf, rotary = vision_model(name, seed)
    pixels, grid = inputs(case)
    if not grid:  # transformers cannot run an empty batch
        empty = torch.zeros(0, hf.config.out_hidden_size if name == "qwen2_5_vl" else hf.config.hidden_size)
        return empty.double(), empty

    def run(model):
        return model(pixels.to(model.dtype), grid_thw=torch.tensor(grid)).pooler_output

    truth = float64_run(hf, run, *rotary)
    with torch.no_grad():
        return truth, run(hf)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_from_hf_is_the_patched_transformers_tower(name):
    """The same parameters under transformers' names, and the same features as the patched transformers module
    (one code path over either module tree: bit for bit), through the interpreter."""
    hf, _ = vision_model(name, seed=9)
    tower = Qwen2VisionTransformer.from_hf(hf)
    assert isinstance(tower_from_hf(hf), Qwen2VisionTransformer)
    assert tower.config.windowed == (name == "qwen2_5_vl")
    assert set(tower.state_dict()) == set(hf.state_dict())
    pixels, grid = inputs("images")
    with torch.no_grad():
        merged, deepstack = tower(pixels, grid)
        patch_model(hf)
        expected = hf(pixels, grid_thw=torch.tensor(grid)).pooler_output
    assert deepstack == []
    torch.testing.assert_close(merged, expected, rtol=0, atol=0)


def test_config_from_released_config_json():
    """config.json as Qwen2-VL-7B and Qwen2.5-VL-7B ship it (legacy ``in_chans``; Qwen2-VL's ``embed_dim`` and
    ``mlp_ratio``, and its ``hidden_size`` being the merger's output)."""
    qwen2 = config_from_dict(
        {
            "model_type": "qwen2_vl",
            "vision_config": {
                "depth": 32,
                "embed_dim": 1280,
                "mlp_ratio": 4,
                "num_heads": 16,
                "in_chans": 3,
                "hidden_size": 3584,
                "patch_size": 14,
                "spatial_merge_size": 2,
                "spatial_patch_size": 14,
                "temporal_patch_size": 2,
            },
        }  # fmt: skip
    )[1]
    assert (qwen2.windowed, qwen2.hidden_size, qwen2.intermediate_size) == (False, 1280, 5120)
    assert qwen2.out_hidden_size == 3584
    assert (qwen2.head_dim, qwen2.hidden_act, qwen2.fullatt_block_indexes) == (80, "quick_gelu", ())
    qwen2_5 = config_from_dict(
        {
            "model_type": "qwen2_5_vl",
            "vision_config": {
                "depth": 32,
                "hidden_act": "silu",
                "hidden_size": 1280,
                "intermediate_size": 3420,
                "num_heads": 16,
                "in_chans": 3,
                "out_hidden_size": 3584,
                "patch_size": 14,
                "spatial_merge_size": 2,
                "spatial_patch_size": 14,
                "window_size": 112,
                "fullatt_block_indexes": [7, 15, 23, 31],
                "tokens_per_second": 2,
                "temporal_patch_size": 2,
            },
        }  # fmt: skip
    )[1]
    assert qwen2_5 == Qwen2VisionConfig()  # the defaults are Qwen2.5-VL-7B's
    assert (qwen2_5.windowed, qwen2_5.window_tokens, qwen2_5.patch_dim) == (True, 64, 1176)
    # transformers' own configs, full and vision, read the same through from_hf and through their dicts.
    for full in (qwen2_5_full_config(), qwen2_full_config()):
        from_hf = config_from_hf(full.vision_config)[1]
        assert from_hf == config_from_hf(full)[1] == config_from_dict(full.to_dict())[1]


@pytest.mark.parametrize(
    "change, pattern",
    [
        (dict(hidden_act="no_such_act"), "hidden_act must be one of transformers' ACT2FN names"),
        (dict(num_heads=3), "head_dim"),
        (dict(window_size=14), "window_size"),
        (dict(windowed=False, hidden_act="prelu"), "hidden_act 'prelu' has learned parameters"),
    ],
)
def test_unsupported_configs_raise(change, pattern):
    with pytest.raises(ValueError, match=pattern):
        Qwen2VisionConfig(**{**dict(depth=4, hidden_size=64, num_heads=2), **change})


@pytest.mark.parametrize("config_class", [VisionConfig, Qwen2VisionConfig])
@pytest.mark.parametrize(
    "change, error, pattern",
    [
        (dict(hidden_size="64"), TypeError, r"hidden_size must be an int, got '64'"),
        (dict(depth=True), TypeError, r"depth must be an int, got True"),
        (dict(depth=0), ValueError, r"depth must be >= 1, got 0"),
        (
            dict(num_heads=3),
            ValueError,
            r"hidden_size 64 over num_heads 3 must give a head_dim that is a multiple of 4",
        ),
        (
            dict(hidden_size=1040, num_heads=4),
            ValueError,
            r"hidden_size 1040 over num_heads 4 must give a head_dim .* at most 256",
        ),
    ],
)
def test_both_tower_configs_check_their_sizes(config_class, change, error, pattern):
    """A config.json may hold anything in a size's place: both configs name the field (a string there once made
    a string-formatting error), and both refuse heads the kernels cannot run (Qwen3-VL's did at its first forward)."""
    base = dict(depth=4, hidden_size=64, num_heads=2)
    if config_class is VisionConfig:
        base["deepstack_visual_indexes"] = ()
    with pytest.raises(error, match=rf"{config_class.__name__}: {pattern}"):
        config_class(**{**base, **change})


def test_load_tower_reads_the_tower_kind_from_config_json(tmp_path):
    """save_pretrained of full Qwen2.5-VL / Qwen2-VL models (text weights included), and a Qwen3-VL vision
    checkpoint: load_tower builds the class config.json names, with the checkpoint's weights."""
    for name, config, model_class in (
        ("qwen2_5_vl", qwen2_5_full_config(), Qwen2_5_VLForConditionalGeneration),
        ("qwen2_vl", qwen2_full_config(), Qwen2VLForConditionalGeneration),
    ):
        model = model_class(config)
        model.save_pretrained(tmp_path / name)
        tower = load_tower(tmp_path / name)
        assert type(tower) is Qwen2VisionTransformer and tower.config == config_from_hf(config)[1]
        for key, value in model.model.visual.state_dict().items():
            torch.testing.assert_close(tower.state_dict()[key], value, rtol=0, atol=0)
    from qvl.vit.checkpoint import save_vision_checkpoint
    from towers import hf_vision_model

    qwen3 = hf_vision_model(seed=1)
    save_vision_checkpoint(tmp_path / "qwen3", qwen3.config.to_dict(), qwen3.state_dict())
    assert type(load_tower(tmp_path / "qwen3")) is VisionTransformer
    save_vision_checkpoint(tmp_path / "other", {"model_type": "llava"}, qwen3.state_dict())
    with pytest.raises(ValueError, match="unsupported model_type 'llava'"):
        load_tower(tmp_path / "other")


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_compile_without_recompiles(name):
    """One graph for images, then a video and mixed batches (under fail_on_recompile), each within rounding of
    transformers: no batch-dependent Python value reaches the compiled code (the window tile hint is the
    config's)."""
    config_class, kwargs, model_class, rotary = FAMILIES[name]
    shallow = {**kwargs, "depth": 2, **({"fullatt_block_indexes": [1]} if name == "qwen2_5_vl" else {})}
    config = config_class(**shallow)
    config._attn_implementation = "sdpa"
    hf = randomize(model_class(config), 13).eval()
    tower = Qwen2VisionTransformer.from_hf(hf).compile()
    with force_backend("torch"), torch.no_grad():
        for index, case in enumerate(("one_image", "video", "images")):
            pixels, grid = inputs(case)
            stance = torch.compiler.set_stance("fail_on_recompile") if index else contextlib.nullcontext()
            with stance:
                got = tower(pixels, grid)[0]

            def run(model, pixels=pixels, grid=grid):
                return model(pixels.to(model.dtype), grid_thw=torch.tensor(grid)).pooler_output

            assert_error_within(
                got, float64_run(hf, run, *rotary), run(hf), what=f"{name} compiled {case}", stages=MODEL_STAGES
            )


def test_two_ranks_match_transformers(tmp_path):
    """Weights and data modes of both towers, and patch_model(parallel="data"), on two gloo ranks: every rank
    gets every feature within rounding of transformers (the float64 truth, transformers' fp32 as the yardstick)."""
    run_two_ranks(__file__, tmp_path)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    for name in FAMILIES:
        for case in CASES:
            truth, baseline = reference(name, 21, case)
            for rank, results in enumerate(ranks):
                keys = [f"{name}/weights/{case}", f"{name}/data/{case}"]
                keys += [f"{name}/patched/{case}"] if f"{name}/patched/{case}" in results else []
                for key in keys:
                    assert_error_within(results[key], truth, baseline, what=f"rank {rank}: {key}", stages=MODEL_STAGES)
