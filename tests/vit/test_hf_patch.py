"""qvl.vit.patch_model on tiny random transformers Qwen3-VL models (nothing downloaded)."""

import copy
import functools
import warnings

import pytest
import torch
from accelerate import cpu_offload, dispatch_model
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLModel
from transformers.activations import ACT2FN
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

from qvl.kernels import force_backend
from qvl.vit import VisionTransformer, is_patched, patch_model, register_attention, unpatch_model
from qvl.vit.config import MlpActivation, torch_activation
from qvl.vit.hf_patch import UnfusedFallbackWarning
from ranks import run_two_ranks
from tolerance import assert_error_within
from towers import (
    FALLBACKS_ARE_ERRORS,
    IMAGE_TOKEN_ID,
    MODEL_STAGES,
    TEXT_KWARGS,
    TOKEN_IDS,
    VISION_KWARGS,
    VISION_START_TOKEN_ID,
    float64_copy,
    full_config,
    hf_vision_model,
    moe_full_config,
    pixel_values_for,
    randomize,
    rotary_in_float64,
)

pytestmark = FALLBACKS_ARE_ERRORS

GRID = [[1, 4, 6], [1, 2, 2]]
# A smaller tower than towers.VISION_KWARGS for the tests below that run it many times; out_hidden_size stays the
# text model's hidden size, so full models take it too.
TINY_VISION = {
    **VISION_KWARGS,
    "depth": 2,
    "hidden_size": 64,
    "intermediate_size": 96,
    "deepstack_visual_indexes": [0, 1],
}


def tiny_full_model(seed=0, model_class=Qwen3VLForConditionalGeneration, config=None):
    model = model_class(config or full_config())
    model.config._attn_implementation = "sdpa"
    return randomize(model, seed, std=0.1).eval()


def tiny_vl_config() -> Qwen3VLConfig:
    return Qwen3VLConfig(vision_config=dict(TINY_VISION), text_config=dict(TEXT_KWARGS), **TOKEN_IDS)


class Wrapper(torch.nn.Module):
    """A user's module around a model, reaching it as ``.model``."""

    def __init__(self, model):
        super().__init__()
        self.model = model


def float64_run(module, run, *rotary):
    """``run`` on a float64 copy of ``module`` (the vision rotary in float64 too; ``rotary``: the modeling module
    and rotary class of a family other than Qwen3-VL, see ``towers.rotary_in_float64``), without gradients: the
    ground truth of the suite's tolerance rule (tests/tolerance.py). Inputs are cast by the caller or the model."""
    module64 = float64_copy(module)
    if getattr(module64.config, "_experts_implementation", None) is not None:
        # MoE experts: torch's grouped matmul (transformers' default) has no float64 kernel; the loop over experts
        # does the same sums.
        module64.config._experts_implementation = "eager"
    with rotary_in_float64(*rotary), torch.no_grad():
        return run(module64)


def vision_fields(output) -> list[torch.Tensor]:
    return [output.last_hidden_state, output.pooler_output, *getattr(output, "deepstack_features", [])]


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
    truth = float64_run(hf, lambda hf64: vision_fields(hf64(pixels.double(), grid_thw=grid)))
    with torch.no_grad():
        expected = hf(pixels, grid_thw=grid)
        assert patch_model(hf) is hf and is_patched(hf)
        got = hf(pixels, grid_thw=grid)
    assert_error_within(
        vision_fields(got), truth, vision_fields(expected), what="[last, merged, *deepstack]", stages=MODEL_STAGES
    )


# Every activation transformers' ACT2FN resolves without learned parameters of its own (prelu and xielu have some).
MLP_ACTIVATIONS = sorted(set(ACT2FN) - {"prelu", "xielu"})


@pytest.mark.parametrize("hidden_act", MLP_ACTIVATIONS)
def test_vision_mlp_activations_transformers_names(hidden_act, tower_calls):
    """Every activation a transformers config can name for the vision MLP runs: a GELU on qvl's fused bias+GELU op,
    any other (silu, as transformers' Qwen3-VL testers build their vision configs, relu, ...) as the bias-less GEMM,
    the bias add and torch's activation."""
    hf = hf_vision_model(seed=2, hidden_act=hidden_act, **TINY_VISION)
    pixels, grid = pixel_values_for(GRID), torch.tensor(GRID)
    truth = float64_run(hf, lambda hf64: vision_fields(hf64(pixels.double(), grid_thw=grid)))
    with torch.no_grad():
        expected = hf(pixels, grid_thw=grid)
        got = patch_model(hf)(pixels, grid_thw=grid)
    assert tower_calls == [hf]
    assert_error_within(vision_fields(got), truth, vision_fields(expected), what=hidden_act, stages=MODEL_STAGES)


