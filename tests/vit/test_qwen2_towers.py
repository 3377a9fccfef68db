"""qvl.vit.patch_model on tiny random transformers Qwen2.5-VL and Qwen2-VL models (nothing downloaded)."""

import pytest
import torch
from test_hf_patch import Wrapper, assert_patch_keeps_logits_and_tokens, float64_run
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
)
from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_vl import modeling_qwen2_vl
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
from transformers.vision_utils import get_vision_position_ids, get_vision_window_index

from qvl.vit import is_patched, patch_model, unpatch_model
from qvl.vit.families import config_from_hf
from qvl.vit.runner import build_tower_metadata
from tolerance import assert_error_within
from towers import (
    FALLBACKS_ARE_ERRORS,
    IMAGE_TOKEN_ID,
    MODEL_STAGES,
    TEXT_KWARGS,
    TOKEN_IDS,
    VISION_START_TOKEN_ID,
    pixel_values_for,
    randomize,
)

pytestmark = FALLBACKS_ARE_ERRORS

PATCH_DIM = 3 * 2 * 14 * 14
# A window of 56 pixels is 2 x 2 merge units (4 x 4 patches): grids 6 x 10 and 2 x 6 leave partial windows.
GRID = [[1, 6, 10], [2, 4, 6], [1, 2, 2]]
QWEN2_5_VISION = dict(
    depth=4,
    hidden_size=64,
    num_heads=2,
    intermediate_size=96,
    out_hidden_size=96,
    window_size=56,
    fullatt_block_indexes=[1, 3],
)
QWEN2_VISION = dict(depth=3, embed_dim=64, num_heads=2, mlp_ratio=2, hidden_size=96)
FAMILIES = {
    "qwen2_5_vl": (
        Qwen2_5_VLVisionConfig,
        QWEN2_5_VISION,
        modeling_qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel,
        (modeling_qwen2_5_vl, "Qwen2_5_VLVisionRotaryEmbedding"),
    ),
    "qwen2_vl": (
        Qwen2VLVisionConfig,
        QWEN2_VISION,
        modeling_qwen2_vl.Qwen2VisionTransformerPretrainedModel,
        (modeling_qwen2_vl, "Qwen2VLVisionRotaryEmbedding"),
    ),
}


def vision_model(name: str, seed: int, **overrides):
    config_class, kwargs, model_class, rotary = FAMILIES[name]
    config = config_class(**{**kwargs, **overrides})
    config._attn_implementation = "sdpa"
    return randomize(model_class(config), seed).eval(), rotary


def fields(output) -> list[torch.Tensor]:
    return [output.last_hidden_state, output.pooler_output]


