"""``qvl.vit.patch_model(model)`` for timm's Qwen3-VL vision backbones, the ``qwen3_vit_*`` models
(``timm.models.qwen3_vit``: ``Qwen3VitClassifier`` and ``Qwen3VitEncoder``, whole, or reached through ``.model`` as
``features_only`` wraps them).

timm's encoder is Qwen3-VL's tower without its deepstack mergers: a Conv2d patch embedding, the learned 48x48
position grid resampled bilinearly (align_corners=True), EvaBlocks with fused q/k/v and the 2D rotary in the 'half'
layout, GELU-tanh MLPs, and optionally the projector ('merger'). The patch runs it on the one tower runner
(:mod:`qvl.vit.runner`) over timm's own modules, named by :data:`~qvl.vit.families.TIMM_QWEN3_VIT_NAMES`: a batch of
``B`` images of one size is ``B`` attention segments of ``H * W`` tokens each.

Token order. timm's tokens are raster (NHWC) at every boundary; the runner's are in merge-block order, which the
projector needs (each 2x2 block consecutive). Both orders are permutations of the same tokens, so the conversion is
exact; where it happens:

* a call through the projector (``forward`` of an encoder with a merger: the ``_enc`` and ``_merge`` models) runs in
  merge-block order, the pixels permuted into patch rows of that order on the way in (the patchify copy every path
  makes) and nothing permuted on the way out: the projector's tokens are in timm's order already;
* ``forward_features``, ``forward_intermediates`` and every model without a projector run with a merge size of 1,
  for which merge-block order is raster order: nothing is permuted but the patchify, and any patch grid runs (a
  projector needs even sides, as timm's asserts);
* ``forward_intermediates`` of a ``_merge`` classifier (tokens through the projector, intermediates beside them)
  runs in merge-block order and permutes the intermediates it returns into raster order.

What stays timm's: the classifier's pooling, norm and head (``forward_head``), the ``avg`` pooling of an encoder,
the argument handling of ``forward_intermediates`` (``feature_take_indices``; with ``stop_early`` the result is
timm's, the last taken block's output, through the projector where timm applies it, though qvl runs every block).
``set_grad_checkpointing`` runs each block through timm's ``checkpoint``. A batch's metadata (segments, rotary
positions, the table's interpolation plan) comes from torch ops on the sizes
(:func:`~qvl.vit.metadata.equal_images_inputs`): a compiled caller traces it into its graph; eager calls keep it per
image size. Calls qvl cannot serve run timm's own forward with an :class:`~qvl.vit.patching.UnfusedFallbackWarning`
(weights not on one device, dropout or drop path active in training, hooks qvl's fused forward would not call as
timm does); configurations qvl cannot run at all (another block, norm, activation or rotary setting than the released
models') raise ValueError at :func:`patch_model`. Under ``torch.autocast`` the runner follows autocast as the ops
declare it, as for transformers' models.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
import types

import torch
from torch import nn

from . import runner as tower_runner
from .config import VisionConfig
from .families import TIMM_QWEN3_VIT_NAMES
from .layers import linear_parts
from .metadata import DeviceInputs, equal_images_inputs
from .patching import devices_reason, warn_fallback
from .runner import (
    TowerRunner,
    forward_slot,
    install_module_forwards,
    merger_step,
    remove_module_forwards,
    restore_forward,
    unwrapped,
)

__all__ = ["TIMM_MODULE", "is_patched", "is_timm_model", "patch_model", "unpatch_model"]

# The timm module defining the models this adapter serves; looked up in sys.modules only (a timm model exists,
# so timm is imported), so that nothing here imports timm.
TIMM_MODULE = "timm.models.qwen3_vit"
# Where training stacks' hooks come from: they gather or shard parameters and never read a module's tensors, so they
# are honoured on the modules the runner calls (the patch embedding, blocks, projector, hooked linears).
STACK_HOOK_MODULES = ("torch.distributed.", "deepspeed.", "accelerate.")
# Shapes whose device inputs an eager patched model keeps (a training loop's few image sizes).
INPUTS_CACHE_SIZE = 8


def _model_chain(model: nn.Module):
    """``model``, its ``.model``, that one's ``.model``, ... (timm's ``features_only`` wrappers, a user's)."""
    module, seen = model, set()
    while isinstance(module, nn.Module) and id(module) not in seen:
        seen.add(id(module))
        yield module
        module = getattr(module, "model", None)


