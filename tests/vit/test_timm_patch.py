"""qvl.vit.patch_model on timm's qwen3_vit backbones (random weights, nothing downloaded), judged against timm itself:
every variant timm registers, patched against unpatched in fp32, under bf16 autocast over fp32 weights and in 16-bit
weights (outputs, forward_features, forward_intermediates and every parameter's gradient, by the suite's tolerance
rule with timm's own float64 run as the truth); the real variant configurations; features_only; a training step with
AMP and timm's gradient checkpointing; torch.compile across image sizes without a recompile; unpatching; what errors
and what falls back. Everything runs on qvl's CPU torch path (no Triton interpreter)."""

import copy

import pytest
import torch
from torch import nn

timm = pytest.importorskip("timm")

from test_hf_patch import as_computed  # noqa: E402
from timm.models.qwen3_vit import Qwen3VitClassifier, Qwen3VitEncoder  # noqa: E402

from qvl.kernels import force_backend  # noqa: E402
from qvl.vit import is_patched, patch_model, unpatch_model  # noqa: E402
from qvl.vit.metadata import DeviceInputs, build_metadata, equal_images_inputs  # noqa: E402
from qvl.vit.patching import UnfusedFallbackWarning  # noqa: E402
from qvl.vit.runner import ModuleForward  # noqa: E402
from tolerance import assert_error_within  # noqa: E402
from towers import FALLBACKS_ARE_ERRORS, model_stages, randomize  # noqa: E402

pytestmark = FALLBACKS_ARE_ERRORS

VARIANTS = timm.list_models("qwen3_vit*")
# Every variant's own widths shrunk (its MLP ratio and head kind kept): 2 blocks of 64 in 2 heads of 32, an 8 x 8
# position table, a 48-wide projector (the _enc and _merge models), 5 classes (the classifiers).
TINY = dict(depth=2, embed_dim=64, num_heads=2, pos_embed_grid_size=8, out_features=48)
# Two 96 x 64 images: a 6 x 4 patch grid (3 x 2 merge blocks), the 8 x 8 table resampled to it.
IMAGES = (2, 3, 96, 64)


@pytest.fixture(autouse=True)
def torch_path():
    """qvl's CPU torch path, as a CPU user runs it (the suite sets Triton's interpreter for CPU tensors)."""
    with force_backend("torch"):
        yield


def tiny_model(name: str, seed: int = 0, **overrides) -> nn.Module:
    kwargs = {**TINY, **({} if name.endswith("_enc") else {"num_classes": 5}), **overrides}
    return randomize(timm.create_model(name, pretrained=False, **kwargs), seed).eval()


def images(shape=IMAGES, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def encoder_of(model: nn.Module) -> Qwen3VitEncoder:
    """The encoder of a classifier, an encoder, or a wrapper's ``.model`` (features_only)."""
    while not isinstance(model, (Qwen3VitEncoder, Qwen3VitClassifier)):
        model = model.model
    return model if isinstance(model, Qwen3VitEncoder) else model.encoder


def float64_model(model: nn.Module) -> nn.Module:
    """A float64 copy of a timm model whose rotary is float64 too: timm builds the rotary's sin and cos in fp32
    whatever the model's dtype, from inverse frequencies it rounded to fp32; the truth computes both in float64."""
    model64 = copy.deepcopy(model).double()
    rope = encoder_of(model64).rope
    count = rope.bands.numel()
    rope.bands = rope.temperature ** -(torch.arange(count, dtype=torch.float64) / count)
    get_embed = rope.get_embed
    rope.get_embed = lambda shape=None, dtype=None: get_embed(shape, dtype=torch.float64)
    return model64


def run(model: nn.Module, x: torch.Tensor, grad_seed: int = 1, autocast: torch.dtype | None = None):
    """``{what: tensor}``: the forward's output, forward_features, forward_intermediates' final features and the
    first and last blocks' outputs (NCHW), and every parameter's gradient of the forward's output against a fixed
    random gradient."""
    x = x.to(next(model.parameters()).dtype)
    params = list(model.parameters())
    amp = torch.autocast("cpu", dtype=autocast) if autocast is not None else torch.autocast("cpu", enabled=False)
    with torch.enable_grad(), amp:
        out = model(x)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed)).to(out.dtype)
    grads = torch.autograd.grad(out, params, grad)
    with torch.no_grad(), amp:
        features = model.forward_features(x)
        final, intermediates = model.forward_intermediates(x, indices=[0, -1])
    results = {"output": out, "forward_features": features, "forward_intermediates' features": final}
    results.update({f"intermediate {i}": y for i, y in enumerate(intermediates)})
    results.update({f"{name}.grad": g for (name, _), g in zip(model.named_parameters(), grads, strict=True)})
    return results


