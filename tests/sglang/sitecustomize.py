"""Test-only start-up shim for the SGLang CPU environment (``.venv-sglang``), loaded by every process of a test run
(the helpers put this folder first on ``PYTHONPATH``; SGLang's scheduler and detokenizer processes inherit it).

* torchvision: PyPI's build is a CUDA one; tests/vllm/sitecustomize.py explains the blank
  ``torchvision._meta_registrations`` that makes ``import torchvision`` work here (run from there, not copied).
* ``Tensor.pin_memory``: SGLang's video decoder pins the decoded frames unless it runs its CPU engine (which this
  machine cannot: it needs AVX-512/AMX kernels); without an accelerator torch refuses to pin, so here it returns
  the tensor itself (pinning only speeds up host-to-device copies, of which there are none).
* ``vllm._custom_ops``: on its generic platform SGLang's ``RotaryEmbedding.__init__`` imports
  ``vllm._custom_ops.rotary_embedding`` and never calls it (the forward is pure torch). vLLM is not installed
  here, so a stand-in module provides the name; calling it raises, so no test can pass through it unnoticed.

Test infrastructure only, never part of the qvl package.
"""

import importlib.machinery
import importlib.util
import os
import runpy
import sys
import types

runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "vllm", "sitecustomize.py"))

import torch  # noqa: E402

if not torch.accelerator.is_available():
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self


def _not_here(*args, **kwargs):
    raise RuntimeError("vllm._custom_ops is a test stand-in in .venv-sglang (tests/sglang/sitecustomize.py)")


# Not where vLLM is installed; a spec without origin is the tests/vllm folder, seen as a namespace package when
# tests/ is on sys.path.
_vllm = importlib.util.find_spec("vllm")
if _vllm is None or _vllm.origin is None:
    vllm = types.ModuleType("vllm")
    vllm.__path__ = []
    # A spec without origin: a namespace, which tests/conftest.py reads as "vLLM is not installed".
    vllm.__spec__ = importlib.machinery.ModuleSpec("vllm", None, is_package=True)
    custom_ops = types.ModuleType("vllm._custom_ops")
    custom_ops.rotary_embedding = _not_here
    vllm._custom_ops = custom_ops
    sys.modules["vllm"] = vllm
    sys.modules["vllm._custom_ops"] = custom_ops


def _current_report() -> dict | None:
    """The plugin's route counts, state and towers in this process; None until its module has run. The module sits in
    ``sys.modules`` while its body runs, and a read then raises AttributeError ("partially initialized module"; seen
    polling during its import on a loaded machine), which would end the reporting thread and leave the process
    without a report: the likely cause of one CI run's two-rank dp_encoder failure (one scheduler report of two)."""
    plugin = sys.modules.get("qvl.vit.engines.sglang.plugin")
    if plugin is None:
        return None
    try:
        return {"pid": os.getpid(), "counts": plugin.route_counts(), "state": plugin.state(), "towers": plugin.towers()}
    except AttributeError:
        return None


def _report_routes(directory: str) -> None:
    """Write the plugin's route counts and state to ``directory/<pid>.json`` whenever they change: SGLang's scheduler
    runs the routes in a subprocess that the engine's shutdown kills, so the test reads what it last wrote."""
    import json
    import threading
    import time

    def loop():
        last = None
        while True:
            report = _current_report()
            if report is not None and report != last:
                path = os.path.join(directory, f"{os.getpid()}.json")
                with open(path + ".tmp", "w", encoding="utf-8") as f:
                    json.dump(report, f)
                os.replace(path + ".tmp", path)
                last = report
            time.sleep(0.2)

    threading.Thread(target=loop, name="qvl-test-route-report", daemon=True).start()


if os.environ.get("QVL_TEST_REPORT_DIR"):
    _report_routes(os.environ["QVL_TEST_REPORT_DIR"])
