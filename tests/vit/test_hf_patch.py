"""qvl.vit.patch_model on tiny random transformers Qwen3-VL models (nothing downloaded)."""

import os
import subprocess
import sys

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


def test_patched_empty_batch():
    hf = patch_model(hf_vision_model(seed=12))
    with torch.no_grad():
        out = hf(torch.empty(0, 1536), grid_thw=torch.empty(0, 3, dtype=torch.long))
    assert out.pooler_output.shape == (0, 96) and [d.shape for d in out.deepstack_features] == [(0, 96)] * 2


def test_patch_model_parallel_arguments():
    hf = hf_vision_model(seed=13)
    with pytest.raises(ValueError, match="VisionTransformer.from_hf"):
        patch_model(hf, parallel="weights")
    with pytest.raises(ValueError, match="patch_model: parallel must be"):
        patch_model(hf, parallel="tensor")
    with pytest.raises(RuntimeError, match=r"patch_model\(parallel='data'\) needs torch.distributed"):
        patch_model(hf, parallel="data")
    assert not is_patched(hf)


# --------------------------------------------------------------------------------------------------
# Data-parallel patch: two gloo ranks, started by the test below (this file run as a script is one rank)
# --------------------------------------------------------------------------------------------------
DATA_PARALLEL_GRIDS = {"mixed": [[1, 4, 6], [3, 2, 4], [1, 2, 2], [1, 6, 2]], "one_image": [[1, 4, 4]]}


def _data_parallel_rank(out_dir: str) -> None:
    import torch.distributed as dist

    from qvl.vit.parallel import init_from_env

    init_from_env("cpu")
    model = tiny_full_model(seed=11)
    patch_model(model, parallel="data")
    results = {"mode": model.model.visual.forward.__func__.keywords["data_parallel"].mode}
    with force_backend("torch"), torch.no_grad():
        for name, grid in DATA_PARALLEL_GRIDS.items():
            out = model.model.visual(pixel_values_for(grid, seed=12), grid_thw=torch.tensor(grid))
            results[name] = [out.pooler_output, *out.deepstack_features]
        results["logits"] = model(**image_inputs(GRID, seed=3)).logits
    torch.save(results, f"{out_dir}/rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


def test_data_parallel_patch_over_two_ranks(tmp_path):
    """`patch_model(model, parallel="data")` on two gloo ranks: every rank gets the unpatched model's
    features (images, a video split by frames, a batch that leaves one rank nothing) and logits."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               __file__, str(tmp_path)]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]

    model = tiny_full_model(seed=11)
    with torch.no_grad():
        expected = {}
        for name, grid in DATA_PARALLEL_GRIDS.items():
            out = model.model.visual(pixel_values_for(grid, seed=12), grid_thw=torch.tensor(grid))
            expected[name] = [out.pooler_output, *out.deepstack_features]
        expected["logits"] = model(**image_inputs(GRID, seed=3)).logits
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["mode"] == "data"
        for name in DATA_PARALLEL_GRIDS:
            for a, b in zip(got[name], expected[name], strict=True):
                # fp32 rounding: this model's weights are twice as large as the vision-only tests' ones
                torch.testing.assert_close(a, b, rtol=1e-4, atol=5e-5)
        torch.testing.assert_close(got["logits"], expected["logits"], rtol=1e-4, atol=1e-4)


if __name__ == "__main__":
    _data_parallel_rank(sys.argv[1])