def assert_matches_timm(model, x, autocast=None, grad_seed=1, tower_calls=None):
    """Patch ``model`` and check it against its unpatched run (the baseline) and its float64 run (the truth);
    ``autocast``: the patched and the baseline runs under CPU autocast to that dtype, judged at its resolution."""
    stages = model_stages(model, backward=True)
    truth = run(float64_model(model), x, grad_seed)
    expected = run(model, x, grad_seed, autocast)
    patch_model(model)
    assert is_patched(model)
    got = run(model, x, grad_seed, autocast)
    if tower_calls is not None:  # forward, forward_features, forward_intermediates: each ran the runner once
        assert tower_calls == [encoder_of(model)] * 3
    assert got.keys() == truth.keys() == expected.keys()
    for what, actual in got.items():
        truth64, baseline = truth[what], expected[what]
        assert actual.dtype == baseline.dtype and actual.shape == baseline.shape, what
        if autocast is not None:
            actual, baseline = as_computed([actual, baseline], autocast)
        assert_error_within(actual, truth64, baseline, what=what, stages=stages)


@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("name", VARIANTS)
def test_every_variant_matches_timm(name, autocast, tower_calls):
    """Each variant timm registers (classifier, _merge classifier, _enc encoder at 88M, 306M and 416M), shrunk: in
    fp32, and under bf16 autocast over fp32 weights (timm's AMP training), the patched model's outputs and
    gradients within the rule of timm's own run, the tower on qvl in every call (no fallback: an error here)."""
    assert_matches_timm(tiny_model(name, seed=3), images(seed=4), autocast, tower_calls=tower_calls)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", ["qwen3_vit_88m", "qwen3_vit_88m_merge", "qwen3_vit_88m_enc"])
def test_16bit_weights_match_timm(name, dtype, tower_calls):
    """A model cast to bf16 or fp16: the patched run within the rule of timm's own in that dtype."""
    assert_matches_timm(tiny_model(name, seed=5).to(dtype), images(seed=6), tower_calls=tower_calls)


# The variants' real widths: (embed_dim, heads, MLP width).
REAL_WIDTHS = {"88m": (768, 12, 3072), "306m": (1024, 16, 4096), "416m": (1152, 16, 4304)}


def size_of(name: str) -> str:
    return name.split("_")[2]


def test_real_variant_configs_patch_on_the_meta_device():
    """Every variant at its real size (88M to 460M parameters), built on the meta device: patch_model reads each
    into the runner with the variant's widths, heads and projector; a call on meta weights runs timm's own forward
    with a warning (offloaded weights are not qvl's to load); unpatch_model undoes the patch."""
    for name in VARIANTS:
        model = timm.create_model(name, pretrained=False, device="meta")
        patch = encoder_of(patch_model(model)).forward_features.patch
        config = patch.raster_runner.config
        assert (config.hidden_size, config.num_heads, config.intermediate_size) == REAL_WIDTHS[size_of(name)], name
        merger = encoder_of(model).merger
        assert (merger is None) == (patch.merge_runner is None) == name.endswith(size_of(name)), name
        if merger is not None:
            assert patch.merge_runner.config.out_hidden_size == merger.out_features, name
        with pytest.warns(UnfusedFallbackWarning, match="not all on one device"):
            out = model(torch.empty(1, 3, 32, 32, device="meta"))
        assert out.device.type == "meta"
        assert not is_patched(unpatch_model(model))


@pytest.mark.parametrize("name", VARIANTS)
def test_real_widths_on_one_tiny_image(name, tower_calls):
    """Each variant's real block, head, MLP and projector widths (one block deep; the whole 88M classifier below) on
    one 32 x 32 image: its 2 x 2 patches from the 48 x 48 table, within the rule of timm's own run."""
    classes = {} if name.endswith("_enc") else {"num_classes": 5}
    model = randomize(timm.create_model(name, pretrained=False, depth=1, **classes))
    assert_matches_timm(model.eval(), images((1, 3, 32, 32), seed=16), tower_calls=tower_calls)


