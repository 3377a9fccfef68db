"""qvl.vit.families: a family declared once serves every entry point, and nothing else names a model type."""

import dataclasses
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from qvl.kernels import force_backend
from qvl.vit import VisionTransformer, cli, families, load_tower, patch_model
from qvl.vit.checkpoint import save_vision_checkpoint
from towers import VISION_KWARGS, hf_vision_model, pixel_values_for

GRID = [[1, 4, 6], [1, 2, 2]]
VIT = Path(__file__).resolve().parents[2] / "vit"


@pytest.fixture
def toy_family():
    """Qwen3-VL's family under model types of its own (a fine-tune published as "toy_vl"), registered for one
    test."""
    qwen3_vl = families.family_of("qwen3_vl")
    toy = dataclasses.replace(
        qwen3_vl,
        name="Toy-VL",
        model_types=("toy_vl",),
        vision_model_types=("toy_vl_vision",),
        vllm_architectures={},
        sglang_architectures=(),
    )
    families.register(toy)
    yield toy
    families.FAMILIES.remove(toy)


def toy_vision_model(seed: int = 1):
    hf = hf_vision_model(seed=seed)
    hf.config.model_type = "toy_vl_vision"
    return hf


def test_model_types_are_named_in_families_alone():
    """No module of qvl.vit but families.py holds a model type, outside docstrings and import paths."""
    pattern = re.compile(r"[\"'](qwen2_5_vl|qwen3_vl|qwen3_5|qwen2_vl|qwen3_omni)\w*[\"']")
    offenders = [
        f"{path.name}:{number}"
        for path in VIT.glob("*.py")
        if path.name != "families.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert offenders == []


def test_every_model_type_has_one_family():
    model_types = families.supported_model_types()
    assert len(model_types) == len(set(model_types))
    for model_type in model_types:
        assert model_type in families.family_of(model_type).all_model_types
    assert families.family_of("llava") is None
    with pytest.raises(ValueError, match="unsupported model_type 'llava'"):
        families.family_of_config({"model_type": "llava"})


def test_every_level_of_a_nested_config_reads_the_same_tower():
    """Qwen3-Omni's vision config read from the full model's config.json, from its thinker's own (which holds
    vision_config at the top, as a thinker saved alone writes it) and from the vision config itself."""
    vision = {"model_type": "qwen3_omni_moe_vision_encoder", **VISION_KWARGS}
    configs = [
        {
            "model_type": "qwen3_omni_moe",
            "thinker_config": {"model_type": "qwen3_omni_moe_thinker", "vision_config": vision},
        },
        {"model_type": "qwen3_omni_moe_thinker", "vision_config": vision},
        vision,
    ]
    read = [families.config_from_dict(config) for config in configs]
    assert all(family.name == "Qwen3-Omni-MoE" for family, _ in read)
    assert read[0][1] == read[1][1] == read[2][1] and read[0][1].depth == VISION_KWARGS["depth"]


def test_register_refuses_a_taken_model_type():
    qwen3_vl = families.family_of("qwen3_vl")
    with pytest.raises(ValueError, match="qwen3_vl"):
        families.register(dataclasses.replace(qwen3_vl, name="Copy", vllm_architectures={}))


def test_a_family_added_through_the_registry_is_served_everywhere(toy_family, tmp_path):
    """patch_model, load_tower and qvl encode --model serve a family registered in families.py alone, with the
    features of the family it copies."""
    pixels, grid = pixel_values_for(GRID), torch.tensor(GRID)
    with torch.no_grad(), force_backend("torch"):
        expected = VisionTransformer.from_hf(hf_vision_model(seed=1))(pixels, GRID)[0]
        toy = patch_model(toy_vision_model())
        torch.testing.assert_close(toy(pixels, grid_thw=grid).pooler_output, expected, rtol=0, atol=0)

        checkpoint = tmp_path / "toy"
        config = {"model_type": "toy_vl", "vision_config": {**VISION_KWARGS, "model_type": "toy_vl_vision"}}
        save_vision_checkpoint(checkpoint, config, toy.state_dict())
        tower = load_tower(checkpoint)
        assert type(tower) is VisionTransformer
        torch.testing.assert_close(tower(pixels, GRID)[0], expected, rtol=0, atol=0)

        from PIL import Image

        picture = tmp_path / "picture.png"
        Image.effect_mandelbrot((64, 96), (-2, -1.25, 0.5, 1.25), 16).convert("RGB").save(picture)
        output = tmp_path / "out.safetensors"
        assert cli.main(["encode", str(picture), "--model", str(checkpoint), "-o", str(output)]) == 0
    with safe_open(str(output), "pt") as handle:
        assert handle.get_tensor("image.0.merged").shape[1] == VISION_KWARGS["out_hidden_size"]
        assert handle.metadata()["model"] == str(checkpoint)
