"""qvl inside SGLang's engine on the CPU: a tiny random Qwen3-VL (tests/sglang/sglang_checkpoint.py) serving one
image, two images in one prompt and a video, in fp32, with SGLang alone's greedy tokens (up to a near-tie, where
two equally right runs may part); the route counts
reported by SGLang's scheduler processes show where qvl ran. Four engine starts (45-90 s each on 2 cores), the Triton
kernels through the interpreter: qvl's switch off (SGLang alone, the baseline), qvl on one rank, and qvl on two
ranks with the tower's weights split and with SGLang's data-parallel encoder."""

import pytest
from tokens import assert_same_tokens

from engine import run_engine
from sglang_checkpoint import make_qwen3_vl

pytestmark = pytest.mark.xdist_group("sglang_engine")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl_sglang"))


@pytest.fixture(scope="module")
def baseline(checkpoint):
    """SGLang alone: qvl's plugin loads (installed) but its switch is off."""
    return run_engine(checkpoint, dtype="float32", env={"QVL_SGLANG": "off", "TRITON_INTERPRET": "1"})


def scheduler_reports(result) -> list[dict]:
    """The reports of the processes where the plugin applied its routes to a model: SGLang's schedulers."""
    return [report for report in result["reports"] if report["state"]["models"]]


def test_switch_off_leaves_sglang_alone(baseline):
    assert baseline["reports"], "no process reported: the plugin did not load"
    for report in baseline["reports"]:
        assert report["state"]["mode"] == "off" and not report["state"]["hooked"]
        assert not any(report["counts"].values())


def test_qvl_gives_sglang_tokens(checkpoint, baseline):
    result = run_engine(checkpoint, dtype="float32", env={"TRITON_INTERPRET": "1"})
    assert_same_tokens(result, baseline)
    [scheduler] = scheduler_reports(result)
    [model] = scheduler["state"]["models"]
    assert model == {
        "model": "Qwen3VLForConditionalGeneration",
        "attention_layers": 3,
        "attention_left": {},
        "tower": "qvl",
        "cpu": None,
    }
    # Images and videos are encoded by separate tower calls (how SGLang groups requests into calls depends on
    # timing); none was left to SGLang.
    assert scheduler["counts"]["tower"] >= 2 and scheduler["counts"]["tower_fallback"] == 0
    assert "vision attention -> torch.ops.qvl.vision_attn in 3 layers" in result["log"]
    assert "vision tower on qvl" in result["log"]


@pytest.mark.parametrize("dp_encoder", [False, True], ids=["weights", "dp_encoder"])
def test_qvl_on_two_ranks(checkpoint, baseline, dp_encoder):
    """Two tensor-parallel ranks: the tower's weights split over them (qvl's runner with SGLang's sharded linears and
    an all-reduce), or replicated with SGLang's data-parallel encoder (qvl's balancer splits the batch). Tokens are
    compared with the one-rank baseline: the text model's split sums round otherwise, which may part the runs only at
    a greedy near-tie (:func:`assert_same_tokens`)."""
    result = run_engine(checkpoint, dtype="float32", env={"TRITON_INTERPRET": "1"}, tp=2, dp_encoder=dp_encoder)
    assert_same_tokens(result, baseline)
    schedulers = scheduler_reports(result)
    assert len(schedulers) == 2, result["reports"]
    for scheduler in schedulers:
        assert scheduler["state"]["models"][0]["tower"] == "qvl"
        assert scheduler["towers"] == [
            {"model": "Qwen3VLForConditionalGeneration", "split": "data" if dp_encoder else "weights"}
        ]
        assert scheduler["counts"]["tower"] >= 2 and scheduler["counts"]["tower_fallback"] == 0
