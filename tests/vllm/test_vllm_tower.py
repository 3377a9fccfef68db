"""qvl's tower route over vLLM's own towers (qvl.vit.engines.vllm.tower: Qwen3-VL's, Qwen3.5's, Qwen2.5-VL's and
Qwen2-VL's), in process, against vLLM's forward and a float64 transformers truth; what it refuses; its compiled
forward."""

import contextlib
import copy
from types import SimpleNamespace

import pytest
import torch

from inprocess import model_config_of, vllm_tower_of
from qvl.kernels.common import force_backend
from qvl.vit.engines import cpu_path
from qvl.vit.engines.vllm import attention as vllm_attention
from qvl.vit.engines.vllm import routes as vllm_routes
from qvl.vit.engines.vllm import tower as vllm_tower
from qvl.vit.families import family_of
from tolerance import assert_error_within
from towers import (
    MODEL_STAGES,
    QWEN2_FAMILIES,
    QWEN2_GRID,
    VISION_KWARGS,
    float64_copy,
    float64_qwen2_family_outputs,
    float64_vision_outputs,
    hf_qwen2_family_tower,
    hf_vision_model,
    pixel_values_for,
    randomize,
    rotary_in_float64,
)

# Two images (one of a single merged token) and a two-frame video.
GRID = [[1, 4, 6], [1, 2, 2], [2, 4, 4]]


def attached(hf_model, dtype, **config):
    visual = vllm_tower_of(hf_model, dtype)
    model = SimpleNamespace(visual=visual, use_data_parallel=False)
    vllm_forward = visual.forward
    vllm_tower.attach(model, model_config_of(hf_model.config, **config), family_of(hf_model.config.model_type))
    assert isinstance(visual.forward, vllm_tower.QvlTowerForward)
    return visual, vllm_forward


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_vllm_and_float64(dtype):
    """fp32 runs the Triton kernels through the interpreter; bf16 the torch path (the interpreter's dots
    cannot take bf16 operands)."""
    hf_model = hf_vision_model(seed=3)
    pixel_values = pixel_values_for(GRID, seed=4)
    truth = torch.cat(float64_vision_outputs(hf_model, pixel_values, GRID), dim=1)
    visual, vllm_forward = attached(hf_model, dtype)
    with torch.no_grad():
        baseline = vllm_forward(pixel_values.to(dtype), grid_thw=GRID)
        before = vllm_routes.route_counts()["tower"]
        if dtype == torch.bfloat16:
            with force_backend("torch"):
                out = visual(pixel_values.to(dtype), grid_thw=torch.tensor(GRID))
        else:
            out = visual(pixel_values.to(dtype), grid_thw=torch.tensor(GRID))
    assert vllm_routes.route_counts()["tower"] == before + 1
    assert out.dtype == baseline.dtype == dtype
    assert_error_within(out, truth, baseline, what=f"vLLM tower on qvl, {dtype}", stages=MODEL_STAGES)


def test_empty_batch():
    visual, _ = attached(hf_vision_model(seed=1), torch.float32)
    out = visual(torch.empty(0, 3 * 2 * 16 * 16), grid_thw=[])
    assert out.shape == (0, visual.out_hidden_size)


def test_encoder_metadata_calls_keep_vllm_forward():
    """vLLM's encoder CUDA-graph path brings metadata it built itself: those calls run vLLM's forward."""
    hf_model = hf_vision_model(seed=2)
    visual, vllm_forward = attached(hf_model, torch.float32)
    pixel_values = pixel_values_for(GRID[:1], seed=5)
    metadata = visual.prepare_encoder_metadata(GRID[:1])
    before = vllm_routes.route_counts()
    with torch.no_grad():
        out = visual(pixel_values, GRID[:1], encoder_metadata=metadata)
        expected = vllm_forward(pixel_values, GRID[:1])
    assert torch.equal(out, expected)
    after = vllm_routes.route_counts()
    assert (after["tower_fallback"], after["tower"]) == (before["tower_fallback"] + 1, before["tower"])


