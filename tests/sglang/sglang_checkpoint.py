"""A tiny random Qwen3-VL checkpoint SGLang can serve, made with the vLLM tests' checkpoint writer
(tests/vllm/checkpoints.py: tokenizer, chat template, processor configs, seeded weights), with vision widths that are
multiples of 32: SGLang's weight loaders narrow merged linears by padded sizes, and vLLM's tower of width 144 does
not load."""

import importlib.util
import os

_spec = importlib.util.spec_from_file_location(
    "vllm_test_checkpoints", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "vllm", "checkpoints.py")
)
writer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(writer)


def make_qwen3_vl(path, seed: int = 3) -> str:
    """A tiny Qwen3-VL checkpoint in ``path`` (made if missing); returns the path as a string.

    Vision: hidden 128 with 2 heads of 64, depth 3, DeepStack taps after blocks 0 and 1, patch 16, a learned 8 x 8
    position grid. Text: as tests/vllm/checkpoints.py's Qwen3-VL.
    """
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tokenizer = writer._write_tokenizer(path)
    rope = {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [12, 10, 10], "mrope_interleaved": True}
    config = Qwen3VLConfig(
        text_config=writer._text_config(tokenizer, head_dim=64, rope_parameters=rope),
        vision_config=dict(
            depth=3,
            hidden_size=128,
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
        **writer._token_ids(tokenizer),
    )
    writer._save_model(path, Qwen3VLForConditionalGeneration, config, seed)
    video = dict(size={"shortest_edge": 4 * 32 * 32, "longest_edge": 64 * 32 * 32}, fps=2, min_frames=4, max_frames=16)
    writer._processor_configs(
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
