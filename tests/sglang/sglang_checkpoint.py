"""A tiny random Qwen3-VL checkpoint SGLang can serve: the vLLM tests' checkpoint (tests/vllm/checkpoints.py:
tokenizer, chat template, processor configs, seeded weights) with a vision width of 128, a multiple of 32: SGLang's
weight loaders narrow merged linears by padded sizes, and a tower of width 144 does not load."""

import importlib.util
import os

_spec = importlib.util.spec_from_file_location(
    "vllm_test_checkpoints", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "vllm", "checkpoints.py")
)
_writer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_writer)


def make_qwen3_vl(path, seed: int = 3) -> str:
    """A tiny Qwen3-VL checkpoint in ``path`` (made if missing), vision hidden 128 with 2 heads of 64; returns the
    path as a string."""
    return _writer.make_qwen3_vl(path, seed, vision_hidden_size=128)
