"""qvl's routes over SGLang's own modules, in process: SGLang's Qwen3-VL tower and its ``VisionAttention`` layers
with the plugin against SGLang's sdpa backend and a float64 transformers truth (fp32 and fp16 run the Triton kernels
through the interpreter), the backend SGLang's layers end up with, the calls and layers left to SGLang, and the
switches."""

import contextlib
import logging
import sys

import pytest
import torch

import qvl.vit.engines.sglang
from bench.sglang_inprocess import sglang_model_of, sglang_world
from qvl.kernels.verify import attention_truth
from qvl.vit.engines.sglang import attention as sglang_attention
from qvl.vit.engines.sglang import plugin as sglang_plugin
from qvl.vit.engines.sglang import tower as sglang_tower
from qvl.vit.engines.tower import EngineTowerForward
from tolerance import assert_error_within
from towers import (
    MODEL_STAGES,
    QWEN2_FAMILIES,
    QWEN2_GRID,
    float64_qwen2_family_outputs,
    float64_vision_outputs,
    hf_qwen2_family_tower,
    hf_vision_model,
    pixel_values_for,
)

# Two images (one of a single merged token) and a two-frame video.
GRID = [[1, 4, 6], [1, 2, 2], [2, 4, 4]]
# SGLang's weight loaders narrow merged linears by sizes padded to 32: a tower whose widths are multiples of 32.
SIZES = dict(hidden_size=128, num_heads=2, intermediate_size=256, out_hidden_size=96)


@contextlib.contextmanager
def mode(value: str):
    """The plugin's switch as SGLang's processes would have read it."""
    saved = dict(sglang_plugin._state)
    sglang_plugin._state["mode"] = value
    try:
        yield
    finally:
        sglang_plugin._state.clear()
        sglang_plugin._state.update(saved)


def outputs(model, pixel_values, grid):
    with torch.no_grad():
        return model.visual(pixel_values.to(model.visual.dtype), grid_thw=torch.tensor(grid))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("route", ["all", "attention"])
def test_routes_match_sglang_and_float64(route, dtype):
    hf_vision = hf_vision_model(seed=3, **SIZES)
    pixel_values = pixel_values_for(GRID, seed=4)
    truth = torch.cat(float64_vision_outputs(hf_vision, pixel_values, GRID), dim=1)
    model = sglang_model_of(hf_vision, dtype)
    baseline = outputs(model, pixel_values, GRID)
    before = sglang_plugin.route_counts()
    with mode(route):
        done = sglang_plugin.apply(model, hf_vision.config)
    assert done["attention_layers"] == len(model.visual.blocks) and not done["attention_left"]
    assert {block.attn.qkv_backend_name for block in model.visual.blocks} == {"qvl"}
    assert done["tower"] == ("qvl" if route == "all" else "QVL_SGLANG=attention")
    out = outputs(model, pixel_values, GRID)
    after = sglang_plugin.route_counts()
    if route == "all":
        assert isinstance(model.visual.forward, EngineTowerForward)
        assert after["tower"] == before["tower"] + 1 and after["attention"] == before["attention"]
    else:
        assert after["attention"] == before["attention"] + len(model.visual.blocks)
        assert after["tower"] == before["tower"]
    assert out.dtype == baseline.dtype == dtype
    assert_error_within(out, truth, baseline, what=f"SGLang tower, route {route}, {dtype}", stages=MODEL_STAGES)


def attention_layer(num_heads=2, num_kv_heads=None, head_dim=64, dtype=torch.float32):
    sglang_world()
    from sglang.srt.layers.attention.vision import VisionAttention

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        layer = VisionAttention(
            embed_dim=num_heads * head_dim,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            projection_size=num_heads * head_dim,
            use_qkv_parallel=True,
            flatten_batch=True,
        )
    finally:
        torch.set_default_dtype(previous)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return layer


