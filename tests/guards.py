"""NaN guard bands: tensors placed as views inside larger buffers filled with NaN.

Triton's interpreter reads masked-off lanes as 0 and never faults on an address past a tensor's end, so a kernel
that loads out of its tensor, or uses a lane without its mask, can pass in the interpreter and fail on a GPU.
Inside a guarded buffer every such read returns NaN, which reaches the result; every stray write replaces a
NaN of the band, which :func:`assert_guards_intact` finds. Tests import this module by bare name (pytest puts
tests/ on sys.path).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch

__all__ = ["LAYOUTS", "assert_clean", "assert_guards_intact", "guarded", "guarded_empty", "layout_pads"]

# The layouts the kernels' guard tests run: every row on a 16-byte boundary (the kernels' aligned path), and row
# strides that are no multiple of 16 bytes (their other path).
LAYOUTS = ("aligned", "unaligned")


def layout_pads(layout: str, dtype: torch.dtype) -> Iterator[int]:
    """``pad`` values of :func:`guarded_empty` giving ``layout`` (one of :data:`LAYOUTS`) in ``dtype``, a new one for
    each tensor of a test: 1, 2, 3, ... steps of 16 bytes for "aligned"; 1, 3, 5, ... elements for "unaligned",
    which give rows of an even length a stride that is no multiple of 16 bytes. Each tensor then has a row stride
    of its own, so a kernel stepping one tensor's rows with another's stride reads a band."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "aligned":
        return itertools.count(16 // dtype.itemsize, 16 // dtype.itemsize)
    return itertools.count(1, 2)


class _Guarded:
    """The buffer a guarded view lives in, and which of its elements the view covers."""

    def __init__(self, buffer: torch.Tensor, inside: torch.Tensor):
        self.buffer = buffer
        self.inside = inside


def guarded_empty(
    shape: tuple[int, ...], dtype: torch.dtype, device="cpu", *, guard_rows: int = 3, pad: int = 8
) -> torch.Tensor:
    """A ``shape`` view full of NaN inside a larger NaN buffer: ``guard_rows`` rows of the leading dimension
    before and after it, and ``pad`` extra elements after each last-dim row (a gap between rows, and between
    heads of a ``(T, H, D)`` tensor). ``pad`` a multiple of 16 bytes keeps every row 16-byte aligned, as packed
    qkv views are; other values give the unaligned layouts. The last dim stays contiguous. A 1-D ``shape`` (a
    weight, a bias) is one such row: guard rows before it, its pad and guard rows after it."""
    if not dtype.is_floating_point:
        raise TypeError("guard bands are NaN: floating-point tensors only")
    if len(shape) == 1:
        row = guarded_empty((1, *shape), dtype, device, guard_rows=guard_rows, pad=pad)
        view = row[0]
        view.guard_record = row.guard_record
        return view
    rows, *middle, cols = shape
    buffer = torch.full((rows + 2 * guard_rows, *middle, cols + pad), float("nan"), dtype=dtype, device=device)
    view = buffer[guard_rows : guard_rows + rows, ..., :cols]
    inside = torch.zeros(buffer.shape, dtype=torch.bool, device=device)
    inside[guard_rows : guard_rows + rows, ..., :cols] = True
    view.guard_record = _Guarded(buffer, inside)
    return view


def guarded(values: torch.Tensor, *, guard_rows: int = 3, pad: int = 8) -> torch.Tensor:
    """``values`` copied into a guarded view (see :func:`guarded_empty`); ``requires_grad`` is carried over
    (the view becomes a leaf)."""
    view = guarded_empty(tuple(values.shape), values.dtype, values.device, guard_rows=guard_rows, pad=pad)
    view.copy_(values.detach())
    if values.requires_grad:
        record = view.guard_record
        view = view.detach().requires_grad_()
        view.guard_record = record
    return view


def assert_guards_intact(view: torch.Tensor) -> None:
    """Every element of ``view``'s buffer outside the view is still NaN: nothing wrote past the tensor."""
    record = getattr(view, "guard_record", None)
    if record is None:
        raise ValueError("not a tensor made by guarded() or guarded_empty()")
    outside = record.buffer[~record.inside]
    written = ~outside.isnan()
    assert not bool(written.any()), f"{int(written.sum())} elements outside the tensor were written"


def assert_clean(*views: torch.Tensor) -> None:
    """Each guarded view holds finite values only (no band's NaN was read into it) and nothing outside it was
    written (:func:`assert_guards_intact`)."""
    for view in views:
        assert bool(view.isfinite().all()), f"{int((~view.isfinite()).sum())} elements of a guarded view are not finite"
        assert_guards_intact(view)