def test_mlp_activation_takes_the_fused_op_where_one_fits():
    assert [MlpActivation(name).fused for name in ("gelu", "gelu_accurate", "quick_gelu")] == ["none", "tanh", "quick"]
    assert MlpActivation("silu", gated=True).fused == "swiglu" and MlpActivation("swish", gated=True).function is None
    for activation in (MlpActivation("silu"), MlpActivation("gelu", gated=True), MlpActivation("relu")):
        assert activation.fused is None and activation.function is torch_activation(activation.hidden_act)
    with pytest.raises(ValueError, match="hidden_act must be one of transformers' ACT2FN names.*got 'no_such_act'"):
        MlpActivation("no_such_act")


def test_learned_vision_activation_is_refused_by_name():
    with pytest.raises(ValueError, match="hidden_act 'prelu' has learned parameters"):
        patch_model(hf_vision_model(seed=2, hidden_act="prelu", **TINY_VISION))


def test_compiled_patched_model_keeps_deepstack_features():
    """``torch.compile(model, dynamic=True)`` over a patched tower: Dynamo then made the ints of qvl's config
    symbolic, and an ``in`` test over them had dropped every deepstack feature without an error."""
    hf = hf_vision_model(seed=1, **TINY_VISION)
    pixels, grid = pixel_values_for(GRID), torch.tensor(GRID)
    truth = float64_run(hf, lambda hf64: vision_fields(hf64(pixels.double(), grid_thw=grid)))
    with torch.no_grad(), force_backend("torch"):
        expected = hf(pixels, grid_thw=grid)
        got = torch.compile(patch_model(hf), dynamic=True)(pixels, grid_thw=grid)
    assert len(got.deepstack_features) == len(TINY_VISION["deepstack_visual_indexes"])
    assert_error_within(
        vision_fields(got),
        truth,
        vision_fields(expected),
        what="compiled [last, merged, *deepstack]",
        stages=MODEL_STAGES,
    )


def image_inputs(grid, seed):
    input_ids = prompt_for(grid)
    return dict(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        mm_token_type_ids=(input_ids == IMAGE_TOKEN_ID).int(),
        pixel_values=pixel_values_for(grid, seed=seed),
        image_grid_thw=torch.tensor(grid),
    )


def assert_patch_keeps_logits_and_tokens(model, inputs, *rotary):
    """Patch ``model`` (twice: harmless) and check its logits and greedy tokens against the unpatched run
    (``rotary``: see :func:`float64_run`): the logits within the tolerance rule, the tokens equal but where the two
    runs, each within that rule, may order a near-tie either way (:func:`assert_same_greedy_tokens`)."""
    from tolerance import compare

    truth = float64_run(model, lambda model64: model64(**inputs).logits, *rotary)
    greedy = dict(max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        expected_logits = model(**inputs).logits
        expected = model.generate(**inputs, **greedy)
    assert patch_model(patch_model(model)) is model and is_patched(model)
    with force_backend("torch"), torch.no_grad():
        logits = model(**inputs).logits
        got = model.generate(**inputs, **greedy)
    comparison = compare(logits, truth, expected_logits, what="logits", stages=MODEL_STAGES)
    assert comparison.passed, comparison.message()
    # The patched logits are within the bound of the truth, the unpatched (torch's error) within half of it: a score
    # of the two runs differs by at most 1.5 bounds, the gap between two tokens' scores by 3. Every step's scores come
    # from the same model on the same vision features as the prompt's logits, and take their bound.
    assert_same_greedy_tokens(got, expected, 3 * comparison.bound)
    return expected_logits


def assert_same_greedy_tokens(got, expected, apart: float) -> None:
    """Greedy generations (``generate(..., output_scores=True, return_dict_in_generate=True)``) of two numerically
    different runs, whose scores of two tokens may be ordered either way where the expected run's are within
    ``apart`` of each other: the same tokens, except that a row may part at such a near-tie (which run picks which
    token is then the roundings' choice: a CPU's BLAS and SIMD width); from there on that row's tokens follow other
    prefixes and are not compared. A token the expected run scored further below its own fails."""
    prompt = expected.sequences.shape[1] - len(expected.scores)
    assert torch.equal(got.sequences[:, :prompt], expected.sequences[:, :prompt])
    parted = set()
    for step, scores in enumerate(expected.scores[: len(got.scores)]):
        for row in set(range(scores.shape[0])) - parted:
            want, chosen = expected.sequences[row, prompt + step], got.sequences[row, prompt + step]
            if want != chosen:
                gap = (scores[row, want] - scores[row, chosen]).item()
                assert gap <= apart, (
                    f"row {row}, step {step}: token {chosen} where {want} led by {gap:.4g} > {apart:.4g}"
                )
                parted.add(row)
    if not parted:  # the same tokens: the same end
        assert got.sequences.shape == expected.sequences.shape


def test_full_model_logits_generate_and_save(tmp_path):
    model = tiny_full_model()
    inputs = image_inputs(GRID, seed=3)
    expected_logits = assert_patch_keeps_logits_and_tokens(model, inputs)

    model.save_pretrained(tmp_path)
    reloaded = Qwen3VLForConditionalGeneration.from_pretrained(tmp_path).eval()
    assert not is_patched(reloaded)
    with torch.no_grad():  # the unpatched model again, on the same weights: the same logits, bit for bit
        torch.testing.assert_close(reloaded(**inputs).logits, expected_logits, rtol=0, atol=0)


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
    from transformers import LlamaConfig, LlamaModel

    llama_config = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1)
    llama = LlamaModel(LlamaConfig(**llama_config))
    for model in (torch.nn.Linear(2, 2), llama, Wrapper(llama)):
        with pytest.raises(TypeError, match="supported: .*'qwen3_vl', 'qwen3_vl_moe'"):
            patch_model(model)
        with pytest.raises(TypeError, match="unpatch_model: unsupported model"):
            unpatch_model(model)