def is_timm_model(model: nn.Module) -> bool:
    """Whether ``model``, or a module down its chain of ``.model`` attributes, is a timm model: the transformers
    entry points hand such a model to this adapter."""
    return any(type(module).__module__.split(".")[0] == "timm" for module in _model_chain(model))


def _timm_classes():
    module = sys.modules.get(TIMM_MODULE)
    return (None, None) if module is None else (module.Qwen3VitEncoder, module.Qwen3VitClassifier)


def _find(model: nn.Module, caller: str) -> tuple[nn.Module, nn.Module | None]:
    """``(encoder, classifier or None)`` of a timm ``qwen3_vit`` model; TypeError for any other timm model."""
    encoder_class, classifier_class = _timm_classes()
    if encoder_class is not None:
        for module in _model_chain(model):
            if isinstance(module, encoder_class):
                return module, None
            if isinstance(module, classifier_class):
                return module.encoder, module
    raise TypeError(
        f"{caller}: timm model {type(model).__name__} is not one qvl serves; qvl runs timm's qwen3_vit_* models"
        " (Qwen3VitClassifier, Qwen3VitEncoder: timm.list_models('qwen3_vit*')), whole or as the .model of a wrapper"
        " (features_only)"
    )


def _gelu_name(act: nn.Module, where: str, allowed: tuple[str, ...]) -> str:
    """transformers' name of an ``nn.GELU`` activation (qvl's fused bias+GELU computes it); ValueError otherwise."""
    names = {"none": "gelu", "tanh": "gelu_pytorch_tanh"}
    if type(act) is nn.GELU and act.approximate in allowed:
        return names[act.approximate]
    raise ValueError(f"{where} is {act!r}; qvl runs nn.GELU(approximate={' or '.join(map(repr, allowed))}) there")


def _check_tree(encoder: nn.Module) -> list[str]:
    """What keeps qvl from running ``encoder`` (empty: nothing): each part the released models build differently."""
    from timm.layers import AttentionRope, Mlp, PatchEmbed, RotaryEmbeddingCat
    from timm.models.eva import EvaBlock

    problems = []
    embed_dim = encoder.embed_dim
    patch_embed = encoder.patch_embed
    proj = getattr(patch_embed, "proj", None)
    if not isinstance(patch_embed, PatchEmbed) or not isinstance(proj, nn.Conv2d):
        problems.append(f"patch_embed is {type(patch_embed).__name__}, not timm's PatchEmbed over an nn.Conv2d")
    else:
        if type(patch_embed.norm) is not nn.Identity:
            problems.append("patch_embed has a norm")
        if patch_embed.dynamic_img_pad:
            problems.append("patch_embed pads images (dynamic_img_pad)")
        square = proj.kernel_size[0] == proj.kernel_size[1]
        if not square or proj.stride != proj.kernel_size or proj.padding != (0, 0) or proj.groups != 1:
            problems.append("patch_embed.proj is not a square patch convolution (kernel = stride, no padding)")
        elif proj.dilation != (1, 1):
            problems.append("patch_embed.proj is dilated")
    side = encoder.pos_embed_grid_size
    if not isinstance(encoder.pos_embed, nn.Parameter) or tuple(encoder.pos_embed.shape) != (1, side * side, embed_dim):
        problems.append(f"pos_embed is not a (1, {side * side}, {embed_dim}) parameter")
    rope = encoder.rope
    if not isinstance(rope, RotaryEmbeddingCat):
        problems.append(f"rope is {type(rope).__name__}, not RotaryEmbeddingCat")
    else:
        layout = dict(
            in_pixels=False, grid_type="index", ref_feat_shape=None, grid_offset=0, grid_indexing="ij", rotate_half=True
        )
        layout.update(aug_active=False, feat_shape=None)
        changed = [f"{name}={getattr(rope, name)!r}" for name, value in layout.items() if getattr(rope, name) != value]
        if changed:
            problems.append(f"rope has {', '.join(changed)} (the released models': axial 'half' rotary on indices)")
    blocks = [unwrapped(block) for block in encoder.blocks]
    if not blocks:
        problems.append("the encoder has no blocks")
    activations = set()
    for index, block in enumerate(blocks):
        where = f"blocks.{index}"
        if not isinstance(block, EvaBlock) or not isinstance(block.attn, AttentionRope):
            problems.append(f"{where} is {type(block).__name__}, not an EvaBlock with AttentionRope")
            continue
        attn = block.attn
        if attn.qkv is None or attn.gate is not None or attn.num_kv_groups != 1:
            problems.append(f"{where}.attn is not fused q/k/v attention without gate or grouped heads")
        if any(type(m) is not nn.Identity for m in (attn.q_norm, attn.k_norm, attn.norm)):
            problems.append(f"{where}.attn normalizes q, k or its output")
        if attn.num_prefix_tokens or not attn.rotate_half:
            problems.append(f"{where}.attn has prefix tokens or the interleaved rotary layout")
        if attn.num_heads * attn.head_dim != embed_dim or attn.num_heads != blocks[0].attn.num_heads:
            problems.append(f"{where}.attn's heads do not span the embedding as the first block's")
        if block.gamma_1 is not None or block.gamma_2 is not None:
            problems.append(f"{where} has layer scale")
        for name in ("norm1", "norm2"):
            norm = getattr(block, name)
            if not isinstance(norm, nn.LayerNorm) or norm.weight is None:
                problems.append(f"{where}.{name} is not an affine LayerNorm")
        mlp = block.mlp
        if type(mlp) is not Mlp or type(mlp.norm) is not nn.Identity:
            problems.append(f"{where}.mlp is {type(mlp).__name__}, not timm's Mlp without a norm")
            continue
        try:
            activations.add(_gelu_name(mlp.act, f"{where}.mlp.act", ("tanh", "none")))
        except ValueError as error:
            problems.append(str(error))
    if len(activations) > 1:
        problems.append(f"the blocks' MLPs use different GELUs {sorted(activations)}")
    merger = encoder.merger
    if merger is not None:
        norm = getattr(merger, "norm", None)
        if not isinstance(norm, nn.LayerNorm) or norm.weight is None:
            problems.append("merger.norm is not an affine LayerNorm")
        try:
            _gelu_name(getattr(merger, "act", None), "merger.act", ("none",))
        except ValueError as error:
            problems.append(str(error))
    return problems


