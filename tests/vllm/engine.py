"""One vLLM engine on a tiny checkpoint, one batch of multimodal requests, the greedy tokens as JSON.

Run as a subprocess with .venv-vllm's python (``run_engine`` below; tests import it by bare name,
``from engine import run_engine``)::

    python tests/vllm/engine.py --model DIR --dtype float32 --tp 1 [--mm-encoder-tp-mode weights|data] \\
        [--skip-video] --out result.json

The caller sets the environment: ``VLLM_PLUGINS`` (which vLLM plugins load; "" loads none),
``TRITON_INTERPRET``, the CPU thread binding for two ranks, and ``PYTHONPATH`` starting with tests/vllm so
that every process, vLLM's spawned ones included, imports the torchvision shim (sitecustomize.py). This
script only adds defaults: a 1 GiB KV cache (``VLLM_CPU_KVCACHE_SPACE``; vLLM's default takes a share of
the machine's memory) and ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, without which vLLM refuses to send the
function of ``collective_rpc`` (a callable travels by cloudpickle) to its engine process.

One ``llm.generate`` runs three requests, so one engine start (35-45 s on 2 CPU cores as vLLM spawns its
processes, 15 s with VLLM_ENABLE_V1_MULTIPROCESSING=0; see ``run_engine``) covers one image,
two images of different sizes in one prompt, and a 4-frame video. Decoding is greedy with a fixed length
(EOS ignored): the tokens of two runs compare one to one. The JSON holds ``dtype``, ``tokens`` (per request),
``top_two`` (per request and step: the two highest-scoring tokens and their raw logits, ``[[token, logit],
[token, logit]]``, highest first; random weights make some steps near-ties, at which two numerically different but
equally correct runs may part), ``num_prompt_tokens`` (per request, after the vision placeholders' expansion),
``worker_info`` (per worker: its pid, ``qvl``: None where vLLM did not load qvl's plugin, else the plugin's
``route_counts()``, ``state()`` and ``towers()``, and its TRITON_INTERPRET), ``load_s`` and ``generate_s``.
"""

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# Two ranks on a 2-core machine: one core each, none kept back for the engine's own process (vLLM's default
# reserves one, which leaves too few for two ranks).
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
MAX_TOKENS = 16
# (height, width) of the test images: small, different sizes and aspect ratios. With Qwen3-VL's 32-px and
# Qwen2.5-VL's 28-px merged tokens they make 4, 6 and 20 (Qwen3-VL) or 4, 6 and 24 (Qwen2.5-VL) vision
# tokens; the largest spans two of Qwen2.5-VL's 112-px attention windows.
IMAGE_SIZES = [(48, 64), (64, 96), (120, 160)]
VIDEO_SHAPE = (4, 64, 64)  # frames, height, width
VIDEO_FPS = 2.0


def image(index: int):
    """Test image ``index`` (an RGB PIL image): seeded noise over a colour gradient, the same every run."""
    import numpy as np
    from PIL import Image

    height, width = IMAGE_SIZES[index]
    rng = np.random.default_rng(index)
    ramp = np.linspace(0, 255, width)[None, :, None] * np.array([1.0, 0.5, 0.2])
    pixels = np.clip(ramp + rng.normal(0, 40, (height, width, 3)), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels)


def video():
    """The test video as vLLM takes a decoded one for Qwen2.5-VL and Qwen3-VL: ``(frames, metadata)``, frames
    a uint8 array ``(T, H, W, 3)``; the metadata says these are all of the video's frames, not to be
    sampled again (the models' processors compute the frames' timestamps from it)."""
    import numpy as np

    frames, height, width = VIDEO_SHAPE
    rng = np.random.default_rng(100)
    pixels = rng.integers(0, 256, (frames, height, width, 3), dtype=np.uint8)
    metadata = {
        "fps": VIDEO_FPS,
        "duration": frames / VIDEO_FPS,
        "total_num_frames": frames,
        "frames_indices": list(range(frames)),
        "video_backend": "opencv",
        "do_sample_frames": False,
    }
    return pixels, metadata


def requests(tokenizer, skip_video: bool) -> list[dict]:
    """The batch: prompts from the model's chat template, with their images or video."""

    def prompt(parts: list[dict], text: str) -> str:
        messages = [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    batch = [
        {"prompt": prompt([{"type": "image"}], "Describe this image."), "multi_modal_data": {"image": image(0)}},
        {
            "prompt": prompt([{"type": "image"}, {"type": "image"}], "What is different between these two pictures?"),
            "multi_modal_data": {"image": [image(1), image(2)]},
        },
    ]
    if not skip_video:
        batch.append(
            {
                "prompt": prompt([{"type": "video"}], "What happens in this video?"),
                "multi_modal_data": {"video": video()},
            }
        )
    return batch


def top_two(step: dict) -> list[list]:
    """A greedy step's two highest-scoring tokens and their raw logits (``logprobs_mode="raw_logits"``), highest
    first: how decisive the step was, and at what scale its logits round."""
    ranked = sorted(step.items(), key=lambda item: item[1].logprob, reverse=True)[:2]
    return [[token, entry.logprob] for token, entry in ranked]


def worker_info(worker) -> dict:
    """Runs in every worker process (``collective_rpc`` passes the worker as the first argument)."""
    import os
    import sys

    plugin = sys.modules.get("qvl.vit.engines.vllm.plugin")
    return {
        "pid": os.getpid(),
        "qvl": None
        if plugin is None
        else {"counts": plugin.route_counts(), "state": plugin.state(), "towers": plugin.towers()},
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),
    }


