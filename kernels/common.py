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
import inspect
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import CompiledKernel
from triton.knobs import HookChain
from triton.runtime.jit import JITFunction

from . import verdicts

try:
    from triton._C.libtriton import native_specialize_impl
except ImportError:  # a Triton without it launches every kernel through kernel[grid] (see fast_binder)
    native_specialize_impl = None

__all__ = [
    "ADA",
    "BACKENDS",
    "TORCH_BACKENDS",
    "TRITON_BACKENDS",
    "FAST_LAUNCH_TRITON",
    "FMA_CONTRACTION",
    "HOPPER",
    "INTERPRETER",
    "KernelLaunch",
    "backend_for",
    "cached_config",
    "cdiv",
    "check_dtype",
    "check_same_device",
    "check_tensor",
    "compile_launch",
    "device_guard",
    "device_target",
    "fast_binder",
    "fast_launch_default",
    "fast_launch_enabled",
    "fast_launch_setting",
    "force_backend",
    "next_power_of_2",
    "refuse_autograd",
    "route_autograd",
    "rows_16_byte_aligned",
    "runs_torch",
    "run_launches",
    "set_fast_launch",
    "set_value_checks",
    "shared_memory_per_block",
    "strides_16_byte_aligned",
    "value_checks_enabled",
]

BACKENDS = ("triton", "interpreter", "torch", "reference")
# The paths that run pure torch, with no Triton kernel.
TORCH_BACKENDS = ("torch", "reference")
# The paths that run the Triton kernels (compiled, or in the interpreter).
TRITON_BACKENDS = ("triton", "interpreter")
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
    """Whether value checks run for inputs on ``device`` (always on CPU, opt-in on CUDA, never while a CUDA graph
    is being captured: their device-to-host sync would break the capture)."""
    if device.type == "cpu":
        return True
    return _value_checks and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


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
        """Launch on the current device and stream (a CUDA launch through the fast path below, where it is on)."""
        if not _INTERPRETING and _fast_launch is not False:
            device = torch.cuda.current_device()
            if fast_launch_enabled(device):
                _launch(self, device)
                return
        self.kernel[self.grid](**self.args, **self.kwargs)


def run_launches(launches: Sequence[KernelLaunch], device: torch.device) -> None:
    """Run ``launches`` in order, with ``device`` current (see :func:`device_guard`)."""
    if _INTERPRETING or device.type != "cuda":
        with device_guard(device):
            for launch in launches:
                launch.run()
        return
    current = torch.cuda.current_device()
    index = current if device.index is None else device.index
    fast = fast_launch_enabled(index)
    # Switching devices costs microseconds each way: only a launch on another GPU pays it.
    with device_guard(device) if index != current else contextlib.nullcontext():
        for launch in launches:
            if fast:
                _launch(launch, index)
            else:
                launch.kernel[launch.grid](**launch.args, **launch.kwargs)


# Fast launches (issue 31): what Triton's ``JITFunction.run`` does per call (kwargs dicts, the generated binder,
# a cache key stringified from the options, the globals check, launch metadata) costs tens of microseconds of
# host time, more than the norms' and activations' kernels run. A launch whose specialization was launched before
# calls the compiled kernel's launcher directly, with the arguments in the kernel's order, exactly as
# ``JITFunction.run`` ends (and as ``CompiledKernel.__getitem__`` launches). That repeats Triton internals (the
# binder's specialization, the device cache's layout, the compiled launcher's arguments), read against the source of
# each version below and the binders checked against each version's own (tests/kernels/test_fast_launch.py): torch
# 2.11 to 2.15 pin Triton 3.6 to 3.9. Another version never takes the path by default, so a Triton that changed them
# runs qvl as Triton launches it (correct, with Triton's host cost) until it is checked and added here. On these
# versions it is still a variant that has not run on a GPU: a GPU takes it by default only with a "right" device
# verdict (qvl.kernels.verdicts: the package's table, or qvl check on that machine).
FAST_LAUNCH_TRITON = ("3.6", "3.7", "3.8", "3.9")


def fast_launch_setting(setting: str | None) -> bool | None:
    """``QVL_FAST_LAUNCH`` read: None when unset (the device verdicts decide), ``""`` or ``"0"`` off, anything
    else on."""
    return None if setting is None else setting not in ("", "0")


