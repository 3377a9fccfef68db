"""Layers the towers compose from qvl ops and torch matmuls: the MLP, the patch merger, and the
row-parallel linear whose one reduction tensor parallelism needs.

Plain functions over weight tensors, so ``torch.compile`` sees through them to the ops and matmuls, and
the same code runs over qvl's own modules and transformers' (:mod:`qvl.vit.hf_patch`). Where a weight cannot
be read as a tensor (vLLM's CPU linears keep it packed for oneDNN, quantized linears keep it encoded), a
:data:`Product` callable stands in for it: ``x -> x @ weight.T``, bias-less. Weight sharding
enters only through the ``all_reduce`` argument: fc1 column-parallel (each rank passes its rows of the
weight and bias), fc2 row-parallel (its columns), and the partial fc2 product summed over the ranks
before the bias is added once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

import qvl.kernels  # noqa: F401  (registers torch.ops.qvl)
from qvl.kernels.common import check_tensor

__all__ = ["AllReduce", "Product", "patch_merger", "row_parallel_linear", "swiglu_mlp", "vision_mlp"]

AllReduce = Callable[[torch.Tensor], torch.Tensor]
# x -> x @ weight.T without bias, for a linear layer whose weight is not a plain tensor.
Product = Callable[[torch.Tensor], torch.Tensor]


def _product(x: torch.Tensor, weight: torch.Tensor | Product) -> torch.Tensor:
    return torch.mm(x, weight.t()) if isinstance(weight, torch.Tensor) else weight(x)


def row_parallel_linear(
    h: torch.Tensor, weight: torch.Tensor | Product, bias: torch.Tensor, all_reduce: AllReduce | None
) -> torch.Tensor:
    """``F.linear(h, weight, bias)`` (``weight`` a tensor or a :data:`Product`); with ``all_reduce``,
    ``weight`` holds this rank's input-feature columns, and the partial products are summed over ranks
    before the bias is added once."""
    if all_reduce is None and isinstance(weight, torch.Tensor):
        return F.linear(h, weight, bias)
    # Each rank holds a slice of the input features, so its product is a partial sum: reduce first,
    # then add the bias once.
    partial = _product(h, weight)
    return (partial if all_reduce is None else all_reduce(partial)) + bias


def _norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm, or RMSNorm where there is no bias."""
    if bias is None:
        return torch.ops.qvl.rms_norm(x, weight, eps)
    return torch.ops.qvl.layer_norm(x, weight, bias, eps)


def patch_merger(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor | None,
    fc1_weight: torch.Tensor | Product,
    fc1_bias: torch.Tensor,
    fc2_weight: torch.Tensor | Product,
    fc2_bias: torch.Tensor,
    spatial_merge_size: int = 2,
    postshuffle_norm: bool = False,
    eps: float = 1e-6,
    all_reduce: AllReduce | None = None,
) -> torch.Tensor:
    """transformers' ``Qwen3VLVisionPatchMerger`` forward on qvl ops (and Qwen2-VL's ``PatchMerger``, Qwen2.5-VL's
    ``Qwen2_5_VLPatchMerger``: the main merger's layout with a LayerNorm or an RMSNorm).

    Args:
        x: ``(N, C)`` hidden states in merge-block order (every ``m * m`` consecutive tokens form one
            block, ``m = spatial_merge_size``); N divisible by ``m * m``; viewable as ``(N / m^2, m^2 C)``.
        norm_weight, norm_bias: ``(C,)`` for the main merger (norm per token, then merge), or
            ``(m^2 C,)`` with ``postshuffle_norm=True`` (the deepstack mergers: merge, then norm). A LayerNorm;
            ``norm_bias=None`` makes it an RMSNorm (Qwen2.5-VL's ``ln_q``, transformers' ``Qwen2RMSNorm``).
        fc1_weight, fc1_bias: ``(F, m^2 C)`` and ``(F,)``; fc2_weight ``(out, F)``, fc2_bias ``(out,)``. Either
            weight may be a :data:`Product` instead.
        all_reduce: for tensor parallelism, fc1 split by output features (each rank passes its rows of
            fc1_weight and fc1_bias, F = its slice) and fc2 by input features (its columns of
            fc2_weight); ``all_reduce`` maps the rank's partial fc2 product to the sum over ranks (e.g.
            ``lambda t: torch.distributed._functional_collectives.all_reduce(t, "sum", group)``), and the
            full fc2_bias is added once after it. None: no parallelism.

    Returns ``(N / m^2, out)`` in x's dtype: ``fc2(gelu(fc1(merge(norm(x)))))`` with exact-erf GELU.
    fc1 runs as a bias-less ``torch.mm`` followed by the in-place :func:`bias_gelu_` (see its rounding note).
    """
    group = spatial_merge_size * spatial_merge_size
    check_tensor("patch_merger", "x", x, ndim=2)
    if x.shape[0] % group != 0:
        raise ValueError(
            f"patch_merger: x's token count {x.shape[0]} must be divisible by spatial_merge_size**2 = {group}"
        )
    merged_width = x.shape[1] * group
    h = _norm(x.view(-1, merged_width) if postshuffle_norm else x, norm_weight, norm_bias, eps)
    h = h.view(-1, merged_width)
    h = _product(h, fc1_weight)
    torch.ops.qvl.bias_gelu_(h, fc1_bias, "none")
    return row_parallel_linear(h, fc2_weight, fc2_bias, all_reduce)