def test_models_are_recognised_by_model_type(tower_calls):
    """Subclasses of the supported classes and wrappers whose ``.model`` is one are patched; nothing is looked up by
    class name."""

    class MyVisionModel(Qwen3VLVisionModel):
        pass

    class MyVLM(Qwen3VLForConditionalGeneration):
        pass

    vlm = tiny_full_model(seed=14, model_class=MyVLM, config=tiny_vl_config())
    vision = randomize(MyVisionModel(vlm.config.vision_config), 15).eval()
    for model, visual in ((vision, vision), (vlm, vlm.model.visual), (Wrapper(Wrapper(vlm)), vlm.model.visual)):
        assert patch_model(model) is model and is_patched(model) and is_patched(visual)
        with force_backend("torch"), torch.no_grad():
            visual(pixel_values_for(GRID), grid_thw=torch.tensor(GRID))
        assert tower_calls.pop() is visual
        assert unpatch_model(model) is model and not is_patched(visual)


def test_registered_attention_implementation(tmp_path):
    """qvl's attention through transformers' own registry, chosen for the vision config only."""
    tiny_full_model(seed=5).save_pretrained(tmp_path)
    reference = Qwen3VLForConditionalGeneration.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    implementation = {"vision_config": register_attention(), "text_config": "sdpa", "": "sdpa"}
    model = Qwen3VLForConditionalGeneration.from_pretrained(tmp_path, attn_implementation=implementation).eval()
    assert model.model.visual.config._attn_implementation == "qvl_vision"
    pixels, grid = pixel_values_for(GRID, seed=6), torch.tensor(GRID)
    truth = float64_run(reference.model.visual, lambda visual64: visual64(pixels.double(), grid_thw=grid).pooler_output)
    with torch.no_grad():
        expected = reference.model.visual(pixels, grid_thw=grid).pooler_output
        got = model.model.visual(pixels, grid_thw=grid).pooler_output
    assert_error_within(got, truth, expected, what="merged", stages=MODEL_STAGES)


def test_moe_vision_model_outputs_unchanged():
    from transformers import Qwen3VLMoeVisionConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

    config = Qwen3VLMoeVisionConfig(**VISION_KWARGS)
    config._attn_implementation = "sdpa"
    hf = randomize(Qwen3VLMoeVisionModel(config), 7).eval()
    pixels, grid = pixel_values_for(GRID, seed=8), torch.tensor(GRID)
    truth = float64_run(hf, lambda hf64: vision_fields(hf64(pixels.double(), grid_thw=grid)))
    with torch.no_grad():
        expected = hf(pixels, grid_thw=grid)
        got = patch_model(hf)(pixels, grid_thw=grid)
    assert_error_within(
        vision_fields(got), truth, vision_fields(expected), what="[last, merged, *deepstack]", stages=MODEL_STAGES
    )


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


