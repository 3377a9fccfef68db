"""What every qvl kernel needs: which path runs (autograd routing included), the device guard, and argument checks.

Four paths run a qvl op, chosen per call from the input's device:

* ``"triton"``: CUDA tensors run the compiled Triton kernel on the tensor's own device.
* ``"interpreter"``: CPU tensors, when Triton's interpreter is on (``TRITON_INTERPRET=1`` in the
  environment before ``qvl.kernels`` is imported: Triton decides at decoration time), run the same
  Triton kernel through the interpreter. This is how the tests exercise the real kernels without a GPU.
* ``"torch"``: CPU tensors otherwise run the ops' torch path (:mod:`qvl.kernels.torch_path`): plain torch
  built for speed on CPU (attention through torch's fused ``scaled_dot_product_attention``, one call per run
  of equal-length segments, memory O(S); the rotary once per q and k; norms and activations in as few
  passes as eager torch allows), which torch.compile traces into. Attention's training forward, which also
  returns the log-sum-exp, and the backward ops run the references.
* ``"reference"``: each op's pure-torch reference, the tests' oracle (attention materializes every segment's
  fp32 logits). Never chosen by default.

``force_backend(name)`` overrides the choice (tests use ``"torch"`` and ``"reference"`` to reach those
paths in an interpreter process; users can use it to compare paths).

Checks that read tensor *values* (for example that ``cu_seqlens`` is monotonic) run on CPU inputs
always, and on CUDA inputs only when value checks are switched on with ``QVL_CHECK_INPUTS=1`` or
:func:`set_value_checks`, because they need a device-to-host sync.

Under autograd a call may take another path: :func:`route_autograd` gives an op its own kernel on the
autograd keys (attention's training forward, which also saves the log-sum-exp), and :func:`refuse_autograd`
makes the in-place ops, which torch.library cannot give a backward, refuse calls that would need one.

Each kernel family chooses its launch configuration with one pure function of shapes, dtype and
:func:`device_target`, and describes its launches as :class:`KernelLaunch` values: the launcher runs them,
and :func:`compile_launch` compiles the very same launches for a GPU target without a GPU (the sm_90
checks in tests/kernels and ``python -m bench.sass_attention``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch
import triton
from triton.backends.compiler import GPUTarget

__all__ = [
    "ADA",
    "BACKENDS",
    "TORCH_BACKENDS",
    "FMA_CONTRACTION",
    "HOPPER",
    "INTERPRETER",
    "KernelLaunch",
    "backend_for",
    "check_dtype",
    "check_same_device",
    "check_tensor",
    "compile_launch",
    "device_guard",
    "device_target",
    "force_backend",
    "refuse_autograd",
    "route_autograd",
    "rows_16_byte_aligned",
    "runs_torch",
    "run_launches",
    "set_value_checks",
    "shared_memory_per_block",
    "strides_16_byte_aligned",
    "value_checks_enabled",
]

BACKENDS = ("triton", "interpreter", "torch", "reference")
# The paths that run pure torch, with no Triton kernel.
TORCH_BACKENDS = ("torch", "reference")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Launch option of every kernel that may contract a * b + c into one FMA. Triton turned that on by default
# until 3.9, which warns that 3.10 turns it off: asking for it keeps results and speed the same whatever
# the Triton version.
FMA_CONTRACTION = {"enable_fp_fusion": True}

# Targets a launch configuration is chosen for: a CUDA device is named the way Triton's driver names it
# (backend, compute capability as major * 10 + minor, warp size); Triton's interpreter, which runs the
# kernels on CPU tensors, is a target of its own.
HOPPER = GPUTarget("cuda", 90, 32)
ADA = GPUTarget("cuda", 89, 32)
INTERPRETER = GPUTarget("interpreter", 0, 1)
# The most shared memory one block may use, by compute capability (CUDA C++ Programming Guide, "Technical
# Specifications per Compute Capability"): 99 KiB on the consumer parts 8.6, 8.9 and 12.x.
_SHARED_MEMORY_PER_BLOCK = {
    75: 64 * 1024,
    80: 163 * 1024,
    86: 99 * 1024,
    87: 163 * 1024,
    89: 99 * 1024,
    90: 227 * 1024,
    100: 227 * 1024,
    103: 227 * 1024,
    120: 99 * 1024,
}

_state = threading.local()
# Read once, as qvl's kernels are defined: Triton reads the knob when it decorates a kernel, so a later change
# would not reach them (and a constant is what torch.compile can trace through, where Triton's knob is not).
_INTERPRETING = bool(triton.knobs.runtime.interpret)
_value_checks = os.environ.get("QVL_CHECK_INPUTS", "0") not in ("", "0")


def triton_interpreting() -> bool:
    """True when Triton's interpreter was on as qvl's kernels were defined."""
    return _INTERPRETING


def backend_for(device: torch.device) -> str:
    """The path a qvl op takes for inputs on ``device``: ``"triton"``, ``"interpreter"``, ``"torch"`` or, forced,
    ``"reference"``. torch.compile traces through it (guarding on the forced path)."""
    forced = getattr(_state, "forced", None)
    if forced is not None:
        return forced
    if device.type == "cuda":
        if triton_interpreting():
            raise RuntimeError(
                "qvl: TRITON_INTERPRET=1 is set but the inputs are on CUDA; the interpreter runs on CPU "
                "tensors only. Unset TRITON_INTERPRET to run the compiled kernels."
            )
        return "triton"
    if device.type == "cpu":
        return "interpreter" if triton_interpreting() else "torch"
    raise ValueError(f"qvl: unsupported device type {device.type!r} (expected 'cuda' or 'cpu')")


@contextlib.contextmanager
def force_backend(name: str) -> Iterator[None]:
    """Run qvl ops on one path inside the block (``"torch"`` and ``"reference"`` work everywhere)."""
    if name not in BACKENDS:
        raise ValueError(f"qvl: backend must be one of {BACKENDS}, got {name!r}")
    if name == "interpreter" and not triton_interpreting():
        raise ValueError("qvl: the interpreter path needs TRITON_INTERPRET=1 before qvl.kernels is imported")
    previous = getattr(_state, "forced", None)
    _state.forced = name
    try:
        yield
    finally:
        _state.forced = previous


def runs_torch(device: torch.device) -> bool:
    """Whether qvl ops on ``device`` run pure torch (the ``"torch"`` path or the ``"reference"`` oracle)."""
    return backend_for(device) in TORCH_BACKENDS


def set_value_checks(enabled: bool) -> None:
    """Switch on checks that read CUDA tensor values (they sync the device; off by default)."""
    global _value_checks
    _value_checks = bool(enabled)


def value_checks_enabled(device: torch.device) -> bool:
    """Whether value checks run for inputs on ``device`` (always on CPU, opt-in on CUDA)."""
    return device.type == "cpu" or _value_checks


def device_guard(device: torch.device) -> contextlib.AbstractContextManager:
    """Make ``device`` current while launching, so a kernel runs on its inputs' GPU (multi-GPU ranks)."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def device_target(device: torch.device) -> GPUTarget:
    """The target a kernel launched for tensors on ``device`` runs on, without a device sync (the compute
    capability comes from torch's device properties, read once per device); CPU tensors run in the
    interpreter."""
    if device.type == "cuda":
        return _cuda_target(device.index if device.index is not None else torch.cuda.current_device())
    return INTERPRETER