def test_metadata_matches_transformers():
    """Window-ordered rotary positions, frame and window segments as transformers builds them."""
    config = config_from_hf(Qwen2_5_VLVisionConfig(**QWEN2_5_VISION))[1]
    grid = torch.tensor(GRID)
    meta = build_tower_metadata(grid, config)
    window_index, cu_window_seqlens = get_vision_window_index(grid, spatial_merge_size=2, window_size=56, patch_size=14)
    positions = get_vision_position_ids(grid, 2).view(-1, 4, 2)[window_index].view(-1, 2)
    torch.testing.assert_close(meta.positions, positions.int(), rtol=0, atol=0)
    torch.testing.assert_close(meta.window.window_index, window_index, rtol=0, atol=0)
    torch.testing.assert_close(meta.window.cu_window_seqlens, cu_window_seqlens.int(), rtol=0, atol=0)
    torch.testing.assert_close(meta.window.reverse_index, torch.argsort(window_index), rtol=0, atol=0)
    # The windowed blocks' tile hint is the config's window (16 tokens here), which no window exceeds.
    assert meta.window.max_window_seqlen == config.window_tokens == 16 and meta.num_tokens == 60 + 48 + 4
    assert meta.merged_token_counts == (15, 12, 1)

    plain = build_tower_metadata(grid, config_from_hf(Qwen2VLVisionConfig(**QWEN2_VISION))[1])
    torch.testing.assert_close(plain.positions, get_vision_position_ids(grid, 2).int(), rtol=0, atol=0)
    assert plain.window is None
    torch.testing.assert_close(plain.cu_seqlens, torch.tensor([0, 60, 84, 108, 112], dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_vision_model_outputs_unchanged(name, dtype):
    """Images and a video, sizes not multiples of the window: last_hidden_state (window order for Qwen2.5-VL),
    pooler_output and every hidden state against transformers in float64."""
    hf, rotary = vision_model(name, seed=1)
    hf = hf.to(dtype)
    pixels, grid = pixel_values_for(GRID, channels=PATCH_DIM), torch.tensor(GRID)

    def run(model):
        return model(pixels.to(model.dtype), grid_thw=grid, output_hidden_states=True)

    out64 = float64_run(hf, run, *rotary)
    truth = fields(out64) + list(out64.hidden_states)
    with torch.no_grad():
        expected = run(hf)
        assert patch_model(hf) is hf and is_patched(hf)
        got = run(hf)
    assert type(got) is type(expected) and set(got.keys()) == set(expected.keys())
    assert len(got.hidden_states) == len(expected.hidden_states) == hf.config.depth + 1
    actual, baseline = fields(got) + list(got.hidden_states), fields(expected) + list(expected.hidden_states)
    assert_error_within(actual, truth, baseline, what=f"{name} [last, merged, *hidden_states]", stages=MODEL_STAGES)
    with torch.no_grad():  # a plain call too: return_dict and no hidden states
        plain = hf(pixels, grid_thw=grid, return_dict=False)
    torch.testing.assert_close(plain[1], got.pooler_output, rtol=0, atol=0)


@pytest.mark.parametrize(
    "name, overrides",
    [
        # transformers' default full-attention blocks on a depth-2 tower: never reached, as in transformers.
        ("qwen2_5_vl", dict(depth=2, fullatt_block_indexes=[7, 15, 23, 31])),
        ("qwen2_vl", dict(hidden_act="gelu")),
        ("qwen2_vl", dict(hidden_act="gelu_pytorch_tanh")),
        ("qwen2_vl", dict(hidden_act="silu")),
        ("qwen2_vl", dict(hidden_act="relu")),
        ("qwen2_5_vl", dict(depth=2, hidden_act="gelu_pytorch_tanh")),
        ("qwen2_5_vl", dict(depth=2, hidden_act="relu")),
        ("qwen2_5_vl", dict(depth=2, hidden_act="swish")),
    ],
    ids=[
        "qwen2_5_vl-fullatt-past-depth",
        "qwen2_vl-gelu",
        "qwen2_vl-gelu-tanh",
        "qwen2_vl-silu",
        "qwen2_vl-relu",
        "qwen2_5_vl-gated-gelu-tanh",
        "qwen2_5_vl-gated-relu",
        "qwen2_5_vl-swish",
    ],
)
def test_configs_transformers_accepts_run_on_qvl(name, overrides, tower_calls):
    """Configs transformers runs and qvl once refused: the tower runs on qvl (not the fallback) and matches. Every
    MLP activation transformers' ACT2FN resolves runs, Qwen2.5-VL's gated MLP with any activation of the gate too
    (fused bias_swiglu for silu / swish, else the bias-less GEMMs then torch's activation)."""
    hf, rotary = vision_model(name, seed=2, **overrides)
    pixels, grid = pixel_values_for(GRID, channels=PATCH_DIM), torch.tensor(GRID)

    def run(model):
        return [model(pixels.to(model.dtype), grid_thw=grid).pooler_output]

    truth = float64_run(hf, run, *rotary)
    with torch.no_grad():
        expected = run(hf)
        got = run(patch_model(hf))
    assert tower_calls == [hf]
    assert_error_within(got, truth, expected, what=f"{name} {overrides}", stages=MODEL_STAGES)


def test_models_found_and_unpatched():
    """Full, inner and wrapped models are recognised by model_type; weight sharding is refused (it would shard the
    model's own parameters), data mode needs a process group."""
    for config_class, model_class in (
        (qwen2_5_full_config, Qwen2_5_VLForConditionalGeneration),
        (qwen2_full_config, Qwen2VLForConditionalGeneration),
    ):
        vlm = model_class(config_class())
        visual = vlm.model.visual
        for model in (vlm, vlm.model, Wrapper(vlm), visual):
            assert patch_model(model) is model and is_patched(model) and is_patched(visual)
            assert "forward patched by qvl.vit.patch_model" in repr(visual)
            assert unpatch_model(model) is model and not is_patched(visual)
        with pytest.raises(ValueError, match=r"Qwen2VisionTransformer\.from_hf\(visual, parallel='weights'\)"):
            patch_model(vlm, parallel="weights")
        with pytest.raises(RuntimeError, match="torch.distributed"):
            patch_model(vlm, parallel="data")
        assert not is_patched(visual)


def test_unsupported_activation_is_refused():
    config = Qwen2VLVisionConfig(**{**QWEN2_VISION, "hidden_act": "prelu"})
    model = modeling_qwen2_vl.Qwen2VisionTransformerPretrainedModel(config)
    with pytest.raises(ValueError, match="hidden_act 'prelu' has learned parameters"):
        patch_model(model)
    assert not is_patched(model)


def test_empty_batch():
    hf, _ = vision_model("qwen2_5_vl", seed=2)
    patch_model(hf)
    with torch.no_grad():
        out = hf(torch.empty(0, PATCH_DIM), grid_thw=torch.empty(0, 3, dtype=torch.long))
    assert out.pooler_output.shape == (0, 96) and out.last_hidden_state.shape == (0, 64)


def qwen2_5_full_config() -> Qwen2_5_VLConfig:
    return Qwen2_5_VLConfig(vision_config=dict(QWEN2_5_VISION), text_config=dict(TEXT_KWARGS), **TOKEN_IDS)


def qwen2_full_config() -> Qwen2VLConfig:
    return Qwen2VLConfig(vision_config=dict(QWEN2_VISION), text_config=dict(TEXT_KWARGS), **TOKEN_IDS)


def image_inputs(grid, seed):
    ids = [1, 2, 3]
    for t, h, w in grid:
        ids += [VISION_START_TOKEN_ID] + [IMAGE_TOKEN_ID] * (t * h * w // 4) + [4]
    input_ids = torch.tensor([ids + [5, 6]])
    return dict(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        mm_token_type_ids=(input_ids == IMAGE_TOKEN_ID).int(),
        pixel_values=pixel_values_for(grid, seed=seed, channels=PATCH_DIM),
        image_grid_thw=torch.tensor(grid),
    )


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_full_model_logits_and_generate(name):
    config, model_class = {
        "qwen2_5_vl": (qwen2_5_full_config, Qwen2_5_VLForConditionalGeneration),
        "qwen2_vl": (qwen2_full_config, Qwen2VLForConditionalGeneration),
    }[name]
    model = model_class(config())
    model.config._attn_implementation = "sdpa"
    model = randomize(model, 4, std=0.1).eval()
    assert_patch_keeps_logits_and_tokens(model, image_inputs([[1, 6, 10], [1, 2, 2]], seed=5), *FAMILIES[name][3])