def test_whole_88m_classifier_on_one_tiny_image(tower_calls):
    """The 88M classifier as timm builds it, all 12 blocks, on one 32 x 32 image."""
    model = randomize(timm.create_model("qwen3_vit_88m", pretrained=False, num_classes=5), seed=17).eval()
    assert_matches_timm(model, images((1, 3, 32, 32), seed=18), tower_calls=tower_calls)


@pytest.mark.parametrize("name", ["qwen3_vit_88m_merge", "qwen3_vit_306m_enc"])
def test_features_only(name, tower_calls):
    """``features_only=True`` (timm's FeatureGetterNet over the pruned model: forward_intermediates, the blocks'
    outputs only) patched through its ``.model``."""
    kwargs = {**TINY, **({} if name.endswith("_enc") else {"num_classes": 5})}
    model = timm.create_model(name, pretrained=False, features_only=True, out_indices=(0, 1), **kwargs)
    model, x = randomize(model, seed=19).eval(), images(seed=20)
    with torch.no_grad():
        truth = float64_model(model)(x.double())
        expected = model(x)
        got = patch_model(model)(x)
    assert is_patched(model) and tower_calls == [encoder_of(model)]
    assert [tuple(f.shape) for f in got] == [tuple(f.shape) for f in expected] == [(2, 64, 6, 4)] * 2
    assert_error_within(got, truth, expected, what="features", stages=model_stages(model))


@pytest.mark.parametrize("name", ["qwen3_vit_88m_merge", "qwen3_vit_88m_enc"])
def test_forward_intermediates_options(name, tower_calls):
    """forward_intermediates' options as timm reads them: ``stop_early`` (the features, or the projector's tokens, of
    the last block taken: a _merge classifier's projector then runs on block 0's output), NLC intermediates, a dict,
    intermediates only; one runner call each."""
    model, x = tiny_model(name, seed=21), images(seed=22)
    calls = [
        dict(indices=[0], stop_early=True),
        dict(indices=1, output_fmt="NLC"),
        dict(indices=[-1, 0], output_dict=True),
        dict(indices=[1], intermediates_only=True, output_fmt="NLC"),
    ]

    def flat(result):
        if isinstance(result, dict):
            return [result.get("image_features"), *result["image_intermediates"]]
        return [result[0], *result[1]] if isinstance(result, tuple) else list(result)

    with torch.no_grad():
        model64 = float64_model(model)
        truth = [flat(model64.forward_intermediates(x.double(), **kwargs)) for kwargs in calls]
        expected = [flat(model.forward_intermediates(x, **kwargs)) for kwargs in calls]
        patch_model(model)
        got = [flat(model.forward_intermediates(x, **kwargs)) for kwargs in calls]
    assert len(tower_calls) == len(calls)
    for kwargs, results, truths, baselines in zip(calls, got, truth, expected, strict=True):
        assert [None if r is None else r.shape for r in results] == [None if r is None else r.shape for r in baselines]
        pairs = [(r, t, b) for r, t, b in zip(results, truths, baselines, strict=True) if r is not None]
        assert_error_within(*map(list, zip(*pairs, strict=True)), what=str(kwargs), stages=model_stages(model))


def test_odd_patch_grids():
    """Without a projector any patch grid runs (raster order throughout: 5 x 3 patches here); through the projector
    an odd grid raises timm's own AssertionError, and the encoder's features still run."""
    assert_matches_timm(tiny_model("qwen3_vit_88m", seed=14), images((2, 3, 80, 48), seed=15))
    x = images((2, 3, 80, 48), seed=15)
    encoder = tiny_model("qwen3_vit_88m_enc", seed=14)
    with torch.no_grad():
        with pytest.raises(AssertionError, match="patch grid height must be divisible by merge_size"):
            encoder(x)
        expected = encoder.forward_features(x)
        patch_model(encoder)
        with pytest.raises(AssertionError, match="patch grid height must be divisible by merge_size"):
            encoder(x)
        got = encoder.forward_features(x)
    assert got.shape == expected.shape == (2, 5, 3, 64)