def fast_launch_default(triton_version: str, verified: bool) -> bool:
    """Whether the fast path is on without a setting: on a Triton version of :data:`FAST_LAUNCH_TRITON` whose fast
    launches the GPU ``verified`` right (a device verdict), off otherwise."""
    return verified and ".".join(triton_version.split(".")[:2]) in FAST_LAUNCH_TRITON


_fast_launch = fast_launch_setting(os.environ.get("QVL_FAST_LAUNCH"))
# The default per CUDA device index, decided on its first launch.
_fast_by_device: dict[int, bool] = {}


def set_fast_launch(enabled: bool | None) -> None:
    """Switch the fast launch path on or off for every device (None: back to the device verdicts' default, see
    :func:`fast_launch_default`; ``QVL_FAST_LAUNCH`` sets it at import). Off, every launch goes through
    ``kernel[grid](**args, **kwargs)``: the A/B of ``python -m bench.bench_host``."""
    global _fast_launch
    _fast_launch = None if enabled is None else bool(enabled)
    _fast_by_device.clear()


def fast_launch_enabled(device: int | None = None) -> bool:
    """Whether launches on CUDA device index ``device`` (default: the current one) take the fast path."""
    if _fast_launch is not None:
        return _fast_launch
    if device is None:
        device = torch.cuda.current_device()
    enabled = _fast_by_device.get(device)
    if enabled is None:
        variant = verdicts.decision("launch", _cuda_target(device), device).variant
        enabled = _fast_by_device[device] = fast_launch_default(triton.__version__, variant == "fast")
    return enabled


class FastBinder:
    """A kernel's specialization without Triton's binder, and what its fast launches keep.

    ``bind(backend, **args, **kwargs)`` returns the kernel's arguments in its parameter order (constexprs included,
    as its launcher takes them), Triton's specialization of them (the very list ``JITFunction.run``'s binder
    computes: ``native_specialize_impl`` per argument with the parameter's flags, ``("constexpr", value)`` for
    constexprs) and the remaining keywords (compile options). ``compiled`` maps a launch key (:func:`_launch`) to
    the kernel Triton compiled for it, ``backends`` a device index to Triton's backend for that device, and
    ``globals`` holds ``(namespace, name, object)`` for each global the kernel reads, as of the last launch Triton
    checked them on.
    """

    __slots__ = ("bind", "compiled", "backends", "globals")

    def __init__(self, bind: Any) -> None:
        self.bind = bind
        self.compiled: dict[tuple, CompiledKernel] = {}
        self.backends: dict[int, Any] = {}
        self.globals: tuple[tuple[dict, str, Any], ...] = ()


def fast_binder(kernel: Any) -> FastBinder | None:
    """``kernel``'s :class:`FastBinder`, made once; None for what it does not handle (an interpreted or autotuned
    kernel, variadic or keyword-only parameters, a Triton without ``native_specialize_impl``), which then always
    launches through ``kernel[grid]``."""
    # Keyed by id: a JITFunction hashes its source hash behind a lock. The entry keeps the kernel alive, so its id
    # is never reused.
    entry = _fast_binders.get(id(kernel))
    if entry is None:
        entry = _fast_binders[id(kernel)] = (kernel, _make_fast_binder(kernel))
    return entry[1]


_fast_binders: dict[int, tuple[Any, FastBinder | None]] = {}


