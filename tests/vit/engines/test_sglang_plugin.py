"""The SGLang plugin where SGLang is not installed (this suite's environment): importing it and calling its entry point
is harmless and says why nothing happened. With SGLang: tests/sglang."""

import importlib.util

import pytest

from qvl.vit.engines.sglang import plugin as sglang_plugin

# A spec without origin is the tests/sglang folder, seen as a namespace package (tests/ is on sys.path).
_SGLANG = importlib.util.find_spec("sglang")


@pytest.mark.skipif(_SGLANG is not None and _SGLANG.origin is not None, reason="SGLang is installed: tests/sglang")
def test_register_without_sglang_changes_nothing(monkeypatch):
    monkeypatch.setattr(sglang_plugin, "_state", {"mode": None, "hooked": False, "reason": None, "models": []})
    monkeypatch.delenv(sglang_plugin.SWITCH, raising=False)
    sglang_plugin.register()
    state = sglang_plugin.state()
    assert state["mode"] == "all" and not state["hooked"]
    assert "hook registry is not usable" in state["reason"]
    assert not any(sglang_plugin.route_counts().values())


def test_plugin_module_imports_no_sglang():
    import subprocess
    import sys

    code = "import sys, qvl.vit.engines.sglang.plugin; print(any(m.split('.')[0] == 'sglang' for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"