def graph_case(name: str):
    """``(visual, vllm_forward, pixel_values, grid, truth)`` of a family (Qwen3-VL's tower, or a Qwen2 one)."""
    if name == "qwen3_vl":
        hf_model, grid = hf_vision_model(seed=3), GRID
        pixel_values = pixel_values_for(grid, seed=4)
        truth = torch.cat(float64_vision_outputs(hf_model, pixel_values, grid), dim=1)
    else:
        hf_model, grid = hf_qwen2_family_tower(name, seed=9), QWEN2_GRID
        pixel_values = pixel_values_for(grid, seed=10, channels=3 * 2 * 14 * 14)
        truth = float64_qwen2_family_outputs(name, hf_model, pixel_values, grid)
    return (*attached(hf_model, torch.float32), pixel_values, grid, truth)


@pytest.mark.parametrize("name", ["qwen3_vl", "qwen2_5_vl"])
def test_encoder_cuda_graph_buffers_give_the_batch_features(name):
    """vLLM's encoder CUDA graphs on qvl's tower as vLLM's manager drives them, the graph itself left out (a CPU
    cannot capture one): buffers for a budget of 64 merged tokens in 8 segments, a run on them (the manager's
    warm-up and capture), then a smaller batch's buffers copied in with the manager's own padding (its
    zero-fill, or the config's logic for offsets) and the forward on the captured buffers: the batch's features in
    the first rows, within the tolerance rule, through the interpreter's kernels."""
    from vllm.v1.worker.encoder_cudagraph import EncoderCudaGraphManager
    from vllm.v1.worker.encoder_cudagraph_defs import EncoderCudaGraphConfig

    visual, vllm_forward, pixel_values, grid, truth = graph_case(name)
    tower = visual.forward
    config = tower.graph_config(EncoderCudaGraphConfig(modalities=["image"], buffer_keys=[], out_hidden_size=1))
    assert config.buffer_keys[0] == "pixel_values" and set(config.buffer_keys) == {
        "pixel_values",
        *tower._values(tower.runner.metadata(grid)),
    }
    captured = tower.capture_values(64, 8)
    assert captured["pixel_values"].shape == (256, tower.runner.config.patch_dim)
    assert captured["cu_seqlens"].shape == (9,)
    # No batch of 16 merged tokens has more than 16 frames: more slots would only add empty attention programs.
    assert tower.capture_values(16, 64)["cu_seqlens"].shape == (17,)
    before = vllm_routes.route_counts()["tower"]
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        assert tower.graph_forward(dict(captured)).shape[0] == 64
        replay = tower.replay_values(pixel_values, torch.tensor(grid))
        for key, buffer in captured.items():
            copy_in = config.padding_logics.get(key, EncoderCudaGraphManager._copy_padded_buffer)
            copy_in(buffer, replay[key])
        offsets = captured["cu_seqlens"]
        assert bool((offsets[1:] >= offsets[:-1]).all()) and int(offsets[-1]) == pixel_values.shape[0]
        out = tower.graph_forward(captured)[: pixel_values.shape[0] // 4]
        baseline = vllm_forward(pixel_values, grid_thw=grid)
    # One batch replayed: counted once (the capture's run is not a forward of a batch).
    assert vllm_routes.route_counts()["tower"] == before + 1
    assert_error_within(out, truth, baseline, what=f"{name} through vLLM's encoder graph buffers", stages=MODEL_STAGES)


def test_model_classes_hand_vllm_graphs_qvl_buffers(monkeypatch):
    """The registered model classes whose vLLM base has the encoder CUDA-graph protocol answer it with qvl's
    buffers and forward while qvl runs the tower, and with vLLM's own otherwise."""
    from vllm.model_executor.models.interfaces import supports_encoder_cudagraph
    from vllm.model_executor.models.qwen3_vl import Qwen3VLForConditionalGeneration
    from vllm.v1.worker.encoder_cudagraph_defs import EncoderCudaGraphConfig

    model_class = vllm_tower.Qwen3VLForConditionalGeneration
    assert supports_encoder_cudagraph(model_class) and vllm_tower._QvlEncoderGraphs in model_class.__mro__
    vllm_config = EncoderCudaGraphConfig(modalities=["image"], buffer_keys=["vllm"], out_hidden_size=1)
    monkeypatch.setattr(Qwen3VLForConditionalGeneration, "get_encoder_cudagraph_config", lambda self: vllm_config)
    model = object.__new__(model_class)
    torch.nn.Module.__init__(model)
    visual, _, pixel_values, grid, _ = graph_case("qwen3_vl")
    model.visual = visual
    assert model.get_encoder_cudagraph_config().buffer_keys == visual.forward.graph_keys()
    inputs = model.prepare_encoder_cudagraph_capture_inputs(64, 4, 8, "cpu", torch.float32)
    assert inputs.values["cu_seqlens"].shape == (9,)
    replay = model.prepare_encoder_cudagraph_replay_buffers(
        {"pixel_values": pixel_values, "image_grid_thw": grid}, 4, 8
    )
    assert torch.equal(replay.values["pixel_values"], pixel_values)
    with torch.no_grad(), force_backend("torch"):
        assert torch.equal(model.encoder_cudagraph_forward(replay.values), visual.forward.graph_forward(replay.values))
    del visual.forward
    assert model.get_encoder_cudagraph_config() is vllm_config


def test_data_mode_under_encoder_graphs_leaves_the_split_to_vllm(monkeypatch):
    """With vLLM's encoder CUDA graphs on, vLLM's graph manager splits a data-mode batch over the ranks itself and
    calls the tower with each rank's share: qvl's tower then encodes what it is given (no balancer, no collective)
    and the model keeps vLLM's split."""
    hf_model = hf_vision_model(seed=3)
    model = object.__new__(vllm_tower.Qwen3VLForConditionalGeneration)
    torch.nn.Module.__init__(model)
    model.visual = vllm_tower_of(hf_model, torch.float32)
    model.use_data_parallel = True
    config = model_config_of(hf_model.config)
    config.compilation_config.cudagraph_mm_encoder = True
    config.compilation_config.cudagraph_mode = SimpleNamespace(name="FULL_AND_PIECEWISE")
    monkeypatch.setattr(vllm_tower, "get_tensor_model_parallel_world_size", lambda: 2)
    vllm_tower.attach(model, config, family_of(hf_model.config.model_type))
    forward = model.visual.forward
    assert isinstance(forward, vllm_tower.QvlTowerForward) and model.use_data_parallel
    assert type(forward.strategy).__name__ == "SingleProcess"
    assert vllm_routes.towers()[-1] == {
        "model": "Qwen3VLForConditionalGeneration",
        "split": "data",
        "compiled": False,
        "encoder_graphs": True,
    }


def test_encoder_graphs_count_only_where_vllm_captures():
    """Where vLLM makes its encoder graph manager: cudagraph_mm_encoder, not enforce_eager, and under the V1 model
    runner cudagraph_mode not NONE; elsewhere the tower stays eager, and qvl's own data-mode split with it."""
    from vllm.config import CUDAGraphMode

    def config(asked, mode, eager=False, v2=False):
        return SimpleNamespace(
            compilation_config=SimpleNamespace(cudagraph_mm_encoder=asked, cudagraph_mode=mode),
            model_config=SimpleNamespace(enforce_eager=eager),
            use_v2_model_runner=v2,
        )

    assert vllm_tower._encoder_graphs_on(config(True, CUDAGraphMode.FULL_AND_PIECEWISE))
    assert not vllm_tower._encoder_graphs_on(config(True, CUDAGraphMode.NONE))
    assert not vllm_tower._encoder_graphs_on(config(False, CUDAGraphMode.FULL_AND_PIECEWISE))
    # The V2 runner makes its encoder graphs whatever the decoder's mode, unless enforce_eager.
    assert vllm_tower._encoder_graphs_on(config(True, CUDAGraphMode.NONE, v2=True))
    assert not vllm_tower._encoder_graphs_on(config(True, CUDAGraphMode.NONE, eager=True, v2=True))


def test_mismatches_leave_vllm_tower():
    hf_model = hf_vision_model(seed=1)
    family = family_of(hf_model.config.model_type)
    visual = vllm_tower_of(hf_model, torch.float32)
    config = model_config_of(hf_model.config)
    assert vllm_tower.tower_mismatch(visual, config, family) is None
    quantized = model_config_of(hf_model.config, quant_config=SimpleNamespace(get_name=lambda: "fp8"))
    assert "quantized" in vllm_tower.tower_mismatch(visual, quantized, family)
    assert "differs from what qvl expects" in vllm_tower.tower_mismatch(torch.nn.Linear(2, 2), config, family)
    other_act = copy.deepcopy(hf_model.config)
    other_act.hidden_act = "prelu"  # learned: qvl does not load its weight (silu, relu, ... now run on qvl)
    assert "hidden_act" in vllm_tower.tower_mismatch(visual, model_config_of(other_act), family)
    lora = model_config_of(hf_model.config)
    lora.lora_config = SimpleNamespace(enable_tower_connector_lora=True)
    assert "LoRA on the tower" in vllm_tower.tower_mismatch(visual, lora, family)
    fp8 = model_config_of(hf_model.config)
    fp8.model_config.multimodal_config = SimpleNamespace(mm_encoder_attn_dtype="fp8")
    assert "fp8 encoder attention" in vllm_tower.tower_mismatch(visual, fp8, family)
    visual.blocks[1].norm2 = torch.nn.RMSNorm(visual.hidden_size)
    assert "LayerNorm" in vllm_tower.tower_mismatch(visual, config, family)
    model = SimpleNamespace(visual=visual, use_data_parallel=False)
    vllm_tower.attach(model, config, family)
    assert "forward" not in vars(visual), "a mismatched tower must keep vLLM's forward"


def test_failure_while_attaching_leaves_vllm_tower(monkeypatch):
    hf_model = hf_vision_model(seed=1)
    visual = vllm_tower_of(hf_model, torch.float32)
    model = SimpleNamespace(visual=visual, use_data_parallel=True)

    def no_group():
        raise RuntimeError("no tensor-parallel group")

    monkeypatch.setattr(vllm_tower, "get_tensor_model_parallel_world_size", no_group)
    before = vllm_routes.towers()
    vllm_tower.attach(model, model_config_of(hf_model.config), family_of(hf_model.config.model_type))
    assert "forward" not in vars(visual) and model.use_data_parallel
    assert vllm_routes.towers() == before


def test_compiled_forward_does_not_recompile_across_batches():
    """With vLLM's ``compile_mm_encoder`` on, the device part compiles once (fullgraph, token dim dynamic),
    through vLLM's packed CPU linears, and serves images and videos of other sizes without recompiling."""
    hf_model = hf_vision_model(seed=6)
    visual, vllm_forward = attached(hf_model, torch.float32, compile_mm_encoder=True)
    batches = [GRID, [[1, 6, 4]], [[3, 2, 4], [1, 4, 4]]]
    torch._dynamo.reset()
    with torch.no_grad(), force_backend("torch"):
        for index, grid in enumerate(batches):
            pixel_values = pixel_values_for(grid, seed=index)
            stance = torch.compiler.set_stance("fail_on_recompile") if index else contextlib.nullcontext()
            with stance:
                out = visual(pixel_values, grid_thw=grid)
            truth = torch.cat(float64_vision_outputs(hf_model, pixel_values, grid), dim=1)
            assert_error_within(
                out,
                truth,
                vllm_forward(pixel_values, grid_thw=grid),
                what=f"compiled, batch {index}",
                stages=MODEL_STAGES,
            )


def test_qwen3_5_tower_without_deepstack():
    """Qwen3.5's tower is vLLM's Qwen3_VisionTransformer without deepstack mergers: the route returns the main
    merger's features alone, as vLLM does, against transformers' Qwen3.5 vision model in float64."""
    from transformers.models.qwen3_5 import modeling_qwen3_5
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig

    fields = {k: v for k, v in VISION_KWARGS.items() if k != "deepstack_visual_indexes"}
    config = Qwen3_5VisionConfig(**fields)
    config._attn_implementation = "sdpa"
    hf_model = randomize(modeling_qwen3_5.Qwen3_5VisionModel(config), seed=7).eval()
    pixel_values = pixel_values_for(GRID, seed=8)
    with torch.no_grad(), rotary_in_float64(modeling_qwen3_5, "Qwen3_5VisionRotaryEmbedding"):
        truth = float64_copy(hf_model)(pixel_values.double(), grid_thw=torch.tensor(GRID)).pooler_output
    visual, vllm_forward = attached(hf_model, torch.float32)
    assert visual.forward.runner.config.deepstack_visual_indexes == ()
    with torch.no_grad():
        baseline = vllm_forward(pixel_values, grid_thw=GRID)
        out = visual(pixel_values, grid_thw=GRID)
    assert_error_within(out, truth, baseline, what="Qwen3.5 tower on qvl", stages=MODEL_STAGES)


def test_model_classes_are_vllm_subclasses():
    """What vLLM imports for each registered architecture: its own model class, plus the tower hook."""
    import importlib

    for architecture, (_, module) in vllm_tower.ARCHITECTURES.items():
        model_class = getattr(vllm_tower, architecture)
        base = getattr(importlib.import_module(module), architecture)
        assert issubclass(model_class, base) and model_class is not base
        assert model_class.__name__ == architecture and model_class.__module__ == vllm_tower.__name__
        assert getattr(vllm_tower, architecture) is model_class  # built once
    with pytest.raises(AttributeError):
        vllm_tower.LlavaForConditionalGeneration


@pytest.mark.parametrize("name", sorted(QWEN2_FAMILIES))
def test_qwen2_family_towers_match_vllm_and_float64(name):
    """vLLM's Qwen2.5-VL tower (RMSNorm, stacked gate_up SwiGLU, windows) and Qwen2-VL tower (LayerNorm,
    QuickGELU) on qvl's runner, fp32 through the interpreter, against vLLM's own forward and transformers in
    float64."""
    hf_model = hf_qwen2_family_tower(name, seed=9)
    pixel_values = pixel_values_for(QWEN2_GRID, seed=10, channels=3 * 2 * 14 * 14)
    truth = float64_qwen2_family_outputs(name, hf_model, pixel_values, QWEN2_GRID)
    visual, vllm_forward = attached(hf_model, torch.float32)
    # Eager: vLLM compiles its SiluAndMul on first use, which under pytest-xdist met compile state other tests of
    # the worker left (an error inside Dynamo), while the baseline only needs vLLM's arithmetic.
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        baseline = vllm_forward(pixel_values, grid_thw=QWEN2_GRID)
    with torch.no_grad():
        before = vllm_routes.route_counts()["tower"]
        out = visual(pixel_values, grid_thw=QWEN2_GRID)
    assert vllm_routes.route_counts()["tower"] == before + 1
    assert_error_within(out, truth, baseline, what=f"vLLM's {name} tower on qvl", stages=MODEL_STAGES)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_decision_steps_aside_by_default_where_not_faster(monkeypatch, dtype):
    """On this CPU both routes follow qvl.vit.engines.cpu_path: with the switch unset, a dtype the table does not show
    qvl winning keeps vLLM's own tower and attention; QVL_CPU_ROUTES=on takes them again."""
    monkeypatch.delenv(cpu_path.SWITCH)
    monkeypatch.setattr(cpu_path, "MEASURED", {("vllm", dtype): cpu_path.Measurement(1.5, "a slower run")})
    hf_model = hf_vision_model(seed=3, depth=1, deepstack_visual_indexes=[0])
    visual = vllm_tower_of(hf_model, dtype)
    model = SimpleNamespace(visual=visual, use_data_parallel=False)
    family = family_of(hf_model.config.model_type)
    vllm_tower.attach(model, model_config_of(hf_model.config), family)
    assert not isinstance(visual.forward, vllm_tower.QvlTowerForward)
    assert "a slower run" in vllm_attention.cpu_step_aside(dtype)
    with cpu_path.forced_routes(True):
        assert vllm_attention.cpu_step_aside(dtype) is None
        vllm_tower.attach(model, model_config_of(hf_model.config), family)
    assert isinstance(visual.forward, vllm_tower.QvlTowerForward)
