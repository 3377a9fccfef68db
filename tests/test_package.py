"""Packaging facts: import names, no heavy work at import, no second copy of the ops."""

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str, *args: str) -> str:
    """``code`` run by a fresh interpreter from the repository root (Triton's interpreter off), with ``args`` as its
    ``sys.argv[1:]``; its stripped stdout."""
    result = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TRITON_INTERPRET": "0"},
        check=True,
    )
    return result.stdout.strip()


def test_repo_root_kernels_folder_defers_to_hugging_face_kernels():
    """Run from the repository root, ``import kernels`` finds qvl's kernels/ folder first. That name belongs to
    Hugging Face's ``kernels`` distribution (transformers 5.25 depends on it and imports it): the folder loads that
    package where it is installed, and qvl.kernels itself where not (never a second registration of the ops)."""
    out = run_python(
        "import importlib.metadata as m, kernels, qvl.kernels;"
        "from transformers.activations import ACT2FN;"
        "installed = any(d.metadata['Name'] == 'kernels' for d in m.distributions());"
        "print(installed, kernels is qvl.kernels, 'site-packages' in (kernels.__file__ or ''))"
    )
    installed = out.split()[0] == "True"
    assert out == ("True False True" if installed else "False True False"), out


def test_import_registers_ops_without_compiling_or_touching_a_gpu():
    out = run_python(
        "import sys, torch, qvl.kernels, qvl.vit;"
        "print(all(hasattr(torch.ops.qvl, n) for n in ('vision_attn', 'rotary_2d', 'rotary_2d_', 'pos_embed_interp',"
        " 'pos_embed_interp_add_', 'layer_norm', 'add_layer_norm', 'bias_gelu', 'bias_gelu_',"
        " 'rms_norm', 'add_rms_norm', 'bias_swiglu')),"
        " torch.cuda.is_initialized())"
    )
    assert out == "True False"


def test_vllm_plugin_is_declared_and_harmless_without_vllm():
    """The entry point vLLM loads, and what it does where vLLM is absent: its module imports no vLLM, and the
    hook (called by nothing but vLLM) returns with a note. tests/vllm checks it inside vLLM."""
    out = run_python(
        "import sys, importlib.metadata as md;"
        "ep, = [e for e in md.entry_points(group='vllm.general_plugins') if e.name == 'qvl'];"
        "from qvl.vit import vllm_plugin; has_vllm = 'vllm' in sys.modules;"
        "ep.load()(); state = vllm_plugin.state();"
        "print(ep.value, has_vllm, state['attention'], 'vLLM is not importable' in state['reason'])"
    )
    assert out == "qvl.vit.vllm_plugin:register False False True"


def module_imports() -> dict[str, set[str]]:
    """For each module of qvl (``qvl.kernels.*``, ``qvl.vit.*``, subpackages included) and bench, the modules it
    imports, read from the source (any depth: function-level imports count too), with relative imports
    resolved."""
    packages = {"qvl.kernels": ROOT / "kernels", "qvl.vit": ROOT / "vit", "bench": ROOT / "bench"}
    imports = {}
    for package, folder in packages.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts[:-1])) if path.stem == "__init__" else ".".join((package, *parts))
            # The package a relative import starts from: the module's own when it is a package's __init__.
            container = name if path.stem == "__init__" else name.rsplit(".", 1)[0]
            found = set()
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    found.update(alias.name for alias in node.names)
                elif isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:
                        parent = container.rsplit(".", node.level - 1)[0] if node.level > 1 else container
                        base = f"{parent}.{base}" if base else parent
                    found.add(base)
                    found.update(f"{base}.{alias.name}" for alias in node.names)
            imports[name] = found
    return imports


def test_no_import_cycle_between_qvl_modules():
    imports = module_imports()
    graph = {name: {other for other in found if other in imports and other != name} for name, found in imports.items()}
    # A package's __init__ re-exports its modules; the cycle that matters is between modules.
    graph = {name: {o for o in deps if not (o in ("qvl.kernels", "qvl.vit") and name.startswith(o + "."))}
             for name, deps in graph.items()}  # fmt: skip
    visiting, done = [], set()

    def visit(name):
        if name in done:
            return
        assert name not in visiting, f"import cycle: {' -> '.join(visiting[visiting.index(name) :] + [name])}"
        visiting.append(name)
        for other in sorted(graph[name]):
            visit(other)
        visiting.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)


def test_floors_import_only_downwards():
    """kernels/ is single-device (no torch.distributed, nothing of qvl.vit or bench); vit/ knows nothing of
    bench; the balancer is pure (no torch.distributed)."""
    imports = module_imports()
    for name, found in imports.items():
        if name.startswith("qvl.kernels"):
            assert not {m for m in found if m.startswith(("torch.distributed", "qvl.vit", "bench"))}, name
        if name.startswith("qvl.vit"):
            assert not {m for m in found if m.startswith("bench")}, name
    assert not {m for m in imports["qvl.vit.balance"] if m.startswith("torch")}


PUBLIC_NAMES_CHECK = """
import importlib, sys
missing = []
for name in sys.argv[1:]:
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        if exc.name in ("vllm", "sglang"):
            continue
        raise
    missing += [f"{name}.{n}" for n in getattr(module, "__all__", ()) if not hasattr(module, n)]
print(missing)
"""


def test_every_public_name_exists():
    """Each qvl module's ``__all__`` names only what the module has, so ``from module import *`` works. (Modules that
    import vLLM or SGLang at their top are checked in those engines' suites only.)"""
    modules = sorted(n for n in module_imports() if n.startswith("qvl.") and not n.endswith(".__main__"))
    missing = run_python(PUBLIC_NAMES_CHECK, *modules)
    assert missing == "[]", missing