def test_patch_with_token_budgets_pads_to_a_budget(monkeypatch):
    """``patch_model(..., token_budgets=...)`` captures through the runner (on a CPU: the padded batch through the
    normal device part, which is what a replay runs): the outputs, last hidden state included, are transformers'
    within the tolerance rule; hidden states, autograd and batches above every budget take the normal path."""
    hf = hf_vision_model(seed=2, **TINY_VISION)
    pixels, grid = pixel_values_for(GRID), torch.tensor(GRID)
    truth = float64_run(hf, lambda hf64: vision_fields(hf64(pixels.double(), grid_thw=grid)))
    with torch.no_grad():
        expected = hf(pixels, grid_thw=grid)
    patch_model(hf, token_budgets=[64, 16])
    runner = vars(hf)["forward"].runner
    assert runner.captured_budgets == (16, 64)
    runs = []
    run_device = runner.run_device
    monkeypatch.setattr(
        runner, "run_device", lambda pixels, inputs: runs.append(len(pixels)) or run_device(pixels, inputs)
    )
    with torch.no_grad(), force_backend("torch"):
        got = hf(pixels, grid_thw=grid)
        hf(pixels, grid_thw=grid, output_hidden_states=True)
        large = [[1, 8, 10]]
        hf(pixel_values_for(large), grid_thw=torch.tensor(large))
    assert runs == [64, 80]  # the hidden states' call runs device_forward itself
    assert_error_within(
        vision_fields(got),
        truth,
        vision_fields(expected),
        what="padded [last, merged, *deepstack]",
        stages=MODEL_STAGES,
    )
    with force_backend("torch"):
        trained = hf(pixels, grid_thw=grid)
    assert trained.pooler_output.requires_grad and runs == [64, 80, 28]


def test_patch_with_token_budgets_refuses_bad_arguments():
    hf = hf_vision_model(seed=2, **TINY_VISION)
    with pytest.raises(ValueError, match=r"patch_model: token_budgets\[0\] = 30 must be a multiple"):
        patch_model(hf, token_budgets=[30])
    with pytest.raises(TypeError, match=r"patch_model: max_segments must be an int"):
        patch_model(hf, token_budgets=[64], max_segments=1.5)
    with pytest.raises(ValueError, match=r"patch_model: max_segments is given without token_budgets"):
        patch_model(hf, max_segments=4)
    assert not is_patched(hf)


def test_hidden_states_as_transformers(tower_calls):
    """``output_hidden_states`` from the argument or the config: the embedded patches and every block's output, as
    transformers returns them (a selection by index leaves the other entries None, ``return_dict=False`` a tuple)."""
    hf = hf_vision_model(seed=16, **TINY_VISION)
    pixels, grid = pixel_values_for(GRID, seed=17), torch.tensor(GRID)
    truth = float64_run(hf, lambda hf64: hf64(pixels.double(), grid_thw=grid, output_hidden_states=True).hidden_states)
    requests = [({"output_hidden_states": True}, False), ({}, True), ({"output_hidden_states": [0, -1]}, False)]
    with torch.no_grad():
        expected = []
        for kwargs, config_flag in requests:
            hf.config.output_hidden_states = config_flag
            expected.append(hf(pixels, grid_thw=grid, **kwargs))
        expected_tuple = hf(pixels, grid, return_dict=False, output_hidden_states=True)
        patch_model(hf)
        for (kwargs, config_flag), reference in zip(requests, expected):
            hf.config.output_hidden_states = config_flag
            got = hf(pixels, grid_thw=grid, **kwargs)
            assert len(got.hidden_states) == len(reference.hidden_states) == TINY_VISION["depth"] + 1
            for index, (state, baseline) in enumerate(zip(got.hidden_states, reference.hidden_states)):
                assert (state is None) == (baseline is None)
                if state is not None:
                    assert_error_within(
                        state, truth[index], baseline, what=f"hidden_states[{index}]", stages=MODEL_STAGES
                    )
            assert got.hidden_states[-1] is got.last_hidden_state and got.attentions is None
        got_tuple = hf(pixels, grid, return_dict=False, output_hidden_states=True)
    assert len(tower_calls) == len(requests) + 1
    assert (
        [type(x) for x in got_tuple] == [type(x) for x in expected_tuple] == [torch.Tensor, torch.Tensor, list, tuple]
    )
    assert_error_within(got_tuple[3], truth, expected_tuple[3], what="hidden_states of the tuple", stages=MODEL_STAGES)


