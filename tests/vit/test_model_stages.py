"""tests/towers.py's MODEL_STAGES bounds the rounded stages (model_stages, forward and backward) of every model the
tests compare whole, so that the tolerance rule's check of torch's own result against the float64 truth allows what
their roundings can add up to, and no more than that bound."""

from test_hf_patch import moe_full_config, tiny_full_model
from transformers import Qwen3VLMoeForConditionalGeneration

from towers import MODEL_STAGES, hf_qwen2_family_tower, hf_vision_model, model_stages


def test_model_stages_bound_every_model_compared_whole():
    models = {
        "Qwen3-VL tower": hf_vision_model(seed=1),
        "Qwen3-VL": tiny_full_model(),
        "Qwen3-VL MoE": tiny_full_model(
            seed=9, model_class=Qwen3VLMoeForConditionalGeneration, config=moe_full_config()
        ),
        "Qwen2-VL tower": hf_qwen2_family_tower("qwen2_vl", 1),
        "Qwen2.5-VL tower": hf_qwen2_family_tower("qwen2_5_vl", 1),
    }
    stages = {name: model_stages(model, backward=True) for name, model in models.items()}
    assert all(0 < count <= MODEL_STAGES for count in stages.values()), stages