@pytest.mark.parametrize("name", ["qwen3_vit_88m", "qwen3_vit_88m_merge"])
def test_amp_training_step_with_grad_checkpointing(name, block_runs, monkeypatch):
    """One timm training step as timm's train script makes it: bf16 autocast over fp32 weights,
    ``set_grad_checkpointing()``, cross-entropy, SGD. Each block runs through timm's ``checkpoint`` (once a block)
    and is recomputed in backward; the loss and every gradient within the rule of timm's own step."""
    from timm.models import _manipulate

    checkpoints = []
    timm_checkpoint = _manipulate.checkpoint

    def counted(function, *args, **kwargs):
        checkpoints.append(function)
        return timm_checkpoint(function, *args, **kwargs)

    monkeypatch.setattr(_manipulate, "checkpoint", counted)
    model = tiny_model(name, seed=7).train()
    model.set_grad_checkpointing(True)
    x, target = images(seed=8), torch.tensor([1, 3])

    def step(model, autocast=True):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        dtype = next(model.parameters()).dtype
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = nn.functional.cross_entropy(model(x.to(dtype)), target)
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
        return [loss.detach(), *grads]

    truth = step(float64_model(model), autocast=False)
    expected = step(copy.deepcopy(model))
    checkpoints.clear()
    patched = patch_model(copy.deepcopy(model))
    got = step(patched)
    depth = TINY["depth"]
    assert len(checkpoints) == depth and len(block_runs) == 2 * depth  # each block: forward, then its recomputation
    names = ["loss", *(f"{n}.grad" for n, _ in model.named_parameters())]
    stages = model_stages(model, backward=True)
    for what, actual, truth64, baseline in zip(names, got, truth, expected, strict=True):
        actual, baseline = as_computed([actual, baseline])
        assert_error_within(actual, truth64, baseline, what=what, stages=stages)


def test_compiled_across_image_sizes_without_recompile():
    """``torch.compile(model, dynamic=True)`` over a patched model: one graph (the metadata is traced into it, no
    graph break) serves a second image size under ``fail_on_recompile`` (timm's own model recompiles there), the
    outputs within the rule of timm's eager run."""
    from torch._dynamo.utils import counters

    model = tiny_model("qwen3_vit_88m_merge", seed=9)
    sizes = [images(seed=10), images((2, 3, 64, 128), seed=11)]
    with torch.no_grad():
        model64 = float64_model(model)
        truths = [model64(x.double()) for x in sizes]
        expected = [model(x) for x in sizes]
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(patch_model(model), dynamic=True)
        got = [compiled(sizes[0])]
        with torch.compiler.set_stance("fail_on_recompile"):
            got.append(compiled(sizes[1]))
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert_error_within(got, truths, expected, what="compiled logits", stages=model_stages(model))


def test_compiled_amp_training_with_checkpointing_across_image_sizes():
    """A compiled AMP training step with timm's gradient checkpointing, the images' height and width marked dynamic
    (``torch._dynamo.mark_dynamic``; under ``dynamic=True`` torch 2.13's Dynamo cannot lift the blocks' float
    attributes into a checkpointed block, for transformers' patched towers too): one graph, with no graph break, for
    two image sizes (the second under ``fail_on_recompile``), the loss and every gradient within the rule of timm's
    eager step. Dynamo and AOTAutograd without Inductor (``backend="aot_eager"``): the graph, not its C++ code, is the
    question here."""
    from torch._dynamo.utils import counters

    model = tiny_model("qwen3_vit_88m_merge", seed=23).train()
    model.set_grad_checkpointing(True)
    reference, reference64 = copy.deepcopy(model), float64_model(model)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(patch_model(model), backend="aot_eager")
    labels = torch.tensor([1, 3])

    def step(model, x, autocast=True):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = nn.functional.cross_entropy(model(x).to(x.dtype), labels)
        loss.backward()
        return [loss.detach()] + [p.grad for p in model.parameters()]

    for index, shape in enumerate([IMAGES, (2, 3, 64, 128)]):
        x = images(shape, seed=24 + index)
        truth = step(reference64, x.double(), autocast=False)
        expected = step(reference, x)
        torch._dynamo.mark_dynamic(x, (2, 3))
        with torch.compiler.set_stance("fail_on_recompile" if index else "default"):
            got = step(compiled, x)
        stages = model_stages(model, backward=True)
        names = ["loss", *(f"{name}.grad" for name, _ in model.named_parameters())]
        for what, actual, truth64, baseline in zip(names, got, truth, expected, strict=True):
            actual, baseline = as_computed([actual, baseline])
            assert_error_within(actual, truth64, baseline, what=f"{shape}: {what}", stages=stages)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]


