"""Loading the tower from local checkpoint directories with transformers' names (safetensors only)."""

import json

import pytest
import torch
from transformers import Qwen3VLForConditionalGeneration

from qvl.kernels import force_backend
from qvl.vit import VisionTransformer
from qvl.vit.checkpoint import CheckpointError, load_vision_checkpoint, save_vision_checkpoint
from towers import full_config, hf_vision_model, pixel_values_for, randomize

GRID = [[1, 4, 6], [2, 2, 2]]


def assert_same_outputs(tower, reference):
    pixels = pixel_values_for(GRID)
    with force_backend("torch"), torch.no_grad():
        got, got_deepstack = tower(pixels, GRID)
        want, want_deepstack = reference(pixels, GRID)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for a, b in zip(got_deepstack, want_deepstack, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("max_shard_size", [None, "200KB"])
def test_full_model_checkpoint_single_and_sharded(tmp_path, max_shard_size):
    model = randomize(Qwen3VLForConditionalGeneration(full_config()), 1).eval()
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(tmp_path, **kwargs)
    if max_shard_size:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    tower = VisionTransformer.from_pretrained(tmp_path).eval()
    assert_same_outputs(tower, VisionTransformer.from_hf(model.model.visual).eval())


def test_vision_only_checkpoint_round_trip(tmp_path):
    hf = hf_vision_model(seed=2)
    reference = VisionTransformer.from_hf(hf).eval()
    save_vision_checkpoint(tmp_path, hf.config.to_dict(), reference.state_dict())
    config, state_dict = load_vision_checkpoint(tmp_path)
    assert config["depth"] == 3 and "blocks.2.attn.qkv.weight" in state_dict
    assert_same_outputs(VisionTransformer.from_pretrained(tmp_path, dtype=torch.float32).eval(), reference)


def test_pickled_weights_are_never_loaded(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"depth": 1}))
    torch.save({"patch_embed.proj.weight": torch.zeros(1)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_vision_checkpoint(tmp_path)


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda d: None, "config.json: not found"),
        (lambda d: (d / "config.json").write_text("{not json"), "config.json: unreadable"),
        (lambda d: (d / "config.json").write_text("[]"), "config.json: expected a JSON object, got a list"),
        (
            lambda d: ((d / "config.json").write_text("{}"), (d / "model.safetensors").write_bytes(b"garbage")),
            "model.safetensors: unreadable",
        ),
        (
            lambda d: (
                (d / "config.json").write_text("{}"),
                (d / "model.safetensors.index.json").write_text(
                    json.dumps({"weight_map": {"a": "part-1.safetensors"}})
                ),
            ),
            "part-1.safetensors: not found",
        ),
    ],
)
def test_bad_directories_name_the_file(tmp_path, make, words):
    make(tmp_path)
    with pytest.raises(CheckpointError, match=words):
        load_vision_checkpoint(tmp_path)


def test_not_a_directory(tmp_path, monkeypatch):
    with pytest.raises(CheckpointError, match="not a directory$"):
        load_vision_checkpoint(tmp_path / "missing")
    # A missing owner/name path reads as a Hub id: the message says where those are fetched.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=r"Qwen/Qwen3-VL-2B-Instruct: not a directory \(a Hugging Face Hub id\? "):
        VisionTransformer.from_pretrained("Qwen/Qwen3-VL-2B-Instruct")


def test_qwen3_5_and_omni_checkpoints(tmp_path):
    """Qwen3.5's config.json gives a tower without deepstack mergers; Qwen3-Omni's keeps the tower under
    ``thinker.visual.`` with its config in ``thinker_config`` and its mergers named ln_q / mlp."""
    from safetensors.torch import save_file
    from transformers import Qwen3_5VisionConfig, Qwen3OmniMoeVisionEncoderConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeVisionEncoder

    from towers import VISION_KWARGS

    no_deepstack = {k: v for k, v in VISION_KWARGS.items() if k != "deepstack_visual_indexes"}
    for name, model, wrap, prefix in (
        ("qwen3_5", Qwen3_5VisionModel(Qwen3_5VisionConfig(**no_deepstack)), "vision_config", "model.visual."),
        (
            "omni",
            Qwen3OmniMoeVisionEncoder(Qwen3OmniMoeVisionEncoderConfig(**VISION_KWARGS)),
            "thinker_config",
            "thinker.visual.",
        ),
    ):
        model = randomize(model, 5).eval()
        directory = tmp_path / name
        directory.mkdir()
        vision = model.config.to_dict()
        config = {"model_type": "qwen3_5", "vision_config": vision}
        if wrap == "thinker_config":
            config = {"model_type": "qwen3_omni_moe", "thinker_config": {"vision_config": vision}}
        (directory / "config.json").write_text(json.dumps(config))
        tensors = {prefix + key: value.contiguous() for key, value in model.state_dict().items()}
        save_file(tensors, str(directory / "model.safetensors"))
        tower = VisionTransformer.from_pretrained(directory).eval()
        assert len(tower.deepstack_merger_list) == (0 if name == "qwen3_5" else 2)
        assert_same_outputs(tower, VisionTransformer.from_hf(model).eval())
