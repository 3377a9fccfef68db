"""SGLang's vision modules built in the calling process, without an engine (the CPU benchmark's SGLang peers, the
SGLang tests' in-process checks): a one-rank SGLang world (gloo, a published ``ServerArgs`` on the CPU) and SGLang's
tower of a family (Qwen3-VL's ``Qwen3VLMoeVisionModel``, Qwen2.5-VL's, Qwen2-VL's) loaded with a transformers
tower's weights, held by SGLang's own model class as the engine's loader would leave it. Needs the start-up shim of
tests/sglang/sitecustomize.py where SGLang's torchvision and vllm imports fail (this project's CPU environment)."""

import functools
import os
import socket

import torch
from torch import nn


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@functools.cache
def sglang_world() -> None:
    """Initialise SGLang's distributed state and runtime context once per process (one rank)."""
    from sglang.srt.distributed import parallel_state
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    reset_context()
    publish(ServerArgs(model_path="dummy", device="cpu"), role="test", ranks=SpawnRanks(world_rank=0))
    get_parallel().override_permanently(world_group=parallel_state._WORLD)
    parallel_state.initialize_model_parallel(backend="gloo")


# A transformers vision config's model_type -> SGLang's module, model class and tower class for it.
SGLANG_TOWERS = {
    "qwen3_vl_vision": ("qwen3_vl", "Qwen3VLForConditionalGeneration", "Qwen3VLMoeVisionModel"),
    "qwen2_5_vl_vision": ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VisionTransformer"),
    "qwen2_vl_vision": ("qwen2_vl", "Qwen2VLForConditionalGeneration", "Qwen2VisionTransformer"),
}


def load_hf_weights(module: nn.Module, state: dict) -> None:
    """Load a transformers vision tower's ``state`` into SGLang's tower ``module`` as SGLang's loaders do: q/k/v as
    one ``qkv_proj`` and Qwen2.5-VL's gate and up as the two halves of ``gate_up_proj``."""
    from sglang.srt.model_loader.weight_utils import default_weight_loader

    params = dict(module.named_parameters())
    loaded = set()
    for name, tensor in state.items():
        name, shard = name.replace("attn.qkv.", "attn.qkv_proj."), None
        for half, index in (("mlp.gate_proj.", 0), ("mlp.up_proj.", 1)):
            if half in name:
                name, shard = name.replace(half, "mlp.gate_up_proj."), index
        param = params[name]
        loader = getattr(param, "weight_loader", default_weight_loader)
        loader(param, tensor) if shard is None else loader(param, tensor, shard)
        loaded.add(name)
    missing = set(params) - loaded
    assert not missing, f"weights SGLang's tower did not receive: {sorted(missing)}"


def sglang_model_of(hf_vision: nn.Module, dtype: torch.dtype) -> nn.Module:
    """SGLang's model class of ``hf_vision``'s family holding only its vision tower (``visual``), built from the
    transformers vision model ``hf_vision``'s config and loaded with its weights, in ``dtype``; its text model is
    not built (the routes only read the tower)."""
    import importlib

    sglang_world()
    module, model_class, tower_class = SGLANG_TOWERS[hf_vision.config.model_type]
    module = importlib.import_module(f"sglang.srt.models.{module}")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        visual = getattr(module, tower_class)(hf_vision.config, prefix="model.visual")
    finally:
        torch.set_default_dtype(previous)
    load_hf_weights(visual, {name: tensor.to(dtype) for name, tensor in hf_vision.state_dict().items()})
    model_class = getattr(module, model_class)
    model = model_class.__new__(model_class)
    nn.Module.__init__(model)
    model.visual = visual.eval()
    model.use_data_parallel = False
    return model
