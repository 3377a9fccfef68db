"""Packaging facts: import names, no heavy work at import, no second copy of the ops."""

import ast
import json
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
        "from qvl.vit.engines.vllm import plugin; has_vllm = 'vllm' in sys.modules;"
        "ep.load()(); state = plugin.state();"
        "print(ep.value, has_vllm, state['attention'], 'vLLM is not importable' in state['reason'])"
    )
    assert out == "qvl.vit.engines.vllm.plugin:register False False True"


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
    graph = {name: {o for o in deps if not name.startswith(o + ".")} for name, deps in graph.items()}
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


def within(module: str, package: str) -> bool:
    """Whether ``module`` is ``package`` or one of its submodules."""
    return module == package or module.startswith(package + ".")


ENGINES = "qvl.vit.engines"
# Each engine's subpackage -> the other engine's subpackage and the other engine's own package.
ENGINE_SIDES = {f"{ENGINES}.vllm": (f"{ENGINES}.sglang", "sglang"), f"{ENGINES}.sglang": (f"{ENGINES}.vllm", "vllm")}
# The old module paths from before the engines' move to qvl.vit.engines, kept for one release as re-exports of the
# new modules (vit/vllm_plugin.py, vit/sglang_plugin.py: the entry points' old targets; vit/cpu_path.py: docs named
# it): the only modules outside qvl.vit.engines that import it, and imported by nothing.
DEPRECATED_PATHS = {
    "qvl.vit.vllm_plugin": f"{ENGINES}.vllm.plugin",
    "qvl.vit.sglang_plugin": f"{ENGINES}.sglang.plugin",
    "qvl.vit.cpu_path": f"{ENGINES}.cpu_path",
}


def tower_core(name: str) -> bool:
    """Whether ``name`` is a module of qvl.vit's tower core: qvl.vit outside qvl.vit.engines and the old paths."""
    return within(name, "qvl.vit") and not within(name, ENGINES) and name not in DEPRECATED_PATHS


def test_floors_import_only_downwards():
    """kernels/ is single-device (no torch.distributed, nothing of qvl.vit or bench); vit/ knows nothing of
    bench; the balancer is pure (no torch.distributed). Inside vit/, the engines (qvl.vit.engines) build on the tower
    core, which imports nothing of them; neither engine's subpackage imports the other's (or the other engine), what
    they share (qvl.vit.engines.tower, .routes, .cpu_path) imports neither, and the engine packages' ``__init__``
    import nothing (importing a plugin module stays light). No module imports a deprecated old path."""
    imports = module_imports()
    for name, found in imports.items():
        if name.startswith("qvl.kernels"):
            assert not {m for m in found if m.startswith(("torch.distributed", "qvl.vit", "bench"))}, name
        if name.startswith("qvl.vit"):
            assert not {m for m in found if m.startswith("bench")}, name
        if tower_core(name):
            assert not {m for m in found if within(m, ENGINES)}, name
        if within(name, ENGINES):
            sides = [side for side in ENGINE_SIDES if within(name, side)]
            shared = [*ENGINE_SIDES, *(engine for _, engine in ENGINE_SIDES.values())]
            barred = ENGINE_SIDES[sides[0]] if sides else shared
            assert not {m for m in found if any(within(m, other) for other in barred)}, name
        assert not found & DEPRECATED_PATHS.keys(), name
    assert not {m for m in imports["qvl.vit.balance"] if m.startswith("torch")}
    assert not imports[ENGINES] and not any(imports[side] for side in ENGINE_SIDES)


def test_tower_core_loads_nothing_of_the_engines():
    """Importing every module of the tower core loads no module of qvl.vit.engines (an import by a string,
    importlib's, would show here and not in the import statements test_floors_import_only_downwards reads)."""
    modules = sorted(n for n in module_imports() if tower_core(n) and not n.endswith(".__main__"))
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    code += f"print(sorted(m for m in sys.modules if m.startswith({ENGINES!r})))"
    assert run_python(code, *modules) == "[]"


OLD_PATHS_CHECK = """
import importlib, importlib.metadata, json, sys, warnings
import torch  # torch's own import-time warnings are not what this counts
paths = dict(zip(sys.argv[1::2], sys.argv[2::2]))
report = {}
for old, new in paths.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    target = importlib.import_module(new)
    report[old] = {
        "names": sorted(module.__all__) == sorted(target.__all__),
        "same": all(getattr(module, n) is getattr(target, n) for n in target.__all__),
        "warned": [w.category.__name__ for w in caught if "qvl.vit" in str(w.message)],
    }
# An environment installed before the move keeps the old entry points until qvl is reinstalled.
for group, old in (("vllm.general_plugins", "qvl.vit.vllm_plugin"), ("sglang.srt.plugins", "qvl.vit.sglang_plugin")):
    entry = importlib.metadata.EntryPoint("qvl", f"{old}:register", group)
    report[old]["entry_point"] = entry.load() is importlib.import_module(paths[old]).register
print(json.dumps(report))
"""


def test_deprecated_old_paths_re_export_the_new():
    """The old module paths (one release) hold their new modules' public names, the same objects (the plugins' state
    is one), and the old entry points still load the plugins' hooks. The plugin modules import without a warning (in
    an environment installed before the move, vLLM and SGLang import them in every process they start), the CPU rule
    with a DeprecationWarning."""
    args = [path for pair in DEPRECATED_PATHS.items() for path in pair]
    report = json.loads(run_python(OLD_PATHS_CHECK, *args))
    for old in DEPRECATED_PATHS:
        assert report[old]["names"] and report[old]["same"], (old, report[old])
    assert report["qvl.vit.vllm_plugin"] == {"names": True, "same": True, "warned": [], "entry_point": True}
    assert report["qvl.vit.sglang_plugin"] == {"names": True, "same": True, "warned": [], "entry_point": True}
    assert report["qvl.vit.cpu_path"]["warned"] == ["DeprecationWarning"]


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
