"""Bind every launch compile_sm90.py compiles, and a few more, with Triton's own launch binder and with qvl's fast
binder (:func:`qvl.kernels.common.fast_binder`), on a machine without a GPU.

The launches are the ops' own (their ``*_launches`` functions on CPU stand-ins shaped, strided and aligned like the
tower's calls); the extra ones reach the specializations those leave out: pointers off a 16-byte boundary, integers
that are neither multiples of 16 nor 1, integers equal to 1, K and V as TMA descriptors.

Run as a script with TRITON_INTERPRET=0 (the interpreter's kernel objects have no binder). Prints one JSON line per
launch: ``{"name", "kernel", "order", "values", "specialization", "options", "fast_specialization"}``, where the
three booleans say whether the fast binder's argument order (the kernel's parameters), argument values and options
equal the binder's, and both specializations are the lists' ``repr``.
"""

import json
import os
import sys
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET", "0") == "0", "bind with the interpreter off"

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for bench
sys.path.insert(0, str(Path(__file__).resolve().parent))  # compile_sm90's launch builders

import torch  # noqa: E402
import triton  # noqa: E402
from compile_sm90 import BF16, TOKENS, VARIANTS  # noqa: E402
from triton.compiler import make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

from bench.sass_attention import stand_in_launches  # noqa: E402
from qvl.kernels.common import HOPPER, fast_binder  # noqa: E402
from qvl.kernels.gelu import bias_gelu_launches  # noqa: E402
from qvl.kernels.layer_norm import layer_norm_launches  # noqa: E402


def unaligned_norm():
    """x one element past a 16-byte boundary, C = 1000 (not a multiple of 16), delta with row stride 1000 + 1."""
    buffer = torch.empty(1 + TOKENS * 1000, dtype=BF16)
    x = buffer[1:].view(TOKENS, 1000)
    delta = torch.empty(TOKENS, 1001, dtype=BF16)[:, :1000]
    h, y = torch.empty(2, TOKENS, 1000, dtype=BF16)
    weight, bias = torch.empty(2, 1000, dtype=BF16)
    return layer_norm_launches(x, delta, h, weight, bias, y, 1e-5, HOPPER)


def one_row_one_column():
    """A single row of one column: sizes and strides equal to 1."""
    x, y = torch.empty(2, 1, 1, dtype=torch.float32)
    return bias_gelu_launches(x, torch.empty(1), y, "none", HOPPER)


EXTRA = {
    "add_layer_norm bf16 C=1000 unaligned": unaligned_norm,
    "bias_gelu fp32 1x1": one_row_one_column,
    "vision_attn bf16 D=72 descriptors": lambda: stand_in_launches(72, False, tiles={"DESCRIPTORS": True}),
}


def run_options(kernel, kwargs: dict) -> dict:
    """What JITFunction.run adds to the launch's keywords before binding (Triton 3.6 lacks the last knob)."""
    options = {
        "debug": kwargs.get("debug", kernel.debug) or triton.knobs.runtime.debug,
        "instrumentation_mode": triton.knobs.compilation.instrumentation_mode,
    }
    if hasattr(triton.knobs.compilation, "fpsan_homomorphic_casts"):
        options["fpsan_homomorphic_casts"] = triton.knobs.compilation.fpsan_homomorphic_casts
    return options


def main():
    backend = make_backend(HOPPER)
    builders = {name: build for name, build in VARIANTS.items() if callable(build)}
    for name, build in {**builders, **EXTRA}.items():
        for launch in build():
            kernel = launch.kernel
            added = run_options(kernel, launch.kwargs)
            binder = create_function_from_signature(kernel.signature, kernel.params, backend)
            params, specialization, options = binder(**launch.args, **launch.kwargs, **added)
            values, fast_specialization, fast_options = fast_binder(kernel).bind(
                backend, **launch.args, **launch.kwargs
            )
            line = {
                "name": name,
                "kernel": kernel.__name__,
                "order": list(params) == kernel.arg_names,
                "values": len(values) == len(params) and all(a is b for a, b in zip(values, params.values())),
                "options": {**fast_options, **added} == options,
                "specialization": repr(specialization),
                "fast_specialization": repr(list(fast_specialization)),
            }
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
