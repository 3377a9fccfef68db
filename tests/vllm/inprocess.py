"""What the vLLM tests build in their own process (vLLM's vision towers, the parts of a ``VllmConfig`` that qvl's
tower route reads): :mod:`bench.vllm_inprocess`, shared with the CPU benchmark's vLLM peers."""

import sys
from pathlib import Path

# bench/ is a plain directory run from the repository root, not an installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.vllm_inprocess import VLLM_TOWERS, model_config_of, process_weights, vllm_tower_of, vllm_world  # noqa: E402

__all__ = ["VLLM_TOWERS", "model_config_of", "process_weights", "vllm_tower_of", "vllm_world"]