def vision_mlp(
    x: torch.Tensor,
    fc1_weight: torch.Tensor | Product,
    fc1_bias: torch.Tensor,
    fc2_weight: torch.Tensor | Product,
    fc2_bias: torch.Tensor,
    all_reduce: AllReduce | None = None,
    approximate: str = "tanh",
) -> torch.Tensor:
    """transformers' ``Qwen3VLVisionMLP`` forward on qvl ops: ``fc2(gelu_tanh(fc1(x)))`` (other GELUs through
    ``approximate``, e.g. ``"quick"`` for Qwen2-VL's ``VisionMlp``).

    Args:
        x: ``(N, C)``. fc1_weight ``(F, C)``, fc1_bias ``(F,)``, fc2_weight ``(C_out, F)``, fc2_bias
            ``(C_out,)``, all in x's dtype; either weight may be a :data:`Product` instead.
        all_reduce: tensor parallelism as in :func:`patch_merger` (fc1 column-, fc2 row-parallel; the
            partial fc2 product is reduced, then fc2_bias added once).
        approximate: the GELU as :func:`bias_gelu_` names it: ``"tanh"`` (the default, Qwen3-VL's
            ``gelu_pytorch_tanh``), ``"none"`` (exact erf) or ``"quick"`` (``x * sigmoid(1.702 x)``).

    Returns ``(N, C_out)`` in x's dtype. fc1 runs as a bias-less ``torch.mm`` followed by the in-place
    :func:`bias_gelu_` with ``approximate``.
    """
    check_tensor("vision_mlp", "x", x, ndim=2)
    h = _product(x, fc1_weight)
    torch.ops.qvl.bias_gelu_(h, fc1_bias, approximate)
    return row_parallel_linear(h, fc2_weight, fc2_bias, all_reduce)


def swiglu_mlp(
    x: torch.Tensor,
    gate_weight: torch.Tensor | Product,
    gate_bias: torch.Tensor,
    up_weight: torch.Tensor | Product,
    up_bias: torch.Tensor,
    down_weight: torch.Tensor | Product,
    down_bias: torch.Tensor,
    all_reduce: AllReduce | None = None,
) -> torch.Tensor:
    """transformers' ``Qwen2_5_VLMLP`` forward on qvl ops: ``down(silu(gate(x)) * up(x))``, every projection
    with a bias.

    Args:
        x: ``(N, C)``. gate_weight and up_weight ``(F, C)``, their biases ``(F,)``; down_weight ``(C_out, F)``,
            down_bias ``(C_out,)``; all in x's dtype; any weight may be a :data:`Product` instead.
        all_reduce: tensor parallelism as in :func:`vision_mlp` (gate and up column-parallel, down
            row-parallel: the partial down product is reduced, then down_bias added once).

    Returns ``(N, C_out)`` in x's dtype. gate and up run as bias-less products, their biases and the activation
    in one :func:`bias_swiglu`.
    """
    check_tensor("swiglu_mlp", "x", x, ndim=2)
    h = torch.ops.qvl.bias_swiglu(_product(x, gate_weight), _product(x, up_weight), gate_bias, up_bias)
    return row_parallel_linear(h, down_weight, down_bias, all_reduce)