def _make_fast_binder(kernel: Any) -> FastBinder | None:
    if native_specialize_impl is None or not isinstance(kernel, JITFunction):
        return None
    parameters = list(kernel.signature.parameters.values())
    if any(p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters):
        return None
    # Each parameter's specialization, generated as create_function_from_signature generates it (3.6 and 3.9
    # alike): annotated non-constexpr floats and bools are not specialized, other annotations replace the type.
    specialization = []
    for param in kernel.params:
        name = param.name
        if param.is_constexpr:
            specialization.append(f'("constexpr", {name})')
            continue
        call = (
            f"specialize(backend, {name}, {param.is_const}, {not param.do_not_specialize}, "
            f"{not param.do_not_specialize_on_alignment})"
        )
        annotation = param.annotation_type
        if not annotation:
            specialization.append(call)
        elif isinstance(annotation, str) and (annotation == "u1" or annotation[:2] in ("fp", "bf")):
            specialization.append(f'("{annotation}", None)')
        else:
            specialization.append(f'("{annotation}",) + {call}[1:]')
    names = [p.name for p in parameters]
    arguments = [n if p.default is inspect.Parameter.empty else f"{n}=default_{n}" for n, p in zip(names, parameters)]
    source = (
        f"def bind(backend, {', '.join(arguments + ['**options'])}):\n"
        f"    return ({''.join(n + ', ' for n in names)}), ({''.join(s + ', ' for s in specialization)}), options\n"
    )
    namespace = {f"default_{p.name}": p.default for p in parameters if p.default is not inspect.Parameter.empty}
    namespace["specialize"] = native_specialize_impl
    exec(source, namespace)
    return FastBinder(namespace["bind"])


def _launch(launch: KernelLaunch, device: int) -> None:
    """Run ``launch`` on CUDA device ``device`` (the current one), on its current stream.

    The key is what Triton keys its in-memory kernel cache on (the specialization, and the options with the knobs
    ``JITFunction.run`` adds to them), plus the device. A launch whose key was seen before calls the compiled
    kernel's launcher with its arguments; any other goes through ``kernel[grid](**args, **kwargs)``, which compiles
    (or finds) the kernel and returns it for the next. So does a launch after a global the kernel reads was rebound
    (Triton then raises if its value changed). What the direct call would skip sends every launch of the kernel down
    that path: launch hooks (profilers), pre-run hooks, a callable grid, Triton 3.9's stage-inspection hook, and
    unhashable options.
    """
    kernel, grid, args, kwargs = launch
    binder = fast_binder(kernel)
    runtime = triton.knobs.runtime
    if (
        binder is None
        or _hooked(runtime.launch_enter_hook)
        or _hooked(runtime.launch_exit_hook)
        or getattr(runtime, "add_stages_inspection_hook", None) is not None
        or kernel.pre_run_hooks
        or callable(grid)
    ):
        kernel[grid](**args, **kwargs)
        return
    backend = binder.backends.get(device)
    if backend is not None:
        values, key = _launch_key(binder, backend, device, args, kwargs)
        compiled = _cached(binder, key)
        if compiled is not None and _globals_unchanged(binder):
            compiled.run(
                grid[0],
                grid[1] if len(grid) > 1 else 1,
                grid[2] if len(grid) > 2 else 1,
                _current_stream(device),
                compiled.function,
                compiled.packed_metadata,
                None,  # launch metadata and hooks: the launcher calls hooks that are not None
                None,
                None,
                *values,
            )
            return
    compiled = kernel[grid](**args, **kwargs)
    # JITFunction.run has compared the kernel's globals with their values at compile time, and raised if they
    # changed: the objects it found are the ones the next fast launches expect.
    read = kernel.used_global_vals
    binder.globals = tuple((namespace, name, namespace.get(name)) for (name, _), (_, namespace) in read.items())
    if backend is None:
        # JITFunction.run made the device's backend on this first launch.
        backend = binder.backends[device] = kernel.device_caches[device][3]
        values, key = _launch_key(binder, backend, device, args, kwargs)
    # Triton 3.6 may compile asynchronously; only a finished kernel is kept. An unhashable key (an option that
    # Triton only stringifies) is never kept.
    if isinstance(compiled, CompiledKernel):
        with contextlib.suppress(TypeError):
            binder.compiled[key] = compiled


def _hooked(hook: Any) -> bool:
    """Whether a launch hook knob holds a hook: Triton 3.6 and 3.9 keep an empty ``HookChain`` there."""
    return hook is not None and not (isinstance(hook, HookChain) and not hook.calls)


def _globals_unchanged(binder: FastBinder) -> bool:
    for namespace, name, value in binder.globals:
        if namespace.get(name) is not value:
            return False
    return True


