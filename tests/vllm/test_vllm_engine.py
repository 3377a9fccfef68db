"""qvl inside vLLM's engine: greedy tokens with qvl's plugin equal vLLM's own (up to a near-tie, where two equally
right runs may part), and qvl really ran.

Each engine start costs 15 s (in one process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) to 45 s (two ranks) on 2
cores, so the runs are few, each serves one image, two images and a video in one batch (tests/vllm/engine.py),
and each is made once per session and shared by the tests that read it. Which run does what:

* vLLM alone: ``VLLM_PLUGINS=""`` (vLLM's allow-list names no plugin), and ``QVL_VLLM=0`` (qvl's own switch)
  with the plugin loaded: both must leave qvl out of the engine.
* qvl's default (both routes): fp32 through Triton's interpreter (the real kernels inside vLLM), bf16 on
  the torch path in vLLM's own multi-process layout (the plugin loads in spawned processes), and two ranks
  in vLLM's ``mm_encoder_tp_mode="weights"`` and ``"data"``.
* ``QVL_VLLM=attention`` on Qwen3-VL: the attention route alone.
* Qwen2.5-VL (window attention) and Qwen2-VL through qvl's tower route (the same runner as Qwen3-VL's), fp32
  through the interpreter, each against vLLM alone.

Under pytest-xdist (``--dist loadgroup``) the tests that share a run stay in one worker's cache: the tests that
compare with the fp32 Qwen3-VL baseline in one group, the others in a second, which another worker can run.
"""

import functools

import pytest
from tokens import assert_same_tokens

from engine import run_engine

IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
INTERPRETER = {"TRITON_INTERPRET": "1"}
TORCH_PATH = {"TRITON_INTERPRET": "0"}
# The engines check what qvl's routes do on this CPU: they take vision work whatever qvl.vit.engines.cpu_path's table
# says.
QVL = {"VLLM_PLUGINS": "qvl", "QVL_VLLM": "all", "QVL_CPU_ROUTES": "on"}

# name -> (checkpoint fixture, dtype, tensor parallel size, mm_encoder_tp_mode, environment)
RUNS = {
    "qwen3/fp32/vllm": ("qwen3_vl_dir", "float32", 1, None, {"VLLM_PLUGINS": "", **IN_PROCESS, **TORCH_PATH}),
    "qwen3/fp32/qvl": ("qwen3_vl_dir", "float32", 1, None, {**QVL, **IN_PROCESS, **INTERPRETER}),
    "qwen3/fp32/qvl-attention": (
        "qwen3_vl_dir", "float32", 1, None, {**QVL, "QVL_VLLM": "attention", **IN_PROCESS, **INTERPRETER},
    ),
    "qwen3/bf16/vllm": ("qwen3_vl_dir", "bfloat16", 1, None, {**QVL, "QVL_VLLM": "0", **IN_PROCESS, **TORCH_PATH}),
    "qwen3/bf16/qvl": ("qwen3_vl_dir", "bfloat16", 1, None, {**QVL, **TORCH_PATH}),
    "qwen3/fp32/qvl-tp2-weights": ("qwen3_vl_dir", "float32", 2, "weights", {**QVL, **TORCH_PATH}),
    "qwen3/fp32/qvl-tp2-data": ("qwen3_vl_dir", "float32", 2, "data", {**QVL, **TORCH_PATH}),
    "qwen2_5/fp32/vllm": ("qwen2_5_vl_dir", "float32", 1, None, {"VLLM_PLUGINS": "", **IN_PROCESS, **TORCH_PATH}),
    "qwen2_5/fp32/qvl": ("qwen2_5_vl_dir", "float32", 1, None, {**QVL, **IN_PROCESS, **INTERPRETER}),
    "qwen2/fp32/vllm": ("qwen2_vl_dir", "float32", 1, None, {"VLLM_PLUGINS": "", **IN_PROCESS, **TORCH_PATH}),
    "qwen2/fp32/qvl": ("qwen2_vl_dir", "float32", 1, None, {**QVL, **IN_PROCESS, **INTERPRETER}),
}  # fmt: skip


@functools.cache
def _run(name: str, model_dir: str) -> dict:
    _, dtype, tp, mode, env = RUNS[name]
    return run_engine(model_dir, dtype=dtype, tp=tp, mode=mode, env=env)


@pytest.fixture
def engine(request):
    """``engine(name)``: the result of run ``name`` of :data:`RUNS` (made on first use, then shared)."""
    return lambda name: _run(name, request.getfixturevalue(RUNS[name][0]))


