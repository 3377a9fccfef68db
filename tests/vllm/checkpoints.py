"""Tiny Qwen3-VL and Qwen2.5-VL checkpoints with random weights, written to a directory vLLM can serve.

Nothing can be downloaded, so every file of a Hub checkpoint is made here: ``config.json`` and
``model.safetensors`` (transformers' ``save_pretrained``), a byte-level BPE tokenizer trained on a few
sentences plus Qwen's special tokens (``tokenizer.json``, ``tokenizer_config.json``), a chat template
(``chat_template.jinja``), and the image and video processors' configs, written by hand: the video
processor classes import torchvision, which only imports in .venv-vllm with tests/vllm/sitecustomize.py on
the path (the engine's processes have it; the pytest process need not).

The processors' pixel bounds are small, so the test images make a few dozen vision tokens and vLLM's memory
profiling (one image or video at the processors' largest size) stays far below ``max_model_len``. Weights
are normal with std 0.08 (norm scales 1 + that noise): large enough that greedy decoding is decisive, so two
runs of the same engine agree token for token and a wrong vision path changes the tokens. Everything is
seeded: the same call writes the same files. The default seeds were picked (among 1 to 4) so that with
tests/vllm/engine.py's inputs no request decodes to one repeated token, and flipping an image, swapping the
two images of a prompt or reversing the video's frames each changes the greedy tokens.
"""

import json
import os

IMAGE_PROCESSOR = "Qwen2VLImageProcessor"
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# The tokenizer's training text: the prompts' words (tests/vllm/engine.py) and Qwen3-VL's frame timestamps.
CORPUS = [
    "You are a helpful assistant.",
    "Describe this image.",
    "What is different between these two pictures?",
    "What happens in this video?",
    "The quick brown fox jumps over the lazy dog.",
    "system user assistant",
    "<0.5 seconds> <1.5 seconds> <2.5 seconds>",
]
# Qwen's template reduced to what the tests send: string or list content with image, video and text parts.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
OPENAI_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
OPENAI_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
STD = 0.08


def _write_tokenizer(path: str):
    """Trains the BPE (deterministic: the trainer has no randomness) and saves it as a Qwen2Tokenizer with
    the chat template; returns the tokenizer."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
    )
    bpe.train_from_iterator(CORPUS, trainer)
    trained = json.loads(bpe.to_str())["model"]
    tokenizer = Qwen2Tokenizer(
        vocab=trained["vocab"],
        merges=[tuple(merge) for merge in trained["merges"]],
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    # Already in the vocabulary (the trainer puts them first); this makes them whole, special tokens.
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS], special_tokens=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return tokenizer


def _token_ids(tokenizer) -> dict:
    ids = dict(zip(SPECIAL_TOKENS, tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS)))
    return dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )


def _randomize(model, seed: int):
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator) * STD
            param.copy_(noise + 1.0 if "norm" in name and name.endswith("weight") else noise)
    return model


def _save_model(path: str, model_class, config, seed: int):
    # Every parameter is drawn again from the seeded generator: the constructor's initialisation (from
    # torch's global generator, left alone) does not reach the file.
    model = _randomize(model_class(config).float().eval(), seed)
    model.save_pretrained(path)


def _write_json(path: str, name: str, data: dict):
    with open(os.path.join(path, name), "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


def _processor_configs(path: str, processor: str, video_processor: str, *, patch: int, mean, std, image_pixels, video):
    """The image and video processors' configs; ``image_pixels`` is (min, max) of one image, ``video`` the
    video processor's own keys (its pixel bounds count one frame for Qwen2-VL's, all frames for Qwen3-VL's)."""
    common = dict(
        patch_size=patch,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=mean,
        image_std=std,
        do_resize=True,
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        do_convert_rgb=True,
        resample=3,
        processor_class=processor,
    )
    image_size = {"shortest_edge": image_pixels[0], "longest_edge": image_pixels[1]}
    _write_json(
        path, "preprocessor_config.json", {**common, "image_processor_type": IMAGE_PROCESSOR, "size": image_size}
    )
    _write_json(path, "video_preprocessor_config.json", {**common, "video_processor_type": video_processor, **video})


def _text_config(tokenizer, **overrides) -> dict:
    ids = dict(zip(SPECIAL_TOKENS, tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS)))
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        **overrides,
    )