def test_video_features_hidden_states(tower_calls):
    """transformers' ``get_video_features(..., output_hidden_states=True)`` on a patched model."""
    model = tiny_full_model(seed=18, model_class=Qwen3VLModel, config=tiny_vl_config())
    grid = torch.tensor([[2, 2, 4], [1, 2, 2]])
    pixels = pixel_values_for(grid, seed=19)
    truth = float64_run(model, lambda model64: model64.get_video_features(pixels, grid, output_hidden_states=True))
    with torch.no_grad():
        expected = model.get_video_features(pixels, grid, output_hidden_states=True)
        got = patch_model(model).get_video_features(pixels, grid, output_hidden_states=True)
    assert len(tower_calls) == 1
    assert len(got.hidden_states) == len(expected.hidden_states) == TINY_VISION["depth"] + 1
    assert_error_within(
        got.hidden_states, truth.hidden_states, expected.hidden_states, what="hidden_states", stages=MODEL_STAGES
    )


def as_computed(tensors, dtype=torch.bfloat16) -> list[torch.Tensor]:
    """Results computed under autocast to ``dtype``, in that dtype: an fp32 tensor that came out of 16-bit matmuls
    carries their roundings, so the rule judges it at ``dtype``'s resolution (one more rounding on both sides)."""
    return [t.to(dtype) for t in tensors]


def test_mixed_precision_runs_on_qvl(tower_calls):
    """fp32 weights under bf16 autocast (HF Trainer's bf16=True on an fp32 model): the tower runs on qvl with no
    fallback warning (errors here), its outputs in the dtypes of transformers' own autocast run and within the rule of
    it, the float64 model without autocast as the truth."""
    hf = hf_vision_model(seed=22, **TINY_VISION)
    pixels, grid = pixel_values_for(GRID, seed=23), torch.tensor(GRID)
    truth = float64_run(hf, lambda hf64: vision_fields(hf64(pixels.double(), grid_thw=grid)))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = vision_fields(hf(pixels, grid_thw=grid))
        patch_model(hf)
        got = vision_fields(hf(pixels, grid_thw=grid))
    assert tower_calls == [hf]
    assert [t.dtype for t in got] == [t.dtype for t in expected]
    assert_error_within(
        as_computed(got), truth, as_computed(expected), what="fp32 under bf16 autocast", stages=MODEL_STAGES
    )


def test_autocast_to_the_weights_dtype_runs_on_qvl(tower_calls):
    """bf16 weights under bf16 autocast (HF Trainer's bf16=True on a bf16 model, the usual fine-tuning set-up):
    autocast changes nothing there, and the tower runs on qvl, within the rule of the unpatched bf16 model."""
    hf = hf_vision_model(seed=24, **TINY_VISION)
    pixels, grid = pixel_values_for(GRID, seed=25), torch.tensor(GRID)
    truth = float64_run(hf, lambda hf64: vision_fields(hf64(pixels.double(), grid_thw=grid)))
    hf = hf.bfloat16()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = hf(pixels.bfloat16(), grid_thw=grid)
        patch_model(hf)
        got = hf(pixels.bfloat16(), grid_thw=grid)
    assert tower_calls == [hf]
    assert_error_within(
        vision_fields(got), truth, vision_fields(expected), what="bf16 under bf16 autocast", stages=MODEL_STAGES
    )


