"""Training through qvl: patched transformers models (Qwen3-VL, Qwen2.5-VL, Qwen2-VL) give transformers' loss and
gradients in full fine-tuning, merger-only training, LoRA adapters (PEFT) and gradient checkpointing, and the
hidden states' gradients; qvl's own tower trains compiled without recompiles. transformers' own training tests
(``test_training``, ``test_retain_grad_hidden_states_attentions``,
``test_enable_input_require_grads_with_gradient_checkpointing``) rewritten on tiny random models.

Gradients are held to the suite's rule (tests/tolerance.py): each parameter's gradient against a float64 copy's,
at most twice the unpatched model's own error in fp32. The kernels run through Triton's interpreter."""

from __future__ import annotations

import contextlib
import copy
import gc
import warnings

import pytest
import torch
from test_hf_patch import GRID, as_computed, float64_run, tiny_full_model, tiny_vl_config
from test_hf_patch import image_inputs as qwen3_inputs
from test_model import one_intra_op_thread, peak_tensor_bytes
from test_qwen2_towers import FAMILIES as QWEN2_FAMILIES
from test_qwen2_towers import image_inputs as qwen2_inputs
from test_qwen2_towers import qwen2_5_full_config, qwen2_full_config
from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

from qvl.kernels import force_backend
from qvl.vit import VisionTransformer, patch_model
from qvl.vit.hf_patch import UnfusedFallbackWarning
from ranks import run_two_ranks
from tolerance import assert_error_within
from towers import (
    FALLBACKS_ARE_ERRORS,
    MODEL_STAGES,
    float64_copy,
    hf_vision_model,
    pixel_values_for,
    randomize,
    rotary_in_float64,
)

pytestmark = FALLBACKS_ARE_ERRORS


def qwen3_vl(seed):
    return tiny_full_model(seed=seed, config=tiny_vl_config()), qwen3_inputs(GRID, seed=seed + 1), ()


def qwen2_5_vl(seed):
    model = randomize(Qwen2_5_VLForConditionalGeneration(qwen2_5_full_config()), seed, std=0.1)
    model.config._attn_implementation = "sdpa"
    return model.eval(), qwen2_inputs([[1, 6, 10], [1, 2, 2]], seed=seed + 1), QWEN2_FAMILIES["qwen2_5_vl"][3]


def qwen2_vl(seed):
    model = randomize(Qwen2VLForConditionalGeneration(qwen2_full_config()), seed, std=0.1)
    model.config._attn_implementation = "sdpa"
    return model.eval(), qwen2_inputs([[1, 4, 6], [1, 2, 2]], seed=seed + 1), QWEN2_FAMILIES["qwen2_vl"][3]


MODELS = {"qwen3_vl": qwen3_vl, "qwen2_5_vl": qwen2_5_vl, "qwen2_vl": qwen2_vl}


def loss_of(model, inputs) -> torch.Tensor:
    """Next-token cross entropy in the model's dtype (transformers' own loss upcasts float64 logits to fp32,
    which would make the float64 truth only fp32-accurate)."""
    logits = model(**inputs).logits[0, :-1]
    return torch.nn.functional.cross_entropy(logits, inputs["input_ids"][0, 1:])


def train_step(model, inputs, rotary=(), float64=False) -> torch.Tensor:
    """One loss and backward; ``float64``: on the model as it is, with the vision rotary in float64 too."""
    # The rotary stays in float64 through backward too: checkpointed blocks recompute it there.
    with rotary_in_float64(*rotary) if float64 else contextlib.nullcontext():
        loss = loss_of(model, inputs)
        loss.backward()
    return loss.detach()