def counts(result: dict) -> list[dict]:
    """Each worker's qvl route counts (every worker must have loaded the plugin)."""
    infos = [worker["qvl"] for worker in result["worker_info"]]
    assert all(info is not None for info in infos), f"qvl's plugin did not load in every worker: {infos}"
    return [info["counts"] for info in infos]


SHARES_FP32_BASELINE = pytest.mark.xdist_group("vllm-engine-qwen3-fp32")
OWN_BASELINES = pytest.mark.xdist_group("vllm-engine-other")


@SHARES_FP32_BASELINE
def test_qwen3_vl_fp32_tower_route_through_the_interpreter(engine):
    baseline, result = engine("qwen3/fp32/vllm"), engine("qwen3/fp32/qvl")
    assert [worker["qvl"] for worker in baseline["worker_info"]] == [None], "VLLM_PLUGINS='' must not load qvl"
    assert_same_tokens(result, baseline, "Qwen3-VL fp32, qvl tower")
    (worker,) = result["worker_info"]
    assert worker["qvl"]["state"]["tower_architectures"], worker["qvl"]["state"]
    assert worker["triton_interpret"] == "1"
    assert worker["qvl"]["counts"]["tower"] > 0 and worker["qvl"]["counts"]["tower_fallback"] == 0
    assert worker["qvl"]["towers"] == [
        {"model": "Qwen3VLForConditionalGeneration", "split": None, "compiled": False, "encoder_graphs": False}
    ]


@SHARES_FP32_BASELINE
def test_qwen3_vl_attention_route(engine):
    result = engine("qwen3/fp32/qvl-attention")
    assert_same_tokens(result, engine("qwen3/fp32/vllm"), "Qwen3-VL fp32, QVL_VLLM=attention")
    (worker_counts,) = counts(result)
    assert worker_counts["attention"] > 0 and worker_counts["tower"] == 0, worker_counts
    assert worker_counts["attention_fallback"] == 0


@OWN_BASELINES
def test_qwen3_vl_bf16_and_the_qvl_switch(engine):
    baseline, result = engine("qwen3/bf16/vllm"), engine("qwen3/bf16/qvl")
    (off,) = baseline["worker_info"]
    assert off["qvl"]["state"]["mode"] == "off" and not off["qvl"]["state"]["attention"]
    assert set(off["qvl"]["counts"].values()) == {0}, "QVL_VLLM=0 must leave every route to vLLM"
    assert_same_tokens(result, baseline, "Qwen3-VL bf16, qvl tower (vLLM's multi-process layout)")
    (worker_counts,) = counts(result)
    assert worker_counts["tower"] > 0


@SHARES_FP32_BASELINE
@pytest.mark.parametrize("mode", ["weights", "data"])
def test_qwen3_vl_two_ranks(engine, mode):
    """Two ranks (gloo, one core each) in vLLM's encoder modes: the same tokens as one rank, with every
    rank's tower on qvl (data mode: qvl's balancer over vLLM's group)."""
    result = engine(f"qwen3/fp32/qvl-tp2-{mode}")
    assert_same_tokens(result, engine("qwen3/fp32/vllm"), f"Qwen3-VL, two ranks, mm_encoder_tp_mode={mode}")
    worker_counts = counts(result)
    assert len(worker_counts) == 2 and all(c["tower"] > 0 for c in worker_counts), worker_counts
    for worker in result["worker_info"]:
        assert [tower["split"] for tower in worker["qvl"]["towers"]] == [mode], worker["qvl"]["towers"]


@OWN_BASELINES
@pytest.mark.parametrize(
    "family, architecture",
    [("qwen2_5", "Qwen2_5_VLForConditionalGeneration"), ("qwen2", "Qwen2VLForConditionalGeneration")],
)
def test_qwen2_family_tower_route(engine, family, architecture):
    """Qwen2.5-VL (windows, RMSNorm, vLLM's stacked gate_up SwiGLU) and Qwen2-VL (LayerNorm, QuickGELU) through
    qvl's tower runner over vLLM's modules: the same greedy tokens as vLLM alone."""
    baseline, result = engine(f"{family}/fp32/vllm"), engine(f"{family}/fp32/qvl")
    assert_same_tokens(result, baseline, f"{architecture} fp32, qvl tower")
    (worker,) = result["worker_info"]
    assert worker["qvl"]["counts"]["tower"] > 0 and worker["qvl"]["counts"]["tower_fallback"] == 0, worker["qvl"]
    assert worker["qvl"]["towers"] == [
        {"model": architecture, "split": None, "compiled": False, "encoder_graphs": False}
    ]
