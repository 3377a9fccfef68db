"""Packaging facts: import names, no heavy work at import, no second copy of the ops."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "TRITON_INTERPRET": "0"}, check=True)
    return result.stdout.strip()


def test_repo_root_kernels_folder_is_the_one_qvl_kernels():
    """Run from the repository root, transformers' probe for Hugging Face's ``kernels`` package imports
    qvl's kernels/ folder by that name; it must get qvl.kernels itself, not a second registration."""
    out = run_python(
        "import kernels, qvl.kernels, sys;"
        "from transformers.utils.import_utils import is_kernels_available;"
        "print(kernels is qvl.kernels, is_kernels_available(), [m for m in sys.modules if m.startswith('kernels.')])"
    )
    assert out == "True False []"


def test_import_registers_ops_without_compiling_or_touching_a_gpu():
    out = run_python(
        "import sys, torch, qvl.kernels, qvl.vit;"
        "print(all(hasattr(torch.ops.qvl, n) for n in ('vision_attn', 'rotary_2d', 'rotary_2d_', 'pos_embed_interp',"
        " 'pos_embed_interp_add_', 'layer_norm', 'add_layer_norm', 'bias_gelu', 'bias_gelu_')),"
        " torch.cuda.is_initialized())"
    )
    assert out == "True False"
