"""Tiny Qwen3-VL models with random weights, built from transformers' configs (nothing downloaded), and
their float64 runs: the ground truth of the suite's tolerance rule (tests/tolerance.py)."""

import contextlib
import copy
import dataclasses
from unittest import mock

import pytest
import torch
from transformers import Qwen3VLConfig, Qwen3VLVisionConfig
from transformers.models.qwen3_vl import modeling_qwen3_vl
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

# The tests' segment offsets are the checks' own (re-exported: tests import it from here).
from qvl.kernels.verify import cu_seqlens_of  # noqa: F401

IMAGE_TOKEN_ID = 60
VIDEO_TOKEN_ID = 61
VISION_START_TOKEN_ID = 62

VISION_KWARGS = dict(
    depth=3,
    hidden_size=144,
    num_heads=2,
    intermediate_size=200,
    out_hidden_size=96,
    deepstack_visual_indexes=[0, 2],
    num_position_embeddings=64,
)


# A patched call that fell back to transformers' own forward would pass every "same as unpatched" check: the test
# modules that mark themselves with this (``pytestmark = FALLBACKS_ARE_ERRORS``) make a fallback an error unless a
# test expects it (pytest.warns, or warnings caught and recorded).
FALLBACKS_ARE_ERRORS = pytest.mark.filterwarnings("error::qvl.vit.hf_patch.UnfusedFallbackWarning")


def model_stages(model: torch.nn.Module, backward: bool = False) -> int:
    """The rounded stages in sequence of ``model``'s computation (qvl.kernels.tolerance's ``stages``: the rule's
    check that torch's own result agrees with the float64 truth allows each stage its rounding): two per leaf module
    (its own operation, and the residual add, softmax or product beside it), twice that for gradients (which pass
    back through every stage)."""
    leaves = sum(1 for module in model.modules() if not list(module.children()))
    return 2 * leaves * (2 if backward else 1)


# The most rounded stages of any model the tests compare whole, forward and backward (model_stages of each: at most 80
# leaf modules; tests/vit/test_model_stages.py checks the model builders of towers.py and test_hf_patch.py).
MODEL_STAGES = 320


def vision_config(**overrides) -> Qwen3VLVisionConfig:
    config = Qwen3VLVisionConfig(**{**VISION_KWARGS, **overrides})
    config._attn_implementation = "sdpa"
    return config