def assert_gradients_within(patched, reference, reference64, what: str, computed_in: torch.dtype | None = None) -> None:
    """Every parameter that got a gradient in transformers got one through qvl, within rounding; ``computed_in``:
    the autocast dtype the gradients were computed in (each judged in it: :func:`test_hf_patch.as_computed`)."""
    checked = 0
    pairs = zip(patched.named_parameters(), reference.parameters(), reference64.parameters(), strict=True)
    for (name, param), expected, truth in pairs:
        assert (param.grad is None) == (expected.grad is None), f"{what}: {name}"
        if param.grad is not None:
            assert param.grad.dtype == expected.grad.dtype == param.dtype, f"{what}: {name}.grad"
            got, baseline = (
                (param.grad, expected.grad)
                if computed_in is None
                else as_computed([param.grad, expected.grad], computed_in)
            )
            assert_error_within(got, truth.grad, baseline, what=f"{what}: {name}.grad", stages=MODEL_STAGES)
            checked += 1
    assert checked


def run_three(model, inputs, rotary, prepare=lambda model: model):
    """Train the unpatched model in fp32 and float64 and a patched copy (no fallback allowed); returns the
    three models (gradients in ``.grad``) and their losses."""
    reference = prepare(copy.deepcopy(model)).train()
    reference64 = prepare(float64_copy(model)).train()
    patched = prepare(patch_model(copy.deepcopy(model))).train()
    losses = [train_step(reference, inputs), train_step(reference64, inputs, rotary, float64=True)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnfusedFallbackWarning)
        losses.append(train_step(patched, inputs))
    return (patched, reference, reference64), losses


@pytest.mark.parametrize("name", sorted(MODELS))
def test_full_fine_tuning(name):
    """transformers' test_training: every parameter's gradient, the vision tower's and the text model's."""
    model, inputs, rotary = MODELS[name](seed=40)
    (patched, reference, reference64), (loss, loss64, patched_loss) = run_three(model, inputs, rotary)
    assert_error_within(patched_loss, loss64, loss, what=f"{name} loss", stages=MODEL_STAGES)
    assert_gradients_within(patched, reference, reference64, name)


