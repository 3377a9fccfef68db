"""Fixtures of the SGLang tests, which run in .venv-sglang (``bash install.sh sglang``; tests/conftest.py skips this
folder where sglang is not installed).

pytest puts this folder on sys.path, so tests import its modules by bare name (``from inprocess import ...``).
"""

import os
import runpy
import sys
from pathlib import Path

# bench/ (bench.sglang_inprocess, shared with the CPU benchmark) is a plain directory run from the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# SGLang imports torchvision (through transformers) and, on its generic platform, vllm._custom_ops: this process
# needs the start-up shim as well, unless pytest was started with tests/sglang on PYTHONPATH, which already ran it.
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "sitecustomize.py"))
# The routes run on this CPU whatever qvl.vit.engines.cpu_path measured (they are what these tests check); the engines
# started by the tests inherit it. test_sglang_routes.py checks the default decision itself.
os.environ.setdefault("QVL_CPU_ROUTES", "on")
# SGLang compiles its rotary function with torch.compile on first use (23 s here); the tests compare eager code.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
