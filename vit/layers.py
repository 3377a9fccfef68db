"""Layers the towers compose from qvl ops and torch matmuls: the MLP, the patch merger, and the
row-parallel linear whose one reduction tensor parallelism needs.

Plain functions over weight tensors, so ``torch.compile`` sees through them to the ops and matmuls, and
the same code runs over qvl's own modules and transformers' (:mod:`qvl.vit.hf_patch`). The ops come from
:func:`qvl.kernels.ops_for`: on the CPU's torch path plain torch functions, which compiled code traces into and
fuses with the matmuls' neighbours; on the Triton paths in eager code the ops' bodies without the dispatcher
(:mod:`qvl.kernels.direct`); elsewhere ``torch.ops.qvl``. Where a weight cannot
be read as a tensor (vLLM's CPU linears keep it packed for oneDNN, quantized linears keep it encoded), or where
another module sits in a linear's place (a PEFT LoRA adapter, a hooked linear: :func:`linear_parts`), a
:data:`Product` callable stands in for it: ``x -> x @ weight.T``, bias-less, or the module's whole output with
the bias passed beside it None.

The functions run forward and backward: where a tensor they would update in place requires grad (under grad
mode), they take the ops' out-of-place forms, which have a backward. Weight sharding
enters only through the ``all_reduce`` argument: fc1 column-parallel (each rank passes its rows of the
weight and bias), fc2 row-parallel (its columns), and the partial fc2 product summed over the ranks
before the bias is added once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from qvl.kernels import ops_for
from qvl.kernels.common import check_tensor

__all__ = [
    "Activation",
    "AllReduce",
    "GradientMap",
    "Product",
    "column_parallel_input",
    "embed_patches",
    "folded_patch_weight",
    "layer_or_rms_norm",
    "linear_parts",
    "merge_blocks",
    "needs_grad",
    "runs_itself",
    "patch_merger",
    "row_parallel_linear",
    "stacked_swiglu_mlp",
    "swiglu_mlp",
    "unfold_image_rows",
    "vision_mlp",
]

AllReduce = Callable[[torch.Tensor], torch.Tensor]
# An elementwise activation where no fused op fits (transformers' ACT2FN modules: SiLU, ReLU, ...).
Activation = Callable[[torch.Tensor], torch.Tensor]
# x -> x @ weight.T without bias, for a linear layer whose weight is not a plain tensor; or a module's whole
# output (bias included), with the bias beside it None.
Product = Callable[[torch.Tensor], torch.Tensor]


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd will record an op on these tensors: grad mode on and one of them requires grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def runs_itself(module: nn.Module) -> bool:
    """Whether ``module`` must be called rather than read: it is not a plain ``nn.Linear`` / ``nn.Conv3d`` /
    ``nn.Conv2d`` (a PEFT LoRA layer, a subclass with its own forward) or it has forward hooks (which only a call
    runs)."""
    plain = type(module).forward in (nn.Linear.forward, nn.Conv3d.forward, nn.Conv2d.forward)
    return not plain or bool(module._forward_hooks or module._forward_pre_hooks)


def linear_parts(module: nn.Module) -> tuple[torch.Tensor | Product, torch.Tensor | None]:
    """What the layer functions take for the linear layer in ``module``'s place: a plain ``nn.Linear``'s
    ``(weight, bias)``; any other module (a PEFT LoRA adapter wrapping the linear, a hooked or quantized one) as
    ``(module, None)``, so that whatever sits there runs, bias included, instead of being read past."""
    if runs_itself(module):
        return module, None
    return module.weight, module.bias


def embed_patches(proj: nn.Module, pixel_values: torch.Tensor) -> torch.Tensor:
    """A tower's patch embedding: ``proj`` a bias-optional ``nn.Conv3d`` whose kernel equals its stride, on
    ``pixel_values`` ``(T, C * t * p * p)``: one matmul (the conv of one patch is a dot product), or a call of
    ``proj`` when it must run itself (:func:`runs_itself`). Returns ``(T, hidden)`` in the weight's dtype. An
    ``nn.Conv2d`` (timm's, one frame) is a ``t = 1`` one: rows ``(T, C * p * p)``.

    Folded image rows ``(T, C * p * p)`` (an image's ``t`` temporal slots hold the same frame, so each row holds it
    once) take the weight with its temporal slices summed (:func:`folded_patch_weight`): half the matmul for
    ``t = 2``, and the same embedding up to the rounding of that sum. A called ``proj`` gets them written back into
    every slot.

    A called ``proj`` is shaped from its own attributes (``in_channels``, ``kernel_size``, ``out_channels``), not from
    its weight, which a training stack may hold as a placeholder outside the call (DeepSpeed ZeRO-3 gathers it
    for the call and releases it after)."""
    weight = proj.weight
    pixel_values = pixel_values.to(weight.dtype)
    *slots, height, width = proj.kernel_size
    slots = slots[0] if slots else 1
    folded = slots > 1 and pixel_values.shape[-1] == proj.in_channels * height * width
    if runs_itself(proj):
        if folded:
            pixel_values = unfold_image_rows(pixel_values, proj.in_channels, slots)
        patches = pixel_values.view(-1, proj.in_channels, *proj.kernel_size)
        return proj(patches).view(-1, proj.out_channels)
    if folded:
        return F.linear(pixel_values, folded_patch_weight(proj), proj.bias)
    return F.linear(pixel_values, weight.view(weight.shape[0], -1), proj.bias)


def unfold_image_rows(rows: torch.Tensor, channels: int, slots: int) -> torch.Tensor:
    """Folded image rows ``(T, C * p * p)`` written into each of ``slots`` temporal slots: ``(T, C * slots * p * p)``,
    the rows transformers' processors make for an image."""
    return rows.view(rows.shape[0], channels, 1, -1).expand(-1, -1, slots, -1).reshape(rows.shape[0], -1)


def folded_patch_weight(proj: nn.Module) -> torch.Tensor:
    """The weight of ``proj`` (``nn.Conv3d``, ``(hidden, C, t, p, p)``) with its temporal slices summed, in its dtype:
    ``(hidden, C * p * p)``, the patch embedding of folded image rows (:func:`embed_patches`).

    Summed once and kept while ``proj`` keeps the same weight tensor, unwritten (its storage, version counter, dtype
    and device), in a table that holds the weight weakly (nothing is added to the module, which stays picklable; a
    replaced weight's entry goes with it); where autograd records the embedding, or under torch.compile, it is summed
    in the graph instead (a gradient must reach the weight; a compiled forward keeps no Python state), and for an
    inference-mode weight at every call (it has no version counter to say it was written)."""
    weight = proj.weight
    if torch.compiler.is_compiling() or needs_grad(weight) or weight.is_inference():
        return weight.sum(2).flatten(1)
    key = (weight.data_ptr(), weight._version, weight.dtype, weight.device)
    cached = _FOLDED_WEIGHTS.get(weight)
    if cached is None or cached[0] != key:
        cached = _FOLDED_WEIGHTS[weight] = (key, weight.detach().sum(2).flatten(1))
    return cached[1]


# Patch-embedding weight -> (its state when summed, its temporal slices summed): folded_patch_weight's cache.
_FOLDED_WEIGHTS = WeakIdKeyDictionary()


def _product(x: torch.Tensor, weight: torch.Tensor | Product) -> torch.Tensor:
    return torch.mm(x, weight.t()) if isinstance(weight, torch.Tensor) else weight(x)


def _bias_or_zeros(bias: torch.Tensor | None, h: torch.Tensor) -> torch.Tensor:
    """``bias``, or zeros where a :data:`Product` added the bias itself."""
    return h.new_zeros(h.shape[-1]) if bias is None else bias


def _add_bias(h: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``h + bias`` in h's dtype, as ``F.linear`` adds a bias (under autocast: a 16-bit product beside an fp32 bias);
    ``h`` itself where a :data:`Product` added the bias."""
    return h if bias is None else h + bias.to(h.dtype)


def _bias_activation(h: torch.Tensor, bias: torch.Tensor | None, activation: str | Activation) -> torch.Tensor:
    """``activation(h + bias)``: a GELU as bias_gelu names it (``"none"``, ``"tanh"``, ``"quick"``) in the fused op,
    any other elementwise function after a separate bias add."""
    if callable(activation):
        return activation(_add_bias(h, bias))
    return _bias_gelu(h, bias, activation)


def _bias_gelu(h: torch.Tensor, bias: torch.Tensor | None, approximate: str) -> torch.Tensor:
    """``gelu(h + bias)`` (no bias: zeros), in place unless autograd records it."""
    bias = _bias_or_zeros(bias, h)
    if needs_grad(h, bias):
        return ops_for(h.device).bias_gelu(h, bias, approximate)
    ops_for(h.device).bias_gelu_(h, bias, approximate)
    return h


class _ReduceRowParallel(torch.autograd.Function):
    """The row-parallel reduction: forward sums the ranks' partial products; backward passes the (replicated)
    gradient to each rank's partial unchanged, since every rank's partial enters the sum once."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, all_reduce: AllReduce) -> torch.Tensor:
        return all_reduce(partial)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class GradientMap(torch.autograd.Function):
    """``GradientMap.apply(x, function)``: x unchanged (a view) forward; backward hands on ``function(gradient)``,
    the gradient made contiguous first (collectives take contiguous tensors)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, function: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        ctx.function = function
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.function(grad.contiguous()), None


def column_parallel_input(h: torch.Tensor, all_reduce: AllReduce | None) -> torch.Tensor:
    """``h`` as the input of column-parallel linears (qkv, fc1, gate/up): unchanged, except that where autograd
    records it under tensor parallelism its gradient is summed over the ranks in backward."""
    if all_reduce is None or not needs_grad(h):
        return h
    # The conjugate of the row-parallel reduction: each rank's gradient covers only its output features.
    return GradientMap.apply(h, all_reduce)


def row_parallel_linear(
    h: torch.Tensor, weight: torch.Tensor | Product, bias: torch.Tensor | None, all_reduce: AllReduce | None
) -> torch.Tensor:
    """``F.linear(h, weight, bias)`` (``weight`` a tensor or a :data:`Product`; bias None when the product
    includes it); with ``all_reduce``, ``weight`` holds this rank's input-feature columns, and the partial
    products are summed over ranks before the bias is added once (in backward each rank's partial gets the
    whole gradient: :func:`column_parallel_input` is the other half of that pair)."""
    if all_reduce is None and isinstance(weight, torch.Tensor):
        return F.linear(h, weight, bias)
    # Each rank holds a slice of the input features, so its product is a partial sum: reduce first,
    # then add the bias once.
    partial = _product(h, weight)
    if all_reduce is None:
        reduced = partial
    elif needs_grad(partial):
        reduced = _ReduceRowParallel.apply(partial, all_reduce)
    else:
        reduced = all_reduce(partial)
    return _add_bias(reduced, bias)


def layer_or_rms_norm(ops, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float):
    """LayerNorm, or RMSNorm where there is no bias, from ``ops`` (:func:`~qvl.kernels.ops_for`'s choice, or
    ``torch.ops.qvl``)."""
    if bias is None:
        return ops.rms_norm(x, weight, eps)
    return ops.layer_norm(x, weight, bias, eps)


def merge_blocks(x: torch.Tensor, group: int) -> torch.Tensor:
    """``x (N, C)`` as ``(N / group, group * C)`` rows, each ``group`` consecutive tokens side by side: a view of x
    (of a contiguous copy where x is strided).

    In inference a strided view rather than ``view``: on the torch path compiled code fuses the sum or norm that
    makes x, and Inductor, reshaping such a fused result, guards on the merged-token count (a batch of one merged
    token would compile again); a strided view makes it store x and read it back as merge blocks. Where autograd
    records, x comes from custom ops (:func:`~qvl.kernels.ops_for`), which store it anyway, and ``view`` keeps the
    backward free of as_strided's scatter, which a compiled backward would guard on that count for."""
    merged_width = group * x.shape[1]
    if needs_grad(x):
        return x.view(-1, merged_width)
    x = x.contiguous()
    return x.as_strided((x.shape[0] // group, merged_width), (merged_width, 1))


def patch_merger(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor | None,
    fc1_weight: torch.Tensor | Product,
    fc1_bias: torch.Tensor | None,
    fc2_weight: torch.Tensor | Product,
    fc2_bias: torch.Tensor | None,
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
    ops = ops_for(x.device)
    if postshuffle_norm:
        h = layer_or_rms_norm(ops, merge_blocks(x, group), norm_weight, norm_bias, eps)
    else:
        h = merge_blocks(layer_or_rms_norm(ops, x, norm_weight, norm_bias, eps), group)
    h = column_parallel_input(h, all_reduce)
    h = _bias_gelu(_product(h, fc1_weight), fc1_bias, "none")
    return row_parallel_linear(h, fc2_weight, fc2_bias, all_reduce)


def vision_mlp(
    x: torch.Tensor,
    fc1_weight: torch.Tensor | Product,
    fc1_bias: torch.Tensor | None,
    fc2_weight: torch.Tensor | Product,
    fc2_bias: torch.Tensor | None,
    all_reduce: AllReduce | None = None,
    activation: str | Activation = "tanh",
) -> torch.Tensor:
    """transformers' ``Qwen3VLVisionMLP`` forward on qvl ops: ``fc2(gelu_tanh(fc1(x)))`` (other activations through
    ``activation``, e.g. ``"quick"`` for Qwen2-VL's ``VisionMlp``).

    Args:
        x: ``(N, C)``. fc1_weight ``(F, C)``, fc1_bias ``(F,)``, fc2_weight ``(C_out, F)``, fc2_bias
            ``(C_out,)``, all in x's dtype; either weight may be a :data:`Product` instead.
        all_reduce: tensor parallelism as in :func:`patch_merger` (fc1 column-, fc2 row-parallel; the
            partial fc2 product is reduced, then fc2_bias added once).
        activation: a GELU as :func:`bias_gelu_` names it: ``"tanh"`` (the default, Qwen3-VL's
            ``gelu_pytorch_tanh``), ``"none"`` (exact erf) or ``"quick"`` (``x * sigmoid(1.702 x)``); or any
            elementwise function (:data:`Activation`, e.g. transformers' ``ACT2FN["silu"]``).

    Returns ``(N, C_out)`` in x's dtype. fc1 runs as a bias-less ``torch.mm`` followed by the in-place
    :func:`bias_gelu_` for a GELU, or by the bias add and ``activation``.
    """
    check_tensor("vision_mlp", "x", x, ndim=2)
    x = column_parallel_input(x, all_reduce)
    h = _bias_activation(_product(x, fc1_weight), fc1_bias, activation)
    return row_parallel_linear(h, fc2_weight, fc2_bias, all_reduce)


def swiglu_mlp(
    x: torch.Tensor,
    gate_weight: torch.Tensor | Product,
    gate_bias: torch.Tensor | None,
    up_weight: torch.Tensor | Product,
    up_bias: torch.Tensor | None,
    down_weight: torch.Tensor | Product,
    down_bias: torch.Tensor | None,
    all_reduce: AllReduce | None = None,
    activation: Activation | None = None,
) -> torch.Tensor:
    """transformers' ``Qwen2_5_VLMLP`` forward on qvl ops: ``down(silu(gate(x)) * up(x))``, every projection
    with a bias (another activation of the gate through ``activation``).

    Args:
        x: ``(N, C)``. gate_weight and up_weight ``(F, C)``, their biases ``(F,)``; down_weight ``(C_out, F)``,
            down_bias ``(C_out,)``; all in x's dtype; any weight may be a :data:`Product` instead.
        all_reduce: tensor parallelism as in :func:`vision_mlp` (gate and up column-parallel, down
            row-parallel: the partial down product is reduced, then down_bias added once).

        activation: None for SiLU (the fused op), else the gate's elementwise activation (:data:`Activation`).

    Returns ``(N, C_out)`` in x's dtype. gate and up run as bias-less products, their biases and the activation
    in one :func:`bias_swiglu` (with ``activation``: bias adds, ``activation(gate) * up`` in torch).
    """
    check_tensor("swiglu_mlp", "x", x, ndim=2)
    x = column_parallel_input(x, all_reduce)
    gate, up = _product(x, gate_weight), _product(x, up_weight)
    return _swiglu_down(gate, up, gate_bias, up_bias, down_weight, down_bias, all_reduce, activation)


def stacked_swiglu_mlp(
    x: torch.Tensor,
    gate_up_weight: torch.Tensor | Product,
    gate_up_bias: torch.Tensor | None,
    down_weight: torch.Tensor | Product,
    down_bias: torch.Tensor | None,
    all_reduce: AllReduce | None = None,
    activation: Activation | None = None,
) -> torch.Tensor:
    """:func:`swiglu_mlp` with gate and up stacked in one linear (vLLM's ``gate_up_proj``): ``gate_up_weight``
    ``(2F, C)`` (gate rows first) or a :data:`Product`, ``gate_up_bias`` ``(2F,)``; one product, whose halves
    enter :func:`bias_swiglu` as views."""
    check_tensor("stacked_swiglu_mlp", "x", x, ndim=2)
    x = column_parallel_input(x, all_reduce)
    gate, up = _product(x, gate_up_weight).chunk(2, dim=-1)
    gate_bias, up_bias = (None, None) if gate_up_bias is None else gate_up_bias.chunk(2)
    return _swiglu_down(gate, up, gate_bias, up_bias, down_weight, down_bias, all_reduce, activation)


def _swiglu_down(gate, up, gate_bias, up_bias, down_weight, down_bias, all_reduce, activation=None) -> torch.Tensor:
    """``down(silu(gate + gate_bias) * (up + up_bias))``, the biases and the activation in one op (a missing bias
    as zeros); with ``activation``, ``down(activation(gate + gate_bias) * (up + up_bias))`` in torch."""
    if activation is not None:
        h = activation(_add_bias(gate, gate_bias)) * _add_bias(up, up_bias)
        return row_parallel_linear(h, down_weight, down_bias, all_reduce)
    zeros = gate.new_zeros(gate.shape[-1]) if gate_bias is None or up_bias is None else None
    h = ops_for(gate.device).bias_swiglu(
        gate, up, zeros if gate_bias is None else gate_bias, zeros if up_bias is None else up_bias
    )
    return row_parallel_linear(h, down_weight, down_bias, all_reduce)