def test_unpatch_restores_timm():
    """unpatch_model puts back every method and module forward the patch replaced: timm's own forward runs again,
    bit for bit; patching twice is harmless; print(model) shows the patch while it is there."""
    model = tiny_model("qwen3_vit_88m_merge", seed=10)
    pristine, x = copy.deepcopy(model), images(seed=11)
    with torch.no_grad():
        expected = model(x)
        patch_model(patch_model(model))
        assert is_patched(model) and "forward patched by qvl.vit.patch_model" in repr(model)
        assert unpatch_model(model) is model and not is_patched(model)
        got = model(x)
    replaced = {"forward", "forward_features", "forward_intermediates", "extra_repr"}
    assert not replaced & set(vars(model.encoder)) and "forward_intermediates" not in vars(model)
    assert not any(isinstance(vars(module).get("forward"), ModuleForward) for module in model.modules())
    assert repr(model) == repr(pristine)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert unpatch_model(model) is model


def test_what_qvl_cannot_run_raises():
    """Another timm architecture: TypeError naming the models qvl serves; a configuration qvl cannot run (another
    activation, a non-default rotary setting): ValueError naming it, the model left unpatched; transformers'
    options: ValueError."""
    with pytest.raises(TypeError, match=r"VisionTransformer is not one qvl serves.*qwen3_vit"):
        patch_model(timm.create_model("vit_tiny_patch16_224", pretrained=False, depth=1))
    silu = tiny_model("qwen3_vit_88m", act_layer=nn.SiLU)
    with pytest.raises(ValueError, match=r"blocks\.0\.mlp\.act is SiLU\(\)"):
        patch_model(silu)
    assert not is_patched(silu)
    shifted = tiny_model("qwen3_vit_88m_enc")
    shifted.rope.grid_offset = 0.5
    with pytest.raises(ValueError, match="rope has grid_offset=0.5"):
        patch_model(shifted)
    with pytest.raises(ValueError, match="parallel is not supported for timm's models"):
        patch_model(tiny_model("qwen3_vit_88m"), parallel="data")


def test_calls_qvl_cannot_serve_run_timm_with_a_warning(tower_calls):
    """Drop path active in training, and a hook on a module qvl's fused blocks do not call (timm's attention): those
    calls run timm's own forward, bit for bit, with an UnfusedFallbackWarning; the same model in eval mode, or
    without the hook, runs on qvl."""
    model = tiny_model("qwen3_vit_88m", seed=12, drop_path_rate=0.2)
    reference, x = copy.deepcopy(model).train(), images(seed=13)
    patch_model(model)
    with torch.no_grad():
        model(x)  # eval: drop path is off
    assert len(tower_calls) == 1
    model.train()
    torch.manual_seed(0)
    expected = reference(x)
    torch.manual_seed(0)
    with pytest.warns(UnfusedFallbackWarning, match="drop path is active in training"):
        got = model(x)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    model.eval()
    seen = []
    handle = model.encoder.blocks[0].attn.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    with torch.no_grad(), pytest.warns(UnfusedFallbackWarning, match=r"registered on blocks\.0\.attn"):
        model(x)
    assert seen == [(2, 24, 64)] and len(tower_calls) == 1
    handle.remove()
    with torch.no_grad():
        model(x)
    assert len(tower_calls) == 2


@pytest.mark.parametrize("merge", [1, 2])
def test_equal_images_inputs_are_the_host_metadata(merge):
    """The traced metadata of a batch of equal-size images is build_metadata's, bit for bit (raster order for a
    merge size of 1)."""
    for batch, height, width in ((2, 6, 4), (3, 10, 14), (1, 48, 48), (1, 2, 2)):
        host = DeviceInputs.of(build_metadata([[1, height, width]] * batch, merge, 48))
        traced = equal_images_inputs(batch, height, width, merge, 48, "cpu")
        assert traced.max_seqlen == host.max_seqlen
        for got, expected in zip(traced[:4], host[:4], strict=True):
            assert got.dtype == expected.dtype
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
