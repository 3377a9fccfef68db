"""What qvl's ops do under ``torch.autocast``: each op declares it through ``torch.library``, as torch's own do.

Autocast (mixed precision over fp32 weights: HF Trainer's ``bf16=True``, accelerate's ``mixed_precision``,
Lightning's ``"bf16-mixed"``, timm's ``--amp``) casts the inputs of each op by a policy for that op. A custom op
without a rule of its own falls through autocast untouched, and every torch op its body calls is then autocast
in turn: a norm written in torch would have its statistics cast to bf16 half-way. So every qvl op gets a kernel
on the ``AutocastCPU`` and ``AutocastCUDA`` keys (:func:`follow_autocast`): it casts the arguments as the op's
rule says and runs the op with autocast switched off below it. The casts are ordinary torch ops, so autograd
records them and gradients reach fp32 parameters in fp32; eager calls and ``torch.compile`` (which traces
through the same dispatch keys) agree.

The rules follow torch's own policy for the work each op does:

* :func:`in_fp32`: norms, as ``torch.layer_norm`` under CUDA's autocast: every floating input to fp32, the result
  fp32. (The CPU's autocast leaves ``layer_norm`` in its input's dtype; qvl keeps one rule for both devices, which
  changes no tower's result: the linear after a norm rounds its input to the autocast dtype either way.)
* :func:`in_autocast_dtype`: matmul-like work in the autocast dtype, as ``scaled_dot_product_attention`` and a
  linear layer's bias: the attention's q, k and v; the bias-and-activation epilogues of the MLP's first linear
  (``bias_gelu``, ``bias_swiglu``), whose inputs are that linear's output and bias.
* :func:`add_then_norm`: the fused residual add + norm: the sum in the dtype torch's ``x + delta`` promotes to (an
  fp32 stream stays fp32, a 16-bit stream 16-bit), the normed result in fp32 as the norm alone.
* :func:`like_written`: in-place ops: the written tensor keeps its dtype (a cast would write into a copy), the
  others are cast to it.
* :func:`as_given`: everything else (the rotary's elementwise work, position-table resampling, every backward):
  no cast, only autocast off inside.

Only floating tensors on the autocast's device type, other than float64, are cast: autocast's own rule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "AutocastRule",
    "add_then_norm",
    "as_given",
    "follow_autocast",
    "in_autocast_dtype",
    "in_fp32",
    "like_written",
]

# rule(op, device_type, autocast_dtype, *args) -> the op's result, where op is the OpOverload to call (autocast
# is off for device_type while the rule runs) and args its arguments in schema order, defaults filled in.
AutocastRule = Callable[..., Any]

# The library fragment holding the autocast kernels (kept alive with the module).
_AUTOCAST_KEYS = torch.library.Library("qvl", "FRAGMENT")
_DEVICE_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}


def _cast(value: Any, device_type: str, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        castable = value.is_floating_point() and value.dtype != torch.float64 and value.device.type == device_type
        return value.to(dtype) if castable and value.dtype != dtype else value
    return value


def as_given(op, device_type: str, dtype: torch.dtype, *args):
    """No cast: the op computes in its inputs' dtypes, with autocast off for what it calls."""
    return op(*args)


def in_fp32(op, device_type: str, dtype: torch.dtype, *args):
    """Every floating argument in fp32 (torch's policy for norms): the result is fp32."""
    return op(*(_cast(a, device_type, torch.float32) for a in args))


def in_autocast_dtype(*positions: int) -> AutocastRule:
    """A rule casting the arguments at ``positions`` to the autocast dtype (torch's policy for matmul-like work)."""

    def rule(op, device_type: str, dtype: torch.dtype, *args):
        return op(*(_cast(a, device_type, dtype) if i in positions else a for i, a in enumerate(args)))

    return rule


def like_written(written: int) -> AutocastRule:
    """A rule for an in-place op writing argument ``written``: the floating arguments cast to its dtype."""

    def rule(op, device_type: str, dtype: torch.dtype, *args):
        target = args[written].dtype
        return op(*(a if i == written else _cast(a, device_type, target) for i, a in enumerate(args)))

    return rule


def add_then_norm(norm: Callable) -> AutocastRule:
    """The rule of a fused ``(x + delta, norm(x + delta))`` op whose arguments are ``(x, delta, *norm_parameters,
    eps)``: the sum in torch's promotion of x's and delta's dtypes, the normed result in fp32. ``norm`` is the
    unfused norm op, ``norm(sum, *norm_parameters, eps)``, which a 16-bit sum takes in fp32."""

    def rule(op, device_type: str, dtype: torch.dtype, x, delta, *rest):
        if torch.promote_types(x.dtype, delta.dtype) not in (torch.float16, torch.bfloat16):
            return in_fp32(op, device_type, dtype, x, delta, *rest)
        # A 16-bit stream (x and delta of one 16-bit dtype): the sum rounds to it, as torch's add does; only the
        # normed copy is fp32.
        total = x + delta
        return total, in_fp32(norm, device_type, dtype, total, *rest)

    return rule


def follow_autocast(op: str, rule: AutocastRule = as_given) -> None:
    """Give ``qvl::<op>`` its behaviour under ``torch.autocast`` on CPU and CUDA: ``rule`` casts its arguments (see
    the module docstring) and calls the op, with that device's autocast switched off while it runs."""
    overload = getattr(torch.ops.qvl, op).default
    for device_type, key in _DEVICE_KEYS.items():
        excluded = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

        def kernel(keyset, *args, device_type=device_type, excluded=excluded):
            with torch._C._ExcludeDispatchKeyGuard(excluded):
                return rule(overload, device_type, torch.get_autocast_dtype(device_type), *args)

        _AUTOCAST_KEYS.impl(op, kernel, key, with_keyset=True)