def _launch_key(binder: FastBinder, backend: Any, device: int, args: dict, kwargs: dict) -> tuple[tuple, tuple]:
    values, specialization, options = binder.bind(backend, **args, **kwargs)
    compilation = triton.knobs.compilation
    knobs = (
        triton.knobs.runtime.debug,
        compilation.instrumentation_mode,
        getattr(compilation, "fpsan_homomorphic_casts", None),  # Triton 3.9's, absent from 3.6
    )
    return values, (device, specialization, *options.items(), *knobs)


def _cached(binder: FastBinder, key: tuple) -> Any:
    try:
        return binder.compiled.get(key)
    except TypeError:
        return None


def _current_stream(device: int) -> int:
    # The function JITFunction.run asks for the stream (torch's current raw stream where torch is loaded).
    return triton.runtime.driver.active.get_current_stream(device)


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


# Bounded: token counts, and so shapes, change from call to call.
@functools.lru_cache(maxsize=1024)
def strides_16_byte_aligned(shape: Sequence[int], strides: Sequence[int], element_size: int) -> bool:
    """Whether every stride but the last of a tensor of ``shape`` is a multiple of 16 bytes (hashable ``shape`` and
    ``strides``). Dims of size 1 are never stepped, so their strides do not count."""
    elements = 16 // element_size
    return not any(size > 1 and stride % elements for size, stride in zip(shape[:-1], strides[:-1]))


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for the host's grids: ``triton.cdiv`` is a constexpr function, whose wrapper costs
    microseconds a call outside a kernel."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= ``n`` (0 for 0), as ``triton.next_power_of_2`` computes it, without its
    constexpr-function wrapper."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def cached_config(config: Any) -> Any:
    """Cache a launch-configuration function of hashable arguments (sizes, flags, the target): each call returns a
    new dict (callers add to it and pop from it), copied from the one computed on the first call with those
    arguments. Cache only functions of arguments that take few values (a row width, not a token count)."""
    cached = functools.cache(config)

    @functools.wraps(config)
    def copied(*args: Any) -> dict:
        return dict(cached(*args))

    return copied


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


def check_no_internal_overlap(op: str, name: str, tensor: torch.Tensor) -> None:
    """Raise ValueError unless ``tensor``, which ``op`` writes in place, has no two elements at one address (an
    expanded row, say), the check torch's own in-place ops make: a kernel writing such a tensor would apply the
    op to those elements more than once. Reads sizes and strides only; called from the op's body, not its fake
    (torch's overlap test needs concrete sizes)."""
    if torch._debug_has_internal_overlap(tensor) == 1:
        raise ValueError(
            f"{op}: {name} is written in place, so no two of its elements may share memory; got strides "
            f"{tensor.stride()} for shape {tuple(tensor.shape)}"
        )


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
    """``cu_seqlens``: int32, 1-D, contiguous, at least one entry, on ``device``; values checked when
    ``read_values`` and value checks are enabled for the device (fake implementations pass ``read_values=False``)."""
    check_tensor(op, "cu_seqlens", cu_seqlens, ndim=1, dtypes=(torch.int32,))
    assert isinstance(cu_seqlens, torch.Tensor)
    if cu_seqlens.numel() < 1:
        raise ValueError(f"{op}: cu_seqlens must hold at least one entry (0), got an empty tensor")
    if cu_seqlens.numel() > 1 and cu_seqlens.stride(0) != 1:
        # The kernels' segment search reads entry i at cu_seqlens + i.
        raise ValueError(f"{op}: cu_seqlens must be contiguous, got stride {cu_seqlens.stride(0)}")
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
    see the caller's grad mode (the op body runs under the autograd function's no-grad). This kernel runs on every
    call that is not in inference mode (which leaves the autograd keys out), so it is kept to two C calls: the check
    torch's own custom-op autograd kernel makes (any tensor argument, or tensor in a list argument, requiring
    grad) and the redispatch ``OpOverload.redispatch`` makes.
    """
    redispatch = getattr(torch.ops.qvl, op).default._handle.redispatch_boxed
    below_autograd = torch._C._after_autograd_keyset
    any_requires_grad = torch._C._any_requires_grad

    def route(keyset, *args):
        if torch.is_grad_enabled() and any_requires_grad(*args):
            return under_grad(*args)
        return redispatch(keyset & below_autograd, *args)

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