def run_engine(
    model_dir,
    *,
    dtype: str,
    tp: int = 1,
    mode: str | None = None,
    env: dict,
    skip_video: bool = False,
    timeout: float = 300,
) -> dict:
    """Runs this script with the current interpreter (.venv-vllm's under pytest) in a subprocess and
    returns its JSON.

    The subprocess's environment is this process's, with tests/vllm first on ``PYTHONPATH`` (the
    torchvision shim, for vLLM's spawned processes too) and ``env`` on top: the caller says which vLLM
    plugins load (``VLLM_PLUGINS``; unset loads all installed ones) and sets ``TRITON_INTERPRET`` (the
    suite's tests/conftest.py has set it to "1" in this process, which the subprocess inherits otherwise).
    ``tp=2`` adds the thread binding for two ranks unless ``env`` sets it. ``mode`` is vLLM's
    ``mm_encoder_tp_mode`` ("weights" or "data"). ``env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", ...}``
    runs the engine core (and, at ``tp=1``, the worker) inside the subprocess itself instead of in two
    spawned processes: about 15 s less start-up on 2 cores.

    The subprocess runs in its own process group, which a timeout kills whole (vLLM's engine and worker
    processes included); a failure raises ``RuntimeError`` with the ends of its stdout and stderr.
    """
    child_env = dict(os.environ)
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p)
    if tp == 2:
        child_env.update(TP2_ENV)
    child_env.update(env)
    with tempfile.TemporaryDirectory(prefix="qvl-vllm-") as tmp:
        out = os.path.join(tmp, "result.json")
        command = [sys.executable, os.path.abspath(__file__), "--model", os.fspath(model_dir)]
        command += ["--dtype", dtype, "--tp", str(tp), "--out", out]
        command += ["--mm-encoder-tp-mode", mode] if mode else []
        command += ["--skip-video"] if skip_video else []
        return run_script(command, child_env, out, timeout)


def run_script(command: list[str], env: dict, out: str, timeout: float) -> dict:
    """Runs ``command`` (an engine script writing its JSON to ``out``) in its own process group with ``env``, kills
    the whole group on a ``timeout`` and once it exits (engine processes that outlive it), and returns the JSON with
    the script's output under ``"log"``. A failure raises ``RuntimeError`` with the ends of its stdout and stderr."""
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        failure = None if proc.returncode == 0 else f"exit status {proc.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        failure = f"no result after {timeout:.0f} s"
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    if failure is None and not os.path.exists(out):
        failure = "no result file"
    if failure:
        raise RuntimeError(
            f"{os.path.basename(command[1])} ({' '.join(command[2:])}) failed: {failure}\n"
            f"--- stdout (end) ---\n{stdout[-3000:]}\n--- stderr (end) ---\n{stderr[-6000:]}"
        )
    with open(out, encoding="utf-8") as f:
        result = json.load(f)
    result["log"] = stdout + stderr
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="checkpoint directory (tests/vllm/checkpoints.py)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    parser.add_argument("--mm-encoder-tp-mode", choices=["weights", "data"], default=None)
    parser.add_argument("--skip-video", action="store_true", help="leave out the video request")
    parser.add_argument("--out", required=True, help="where the JSON goes")
    args = parser.parse_args(argv)

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm import LLM, SamplingParams

    options = {} if args.mm_encoder_tp_mode is None else {"mm_encoder_tp_mode": args.mm_encoder_tp_mode}
    start = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        tensor_parallel_size=args.tp,
        max_model_len=1024,
        max_num_seqs=4,
        max_num_batched_tokens=1024,
        enforce_eager=True,
        limit_mm_per_prompt={"image": 2, "video": 1},
        generation_config="vllm",  # not the checkpoint's generation_config.json: plain greedy decoding
        seed=0,
        logprobs_mode="raw_logits",  # each step's top tokens with their logits (the scale they round at)
        **options,
    )
    load_s = time.perf_counter() - start

    batch = requests(llm.get_tokenizer(), args.skip_video)
    # logprobs=2: the two highest-scoring tokens of each step, whose gap is the step's margin.
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False, logprobs=2)
    start = time.perf_counter()
    outputs = llm.generate(batch, params, use_tqdm=False)
    generate_s = time.perf_counter() - start

    result = {
        "dtype": args.dtype,
        "tokens": [list(out.outputs[0].token_ids) for out in outputs],
        "top_two": [[top_two(step) for step in out.outputs[0].logprobs] for out in outputs],
        "num_prompt_tokens": [len(out.prompt_token_ids) for out in outputs],
        "worker_info": llm.collective_rpc(worker_info),
        "load_s": round(load_s, 2),
        "generate_s": round(generate_s, 2),
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