def randomize(module: torch.nn.Module, seed: int = 0, std: float = 0.05) -> torch.nn.Module:
    """Random weights everywhere; norm scales near 1 (init leaves LayerNorms at exactly 1 and 0, which hides bugs)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=generator) * std
            param.copy_(noise + 1.0 if "norm" in name and name.endswith("weight") else noise)
    return module


def hf_vision_model(seed: int = 0, **overrides) -> Qwen3VLVisionModel:
    return randomize(Qwen3VLVisionModel(vision_config(**overrides)), seed).eval()


TEXT_KWARGS = dict(
    vocab_size=128,
    hidden_size=96,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=48,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 8, 8]},
)
MOE_TEXT_KWARGS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
TOKEN_IDS = dict(
    image_token_id=IMAGE_TOKEN_ID, video_token_id=VIDEO_TOKEN_ID, vision_start_token_id=VISION_START_TOKEN_ID
)


def full_config() -> Qwen3VLConfig:
    return Qwen3VLConfig(vision_config=dict(VISION_KWARGS), text_config=dict(TEXT_KWARGS), **TOKEN_IDS)


def moe_full_config():
    """The MoE variant (Qwen3-VL-30B-A3B's classes) at toy size."""
    from transformers import Qwen3VLMoeConfig

    return Qwen3VLMoeConfig(
        vision_config=dict(VISION_KWARGS), text_config={**TEXT_KWARGS, **MOE_TEXT_KWARGS}, **TOKEN_IDS
    )


def pixel_values_for(grid_thw, seed: int = 0, channels: int = 3 * 2 * 16 * 16) -> torch.Tensor:
    tokens = int(torch.as_tensor(grid_thw).prod(-1).sum())
    return torch.randn(tokens, channels, generator=torch.Generator().manual_seed(seed))


def hf_vision_model_of(tower) -> Qwen3VLVisionModel:
    """transformers' vision model with a qvl ``VisionTransformer``'s shape and weights, in the tower's dtype."""
    fields = dataclasses.asdict(tower.config)
    rope_theta = fields.pop("rope_theta")
    fields.pop("layer_norm_eps")  # transformers' vision LayerNorms have eps 1e-6, qvl's default
    fields["deepstack_visual_indexes"] = list(fields["deepstack_visual_indexes"])
    model = Qwen3VLVisionModel(vision_config(**fields, rope_parameters={"rope_theta": rope_theta}))
    model.load_state_dict(tower.state_dict())
    return model.to(tower.dtype).eval()


@contextlib.contextmanager
def rotary_in_float64(modeling=modeling_qwen3_vl, rotary_class: str = "Qwen3VLVisionRotaryEmbedding"):
    """Inside the block a float64 transformers vision model also rotates q and k in float64.

    transformers computes the vision rotary in fp32 whatever the model's dtype (``.float()`` casts in
    ``Qwen3VLVisionRotaryEmbedding.forward`` and ``apply_rotary_pos_emb_vision``), which would leave a
    float64 run only fp32-accurate there. The inverse frequencies ``rope_theta ** (-i / n)`` are computed
    in float64 too: they are not weights but a rounding of each implementation (like ``float64_rotary`` in
    tests/conftest.py). Other dtypes run transformers' code. ``modeling`` and ``rotary_class``: another model's
    module whose vision rotary is written the same way (Qwen3.5's).
    """
    rotary_forward = getattr(modeling, rotary_class).forward
    apply_rotary = modeling.apply_rotary_pos_emb_vision

    def forward(self, x, position_ids):
        if x.dtype != torch.float64:
            return rotary_forward(self, x, position_ids)
        n = self.inv_freq.numel()
        exponents = torch.arange(n, dtype=torch.float64, device=x.device) / n
        freqs = position_ids[..., None].double() * self.config.rope_parameters["rope_theta"] ** -exponents
        scale = self.attention_scaling
        return self.recomposition_frequencies(freqs.cos() * scale), self.recomposition_frequencies(freqs.sin() * scale)

    def apply(q, k, cos, sin):
        if q.dtype != torch.float64:
            return apply_rotary(q, k, cos, sin)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        rotate_half = modeling.rotate_half
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    with (
        mock.patch.object(getattr(modeling, rotary_class), "forward", forward),
        mock.patch.object(modeling, "apply_rotary_pos_emb_vision", apply),
    ):
        yield


def vision_outputs(model: Qwen3VLVisionModel, pixel_values: torch.Tensor, grid_thw) -> list[torch.Tensor]:
    """``[pooler_output, *deepstack_features]`` of a transformers vision model, in the model's dtype; ``grid_thw``
    goes to the pixels' device, as a processor's batch moved to the model's device does (transformers builds its
    position-embedding indices there)."""
    with torch.no_grad():
        out = model(pixel_values.to(model.dtype), grid_thw=torch.as_tensor(grid_thw, device=pixel_values.device))
    return [out.pooler_output, *out.deepstack_features]


def float64_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A float64 copy of a transformers module (the original keeps its dtype): the same computation on the
    same, already rounded, weights without further rounding."""
    return copy.deepcopy(module).double()


def float64_vision_outputs(model: Qwen3VLVisionModel, pixel_values: torch.Tensor, grid_thw) -> list[torch.Tensor]:
    """:func:`vision_outputs` of a float64 copy of ``model`` (rotary included) on the same, already
    rounded, inputs and weights: the ground truth for ``tolerance.assert_error_within``."""
    with rotary_in_float64():
        return vision_outputs(float64_copy(model), pixel_values.double(), grid_thw)


# name -> (transformers' class prefix, vision model class, vision config). Qwen2.5-VL: 56-px windows (2 x 2 merged
# tokens) that the grids below cut into partial ones, full attention in block 1 only; Qwen2-VL: QuickGELU. Head
# dim 32 both.
QWEN2_FAMILIES = {
    "qwen2_5_vl": (
        "Qwen2_5_VL",
        "Qwen2_5_VisionTransformerPretrainedModel",
        dict(
            depth=2,
            hidden_size=64,
            num_heads=2,
            intermediate_size=96,
            out_hidden_size=96,
            window_size=56,
            fullatt_block_indexes=[1],
        ),
    ),
    "qwen2_vl": (
        "Qwen2VL",
        "Qwen2VisionTransformerPretrainedModel",
        dict(depth=2, embed_dim=64, num_heads=2, mlp_ratio=2, hidden_size=96),
    ),
}
QWEN2_GRID = [[1, 6, 10], [2, 4, 6], [1, 2, 2]]


def hf_qwen2_family_tower(name: str, seed: int) -> torch.nn.Module:
    """transformers' vision tower of the Qwen2 family ``name`` (a key of :data:`QWEN2_FAMILIES`) with random weights."""
    import importlib

    prefix, model_class, kwargs = QWEN2_FAMILIES[name]
    modeling = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    configuration = importlib.import_module(f"transformers.models.{name}.configuration_{name}")
    config = getattr(configuration, f"{prefix}VisionConfig")(**kwargs)
    config._attn_implementation = "sdpa"
    return randomize(getattr(modeling, model_class)(config), seed=seed).eval()


def float64_qwen2_family_outputs(
    name: str, model: torch.nn.Module, pixel_values: torch.Tensor, grid_thw
) -> torch.Tensor:
    """The merged features of a float64 copy of the Qwen2-family tower ``model`` (rotary included): the truth."""
    import importlib

    modeling = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    prefix = QWEN2_FAMILIES[name][0]
    with torch.no_grad(), rotary_in_float64(modeling, f"{prefix}VisionRotaryEmbedding"):
        return float64_copy(model)(pixel_values.double(), grid_thw=torch.tensor(grid_thw)).pooler_output
