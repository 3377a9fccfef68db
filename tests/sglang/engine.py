"""One SGLang engine on a tiny checkpoint, one batch of multimodal requests, the greedy tokens as JSON.

Run as a subprocess with .venv-sglang's python (``run_engine`` below)::

    python tests/sglang/engine.py --model DIR --dtype float32 --out result.json

The caller sets the environment: ``QVL_SGLANG`` / ``SGLANG_PLUGINS`` (the switches), ``TRITON_INTERPRET``, and
``PYTHONPATH`` starting with tests/sglang so that every process, SGLang's scheduler included, runs the start-up shim
(sitecustomize.py), which also reports the plugin's route counts of each process to ``QVL_TEST_REPORT_DIR``.

SGLang runs on its generic CPU platform (every fused op on its pure-torch forward): torch-native attention for the
text model, torch sampling, no CUDA graphs. One ``generate`` runs three requests: one image, two images of different
sizes in one prompt, and a 4-frame video (the inputs of tests/vllm/engine.py; the video as an MPEG-4 file).
Decoding is greedy with a fixed length (EOS ignored). The JSON holds ``dtype``, ``tokens`` (per request),
``top_two`` (per request and step: the two most likely tokens and their log-probabilities, ``[[token, logprob],
[token, logprob]]``, most likely first: how decisive each greedy step was), ``reports`` (per process that imported the
plugin: its pid, route counts and state), ``load_s`` and ``generate_s``.
"""

import argparse
import glob
import importlib.util
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MAX_TOKENS = 16
_spec = importlib.util.spec_from_file_location("vllm_test_engine", os.path.join(HERE, "..", "vllm", "engine.py"))
inputs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(inputs)


def requests(tokenizer, video_file: str) -> tuple[list[str], list, list]:
    """Prompts from the model's chat template, with their images and videos (SGLang's per-request lists)."""

    def prompt(parts: list[dict], text: str) -> str:
        messages = [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    prompts = [
        prompt([{"type": "image"}], "Describe this image."),
        prompt([{"type": "image"}, {"type": "image"}], "What is different between these two pictures?"),
        prompt([{"type": "video"}], "What happens in this video?"),
    ]
    images = [[inputs.image(0)], [inputs.image(1), inputs.image(2)], []]
    videos = [[], [], [video_file]]
    return prompts, images, videos


def top_two(step: list) -> list[list]:
    """A greedy step's two most likely tokens and their log-probabilities (SGLang's ``(logprob, token, text)``
    entries), most likely first."""
    ranked = sorted(step, key=lambda entry: entry[0], reverse=True)[:2]
    return [[token, logprob] for logprob, token, _ in ranked]


def write_video(path: str) -> str:
    """tests/vllm/engine.py's test video as an MPEG-4 file (SGLang decodes video files with decord; its Qwen3-VL
    processor takes no frame arrays). Lossy, but every run decodes the same file to the same frames."""
    import av

    frames, metadata = inputs.video()
    with av.open(path, "w") as container:
        stream = container.add_stream("mpeg4", rate=int(metadata["fps"]))
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return path


def run_engine(model_dir, *, dtype: str, env: dict, tp: int = 1, dp_encoder: bool = False, timeout: float = 400):
    """Runs this script with the current interpreter in a subprocess (its own process group, killed whole on a
    timeout) and returns its JSON; ``env`` goes on top of this process's environment, with tests/sglang first on
    ``PYTHONPATH``. ``tp=2`` binds one core to each rank (``SGLANG_CPU_OMP_THREADS_BIND``: SGLang's CPU ranks
    default to one NUMA node each); ``dp_encoder``: ``--mm-enable-dp-encoder``. A failure raises ``RuntimeError``
    with the ends of the script's stdout and stderr."""
    with tempfile.TemporaryDirectory(prefix="qvl-sglang-") as tmp:
        child_env = dict(os.environ)
        child_env["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p)
        child_env["QVL_TEST_REPORT_DIR"] = os.path.join(tmp, "reports")
        os.makedirs(child_env["QVL_TEST_REPORT_DIR"])
        if tp == 2:
            child_env["SGLANG_CPU_OMP_THREADS_BIND"] = "0|1"
        child_env.update(env)
        out = os.path.join(tmp, "result.json")
        command = [sys.executable, os.path.abspath(__file__), "--model", os.fspath(model_dir), "--dtype", dtype]
        command += ["--out", out, "--tp", str(tp)] + ["--dp-encoder"] * dp_encoder
        return inputs.run_script(command, child_env, out, timeout)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="checkpoint directory (tests/sglang/sglang_checkpoint.py)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tp", type=int, default=1, help="tp_size")
    parser.add_argument("--dp-encoder", action="store_true", help="mm_enable_dp_encoder: the tower's batch split")
    parser.add_argument("--out", required=True, help="where the JSON goes")
    args = parser.parse_args(argv)

    import sglang

    start = time.perf_counter()
    engine = sglang.Engine(
        model_path=args.model,
        dtype=args.dtype,
        device="cpu",
        attention_backend="torch_native",
        sampling_backend="pytorch",
        disable_cuda_graph=True,
        max_total_tokens=4096,
        context_length=1024,
        random_seed=0,
        log_level="info",
        tp_size=args.tp,
        mm_enable_dp_encoder=args.dp_encoder,
    )
    load_s = time.perf_counter() - start
    try:
        video_file = write_video(os.path.join(os.path.dirname(os.path.abspath(args.out)), "video.mp4"))
        prompts, images, videos = requests(engine.tokenizer_manager.tokenizer, video_file)
        params = {"temperature": 0.0, "max_new_tokens": MAX_TOKENS, "ignore_eos": True}
        start = time.perf_counter()
        outputs = engine.generate(
            prompt=prompts,
            image_data=images,
            video_data=videos,
            sampling_params=params,
            return_logprob=True,
            top_logprobs_num=2,
        )
        generate_s = time.perf_counter() - start
        time.sleep(1.0)  # the scheduler's last route report (sitecustomize.py writes every 0.2 s)
    finally:
        engine.shutdown()
    reports = []
    for path in sorted(glob.glob(os.path.join(os.environ["QVL_TEST_REPORT_DIR"], "*.json"))):
        with open(path, encoding="utf-8") as f:
            reports.append(json.load(f))
    result = {
        "dtype": args.dtype,
        "tokens": [out["output_ids"] for out in outputs],
        "top_two": [[top_two(step) for step in out["meta_info"]["output_top_logprobs"]] for out in outputs],
        "reports": reports,
        "load_s": round(load_s, 2),
        "generate_s": round(generate_s, 2),
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