class _Model(torch.nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer


def test_backend_takes_sglang_call_forms():
    """Token offsets as a tensor, as SGLang's SingletonCache, as the ViT CUDA graphs' lists (triton_attn's three
    items, fa3's and fa4's two), and equal-length batches without any; every form gives SGLang's sdpa result."""
    from sglang.srt.layers.attention.vision import SingletonCache

    layer = attention_layer()
    sdpa = layer.qkv_backend
    sglang_attention.attach(_Model(layer), sglang_plugin._routes)
    assert layer.qkv_backend_name == "qvl" and layer.pass_strided_qkv
    q, k, v = (torch.randn(40, 2, 64, generator=torch.Generator().manual_seed(i)) for i in range(3))
    cu_seqlens = torch.tensor([0, 12, 12, 40], dtype=torch.int32)
    cache = SingletonCache()
    cache.set_data(cu_seqlens)
    q64, k64, v64 = (t.double() for t in (q, k, v))
    expected = sdpa(q=q, k=k, v=v, bsz=1, seq_len=40, cu_seqlens=cu_seqlens)
    truth = attention_truth(q64, k64, v64, cu_seqlens).reshape(expected.shape)
    before = sglang_plugin.route_counts()
    forms = (cu_seqlens, cache, [cu_seqlens, cu_seqlens.diff(), 28], [cu_seqlens, 28])
    for form in forms:
        out = layer.qkv_backend(q=q, k=k, v=v, bsz=1, seq_len=40, cu_seqlens=form)
        assert_error_within(out, truth, expected, what=f"cu_seqlens as {type(form).__name__}")
    equal = torch.tensor([0, 20, 40], dtype=torch.int32)
    expected = sdpa(q=q, k=k, v=v, bsz=1, seq_len=40, cu_seqlens=equal)
    truth = attention_truth(q64, k64, v64, equal).reshape(expected.shape)
    out = layer.qkv_backend(q=q, k=k, v=v, bsz=2, seq_len=20, cu_seqlens=None)
    assert_error_within(out, truth, expected, what="equal-length batch")
    # Every form ran on qvl's op (a fallback to SGLang's sdpa would give the same result and count elsewhere).
    after = sglang_plugin.route_counts()
    assert after["attention"] - before["attention"] == len(forms) + 1
    assert after["attention_fallback"] == before["attention_fallback"]


def test_calls_qvl_does_not_cover_go_to_sglang(caplog):
    layer = attention_layer()
    sglang_attention.attach(_Model(layer), sglang_plugin._routes)
    q, k, v = (torch.randn(16, 2, 64, generator=torch.Generator().manual_seed(i)) for i in range(3))
    cu_seqlens = torch.tensor([0, 16], dtype=torch.int32)
    mask = torch.ones(1, 1, 16, 16, dtype=torch.bool)
    before = sglang_plugin.route_counts()
    with caplog.at_level(logging.INFO, logger="sglang.qvl"):
        out = layer.qkv_backend(q=q, k=k, v=v, bsz=1, seq_len=16, cu_seqlens=cu_seqlens, attention_mask=mask)
        layer.qkv_backend(q=q, k=k, v=v, bsz=1, seq_len=16, cu_seqlens=cu_seqlens, attention_mask=mask)
    expected = layer.qkv_backend.fallback(q=q, k=k, v=v, bsz=1, seq_len=16, cu_seqlens=cu_seqlens, attention_mask=mask)
    assert torch.equal(out, expected)
    after = sglang_plugin.route_counts()
    assert after["attention_fallback"] == before["attention_fallback"] + 2 and after["attention"] == before["attention"]
    assert sum("explicit attention mask" in record.getMessage() for record in caplog.records) <= 1


def test_layers_qvl_does_not_cover_keep_their_backend():
    grouped = attention_layer(num_heads=4, num_kv_heads=2, head_dim=32)
    taken, left = sglang_attention.attach(_Model(grouped), sglang_plugin._routes)
    assert taken == 0 and left == {"k/v with fewer heads (2) than q (4)": 1}
    assert grouped.qkv_backend_name == "sdpa"


@pytest.mark.parametrize("switch", ["1", "Y"])
def test_tower_route_steps_aside_for_vit_cuda_graphs(monkeypatch, switch):
    """Wherever SGLang reads its switch as on (its parser takes "y" too), its graphs run its own tower forward."""
    hf_vision = hf_vision_model(seed=1, **SIZES)
    model = sglang_model_of(hf_vision, torch.float32)
    monkeypatch.setenv(sglang_tower.CUDA_GRAPH_SWITCH, switch)
    with mode("all"):
        done = sglang_plugin.apply(model, hf_vision.config)
    assert done["tower"].startswith(sglang_tower.CUDA_GRAPH_SWITCH)
    assert not isinstance(model.visual.forward, EngineTowerForward)
    assert done["attention_layers"] == len(model.visual.blocks)


def test_tower_route_steps_aside_for_norms_with_a_bias_it_would_read_as_rmsnorm():
    """SGLang's own LayerNorm (its AMX CPU engine's tower norm) has a variance_epsilon like an RMSNorm, and a bias:
    the runner, which reads every norm but torch's LayerNorm as an RMSNorm, must not take that tower."""
    from sglang.srt.layers.layernorm import LayerNorm

    hf_vision = hf_vision_model(seed=1, **SIZES)
    model = sglang_model_of(hf_vision, torch.float32)
    block = model.visual.blocks[0]
    block.norm1 = LayerNorm(block.norm1.weight.shape[0])
    with mode("all"):
        done = sglang_plugin.apply(model, hf_vision.config)
    assert done["tower"] == "norms other than torch's LayerNorm or an RMSNorm (without bias)"
    assert not isinstance(model.visual.forward, EngineTowerForward)


def test_empty_batch():
    hf_vision = hf_vision_model(seed=2, **SIZES)
    model = sglang_model_of(hf_vision, torch.float32)
    with mode("all"):
        sglang_plugin.apply(model, hf_vision.config)
    out = model.visual(torch.empty(0, 3 * 2 * 16 * 16), grid_thw=torch.empty(0, 3, dtype=torch.int64))
    assert out.shape == (0, model.visual.out_hidden_size)


@pytest.fixture
def fresh_plugin(monkeypatch):
    """The plugin and SGLang's hook registry as a new process has them; both put back afterwards."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    monkeypatch.setattr(sglang_plugin, "_state", {"mode": None, "hooked": False, "reason": None, "models": []})
    hooks = {target: list(entries) for target, entries in HookRegistry._hooks.items()}
    yield HookRegistry
    HookRegistry._hooks.clear()
    HookRegistry._hooks.update(hooks)


@pytest.mark.parametrize(("value", "hooked"), [("", True), ("attention", True), ("off", False), ("nonsense", False)])
def test_switch(fresh_plugin, monkeypatch, value, hooked):
    monkeypatch.setenv(sglang_plugin.SWITCH, value)
    sglang_plugin.register()
    sglang_plugin.register()
    entries = fresh_plugin._hooks.get(sglang_plugin.MODEL_LOADER, [])
    assert len(entries) == int(hooked)
    assert sglang_plugin.state()["hooked"] is hooked
    assert sglang_plugin.state()["mode"] == {"": "all", "attention": "attention"}.get(value, "off")


def test_sglang_allow_list_leaves_qvl_out(monkeypatch):
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group

    monkeypatch.setenv("SGLANG_PLUGINS", "qvl")
    assert load_plugins_by_group(GENERAL_PLUGINS_GROUP)["qvl"][0] is sglang_plugin.register
    monkeypatch.setenv("SGLANG_PLUGINS", "another_plugin")
    assert "qvl" not in load_plugins_by_group(GENERAL_PLUGINS_GROUP)


@pytest.mark.parametrize("name", sorted(QWEN2_FAMILIES))
def test_qwen2_family_towers_match_sglang_and_float64(name):
    """SGLang's Qwen2.5-VL tower (RMSNorm, stacked gate_up SwiGLU, windows) and Qwen2-VL tower (LayerNorm, QuickGELU)
    on qvl's runner, fp32 through the interpreter, against transformers in float64, with transformers' own fp32 run
    as the baseline: SGLang 0.5.23's own Qwen2.5-VL forward is 4.8e-4 from that truth at an output scale of 0.17
    (some 20,000 fp32 ulps: it computes something else, cause not known here; its Qwen2-VL forward agrees), so its
    result cannot serve as the measure of rounding."""
    hf_vision = hf_qwen2_family_tower(name, seed=9)
    # SGLang 0.5.23's Qwen2-VL tower reads the channel count under its old name, which transformers 5 dropped.
    hf_vision.config.in_chans = hf_vision.config.in_channels
    pixel_values = pixel_values_for(QWEN2_GRID, seed=10, channels=3 * 2 * 14 * 14)
    truth = float64_qwen2_family_outputs(name, hf_vision, pixel_values, QWEN2_GRID)
    with torch.no_grad():
        baseline = hf_vision(pixel_values, grid_thw=torch.tensor(QWEN2_GRID)).pooler_output
    model = sglang_model_of(hf_vision, torch.float32)
    with mode("all"):
        done = sglang_plugin.apply(model, hf_vision.config)
    assert done["tower"] == "qvl" and done["attention_layers"] == len(model.visual.blocks)
    before = sglang_plugin.route_counts()["tower"]
    out = outputs(model, pixel_values, QWEN2_GRID)
    assert sglang_plugin.route_counts()["tower"] == before + 1
    assert_error_within(out, truth, baseline, what=f"SGLang's {name} tower on qvl", stages=MODEL_STAGES)


def test_routes_step_aside_on_a_cpu_where_qvl_was_not_measured_faster(monkeypatch):
    """qvl.vit.engines.cpu_path's default: SGLang's own vision code runs on a CPU unless qvl's route was measured to
    win."""
    from qvl.vit.engines import cpu_path

    hf_vision = hf_vision_model(seed=5, **SIZES)
    model = sglang_model_of(hf_vision, torch.float32)
    monkeypatch.setenv(cpu_path.SWITCH, "auto")
    monkeypatch.setitem(cpu_path.MEASURED, ("sglang", torch.float32), cpu_path.Measurement(1.25, "a test"))
    with mode("all"):
        done = sglang_plugin.apply(model, hf_vision.config)
    assert done["attention_layers"] == 0 and done["tower"] == done["cpu"]
    assert "1.25x" in done["cpu"]
    assert {block.attn.qkv_backend_name for block in model.visual.blocks} == {"sdpa"}
    assert not isinstance(model.visual.forward, EngineTowerForward)
    monkeypatch.setitem(cpu_path.MEASURED, ("sglang", torch.float32), cpu_path.Measurement(0.8, "a test"))
    with mode("all"):
        done = sglang_plugin.apply(model, hf_vision.config)
    assert done["tower"] == "qvl" and done["cpu"] is None


def test_routes_that_do_not_import_leave_sglang_serving(monkeypatch):
    """apply never raises: routes whose modules fail to import (an SGLang or Triton they do not know) leave the
    model to SGLang, with the reason."""
    hf_vision = hf_vision_model(seed=1, **SIZES)
    model = sglang_model_of(hf_vision, torch.float32)
    monkeypatch.delattr(qvl.vit.engines.sglang, "attention", raising=False)
    monkeypatch.setitem(sys.modules, "qvl.vit.engines.sglang.attention", None)
    with mode("all"):
        done = sglang_plugin.apply(model, hf_vision.config)
    assert done["tower"].startswith("qvl's SGLang routes did not import (ModuleNotFoundError")
    assert done["attention_layers"] == 0 and not isinstance(model.visual.forward, EngineTowerForward)


def test_switch_off_in_apply_changes_nothing():
    hf_vision = hf_vision_model(seed=6, **SIZES)
    model = sglang_model_of(hf_vision, torch.float32)
    with mode("off"):
        done = sglang_plugin.apply(model, hf_vision.config)
    assert done["attention_layers"] == 0 and done["tower"] == "QVL_SGLANG=off"
    assert {block.attn.qkv_backend_name for block in model.visual.blocks} == {"sdpa"}