def _config(encoder: nn.Module, merge: int) -> VisionConfig:
    """The tower config of ``encoder`` for the runner, with merge blocks of ``merge``: one frame a patch
    (timm's Conv2d), no deepstack mergers."""
    block = unwrapped(encoder.blocks[0])
    proj = encoder.patch_embed.proj
    merger = encoder.merger
    return VisionConfig(
        depth=len(encoder.blocks),
        hidden_size=encoder.embed_dim,
        num_heads=block.attn.num_heads,
        intermediate_size=block.mlp.fc1.out_features,
        out_hidden_size=encoder.embed_dim if merger is None else merger.out_features,
        deepstack_visual_indexes=(),
        patch_size=proj.kernel_size[0],
        temporal_patch_size=1,
        spatial_merge_size=merge,
        in_channels=proj.in_channels,
        num_position_embeddings=encoder.pos_embed_grid_size**2,
        rope_theta=float(encoder.rope.temperature),
        hidden_act=_gelu_name(block.mlp.act, "blocks.0.mlp.act", ("tanh", "none")),
        layer_norm_eps=block.norm1.eps,
    )


def _drop_rate(module: nn.Module) -> float:
    """An ``nn.Dropout``'s ``p`` or timm's ``DropPath``'s ``drop_prob``."""
    return getattr(module, "p", None) or getattr(module, "drop_prob", 0.0) or 0.0


def _hook_origin(hook) -> str:
    """The module a hook's function comes from (a bound method's, a partial's function's, a callable's class's)."""
    while hasattr(hook, "func"):  # functools.partial
        hook = hook.func
    return getattr(hook, "__module__", None) or type(hook).__module__