def test_attentions_fall_back_to_transformers_with_a_warning(tower_calls):
    """qvl's fused attention has no per-layer attention outputs: such a call runs transformers' own forward."""
    hf = hf_vision_model(seed=20, **TINY_VISION)
    hf.config._attn_implementation = "eager"
    pixels, grid = pixel_values_for(GRID, seed=21), torch.tensor(GRID)
    with torch.no_grad():
        expected = hf(pixels, grid_thw=grid, output_attentions=True, output_hidden_states=True)
        patch_model(hf)
        with pytest.warns(UnfusedFallbackWarning, match="output_attentions"):
            got = hf(pixels, grid_thw=grid, output_attentions=True, output_hidden_states=True)
        hf.config.output_attentions = True
        with pytest.warns(UnfusedFallbackWarning, match="output_attentions"):
            from_config = hf(pixels, grid_thw=grid)
    assert tower_calls == []
    for output in (got, from_config):
        assert len(output.attentions) == TINY_VISION["depth"]
        assert all(torch.equal(a, b) for a, b in zip(output.attentions, expected.attentions, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(got.hidden_states, expected.hidden_states, strict=True))


def test_patch_after_disk_offload(tmp_path, tower_calls):
    """A tower offloaded by accelerate (weights on the meta device until each submodule's hook loads them) runs
    transformers' own forward."""
    tiny_full_model(seed=22, config=tiny_vl_config()).save_pretrained(tmp_path / "model")
    reference = Qwen3VLForConditionalGeneration.from_pretrained(tmp_path / "model").eval()
    device_map = {"model.visual": "disk", "model.language_model": "cpu", "lm_head": "cpu"}
    model = Qwen3VLForConditionalGeneration.from_pretrained(
        tmp_path / "model", device_map=device_map, offload_folder=tmp_path / "offload"
    ).eval()
    hooked_forward = model.model.visual.forward
    patch_model(model)
    inputs = image_inputs(GRID, seed=23)
    with torch.no_grad():
        expected = reference(**inputs).logits
        with pytest.warns(UnfusedFallbackWarning, match="accelerate"):
            logits = model(**inputs).logits
        assert torch.equal(logits, expected) and tower_calls == []
        assert unpatch_model(model).model.visual.forward is hooked_forward
        assert torch.equal(model(**inputs).logits, expected)


def test_cpu_offload_after_patching(tower_calls):
    model = tiny_full_model(seed=24, config=tiny_vl_config())
    inputs = image_inputs(GRID, seed=25)
    with torch.no_grad():
        expected = model(**inputs).logits
        cpu_offload(patch_model(model), execution_device="cpu")
        with pytest.warns(UnfusedFallbackWarning, match="accelerate"):
            logits = model(**inputs).logits
    assert torch.equal(logits, expected) and tower_calls == []


@pytest.mark.parametrize("patch_first", [True, False], ids=["patch_then_dispatch", "dispatch_then_patch"])
def test_tower_runs_on_qvl_inside_accelerate_hook(patch_first, tower_calls):
    """A device map that keeps the tower whole hooks the vision module and its submodules, which only move inputs:
    qvl runs inside the vision module's hook wrapper, and unpatching restores the wrapper and the forward it wraps."""
    model = tiny_full_model(seed=26, config=tiny_vl_config())
    visual = model.model.visual
    inputs = image_inputs(GRID, seed=27)
    truth = float64_run(model, lambda model64: model64(**inputs).logits)
    with torch.no_grad():
        expected = model(**inputs).logits
    device_map = {"model.visual": "cpu", "model.language_model": "cpu", "lm_head": "cpu"}
    if patch_first:
        patch_model(model)
    dispatch_model(model, device_map, force_hooks=True)
    hooked_forward, inner_forward = visual.forward, visual._old_forward
    patch_model(model)
    with force_backend("torch"), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", UnfusedFallbackWarning)
        logits = model(**inputs).logits
    assert tower_calls == [visual]
    assert_error_within(logits, truth, expected, what="logits", stages=MODEL_STAGES)
    unpatch_model(model)
    assert visual.forward is hooked_forward and not is_patched(model)
    if not patch_first:
        assert visual._old_forward is inner_forward
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, expected)


def test_training_step(tower_calls):
    """A training step runs the tower on qvl (every op has a backward; tests/vit/test_training.py compares every
    gradient with transformers'), and so does a frozen tower while the text model trains."""
    reference = tiny_full_model(seed=28, config=tiny_vl_config()).train()
    model, reference64 = patch_model(copy.deepcopy(reference)), float64_copy(reference)
    inputs = image_inputs(GRID, seed=29)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnfusedFallbackWarning)
        model(**inputs, labels=inputs["input_ids"]).loss.backward()
    assert tower_calls == [model.model.visual]
    assert all(p.grad is not None for p in model.model.visual.parameters())

    model.zero_grad()
    for module in (model, reference, reference64):
        module.model.visual.requires_grad_(False)
    reference(**inputs, labels=inputs["input_ids"]).loss.backward()
    with rotary_in_float64():
        reference64(**inputs, labels=inputs["input_ids"]).loss.backward()
    with force_backend("torch"):
        model(**inputs, labels=inputs["input_ids"]).loss.backward()
    assert tower_calls == [model.model.visual] * 2
    parameters = zip(model.named_parameters(), reference.parameters(), reference64.parameters(), strict=True)
    grads = []
    for (name, param), expected, truth in parameters:
        if name.startswith("model.visual."):
            assert param.grad is None
        else:
            grads.append((param.grad, truth.grad, expected.grad))
    # The text model's gradients as one vector: its inputs, the frozen tower's fp32 features, differ from transformers'
    # by the two towers' own roundings, which can move one small tensor's gradient (a norm weight of a few values)
    # past twice transformers' error alone (seen on one Xeon: k_norm's 1.9e-7 against a bound of 1.6e-7).
    got, truth, expected = (torch.cat([g[i].flatten() for g in grads]) for i in range(3))
    assert_error_within(got, truth, expected, what="the text model's gradients", stages=MODEL_STAGES)


