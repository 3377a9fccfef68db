"""What every qvl kernel needs: which path runs, the device guard, and argument checks.

Three paths run a qvl op, chosen per call from the input's device:

* ``"triton"``: CUDA tensors run the compiled Triton kernel on the tensor's own device.
* ``"interpreter"``: CPU tensors, when Triton's interpreter is on (``TRITON_INTERPRET=1`` in the
  environment before ``qvl.kernels`` is imported: Triton decides at decoration time), run the same
  Triton kernel through the interpreter. This is how the tests exercise the real kernels without a GPU.
* ``"torch"``: CPU tensors otherwise run each op's pure-torch reference, so the ops work anywhere.

``force_backend("torch")`` overrides the choice (tests use it to reach the torch path in an interpreter
process; users can use it to compare paths).

Checks that read tensor *values* (for example that ``cu_seqlens`` is monotonic) run on CPU inputs
always, and on CUDA inputs only when value checks are switched on with ``QVL_CHECK_INPUTS=1`` or
:func:`set_value_checks`, because they need a device-to-host sync.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Sequence

import torch
import triton

__all__ = [
    "BACKENDS",
    "FMA_CONTRACTION",
    "backend_for",
    "check_dtype",
    "check_same_device",
    "check_tensor",
    "device_guard",
    "force_backend",
    "set_value_checks",
    "value_checks_enabled",
]

BACKENDS = ("triton", "interpreter", "torch")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Launch option of every kernel that may contract a * b + c into one FMA. Triton turned that on by default
# until 3.9, which warns that 3.10 turns it off: asking for it keeps results and speed the same whatever
# the Triton version.
FMA_CONTRACTION = {"enable_fp_fusion": True}

_state = threading.local()
_value_checks = os.environ.get("QVL_CHECK_INPUTS", "0") not in ("", "0")


def triton_interpreting() -> bool:
    """True when Triton's interpreter was on as qvl's kernels were defined."""
    return bool(triton.knobs.runtime.interpret)


def backend_for(device: torch.device) -> str:
    """The path a qvl op takes for inputs on ``device``: ``"triton"``, ``"interpreter"`` or ``"torch"``."""
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
    """Run qvl ops on one path inside the block (``"torch"`` works everywhere)."""
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
