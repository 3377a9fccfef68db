"""SGLang's vision modules built in the test process, without an engine: a one-rank SGLang world (gloo, a published
``ServerArgs`` on the CPU) and SGLang's Qwen3-VL tower (``Qwen3VLMoeVisionModel``) loaded with a transformers
tower's weights, held by SGLang's own model class as the engine's loader would leave it."""

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


def sglang_model_of(hf_vision: nn.Module, dtype: torch.dtype) -> nn.Module:
    """SGLang's ``Qwen3VLForConditionalGeneration`` holding only its vision tower (``visual``), built from the
    transformers vision model ``hf_vision``'s config and loaded with its weights, in ``dtype``; its text model is
    not built (the routes only read the tower)."""
    sglang_world()
    from sglang.srt.models.qwen3_vl import Qwen3VLForConditionalGeneration, Qwen3VLMoeVisionModel

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        visual = Qwen3VLMoeVisionModel(hf_vision.config, prefix="model.visual")
    finally:
        torch.set_default_dtype(previous)
    state = {name.replace("attn.qkv.", "attn.qkv_proj."): t.to(dtype) for name, t in hf_vision.state_dict().items()}
    loaded = visual.load_weights(state.items())
    missing = {name for name, _ in visual.named_parameters()} - loaded
    assert not missing, f"weights SGLang's tower did not receive: {sorted(missing)}"
    model = Qwen3VLForConditionalGeneration.__new__(Qwen3VLForConditionalGeneration)
    nn.Module.__init__(model)
    model.visual = visual.eval()
    model.use_data_parallel = False
    return model