@functools.cache
def _cuda_target(index: int) -> GPUTarget:
    major, minor = torch.cuda.get_device_capability(index)
    return GPUTarget("cuda", major * 10 + minor, 32)


def shared_memory_per_block(target: GPUTarget) -> int | None:
    """Bytes of shared memory one block may use on ``target``; None for the interpreter (no limit). An
    architecture missing from the table gets the smallest budget of its major version, or 64 KiB."""
    if target.backend != "cuda":
        return None
    if target.arch in _SHARED_MEMORY_PER_BLOCK:
        return _SHARED_MEMORY_PER_BLOCK[target.arch]
    same_major = [size for arch, size in _SHARED_MEMORY_PER_BLOCK.items() if arch // 10 == target.arch // 10]
    return min(same_major, default=64 * 1024)


class KernelLaunch(NamedTuple):
    """One launch as data, ``kernel[grid](**args, **kwargs)``: what a launcher runs and what
    :func:`compile_launch` compiles. ``args`` holds the kernel's tensors and scalars by parameter name (grouped
    by the launcher as the kernel groups its parameters), ``kwargs`` its meta-parameters and compile options."""

    kernel: Any
    grid: tuple[int, ...]
    args: dict[str, Any]
    kwargs: dict[str, Any]

    def run(self) -> None:
        self.kernel[self.grid](**self.args, **self.kwargs)


def run_launches(launches: Sequence[KernelLaunch], device: torch.device) -> None:
    """Run ``launches`` in order, with ``device`` current (see :func:`device_guard`)."""
    with device_guard(device):
        for launch in launches:
            launch.run()


def compile_launch(launch: KernelLaunch, target: GPUTarget) -> Any:
    """Compile ``launch`` for ``target`` exactly as running it on such a device would, without one.

    The kernel's own argument binder specializes the arguments the way a launch does: pointers whose data
    starts on a 16-byte boundary and integers divisible by 16 get ``tt.divisibility = 16``, integers equal
    to 1 become constants, ``do_not_specialize`` is honoured. CPU tensors with the real call's shapes,
    strides and alignment therefore stand in for CUDA ones. Returns Triton's compiled kernel (``.asm``,
    ``.metadata``). Needs the kernels defined with ``TRITON_INTERPRET=0``.

    Written against Triton 3.9's internals (and read against 3.6's, which differ only in the knob noted
    below), which ``JITFunction.run`` itself uses and no public API
    exposes without a device: ``triton.runtime.jit.create_function_from_signature`` (the binder),
    ``JITFunction.signature``/``.params``/``._pack_args`` (signature, constants and attributes from the
    binder's specialization), ``triton.compiler.make_backend`` and ``ASTSource(fn, signature, constexprs,
    attrs)``, then the public ``triton.compile(src, target=..., options=...)``.
    """
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    if triton_interpreting():
        raise RuntimeError("qvl: compile_launch needs the kernels defined with TRITON_INTERPRET=0")
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    # The options JITFunction.run adds before binding (Triton 3.6 lacks the float-sanitizer knob).
    kwargs = {
        **launch.kwargs,
        "debug": launch.kwargs.get("debug", kernel.debug) or triton.knobs.runtime.debug,
        "instrumentation_mode": triton.knobs.compilation.instrumentation_mode,
    }
    if hasattr(triton.knobs.compilation, "fpsan_homomorphic_casts"):
        kwargs["fpsan_homomorphic_casts"] = triton.knobs.compilation.fpsan_homomorphic_casts
    bound_args, specialization, options = binder(**launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def rows_16_byte_aligned(*tensors: torch.Tensor) -> bool:
    """Whether every tensor's data starts on a 16-byte boundary and every stride but the last (contiguous)
    one is a multiple of 16 bytes (:func:`strides_16_byte_aligned`): then every row a kernel addresses starts on a
    16-byte boundary and can be moved with 16-byte vector or asynchronous copies. Reads host metadata only (no
    device sync)."""
    return all(
        t.data_ptr() % 16 == 0 and strides_16_byte_aligned(t.shape, t.stride(), t.element_size()) for t in tensors
    )


def strides_16_byte_aligned(shape: Sequence[int], strides: Sequence[int], element_size: int) -> bool:
    """Whether every stride but the last of a tensor of ``shape`` is a multiple of 16 bytes. Dims of size 1 are
    never stepped, so their strides do not count."""
    elements = 16 // element_size
    return not any(size > 1 and stride % elements for size, stride in zip(shape[:-1], strides[:-1]))


def check_tensor(
    op: str,
    name: str,
    tensor: object,
    ndim: int,
    dtypes: Sequence[torch.dtype] | None = None,
    last_dim_contiguous: bool = False,
) -> None:
    """Raise TypeError/ValueError naming ``op`` and ``name`` unless ``tensor`` fits the description."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != ndim:
        raise ValueError(f"{op}: {name} must be {ndim}-D, got shape {tuple(tensor.shape)}")
    if dtypes is not None:
        check_dtype(op, name, tensor, dtypes)
    if last_dim_contiguous and tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(f"{op}: {name} must have a contiguous last dimension, got strides {tensor.stride()}")


def check_dtype(op: str, name: str, tensor: torch.Tensor, dtypes: Sequence[torch.dtype]) -> None:
    if tensor.dtype not in dtypes:
        expected = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{op}: {name} must be one of ({expected}), got {tensor.dtype}")


def check_same_device(op: str, named: dict[str, torch.Tensor]) -> None:
    """All tensors in ``named`` on one device (the first one's)."""
    items = list(named.items())
    first_name, first = items[0]
    for name, tensor in items[1:]:
        if tensor.device != first.device:
            raise ValueError(f"{op}: {name} is on {tensor.device} but {first_name} is on {first.device}")


def check_cu_seqlens(
    op: str, cu_seqlens: object, num_tokens: int, device: torch.device, read_values: bool = True
) -> None:
    """``cu_seqlens``: int32, 1-D, at least one entry, on ``device``; values checked when ``read_values``
    and value checks are enabled for the device (fake implementations pass ``read_values=False``)."""
    check_tensor(op, "cu_seqlens", cu_seqlens, ndim=1, dtypes=(torch.int32,))
    assert isinstance(cu_seqlens, torch.Tensor)
    if cu_seqlens.numel() < 1:
        raise ValueError(f"{op}: cu_seqlens must hold at least one entry (0), got an empty tensor")
    if cu_seqlens.device != device:
        raise ValueError(f"{op}: cu_seqlens is on {cu_seqlens.device} but q is on {device}")
    if not (read_values and value_checks_enabled(device)):
        return
    values = cu_seqlens.cpu()
    if int(values[0]) != 0:
        raise ValueError(f"{op}: cu_seqlens must start at 0, got {int(values[0])}")
    if int(values[-1]) != num_tokens:
        raise ValueError(f"{op}: cu_seqlens must end at the token count {num_tokens}, got {int(values[-1])}")
    if values.numel() > 1 and bool((values[1:] < values[:-1]).any()):
        raise ValueError(f"{op}: cu_seqlens must be non-decreasing, got {values.tolist()}")


# The library fragment holding the kernels route_autograd registers (kept alive with the module).
_AUTOGRAD_KEYS = torch.library.Library("qvl", "FRAGMENT")


def route_autograd(op: str, under_grad) -> None:
    """Give ``qvl::<op>`` its own kernel on the AutogradCPU / AutogradCUDA keys: with grad mode on and a tensor
    argument requiring grad the call runs ``under_grad(*args)``; otherwise it goes to the keys below autograd,
    as the custom op's own no-grad path does (inference is unchanged, eager or compiled).

    The dispatcher prefers these per-backend keys to the custom op's ``Autograd`` registration, and they still
    see the caller's grad mode (the op body runs under the autograd function's no-grad). The check reads Python
    attributes only.
    """
    overload = getattr(torch.ops.qvl, op).default

    def route(keyset, *args):
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return under_grad(*args)
        return overload.redispatch(keyset & torch._C._after_autograd_keyset, *args)

    for key in ("AutogradCPU", "AutogradCUDA"):
        _AUTOGRAD_KEYS.impl(op, route, key, with_keyset=True)


def refuse_autograd(op: str, alternative: str) -> None:
    """Make the in-place op ``qvl::<op>`` raise a RuntimeError naming ``alternative`` when autograd would record
    it (:func:`route_autograd`). torch.library gives mutating custom ops no autograd formula
    (``register_autograd`` refuses non-functional schemas); without this guard such a call would mutate its input
    and silently leave the autograd graph believing the old value."""
    message = (
        f"qvl::{op} mutates its input and has no backward (torch.library supports autograd for functional "
        f"custom ops only); under torch.no_grad() or with inputs that do not require grad it runs as usual. "
        f"For gradients use the out-of-place {alternative}."
    )

    def refuse(*args):
        raise RuntimeError(message)

    route_autograd(op, refuse)
