"""Test-only start-up shim for the SGLang CPU environment (``.venv-sglang``), loaded by every process of a test run
(the helpers put this folder first on ``PYTHONPATH``; SGLang's scheduler and detokenizer processes inherit it).

* torchvision: PyPI's build is a CUDA one; tests/vllm/sitecustomize.py explains the blank
  ``torchvision._meta_registrations`` that makes ``import torchvision`` work here (run from there, not copied).
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
