"""qvl's vLLM plugin hook (qvl.vit.engines.vllm.plugin.register): what it installs, its switch, and a vLLM it does not
recognise. Registration changes vLLM's process-wide registries, so every case runs in one fresh subprocess
(vLLM's import is the slow part), resetting them between cases."""

import json
import os
import subprocess
import sys
from importlib import metadata

from engine import HERE  # tests/vllm: its sitecustomize.py is the torchvision shim a fresh process needs

SCENARIOS = r"""
import json, logging, sys
from vllm import ModelRegistry
from vllm.model_executor.custom_op import op_registry_oot
from vllm.model_executor.layers.attention.mm_encoder_attention import MMEncoderAttention
from qvl.vit.engines.vllm import plugin as vllm_plugin

records = []
handler = logging.Handler()
handler.emit = lambda record: records.append(record.getMessage())
logging.getLogger("vllm.qvl").addHandler(handler)
logging.getLogger("vllm.qvl").setLevel(logging.INFO)  # vLLM sets its loggers' levels only once an engine starts
original_models = dict(ModelRegistry.models)

def case(env, prepare=None):
    import os
    vllm_plugin._state.update(mode=None, attention=False, tower_architectures=(), reason=None)
    op_registry_oot.clear()
    ModelRegistry.models.clear()
    ModelRegistry.models.update(original_models)
    os.environ.pop("QVL_VLLM", None)
    os.environ.update(env)
    records.clear()
    undo = prepare() if prepare else None
    try:
        vllm_plugin.register()
        vllm_plugin.register()  # vLLM may call it again: nothing more happens
    finally:
        if undo:
            undo()
    oot = op_registry_oot.get("MMEncoderAttention")
    return {
        "state": vllm_plugin.state(),
        "log": list(records),
        "oot": None if oot is None else oot.__name__,
        "models": {arch: getattr(ModelRegistry.models[arch], "module_name", None)
                   for arch in ("Qwen3VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
                                "Qwen2VLForConditionalGeneration")},
    }

def changed_signature():
    saved = MMEncoderAttention.forward_cpu
    MMEncoderAttention.forward_cpu = lambda self, query, key, value, cu_seqlens=None: None
    return lambda: setattr(MMEncoderAttention, "forward_cpu", saved)

def slot_taken():
    op_registry_oot["MMEncoderAttention"] = MMEncoderAttention

def registry_broken():
    saved = ModelRegistry.get_supported_archs
    def broken():
        raise RuntimeError("registry changed")
    ModelRegistry.get_supported_archs = broken
    return lambda: setattr(ModelRegistry, "get_supported_archs", saved)

print(json.dumps({
    "default": case({}),
    "attention": case({"QVL_VLLM": "attention"}),
    "off": case({"QVL_VLLM": "0"}),
    "unknown": case({"QVL_VLLM": "sometimes"}),
    "changed_signature": case({}, changed_signature),
    "slot_taken": case({}, slot_taken),
    "registry_broken": case({}, registry_broken),
}))
"""


def run_scenarios() -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-c", SCENARIOS], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_entry_point_is_installed():
    (entry,) = [ep for ep in metadata.entry_points(group="vllm.general_plugins") if ep.name == "qvl"]
    assert entry.value == "qvl.vit.engines.vllm.plugin:register"


def test_register_switch_and_unrecognised_vllm():
    results = run_scenarios()
    towers = "qvl.vit.engines.vllm.tower"

    default = results["default"]
    assert default["oot"] == "QvlEncoderAttention" and default["state"]["attention"]
    assert default["models"]["Qwen3VLForConditionalGeneration"] == towers
    assert default["models"]["Qwen2_5_VLForConditionalGeneration"] == towers
    assert default["models"]["Qwen2VLForConditionalGeneration"] == towers
    assert "Qwen3_5ForConditionalGeneration" in default["state"]["tower_architectures"]
    assert len(default["log"]) == 1 and default["log"][0].startswith("qvl: active (QVL_VLLM=all)")

    attention = results["attention"]
    assert attention["oot"] == "QvlEncoderAttention" and attention["state"]["tower_architectures"] == []
    assert attention["models"]["Qwen3VLForConditionalGeneration"] != towers

    for name in ("off", "unknown"):
        result = results[name]
        assert result["oot"] is None and result["models"]["Qwen3VLForConditionalGeneration"] != towers, name
        assert result["state"]["mode"] == "off" and len(result["log"]) == 1, result
    assert "sometimes" in results["unknown"]["log"][0]

    for name, reason in (("changed_signature", "forward_cpu"), ("slot_taken", "another plugin")):
        result = results[name]
        assert reason in result["state"]["reason"], result
        assert result["oot"] in (None, "MMEncoderAttention") and not result["state"]["attention"], result
        assert result["models"]["Qwen3VLForConditionalGeneration"] != towers
        assert len(result["log"]) == 1 and "left unchanged" in result["log"][0]

    broken = results["registry_broken"]
    assert broken["oot"] == "QvlEncoderAttention" and broken["state"]["tower_architectures"] == []
    assert "registry changed" in broken["state"]["reason"]
    assert [line.split(":")[1].strip() for line in broken["log"]][0].startswith("vLLM")
