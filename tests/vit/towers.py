"""Tiny Qwen3-VL models with random weights, built from transformers' configs (nothing downloaded)."""

import torch
from transformers import Qwen3VLConfig, Qwen3VLVisionConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

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
TOKEN_IDS = dict(image_token_id=IMAGE_TOKEN_ID, video_token_id=VIDEO_TOKEN_ID,
                 vision_start_token_id=VISION_START_TOKEN_ID)


def full_config() -> Qwen3VLConfig:
    return Qwen3VLConfig(vision_config=dict(VISION_KWARGS), text_config=dict(TEXT_KWARGS), **TOKEN_IDS)


def moe_full_config():
    """The MoE variant (Qwen3-VL-30B-A3B's classes) at toy size."""
    from transformers import Qwen3VLMoeConfig

    return Qwen3VLMoeConfig(vision_config=dict(VISION_KWARGS), text_config={**TEXT_KWARGS, **MOE_TEXT_KWARGS},
                            **TOKEN_IDS)


def pixel_values_for(grid_thw, seed: int = 0, channels: int = 3 * 2 * 16 * 16) -> torch.Tensor:
    tokens = int(torch.as_tensor(grid_thw).prod(-1).sum())
    return torch.randn(tokens, channels, generator=torch.Generator().manual_seed(seed))