def make_qwen3_vl(path, seed: int = 3, vision_hidden_size: int = 144) -> str:
    """A tiny Qwen3-VL checkpoint in ``path`` (made if missing); returns the path as a string.

    Vision: hidden 144 with 2 heads (head dim 72, as the real towers; ``vision_hidden_size`` sets another width),
    depth 3, DeepStack taps after blocks 0 and 1, patch 16, a learned 8 x 8 position grid. Text: hidden 128, 2
    layers, 4 query and 2 KV heads of dim 64 with interleaved M-RoPE sections [12, 10, 10] (the real [24, 20, 20]
    halved).
    """
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tokenizer = _write_tokenizer(path)
    rope = {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [12, 10, 10], "mrope_interleaved": True}
    config = Qwen3VLConfig(
        text_config=_text_config(tokenizer, head_dim=64, rope_parameters=rope),
        vision_config=dict(
            depth=3,
            hidden_size=vision_hidden_size,
            num_heads=2,
            intermediate_size=256,
            hidden_act="gelu_pytorch_tanh",
            patch_size=16,
            temporal_patch_size=2,
            spatial_merge_size=2,
            out_hidden_size=128,
            num_position_embeddings=64,
            deepstack_visual_indexes=[0, 1],
        ),
        tie_word_embeddings=False,
        **_token_ids(tokenizer),
    )
    _save_model(path, Qwen3VLForConditionalGeneration, config, seed)
    # One merged token is 32 x 32 px; an image gets 1 to 64 tokens, a video 4 to 64 frame-tokens in all.
    video = dict(size={"shortest_edge": 4 * 32 * 32, "longest_edge": 64 * 32 * 32}, fps=2, min_frames=4, max_frames=16)
    _processor_configs(
        path,
        "Qwen3VLProcessor",
        "Qwen3VLVideoProcessor",
        patch=16,
        mean=[0.5, 0.5, 0.5],
        std=[0.5, 0.5, 0.5],
        image_pixels=(32 * 32, 64 * 32 * 32),
        video={**video, "do_sample_frames": True},
    )
    return path


def make_qwen2_5_vl(path, seed: int = 3) -> str:
    """A tiny Qwen2.5-VL checkpoint in ``path`` (made if missing); returns the path as a string.

    Vision: hidden 160 with 2 heads (head dim 80, as the real towers), depth 2, patch 14, 112-px windows
    (4 x 4 merged tokens) with full attention in block 1 only. Text: hidden 128, 2 layers, 4 query and 2 KV
    heads of dim 32 with M-RoPE sections [4, 6, 6] (the real [16, 24, 24] at a quarter).
    """
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tokenizer = _write_tokenizer(path)
    rope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 6, 6]}
    config = Qwen2_5_VLConfig(
        text_config=_text_config(tokenizer, rope_parameters=rope),
        vision_config=dict(
            depth=2,
            hidden_size=160,
            num_heads=2,
            intermediate_size=256,
            hidden_act="silu",
            patch_size=14,
            temporal_patch_size=2,
            spatial_merge_size=2,
            window_size=112,
            fullatt_block_indexes=[1],
            out_hidden_size=128,
            tokens_per_second=2,
        ),
        tie_word_embeddings=False,
        **_token_ids(tokenizer),
    )
    _save_model(path, Qwen2_5_VLForConditionalGeneration, config, seed)
    _qwen2_processor_configs(path, "Qwen2_5_VLProcessor")
    return path


def _qwen2_processor_configs(path: str, processor: str) -> None:
    """The Qwen2 family's processor configs (patch 14, OpenAI CLIP's mean and std, Qwen2-VL's video processor).
    One merged token is 28 x 28 px; an image gets 4 to 80 tokens, a video frame pair 4 to 16."""
    video = dict(size={"shortest_edge": 4 * 28 * 28, "longest_edge": 16 * 28 * 28}, min_frames=4, max_frames=16)
    _processor_configs(
        path,
        processor,
        "Qwen2VLVideoProcessor",
        patch=14,
        mean=OPENAI_CLIP_MEAN,
        std=OPENAI_CLIP_STD,
        image_pixels=(4 * 28 * 28, 80 * 28 * 28),
        video={**video, "do_sample_frames": False},
    )


def make_qwen2_vl(path, seed: int = 3) -> str:
    """A tiny Qwen2-VL checkpoint in ``path`` (made if missing); returns the path as a string.

    Vision: width 160 with 2 heads (head dim 80, as the real towers), depth 2, MLP ratio 2 with QuickGELU, patch
    14, LayerNorms, full attention in every block. Text: as :func:`make_qwen2_5_vl`'s.
    """
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tokenizer = _write_tokenizer(path)
    rope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 6, 6]}
    config = Qwen2VLConfig(
        text_config=_text_config(tokenizer, rope_parameters=rope),
        vision_config=dict(
            depth=2,
            embed_dim=160,
            num_heads=2,
            mlp_ratio=2,
            hidden_size=128,
            hidden_act="quick_gelu",
            patch_size=14,
            temporal_patch_size=2,
            spatial_merge_size=2,
        ),
        tie_word_embeddings=False,
        **_token_ids(tokenizer),
    )
    _save_model(path, Qwen2VLForConditionalGeneration, config, seed)
    _qwen2_processor_configs(path, "Qwen2VLProcessor")
    return path