class _TimmPatch:
    """The state of one patched timm encoder: its runners, the methods the patch replaced, and the checks of each
    call.

    Two runners over the same modules: ``raster_runner`` (merge size 1: raster order, no projector) for the
    features, and ``merge_runner`` (the projector's merge size: merge-block order, the projector run; None without a
    projector) for calls through the projector.
    """

    def __init__(self, encoder: nn.Module, classifier: nn.Module | None):
        from timm.models._manipulate import checkpoint as timm_checkpoint
        from timm.models.eva import EvaBlock

        self.encoder = encoder
        self.classifier = classifier
        self.raster_runner = self._runner(1, merger=False)
        self.merge_runner = None if encoder.merger is None else self._runner(encoder.merger.merge_size, merger=True)
        self._timm_checkpoint = timm_checkpoint
        self._block_class = EvaBlock
        self._inputs = collections.OrderedDict()
        # Every module qvl could skip or call otherwise than timm (anything under the encoder but the encoder),
        # and the dropouts a training call would have to apply, as they are now (patch again after changing them).
        self.modules = [(name, module) for name, module in encoder.named_modules() if module is not encoder]
        self.dropouts = [m for _, m in self.modules if isinstance(m, nn.Dropout) or hasattr(m, "drop_prob")]
        self.replaced: list[tuple[object, str, object]] = []

    def _runner(self, merge: int, merger: bool) -> TowerRunner:
        names = TIMM_QWEN3_VIT_NAMES if merger else dataclasses.replace(TIMM_QWEN3_VIT_NAMES, merger=None)
        try:
            config = _config(self.encoder, merge)
        except ValueError as error:
            raise ValueError(f"patch_model: timm's {type(self.encoder).__name__}: {error}") from None
        return TowerRunner(self.encoder, config, names, module_calls=True, name="patch_model")

    def extra_repr(self) -> str:
        """The encoder's own ``extra_repr`` and a line saying that it is patched (``print(model)``)."""
        replaced = next(r for owner, name, r in self.replaced if owner is self.encoder and name == "extra_repr")
        own = (replaced or types.MethodType(type(self.encoder).extra_repr, self.encoder))()
        return "\n".join(filter(None, (own, "forward patched by qvl.vit.patch_model")))

    # ---- the checks of each call ----

    def unserved_reason(self) -> str | None:
        """Why this call cannot run on qvl, or None."""
        reason = devices_reason(self.encoder)
        if reason is not None:
            return reason
        active = [m for m in self.dropouts if m.training and _drop_rate(m) > 0]
        if active:
            return (
                f"dropout or drop path is active in training ({type(active[0]).__name__} of rate"
                f" {_drop_rate(active[0])}), which qvl's fused blocks do not apply"
            )
        for name, module in self.modules:
            hooks = (
                *module._forward_pre_hooks.values(),
                *module._forward_hooks.values(),
                *module._backward_pre_hooks.values(),
                *module._backward_hooks.values(),
            )
            foreign = [hook for hook in hooks if not _hook_origin(hook).startswith(STACK_HOOK_MODULES)]
            if foreign:
                return (
                    f"a hook ({_hook_origin(foreign[0])}) is registered on {name}, which qvl's fused tower does not"
                    " call with timm's tensors"
                )
        return None

    # ---- running the runner ----

    def checkpoint(self, module: nn.Module):
        """timm's ``checkpoint`` for a block while the encoder's gradient checkpointing is on (as timm's forward)."""
        if self.encoder.grad_checkpointing and torch.is_grad_enabled() and isinstance(module, self._block_class):
            return self._timm_checkpoint
        return None

    def inputs(self, runner: TowerRunner, batch: int, height: int, width: int) -> DeviceInputs:
        """The device inputs of ``batch`` images of ``height x width`` patches (:func:`equal_images_inputs`): traced
        into a caller's compiled graph; in eager code kept per shape (built outside inference mode, so that a shape
        first seen in inference serves training too)."""
        config = runner.config
        build = (batch, height, width, config.spatial_merge_size, config.num_grid_per_side, runner.device)
        if torch.compiler.is_compiling():
            return equal_images_inputs(*build)
        cached = self._inputs.get(build)
        if cached is None:
            with torch.inference_mode(False):
                cached = self._inputs[build] = equal_images_inputs(*build)
            while len(self._inputs) > INPUTS_CACHE_SIZE:
                self._inputs.popitem(last=False)
        else:
            self._inputs.move_to_end(build)
        return cached

    def run(self, x: torch.Tensor, runner: TowerRunner, hidden: list | None = None):
        """The runner's device part on images ``x (B, C, H, W)``: ``(outputs, (B, h, w))``, tokens in ``runner``'s
        merge-block order (raster for a merge size of 1); ``hidden`` receives the embedded patches and each block's
        output."""
        config = runner.config
        patch, merge = config.patch_size, config.spatial_merge_size
        if x.dim() != 4:
            raise ValueError(f"qvl.vit.patch_model: timm's encoder takes images (B, C, H, W), got {tuple(x.shape)}")
        batch, channels, height, width = x.shape
        # timm's own checks, with its messages (PatchEmbed, Qwen3VitPatchMerger.merge).
        for side, size in (("height", height), ("width", width)):
            if size % patch:
                raise AssertionError(f"Input {side} ({size}) should be divisible by patch size ({patch}).")
            if (size // patch) % merge:
                raise AssertionError(f"patch grid {side} must be divisible by merge_size")
        rows, cols = height // patch, width // patch
        # Patch rows in merge-block order: (B, C, rows/m, m, p, cols/m, m, p) -> (B, rows/m, cols/m, m, m, C, p, p).
        blocks = x.reshape(batch, channels, rows // merge, merge, patch, cols // merge, merge, patch)
        pixels = blocks.permute(0, 2, 5, 3, 6, 1, 4, 7).reshape(-1, channels * patch * patch)
        inputs = self.inputs(runner, batch, rows, cols)
        if hidden is None:
            return runner.run_device(pixels, inputs), (batch, rows, cols)
        outputs = tower_runner.device_forward(
            runner.tree, runner.spec, pixels, inputs, hidden_states_out=hidden, module_calls=True
        )
        return outputs, (batch, rows, cols)

    @staticmethod
    def to_raster(tokens: torch.Tensor, shape: tuple[int, int, int], merge: int) -> torch.Tensor:
        """Tokens ``(B * h * w, C)`` in merge-block order of ``merge`` as timm's NHWC ``(B, h, w, C)``."""
        batch, rows, cols = shape
        if merge == 1:
            return tokens.view(batch, rows, cols, -1)
        blocks = tokens.view(batch, rows // merge, cols // merge, merge, merge, -1)
        return blocks.permute(0, 1, 3, 2, 4, 5).reshape(batch, rows, cols, -1)

    def merge_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The projector (through its module call, as the runner makes it) on tokens in merge-block order."""
        options = dict(spec=self.merge_runner.spec, postshuffle_norm=False, all_reduce=None, linear=linear_parts)
        return self.encoder.merger(tokens, qvl=(merger_step, options))

    def intermediates(self, x, indices, stop_early: bool, output_fmt: str, through_merger: bool):
        """``(final, intermediates)`` of timm's ``forward_intermediates``: the features (NHWC), or with
        ``through_merger`` the projector's tokens, and the blocks' outputs timm selects, in ``output_fmt``."""
        from timm.models._features import feature_take_indices

        if output_fmt not in ("NCHW", "NLC"):
            raise AssertionError("Output format must be one of NCHW or NLC.")
        encoder = self.encoder
        depth = len(encoder.blocks)
        take_indices, max_index = feature_take_indices(depth, indices)
        last = max_index if stop_early else depth - 1
        runner = self.merge_runner if through_merger else self.raster_runner
        merge = runner.config.spatial_merge_size
        hidden = []
        outputs, shape = self.run(x, runner, hidden)
        batch, rows, cols = shape
        picked = [self.to_raster(hidden[i + 1], shape, merge) for i in range(last + 1) if i in take_indices]
        if output_fmt == "NCHW":
            picked = [y.permute(0, 3, 1, 2).contiguous() for y in picked]
        else:
            picked = [y.reshape(batch, rows * cols, -1) for y in picked]
        if not through_merger:
            return self.to_raster(hidden[last + 1], shape, merge), picked
        merged = outputs.merged if last == depth - 1 else self.merge_tokens(hidden[last + 1])
        return merged.view(batch, -1, merged.shape[-1]), picked


class _PatchedMethod:
    """One method of a patched timm module, in the instance's attribute: runs qvl, or the method it replaced (timm's
    own) where the call cannot run on qvl."""

    def __init__(self, patch: _TimmPatch, owner: nn.Module, name: str, run):
        self.patch = patch
        self.owner = owner
        self.name = name
        self.replaced = vars(owner).get(name)
        self.run = run

    def original(self, *args, **kwargs):
        """The method the patch replaced (the class's, or an instance attribute that was there), called."""
        if self.replaced is not None:
            return self.replaced(*args, **kwargs)
        return getattr(type(self.owner), self.name)(self.owner, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        reason = self.patch.unserved_reason()
        if reason is not None:
            warn_fallback("qvl.vit.patch_model", reason, "timm's own forward")
            return self.original(*args, **kwargs)
        return self.run(self, *args, **kwargs)


def _encoder_forward(method: _PatchedMethod, x: torch.Tensor) -> torch.Tensor:
    """``Qwen3VitEncoder.forward``: through the projector in merge-block order; without one, timm's own (its pooling
    around the patched ``forward_features``)."""
    patch = method.patch
    if patch.encoder.merger is None or patch.merge_runner is None:
        return method.original(x)
    outputs, (batch, _, _) = patch.run(x, patch.merge_runner)
    return outputs.merged.view(batch, -1, outputs.merged.shape[-1])


def _encoder_forward_features(method: _PatchedMethod, x: torch.Tensor) -> torch.Tensor:
    """``Qwen3VitEncoder.forward_features``: NHWC features, in raster order throughout."""
    patch = method.patch
    outputs, shape = patch.run(x, patch.raster_runner)
    return patch.to_raster(outputs.last_hidden_state, shape, 1)


def _forward_intermediates(
    method: _PatchedMethod,
    x: torch.Tensor,
    indices=None,
    return_prefix_tokens: bool = False,
    norm: bool = False,
    stop_early: bool = False,
    output_fmt: str = "NCHW",
    intermediates_only: bool = False,
    output_dict: bool = False,
):
    """``forward_intermediates`` of the encoder or the classifier (whose features pass through the projector where
    it has one); ``return_prefix_tokens`` and ``norm`` are unused, as in timm (no prefix tokens, no final norm)."""
    patch = method.patch
    through_merger = (
        method.owner is patch.classifier
        and not intermediates_only
        and patch.encoder.merger is not None
        and patch.merge_runner is not None
    )
    final, picked = patch.intermediates(x, indices, stop_early, output_fmt, through_merger)
    if intermediates_only:
        return {"image_intermediates": picked} if output_dict else picked
    return {"image_features": final, "image_intermediates": picked} if output_dict else (final, picked)


def _find_patch(encoder: nn.Module) -> _TimmPatch | None:
    method = vars(encoder).get("forward_features")
    return method.patch if isinstance(method, _PatchedMethod) else None


def patch_model(model: nn.Module, **options) -> nn.Module:
    """Make a timm ``qwen3_vit`` model run on qvl, in place; returns ``model`` (see the module docstring). Patching
    again re-reads the model (after changing it, patch again). ``parallel``, ``token_budgets`` and ``max_segments``
    of :func:`qvl.vit.patch_model` are for transformers' models: given here, ValueError."""
    given = sorted(name for name, value in options.items() if value is not None)
    if given:
        raise ValueError(f"patch_model: {', '.join(given)} is not supported for timm's models")
    encoder, classifier = _find(model, "patch_model")
    problems = _check_tree(encoder)
    if problems:
        raise ValueError(
            f"patch_model: qvl cannot run this timm {type(encoder).__name__}: {'; '.join(problems)}. The released"
            " qwen3_vit configurations run on qvl; this one runs on timm's own forward (unpatched)"
        )
    if _find_patch(encoder) is not None:
        unpatch_model(model)
    patch = _TimmPatch(encoder, classifier)
    for runner in (patch.raster_runner, patch.merge_runner):
        if runner is not None:
            install_module_forwards(encoder, runner.spec, patch.checkpoint)
    methods = [
        (encoder, forward_slot(encoder), _encoder_forward),
        (encoder, "forward_features", _encoder_forward_features),
        (encoder, "forward_intermediates", _forward_intermediates),
    ]
    if classifier is not None:
        methods.append((classifier, "forward_intermediates", _forward_intermediates))
    for owner, name, run in methods:
        method = _PatchedMethod(patch, owner, name, run)
        setattr(owner, name, method)
        patch.replaced.append((owner, name, method.replaced))
    patch.replaced.append((encoder, "extra_repr", vars(encoder).get("extra_repr")))
    encoder.extra_repr = patch.extra_repr
    return model


def unpatch_model(model: nn.Module) -> nn.Module:
    """Undo :func:`patch_model`, in place; returns ``model`` (an unpatched one unchanged)."""
    encoder, _ = _find(model, "unpatch_model")
    patch = _find_patch(encoder)
    if patch is None:
        return model
    for owner, name, replaced in reversed(patch.replaced):
        if name == "extra_repr":
            if replaced is None:
                del owner.extra_repr
            else:
                owner.extra_repr = replaced
        elif name in ("forward", "_old_forward"):
            restore_forward(owner, name, replaced)
        elif replaced is None:
            delattr(owner, name)
        else:
            setattr(owner, name, replaced)
    for runner in (patch.raster_runner, patch.merge_runner):
        if runner is not None and (runner.spec.names.merger is None or encoder.merger is not None):
            remove_module_forwards(encoder, runner.spec)
    return model


def is_patched(model: nn.Module) -> bool:
    """Whether a timm ``qwen3_vit`` model runs on qvl."""
    return _find_patch(_find(model, "is_patched")[0]) is not None