def test_unpatch_restores_forward_and_repr():
    hf = hf_vision_model(seed=30, **TINY_VISION)
    unpatched_repr, unpatched_attributes = repr(hf), set(vars(hf))
    assert unpatch_model(hf) is hf  # nothing to undo
    patch_model(patch_model(hf))
    assert is_patched(hf) and "patched by qvl.vit.patch_model" in repr(hf)
    assert unpatch_model(hf) is hf and not is_patched(hf)
    assert repr(hf) == unpatched_repr and set(vars(hf)) == unpatched_attributes
    assert hf.forward.__func__ is type(hf).forward


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
    results = {"repr": repr(model.model.visual)}
    with force_backend("torch"), torch.no_grad():
        for name, grid in DATA_PARALLEL_GRIDS.items():
            out = model.model.visual(pixel_values_for(grid, seed=12), grid_thw=torch.tensor(grid))
            results[name] = [out.pooler_output, *out.deepstack_features]
        results["logits"] = model(**image_inputs(GRID, seed=3)).logits
        grid = DATA_PARALLEL_GRIDS["mixed"]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = model.model.visual(
                pixel_values_for(grid, seed=12), grid_thw=torch.tensor(grid), output_hidden_states=True
            )
        results["hidden_states"] = out.hidden_states
        results["warnings"] = [str(w.message) for w in caught if issubclass(w.category, UnfusedFallbackWarning)]
    # Training through that fallback: every rank runs the whole batch, so its gradients, summed over the ranks as
    # data mode asks, must come out as one process's (transformers' own forward on this rank, unpatched).
    visual = model.model.visual
    gradients = []
    for forward in (visual, functools.partial(type(visual).forward, visual)):
        visual.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnfusedFallbackWarning)
            out = forward(pixel_values_for(grid, seed=12), grid_thw=torch.tensor(grid), output_hidden_states=True)
        (out.pooler_output.sum() + sum(features.sum() for features in out.deepstack_features)).backward()
        gradients.append({name: p.grad.clone() for name, p in visual.named_parameters()})
    for gradient in gradients[0].values():
        dist.all_reduce(gradient)
    results["fallback_gradients"] = gradients
    torch.save(results, f"{out_dir}/rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


def test_data_parallel_patch_over_two_ranks(tmp_path):
    """`patch_model(model, parallel="data")` on two gloo ranks: every rank gets the unpatched model's
    features (images, a video split by frames, a batch that leaves one rank nothing) and logits."""
    # Each rank imports this file, and with it tests/tolerance.py, which pytest finds through the conftest.
    run_two_ranks(__file__, tmp_path, timeout=240, TRITON_INTERPRET="0")

    def references(model):
        """The rank's results, from ``model`` itself: features and logits, and the mixed batch's hidden states."""
        results = {}
        dtype = model.dtype
        for name, grid in DATA_PARALLEL_GRIDS.items():
            out = model.model.visual(pixel_values_for(grid, seed=12).to(dtype), grid_thw=torch.tensor(grid))
            results[name] = [out.pooler_output, *out.deepstack_features]
        results["logits"] = model(**image_inputs(GRID, seed=3)).logits
        grid = DATA_PARALLEL_GRIDS["mixed"]
        results["hidden_states"] = model.model.visual(
            pixel_values_for(grid, seed=12).to(dtype), grid_thw=torch.tensor(grid), output_hidden_states=True
        ).hidden_states
        return results

    model = tiny_full_model(seed=11)
    truth = float64_run(model, references)
    with torch.no_grad():
        expected = references(model)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert "patch_model(parallel='data')" in got["repr"]
        # Each rank encodes only its share of the tokens: the hidden states come from transformers' forward.
        assert len(got["warnings"]) == 1 and "data-parallel" in got["warnings"][0]
        for name in [*DATA_PARALLEL_GRIDS, "logits", "hidden_states"]:
            assert_error_within(
                got[name], truth[name], expected[name], what=f"rank {rank}: {name}", stages=MODEL_STAGES
            )
        summed, single = got["fallback_gradients"]
        assert summed.keys() == single.keys()
        assert all(torch.equal(summed[name], single[name]) for name in single), f"rank {rank}: fallback gradients"


if __name__ == "__main__":
    from ranks import run_rank

    run_rank(_data_parallel_rank)


# The rest of the Qwen vision family whose tower is Qwen3-VL's: (modeling module, vision class, rotary class).
FAMILY = {
    "qwen3_5": ("qwen3_5", "Qwen3_5VisionModel", "Qwen3_5VisionRotaryEmbedding"),
    "qwen3_5_moe": ("qwen3_5_moe", "Qwen3_5MoeVisionModel", "Qwen3_5MoeVisionRotaryEmbedding"),
    "qwen3_omni_moe": ("qwen3_omni_moe", "Qwen3OmniMoeVisionEncoder", "Qwen3OmniMoeVisionRotaryEmbedding"),
}


def family_vision_model(name: str, seed: int):
    import importlib

    module_name, vision_class, rotary_class = FAMILY[name]
    modeling = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    model_class = getattr(modeling, vision_class)
    fields = dict(VISION_KWARGS)
    if "deepstack_visual_indexes" not in model_class.config_class.__annotations__:
        del fields["deepstack_visual_indexes"]  # Qwen3.5: no deepstack mergers
    config = model_class.config_class(**fields)
    config._attn_implementation = "sdpa"
    return randomize(model_class(config), seed).eval(), (modeling, rotary_class)


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_family_vision_models_unchanged(name):
    """Qwen3.5 (no deepstack: plain pooling output, as transformers returns), Qwen3.5-MoE and Qwen3-Omni's
    vision encoder (mergers named ln_q / mlp) against transformers in float64, video included."""
    hf, rotary = family_vision_model(name, seed=2)
    grid_thw = [[1, 4, 6], [2, 2, 4]]
    pixels, grid = pixel_values_for(grid_thw), torch.tensor(grid_thw)
    truth = float64_run(hf, lambda hf64: vision_fields(hf64(pixels.double(), grid_thw=grid)), *rotary)
    with torch.no_grad():
        expected = hf(pixels, grid_thw=grid)
        patch_model(hf)
        got = hf(pixels, grid_thw=grid)
    assert type(got) is type(expected) and set(got.keys()) == set(expected.keys())
    assert_error_within(
        vision_fields(got), truth, vision_fields(expected), what=f"{name} [last, merged, ...]", stages=MODEL_STAGES
    )
    with torch.no_grad():
        merged, deepstack = VisionTransformer.from_hf(hf)(pixels, grid_thw)
    assert_error_within(
        [merged, *deepstack], truth[1:], vision_fields(expected)[1:], what=f"{name} from_hf", stages=MODEL_STAGES
    )


def test_qwen3_omni_tower_found_under_thinker():
    """Qwen3-Omni's full model holds its thinker, whose ``.visual`` is the vision encoder."""
    encoder, _ = family_vision_model("qwen3_omni_moe", seed=3)
    thinker = torch.nn.Module()
    thinker.config = type("ThinkerConfig", (), {"model_type": "qwen3_omni_moe_thinker"})()
    thinker.visual = encoder
    omni = torch.nn.Module()
    omni.thinker = thinker
    assert patch_model(omni) is omni and is_patched(omni) and is_patched(encoder)


def test_qwen3_5_full_model_logits_and_generate():
    """Qwen3.5 (hybrid linear/full attention text model) with its tower patched: logits and greedy tokens."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    from transformers.models.qwen3_5 import modeling_qwen3_5

    vision = {k: v for k, v in VISION_KWARGS.items() if k != "deepstack_visual_indexes"}
    text = {
        **TEXT_KWARGS,
        "layer_types": ["linear_attention", "full_attention"],
        "linear_num_value_heads": 2,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "rope_parameters": {**TEXT_KWARGS["rope_parameters"], "partial_rotary_factor": 1.0},
    }
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(vision_config=vision, text_config=text, **TOKEN_IDS))
    model.config._attn_implementation = "sdpa"
    model = randomize(model, 4, std=0.1).eval()
    assert_patch_keeps_logits_and_tokens(
        model, image_inputs([[1, 4, 4]], seed=5), modeling_qwen3_5, "Qwen3_5VisionRotaryEmbedding"
    )
