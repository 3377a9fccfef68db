"""vLLM's vision modules built in the calling process, without an engine (the CPU benchmark's vLLM peers, the vLLM
tests' in-process checks): a one-rank vLLM world (gloo) and vLLM's own vision tower of a family (Qwen3-VL's
``Qwen3_VisionTransformer``, Qwen2.5-VL's, Qwen2-VL's) loaded with a transformers tower's weights and post-processed
the way vLLM's loader does (on CPU its linears pack their weights for oneDNN and keep an empty ``weight``)."""

import functools
import socket
from types import SimpleNamespace

import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel

# A transformers vision config's model_type -> vLLM's module and tower class for it.
VLLM_TOWERS = {
    "qwen3_vl_vision": ("vllm.model_executor.models.qwen3_vl", "Qwen3_VisionTransformer"),
    "qwen3_5_vision": ("vllm.model_executor.models.qwen3_vl", "Qwen3_VisionTransformer"),
    "qwen2_5_vl_vision": ("vllm.model_executor.models.qwen2_5_vl", "Qwen2_5_VisionTransformer"),
    "qwen2_vl_vision": ("vllm.model_executor.models.qwen2_vl", "Qwen2VisionTransformer"),
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@functools.cache
def vllm_world() -> VllmConfig:
    """Initialise vLLM's distributed state once per process (one rank, tensor parallel size 1); the
    returned config is the one vLLM modules must be built under (``set_current_vllm_config``)."""
    config = VllmConfig()
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
            backend="gloo",
        )
        initialize_model_parallel(1, 1)
    return config


def process_weights(module: torch.nn.Module) -> torch.nn.Module:
    """What vLLM's loader does to each layer after loading weights (CPU linears pack theirs)."""
    for layer in module.modules():
        method = getattr(layer, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(layer)
    return module


def vllm_tower_of(hf_model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """vLLM's tower of ``hf_model``'s family (Qwen3-VL's ``Qwen3_VisionTransformer``, Qwen2.5-VL's or Qwen2-VL's)
    with its configuration and weights, in ``dtype``."""
    import importlib

    module, tower_class = VLLM_TOWERS[hf_model.config.model_type]
    tower_class = getattr(importlib.import_module(module), tower_class)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with set_current_vllm_config(vllm_world()):
            tower = tower_class(hf_model.config, norm_eps=1e-6, prefix="visual")
    finally:
        torch.set_default_dtype(previous)
    state = {name: tensor.to(dtype) for name, tensor in hf_model.state_dict().items()}
    loaded = tower.load_weights(state.items())
    missing = {name for name, _ in tower.named_parameters()} - loaded
    assert not missing, f"weights vLLM's tower did not receive: {sorted(missing)}"
    return process_weights(tower).eval()


def model_config_of(hf_config, *, compile_mm_encoder: bool = False, quant_config=None) -> SimpleNamespace:
    """The parts of a ``VllmConfig`` that :func:`qvl.vit.engines.vllm.tower.attach` reads, for a model whose (vision)
    config is ``hf_config``."""
    return SimpleNamespace(
        quant_config=quant_config,
        model_config=SimpleNamespace(hf_config=hf_config),
        compilation_config=SimpleNamespace(compile_mm_encoder=compile_mm_encoder),
    )
