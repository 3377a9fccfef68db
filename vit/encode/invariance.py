"""Features that do not depend on the batch: every matrix product of the tower in row tiles of one fixed height.

BLAS libraries pick a product's algorithm by its shape. On a CPU, MKL sums a product's inner dimension in another
order for a few hundred rows than for a few thousand (and for one thread than for two), so a token's features moved
in their last bits with the number of tokens sharing its batch: 1-3e-6 on features of about 1 in fp32 (torch 2.13,
2-core Xeon). Everything else in the towers is per token or per frame (norms, activations, the position table, the
rotary embedding, attention within each frame group). With every product run on tiles of exactly
:data:`PRODUCT_ROWS` rows (the last one padded with zero rows), each token's products are computed by the same
algorithm on the same values whatever else is in the batch: its features are bit-identical under any packing, for
the same device, dtype and thread count.

The tiles cost little on a CPU (a product of 512 rows already runs at MKL's full rate; the padding is at most one tile
per product and batch). Compiled towers run Inductor's own calls of the products, which this mode does not reach.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["PRODUCT_ROWS", "fixed_row_products"]

PRODUCT_ROWS = 512


def _row_operand(func, args) -> int | None:
    """Where ``func``'s row operand (the tokens) is in ``args``: a 2-D first matrix of a product, else None."""
    position = 1 if func in (torch.addmm, torch.Tensor.addmm) else 0
    if func not in _PRODUCTS or len(args) <= position + 1:
        return None
    rows, other = args[position], args[position + 1]
    if not isinstance(rows, torch.Tensor) or not isinstance(other, torch.Tensor) or rows.dim() != 2:
        return None
    return position if other.dim() == 2 and rows.shape[0] > 0 else None


_PRODUCTS = frozenset(
    {F.linear, torch.mm, torch.addmm, torch.matmul, torch.Tensor.mm, torch.Tensor.addmm, torch.Tensor.matmul,
     torch.Tensor.__matmul__}
)  # fmt: skip


class _FixedRowProducts(TorchFunctionMode):
    def __init__(self, rows: int):
        super().__init__()
        self.rows = rows

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        position = _row_operand(func, args)
        if position is None:
            return func(*args, **kwargs)
        x = args[position]
        out = None
        for start in range(0, x.shape[0], self.rows):
            tile = x[start : start + self.rows]
            count = tile.shape[0]
            if count < self.rows:
                tile = torch.cat([tile, tile.new_zeros(self.rows - count, tile.shape[1])])
            product = func(*args[:position], tile, *args[position + 1 :], **kwargs)
            if out is None:
                out = product.new_empty((x.shape[0], *product.shape[1:]))
            out[start : start + count] = product[:count]
        return out


@contextlib.contextmanager
def fixed_row_products(rows: int = PRODUCT_ROWS) -> Iterator[None]:
    """Inside: every 2-D matrix product (``F.linear``, ``torch.mm``, ``torch.addmm``, ``torch.matmul`` and their
    tensor methods on a 2-D first matrix) runs on tiles of exactly ``rows`` rows and returns what the whole product
    returns, its rows computed independently of how many there are (see the module's docstring)."""
    with _FixedRowProducts(rows):
        yield
