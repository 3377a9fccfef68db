"""Fixtures of the vLLM tests, which run in .venv-vllm (``bash install.sh vllm``; tests/conftest.py skips this
folder where vllm is not installed): tiny checkpoints, built once per session, and ``run_engine``
(tests/vllm/engine.py), which serves one in vLLM's CPU build in a subprocess.

pytest puts this folder on sys.path, so tests import its modules by bare name:
``from engine import run_engine``, ``from checkpoints import make_qwen3_vl``.
"""

import gc
import os
import runpy

import pytest

# Building a checkpoint imports transformers' model classes, and in .venv-vllm transformers then imports
# the broken torchvision (see sitecustomize.py): this process needs the shim as well, unless pytest was
# started with tests/vllm on PYTHONPATH, which already ran it. run_path, not import: another sitecustomize
# may own that module name here.
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "sitecustomize.py"))

from checkpoints import make_qwen2_5_vl, make_qwen2_vl, make_qwen3_vl  # noqa: E402
from engine import run_engine  # noqa: E402,F401  (here too for tests that look for it in conftest)
from qvl.vit.engines.cpu_path import SWITCH  # noqa: E402


@pytest.fixture(autouse=True)
def routes_on_cpu(monkeypatch):
    """These tests check what qvl's routes do on this CPU, so they take vision work whatever qvl.vit.engines.cpu_path's
    measured table says (tests that check the step-aside decision set the switch themselves)."""
    monkeypatch.setenv(SWITCH, "on")


@pytest.fixture(autouse=True)
def release_vllm_layers():
    """Free the vLLM layers a test built, when it ends. vLLM's CPU linears hold a oneDNN handle
    (``vllm._custom_ops.CPUDNNLGEMMHandler``) whose ``__del__`` releases it with ``handler_tensor.item()``, and vLLM's
    towers sit in reference cycles, so they are freed whenever the cyclic collector next runs. When that is inside a
    later test's ``torch.compile`` trace (test_compiled_forward_does_not_recompile_across_batches,
    test_compiles_whole_without_recompiles), ``item()`` dispatches to the active FakeTensorMode and fails
    ("Please convert all Tensors to FakeTensors first"; a RecursionError was reported from the same ``__del__``),
    so each handle leaks and pytest prints every ``__del__``'s traceback, hundreds of lines, as a
    PytestUnraisableExceptionWarning under a passing test. vLLM's own engine keeps its model for its lifetime, so
    it is the tests, which build and drop towers in process, that expose it: collecting here runs each ``__del__``
    outside any trace."""
    yield
    gc.collect()


@pytest.fixture(scope="session")
def qwen3_vl_dir(tmp_path_factory) -> str:
    """A tiny random Qwen3-VL checkpoint directory (tests/vllm/checkpoints.py)."""
    return make_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl"))


@pytest.fixture(scope="session")
def qwen2_5_vl_dir(tmp_path_factory) -> str:
    """A tiny random Qwen2.5-VL checkpoint directory (tests/vllm/checkpoints.py)."""
    return make_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"))


@pytest.fixture(scope="session")
def qwen2_vl_dir(tmp_path_factory) -> str:
    """A tiny random Qwen2-VL checkpoint directory (tests/vllm/checkpoints.py)."""
    return make_qwen2_vl(tmp_path_factory.mktemp("qwen2_vl"))
