"""The host-side parts of a qvl call that run without a GPU, timed on the CPU (issue 31), from the repository root:
``PYTHONPATH=. .venv/bin/python bench/results/host-cpu-20261204/host_parts.py`` (interpreter off).

Per op, microseconds per call (best of 5 rounds of 2000 calls) of:

* ``checks``: the op's argument checks (what its entry and its fake run);
* ``launches``: building its launch list for CUDA-shaped CPU tensors (the ``*_launches`` function, Hopper target);
* ``bind``: the fast launch's per-call work before the launcher, for each launch: the fast binder, the key and
  the cache look-up (``fast``); Triton's binder and its cache key as ``JITFunction.run`` computes them (``triton``).

And the dispatch of a custom op: ``torch.ops.qvl.layer_norm`` on a (1, 8) CPU tensor (torch path) against
the same body called as a function, with and without autograd wanting the call (grad mode off / on).
"""

import timeit

import torch
import triton
from triton.compiler import make_backend
from triton.runtime.jit import compute_cache_key, create_function_from_signature

import qvl.kernels  # noqa: F401
from qvl.kernels import common
from qvl.kernels.common import HOPPER, fast_binder

assert not common.triton_interpreting(), "time with TRITON_INTERPRET unset"

gelu = __import__("qvl.kernels.gelu", fromlist=["_"])
layer_norm = __import__("qvl.kernels.layer_norm", fromlist=["_"])
rms_norm = __import__("qvl.kernels.rms_norm", fromlist=["_"])
rotary = __import__("qvl.kernels.rotary", fromlist=["_"])
swiglu = __import__("qvl.kernels.swiglu", fromlist=["_"])
pos_embed = __import__("qvl.kernels.pos_embed", fromlist=["_"])

BF16 = torch.bfloat16
T, C, F, H, D = 64, 1152, 4304, 16, 72


def best_us(fn, number=2000, rounds=5) -> float:
    return min(timeit.repeat(fn, number=number, repeat=rounds)) / number * 1e6


def cases():
    x, delta, h, y = torch.empty(4, T, C, dtype=BF16)
    weight, bias = torch.empty(2, C, dtype=BF16)
    mlp, mlp_y = torch.empty(2, T, F, dtype=BF16)
    mlp_bias, up_bias = torch.empty(2, F, dtype=BF16)
    q, k, _ = torch.empty(T, 3, H, D, dtype=BF16).unbind(1)
    q_out, k_out = torch.empty(2, T, H, D, dtype=BF16)
    positions = torch.zeros(T, 2, dtype=torch.int32)
    table = torch.empty(48 * 48, C, dtype=BF16)
    indices, weights = torch.zeros(T, 4, dtype=torch.int32), torch.zeros(T, 4)
    eps = 1e-6
    yield (
        "layer_norm",
        lambda: layer_norm.check_norm_args("layer_norm", x, weight, bias, eps),
        lambda: layer_norm.layer_norm_launches(x, None, None, weight, bias, y, eps, HOPPER),
    )
    yield (
        "add_layer_norm",
        lambda: layer_norm.check_norm_args("add_layer_norm", x, weight, bias, eps, delta),
        lambda: layer_norm.layer_norm_launches(x, delta, h, weight, bias, y, eps, HOPPER),
    )
    yield (
        "rms_norm",
        lambda: layer_norm.check_norm_args("rms_norm", x, weight, None, eps),
        lambda: rms_norm.rms_norm_launches(x, None, None, weight, y, eps, HOPPER),
    )
    yield (
        "bias_gelu",
        lambda: gelu._check_bias_gelu_args("bias_gelu", mlp, mlp_bias, "tanh"),
        lambda: gelu.bias_gelu_launches(mlp, mlp_bias, mlp_y, "tanh", HOPPER),
    )
    yield (
        "bias_swiglu",
        lambda: swiglu._check_bias_swiglu_args("bias_swiglu", mlp, mlp, mlp_bias, up_bias),
        lambda: swiglu.bias_swiglu_launches(mlp, mlp, mlp_bias, up_bias, mlp_y, HOPPER),
    )
    yield (
        "rotary_2d",
        lambda: rotary._check_rotary_args("rotary_2d", q, k, positions, 10000.0, read_values=False),
        lambda: rotary.rotary_launches(q, k, q_out, k_out, positions, 10000.0, HOPPER),
    )
    yield (
        "pos_embed_interp_add_",
        lambda: pos_embed._check_add_args("pos_embed_interp_add_", y, table, indices, weights, read_values=False),
        lambda: pos_embed.pos_embed_interp_launches(table, indices, weights, y, True, HOPPER),
    )


def triton_bind(launch, backend):
    """What JITFunction.run computes per call before its cache look-up and launch."""
    kernel = launch.kernel
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    key_cache = {}

    def bind():
        kwargs = dict(launch.kwargs)
        kwargs["debug"] = kwargs.get("debug", kernel.debug) or triton.knobs.runtime.debug
        kwargs["instrumentation_mode"] = triton.knobs.compilation.instrumentation_mode
        if hasattr(triton.knobs.compilation, "fpsan_homomorphic_casts"):
            kwargs["fpsan_homomorphic_casts"] = triton.knobs.compilation.fpsan_homomorphic_casts
        bound, specialization, options = binder(**launch.args, **kwargs)
        return compute_cache_key(key_cache, specialization, options), tuple(bound.values())

    return bind


def fast_bind(launch, backend):
    binder = fast_binder(launch.kernel)
    binder.compiled.setdefault(common._launch_key(binder, backend, 0, launch.args, launch.kwargs)[1], object())

    def bind():
        values, key = common._launch_key(binder, backend, 0, launch.args, launch.kwargs)
        return common._cached(binder, key) is not None and common._globals_unchanged(binder), values

    return bind


def main():
    backend = make_backend(HOPPER)
    print(f"triton {triton.__version__}, torch {torch.__version__}")
    print(f"{'op':24s} {'checks':>7s} {'launches':>9s} {'bind fast':>10s} {'bind triton':>12s}  (us per call)")
    for name, checks, launches in cases():
        built = launches()
        fast = sum(best_us(fast_bind(launch, backend)) for launch in built)
        slow = sum(best_us(triton_bind(launch, backend)) for launch in built)
        print(f"{name:24s} {best_us(checks):7.2f} {best_us(launches):9.2f} {fast:10.2f} {slow:12.2f}")

    x, weight, bias = torch.randn(1, 8), torch.ones(8), torch.zeros(8)
    op, body = torch.ops.qvl.layer_norm, layer_norm.layer_norm._init_fn
    for grad in (False, True):
        weight.requires_grad_(grad)
        print(
            f"layer_norm (1, 8) CPU, weight.requires_grad={grad}: custom op {best_us(lambda: op(x, weight, bias, 1e-6)):.2f}"
            f" us, its body as a function {best_us(lambda: body(x, weight, bias, 1e-6)):.2f} us"
        )


if __name__ == "__main__":
    main()