@pytest.mark.parametrize("name", ["qwen3_vl", "qwen2_5_vl"])
def test_mixed_precision_fine_tuning(name, tower_calls):
    """fp32 weights under bf16 autocast (the mixed-precision recipe of HF Trainer, accelerate, Lightning and timm):
    the patched tower runs on qvl (no fallback), and the loss and every parameter's gradient are within the rule of
    transformers' own autocast run, judged at bf16's resolution, the float64 model without autocast as the truth.
    Qwen2.5-VL keeps a 16-bit residual stream (no position table) through RMSNorms and window attention."""
    model, inputs, rotary = MODELS[name](seed=60)
    reference, patched = copy.deepcopy(model).train(), patch_model(copy.deepcopy(model)).train()
    reference64 = float64_copy(model).train()
    loss64 = train_step(reference64, inputs, rotary, float64=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = train_step(reference, inputs)
        patched_loss = train_step(patched, inputs)
    assert len(tower_calls) == 1
    assert_error_within(
        as_computed([patched_loss]), [loss64], as_computed([loss]), what=f"{name} loss", stages=MODEL_STAGES
    )
    assert_gradients_within(patched, reference, reference64, f"{name} under bf16 autocast", torch.bfloat16)


def test_merger_only_and_frozen_tower():
    """Only the merger trains (the blocks frozen): the merger's gradients, none for the blocks."""

    def merger_only(model):
        model.requires_grad_(False)
        model.model.visual.merger.requires_grad_(True)
        return model

    model, inputs, rotary = qwen3_vl(seed=41)
    (patched, reference, reference64), _ = run_three(model, inputs, rotary, merger_only)
    assert_gradients_within(patched, reference, reference64, "merger only")
    assert all(p.grad is None for p in patched.model.visual.blocks.parameters())


def test_lora_adapters_on_the_tower_are_not_bypassed():
    """PEFT LoRA adapters on the tower's qkv / proj / MLP linears (random, so they change the output): the patched
    model's loss and the adapters' gradients are transformers'."""
    import peft  # the test extra installs it

    model, inputs, rotary = qwen2_5_vl(seed=42)
    config = peft.LoraConfig(r=4, target_modules=["qkv", "attn.proj", "gate_proj", "up_proj", "down_proj"],
                             init_lora_weights=False)  # fmt: skip

    def with_lora(model):
        torch.manual_seed(43)
        return peft.get_peft_model(model, copy.deepcopy(config))

    with torch.no_grad():
        base_loss = loss_of(model, inputs)
    (patched, reference, reference64), (loss, loss64, patched_loss) = run_three(model, inputs, rotary, with_lora)
    assert abs(float(loss) - float(base_loss)) > 1e-3  # the adapters matter
    assert_error_within(patched_loss, loss64, loss, what="LoRA loss", stages=MODEL_STAGES)
    assert_gradients_within(patched, reference, reference64, "LoRA")
    assert any("lora" in name and p.grad is not None for name, p in patched.named_parameters())


def test_gradient_checkpointing_and_input_require_grads():
    """gradient_checkpointing_enable() on a full model: transformers' gradients through the patched tower, also
    with enable_input_require_grads and a frozen tower (that each block's own checkpoint function runs and
    recomputes: tests/vit/test_training_stacks.py)."""

    def checkpointing(model):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model

    model, inputs, rotary = qwen3_vl(seed=44)
    (patched, reference, reference64), _ = run_three(model, inputs, rotary, checkpointing)
    assert_gradients_within(patched, reference, reference64, "checkpointed")

    def frozen_tower(model):
        checkpointing(model)
        model.enable_input_require_grads()
        model.model.visual.requires_grad_(False)
        return model

    (patched, reference, reference64), _ = run_three(model, inputs, rotary, frozen_tower)
    assert_gradients_within(patched, reference, reference64, "input require grads")


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_hf_trainer_steps_with_checkpointing(tmp_path, block_runs, bf16):
    """Three HF Trainer steps (gradient_checkpointing=True, SGD at a constant rate) on a patched tiny Qwen3-VL: each
    step's loss is the unpatched model's within the rounding bound of a float64 run, and the tower's blocks run on
    qvl and are recomputed in every backward. ``bf16``: ``TrainingArguments(bf16=True)`` on the fp32 model
    (accelerate's bf16 autocast over fp32 weights), the float64 run without it; losses judged at bf16's
    resolution."""
    from transformers import Trainer, TrainingArguments

    model, inputs, rotary = qwen3_vl(seed=47)
    steps = 3

    class Recording(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = loss_of(model, inputs)
            self.losses.append(loss.detach())
            return loss

    def train(model, name: str, float64: bool = False) -> torch.Tensor:
        args = TrainingArguments(
            output_dir=str(tmp_path / name),
            max_steps=steps,
            per_device_train_batch_size=1,
            learning_rate=0.05,
            optim="sgd",
            lr_scheduler_type="constant",
            gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"use_reentrant": False},
            use_cpu=True,
            bf16=bf16 and not float64,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
        )
        trainer = Recording(model=model, args=args, train_dataset=[inputs] * steps, data_collator=lambda rows: rows[0])
        trainer.losses, autocast = [], []
        # The autocast each tower call runs under (accelerate wraps the model's forward in it for bf16=True).
        model.model.visual.register_forward_pre_hook(
            lambda *_: autocast.append(torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu"))
        )
        with rotary_in_float64(*rotary) if float64 else contextlib.nullcontext():
            trainer.train()
        assert autocast == [bf16 and not float64 and torch.bfloat16] * steps
        return torch.stack(trainer.losses)

    expected = train(copy.deepcopy(model), "unpatched")
    truth = train(float64_copy(model), "float64", float64=True)
    del block_runs[:]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnfusedFallbackWarning)
        got = train(patch_model(copy.deepcopy(model)), "patched")
    assert len(block_runs) == 2 * len(model.model.visual.blocks) * steps
    if bf16:
        got, expected = as_computed([got, expected])
    assert_error_within(got, truth, expected, what="Trainer losses", stages=MODEL_STAGES)


def test_hidden_states_keep_their_gradients():
    """transformers' test_retain_grad_hidden_states_attentions (hidden states only: the fused attention has no
    attention weights): the recorded hidden states carry transformers' gradients."""
    hf = hf_vision_model(seed=45, depth=2, deepstack_visual_indexes=[0, 1])
    pixels, grid = pixel_values_for(GRID, seed=46), torch.tensor(GRID)

    def run(model):
        with torch.enable_grad():
            out = model(pixels.to(model.dtype), grid_thw=grid, output_hidden_states=True)
            for state in out.hidden_states:
                state.retain_grad()
            (out.pooler_output.square().sum() + sum(f.sum() for f in out.deepstack_features)).backward()
        return [state.grad for state in out.hidden_states]

    truth = float64_run(hf, run)
    expected = run(copy.deepcopy(hf))
    got = run(patch_model(copy.deepcopy(hf)))
    assert len(got) == len(expected) == hf.config.depth + 1
    assert_error_within(got, truth, expected, what="hidden states' gradients", stages=MODEL_STAGES)


def test_compiled_training_step_without_recompiles():
    """qvl's own tower compiled (forward and backward): gradients of a second and third batch of other sizes, a
    video among them, under fail_on_recompile, within rounding of transformers'."""
    hf = hf_vision_model(seed=47, depth=2, deepstack_visual_indexes=[1])
    tower = VisionTransformer.from_hf(hf).compile()
    batches = ([[1, 4, 6], [1, 2, 2]], [[2, 2, 4], [1, 6, 2]], [[1, 2, 2]])

    def loss_and_grads(model, pixels, grid, run) -> dict[str, torch.Tensor]:
        model.zero_grad()
        with torch.enable_grad():
            merged, deepstack = run(model, pixels, grid)
            (merged.square().sum() + sum(f.sum() for f in deepstack)).backward()
        return {name: p.grad for name, p in model.named_parameters()}

    def hf_run(model, pixels, grid):
        out = model(pixels.to(model.dtype), grid_thw=torch.tensor(grid))
        return out.pooler_output, out.deepstack_features

    names = [name for name, _ in tower.named_parameters()]
    with force_backend("torch"):
        for index, grid in enumerate(batches):
            pixels = pixel_values_for(grid, seed=48 + index)
            stance = torch.compiler.set_stance("fail_on_recompile") if index else contextlib.nullcontext()
            with stance:
                got = loss_and_grads(tower, pixels, grid, lambda model, p, g: model(p, g))
            expected = loss_and_grads(hf, pixels, grid, hf_run)
            truth = float64_run(hf, lambda model, p=pixels, g=grid: loss_and_grads(model, p, g, hf_run))
            assert_error_within(
                [got[n] for n in names],
                [truth[n] for n in names],
                [expected[n] for n in names],
                what=f"compiled training, batch {index}",
                stages=MODEL_STAGES,
            )


def test_training_step_peak_memory_not_above_sdpa():
    """A training step (forward and backward) of the patched vision model holds no more tensor bytes at its peak
    than the unpatched model with SDPA on the same batch. The kernels run through the interpreter, whose own
    work lives in numpy arrays: the bytes counted are the tensors a GPU run would allocate (the activations saved
    for backward, the log-sum-exp, the gradients), and attention keeps no score matrix in either."""
    hf = hf_vision_model(seed=52, depth=1, deepstack_visual_indexes=[0])
    patched = patch_model(copy.deepcopy(hf))
    # One image large enough that a saved score matrix would dominate (144 tokens: 2 heads x 144^2 fp32 is 162 KiB
    # against 81 KiB for a 144 x 144 fp32 activation), plus a small one.
    grid = [[1, 12, 12], [1, 2, 4]]
    pixels, grid_thw = pixel_values_for(grid, seed=53), torch.tensor(grid)

    def step(model):
        model.zero_grad(set_to_none=True)
        with torch.enable_grad():
            out = model(pixels, grid_thw=grid_thw)
            (out.pooler_output.square().sum() + sum(f.sum() for f in out.deepstack_features)).backward()

    peaks = {}
    with one_intra_op_thread():
        for name, model in (("sdpa", hf), ("qvl", patched)):
            step(model.train())  # warm-up: the kernels' first launch, lazily built tables
            gc.collect()
            peaks[name] = peak_tensor_bytes(lambda m=model: step(m), "cpu")
    print(f"peak tensor bytes of one training step: {peaks}")
    assert peaks["qvl"] <= peaks["sdpa"], peaks


# --------------------------------------------------------------------------------------------------
# Parallel backward: two gloo ranks, started by the test below (this file run as a script is one rank)
# --------------------------------------------------------------------------------------------------
# One image on two ranks leaves one rank idle in data mode: it must still run the tower's backward (zeros).
PARALLEL_GRIDS = {
    "images": [[1, 4, 6], [1, 2, 2], [1, 6, 2]],
    "video": [[3, 2, 4], [1, 2, 2]],
    "one image": [[1, 4, 6]],
}


def tower_loss(merged, deepstack) -> torch.Tensor:
    return merged.square().sum() + sum(f.sum() for f in deepstack)


def vision_gradients(model, pixels, grid) -> dict[str, torch.Tensor]:
    """The gradients of :func:`tower_loss` over a vision model's outputs (transformers', patched or not): every
    parameter's by name, and ``"pixels"`` (of a leaf of its own: the caller's tensor gets no gradient, which would
    add up over calls)."""
    pixels = pixels.detach().to(model.dtype, copy=True).requires_grad_(True)
    model.zero_grad()
    with torch.enable_grad():
        out = model(pixels, grid_thw=torch.tensor(grid))
        tower_loss(out.pooler_output, getattr(out, "deepstack_features", [])).backward()
    return {"pixels": pixels.grad, **{name: p.grad for name, p in model.named_parameters()}}


def _parallel_rank(out_dir: str) -> None:
    import torch.distributed as dist

    from qvl.vit.parallel import init_from_env

    init_from_env("cpu")
    hf = hf_vision_model(seed=50, depth=2, deepstack_visual_indexes=[1])
    results = {}
    for mode in ("weights", "data"):
        tower = VisionTransformer.from_hf(hf, parallel=mode)
        shapes = {name: p.shape for name, p in tower.named_parameters()}
        for case, grid in PARALLEL_GRIDS.items():
            pixels = pixel_values_for(grid, seed=51).requires_grad_(True)
            tower.zero_grad()
            with force_backend("torch"):
                tower_loss(*tower(pixels, grid)).backward()
            got = {"pixels": pixels.grad, **{name: p.grad for name, p in tower.named_parameters()}}
            if mode == "data":  # each rank's gradients cover its share: their sum is the whole batch's
                for tensor in got.values():
                    dist.all_reduce(tensor)
            expected = vision_gradients(hf, pixel_values_for(grid, seed=51), grid)
            truth = float64_run(hf, lambda model, g=grid: vision_gradients(model, pixel_values_for(g, seed=51), g))
            # This rank's part of the whole tower's gradients (weights mode keeps a shard of each split tensor).
            expected, truth = (
                {"pixels": t["pixels"], **tower._parallel.local_state_dict(t, shapes)} for t in (expected, truth)
            )
            results[f"{mode}/{case}"] = (got, expected, truth)
    torch.save(results, f"{out_dir}/rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


def test_parallel_backward_over_two_ranks(tmp_path):
    """Weights mode (each rank's shard of every split parameter, and the inputs' gradient) and data mode (the sum
    of the ranks' gradients) equal one process's gradients, within rounding, for images and a video."""

    run_two_ranks(__file__, tmp_path)
    for rank in range(2):
        for key, (got, expected, truth) in torch.load(tmp_path / f"rank{rank}.pt").items():
            assert sorted(got) == sorted(expected)
            for name in got:
                assert_error_within(
                    got[name], truth[name], expected[name], what=f"rank {rank} {key}: {name}", stages=MODEL_STAGES
                )


if __name__ == "__main__":
    from ranks import run_rank

    run_rank(_parallel_rank)
