"""qvl.vit.patch_model on tiny random transformers Qwen3-VL models (nothing downloaded)."""

import pytest
import torch
from towers import (
    IMAGE_TOKEN_ID,
    VISION_START_TOKEN_ID,
    full_config,
    hf_vision_model,
    moe_full_config,
    pixel_values_for,
    randomize,
)
from transformers import Qwen3VLForConditionalGeneration, Qwen3VLModel

from qvl.kernels import force_backend
from qvl.vit import is_patched, patch_model, register_attention

GRID = [[1, 4, 6], [1, 2, 2]]


def tiny_full_model(seed=0, model_class=Qwen3VLForConditionalGeneration, config=None):
    model = model_class(config or full_config())
    model.config._attn_implementation = "sdpa"
    return randomize(model, seed, std=0.1).eval()


def prompt_for(grid):
    """Token ids with one vision-start marker and the image placeholders each image needs."""
    ids = [1, 2, 3]
    for t, h, w in grid:
        ids += [VISION_START_TOKEN_ID] + [IMAGE_TOKEN_ID] * (t * h * w // 4) + [4]
    ids += [5, 6]
    return torch.tensor([ids])


def test_vision_model_outputs_unchanged():
    hf = hf_vision_model(seed=1)
    pixels, grid = pixel_values_for(GRID), torch.tensor(GRID)
    with torch.no_grad():
        expected = hf(pixels, grid_thw=grid)
        assert patch_model(hf) is hf and is_patched(hf)
        got = hf(pixels, grid_thw=grid)
    torch.testing.assert_close(got.pooler_output, expected.pooler_output, rtol=1e-4, atol=1e-5)
    for a, b in zip(got.deepstack_features, expected.deepstack_features):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.last_hidden_state, expected.last_hidden_state, rtol=1e-4, atol=1e-5)


def image_inputs(grid, seed):
    input_ids = prompt_for(grid)
    return dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                mm_token_type_ids=(input_ids == IMAGE_TOKEN_ID).int(),
                pixel_values=pixel_values_for(grid, seed=seed), image_grid_thw=torch.tensor(grid))


def assert_patch_keeps_logits_and_tokens(model, inputs):
    """Patch ``model`` (twice: harmless) and check its logits and greedy tokens against the unpatched run."""
    with torch.no_grad():
        expected_logits = model(**inputs).logits
        expected_tokens = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert patch_model(patch_model(model)) is model and is_patched(model)
    with force_backend("torch"), torch.no_grad():
        logits = model(**inputs).logits
        tokens = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(tokens, expected_tokens)
    return expected_logits


def test_full_model_logits_generate_and_save(tmp_path):
    model = tiny_full_model()
    inputs = image_inputs(GRID, seed=3)
    expected_logits = assert_patch_keeps_logits_and_tokens(model, inputs)

    model.save_pretrained(tmp_path)
    reloaded = Qwen3VLForConditionalGeneration.from_pretrained(tmp_path).eval()
    assert not is_patched(reloaded)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**inputs).logits, expected_logits, rtol=1e-4, atol=1e-4)


def test_moe_full_model_logits_and_generate():
    from transformers import Qwen3VLMoeForConditionalGeneration

    model = tiny_full_model(seed=9, model_class=Qwen3VLMoeForConditionalGeneration, config=moe_full_config())
    assert_patch_keeps_logits_and_tokens(model, image_inputs(GRID, seed=10))


def test_dtype_cast_after_patching_keeps_working():
    model = Qwen3VLModel(full_config())
    model.config._attn_implementation = "sdpa"
    randomize(model, 2).eval()
    patch_model(model).half()
    pixels = pixel_values_for(GRID, seed=4).half()
    with force_backend("torch"), torch.no_grad():
        features = model.get_image_features(pixels, torch.tensor(GRID))
    assert [f.dtype for f in features.pooler_output] == [torch.float16] * 2
    assert [f.shape[0] for f in features.pooler_output] == [6, 1]


def test_unsupported_model_raises_type_error():
    with pytest.raises(TypeError, match="supported: Qwen3VLForConditionalGeneration"):
        patch_model(torch.nn.Linear(2, 2))


def test_registered_attention_implementation(tmp_path):
    """qvl's attention through transformers' own registry, chosen for the vision config only."""
    tiny_full_model(seed=5).save_pretrained(tmp_path)
    reference = Qwen3VLForConditionalGeneration.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    implementation = {"vision_config": register_attention(), "text_config": "sdpa", "": "sdpa"}
    model = Qwen3VLForConditionalGeneration.from_pretrained(tmp_path, attn_implementation=implementation).eval()
    assert model.model.visual.config._attn_implementation == "qvl_vision"
    pixels, grid = pixel_values_for(GRID, seed=6), torch.tensor(GRID)
    with torch.no_grad():
        expected = reference.model.visual(pixels, grid_thw=grid).pooler_output
        got = model.model.visual(pixels, grid_thw=grid).pooler_output
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_moe_vision_model_outputs_unchanged():
    from transformers import Qwen3VLMoeVisionConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel
    from towers import VISION_KWARGS

    config = Qwen3VLMoeVisionConfig(**VISION_KWARGS)
    config._attn_implementation = "sdpa"
    hf = randomize(Qwen3VLMoeVisionModel(config), 7).eval()
    pixels, grid = pixel_values_for(GRID, seed=8), torch.tensor(GRID)
    with torch.no_grad():
        expected = hf(pixels, grid_thw=grid)
        got = patch_model(hf)(pixels, grid_thw=grid)
    torch.testing.assert_close(got.pooler_output, expected.pooler_output, rtol=1e-4, atol=1e-5)
    for a, b in zip(got.deepstack_features, expected.deepstack_features):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
