"""A patched tower under the stacks people train with: transformers' gradient checkpointing with whatever
function and kwargs it installed, torch's checkpoint_wrapper, and FSDP2 (two gloo ranks on CPU), each against the
unpatched transformers model's gradients."""

from __future__ import annotations

import contextlib
import copy
import functools

import pytest
import torch
from test_hf_patch import GRID, TINY_VISION, float64_run, image_inputs, tiny_full_model, tiny_vl_config
from test_qwen2_towers import vision_model as qwen2_vision_model
from test_training import loss_of
from test_training import vision_gradients as gradients
from torch import nn
from transformers import PreTrainedModel

from qvl.kernels import force_backend
from qvl.vit import patch_model, runner, unpatch_model
from ranks import run_two_ranks
from tolerance import assert_error_within
from towers import FALLBACKS_ARE_ERRORS, MODEL_STAGES, hf_vision_model, pixel_values_for

QWEN2_PATCH_DIM = 3 * 2 * 14 * 14


pytestmark = FALLBACKS_ARE_ERRORS


def towers():
    """(name, transformers vision model, its float64 rotary patch, pixel values) for one model of each tower kind."""
    hf = hf_vision_model(seed=60, **TINY_VISION)
    yield "qwen3_vl", hf, (), pixel_values_for(GRID, seed=61)
    for name in ("qwen2_5_vl", "qwen2_vl"):
        hf, rotary = qwen2_vision_model(name, seed=62)
        yield name, hf, rotary, pixel_values_for(GRID, seed=63, channels=QWEN2_PATCH_DIM)


@contextlib.contextmanager
def checkpointing_in_call():
    """transformers' GradientCheckpointingLayer as before 5.23, which checkpointed each layer in its ``__call__``
    (around the module's whole call, the forward qvl installs included) rather than in its class's ``forward``."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    def call(self, *args, **kwargs):  # transformers 5.22's, without its cache arguments
        if self.gradient_checkpointing and self.training:
            return self._gradient_checkpointing_func(functools.partial(nn.Module.__call__, self, **kwargs), *args)
        return nn.Module.__call__(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(GradientCheckpointingLayer, "__call__", call, raising=False)
        runner._call_checkpointing_layer.cache_clear()
        try:
            yield
        finally:
            runner._call_checkpointing_layer.cache_clear()


@pytest.mark.parametrize("layer", ["installed", "pre-5.23 __call__"])
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_transformers_checkpointing_runs_the_blocks_own_function(use_reentrant, layer, block_runs):
    """gradient_checkpointing_enable(gradient_checkpointing_kwargs=...) installs a checkpoint function on each block;
    the patched tower calls that function (transformers' own test mocks it) with the user's kwargs, once per block
    also where transformers checkpoints the layer in its ``__call__`` (before 5.23), and each block is recomputed
    once in backward, with transformers' gradients."""
    for name, hf, rotary, pixels in towers():
        truth = float64_run(hf, lambda model, p=pixels: gradients(model, p, GRID), *rotary)
        hf.train()
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
        expected = gradients(hf, pixels, GRID)
        with checkpointing_in_call() if layer != "installed" else contextlib.nullcontext():
            patch_model(hf)
            got, calls = checkpointed_gradients(hf, pixels, block_runs)
        assert calls == list(hf.blocks), name
        blocks = list(hf.blocks)
        assert block_runs[: len(blocks)] == blocks, name
        assert sorted(map(id, block_runs[len(blocks) :])) == sorted(map(id, blocks)), f"{name}: recomputed once each"
        for key in got:
            assert_error_within(
                got[key], truth[key], expected[key], what=f"{name} checkpointed: {key}", stages=MODEL_STAGES
            )


def checkpointed_gradients(hf, pixels, block_runs):
    """The patched tower's gradients, and the blocks whose checkpoint function ran, in order."""
    calls = []
    for block in hf.blocks:
        installed = block._gradient_checkpointing_func

        def counting(function, *args, installed=installed, block=block):
            calls.append(block)
            return installed(function, *args)

        block._gradient_checkpointing_func = counting
    del block_runs[:]
    return gradients(hf, pixels, GRID), calls


@pytest.mark.skipif(
    not hasattr(PreTrainedModel, "activation_checkpointing_enable"),
    reason="this transformers predates activation_checkpointing_enable (every_n_layers, offload)",
)
def test_activation_checkpointing_of_every_other_block(block_runs):
    """transformers' activation_checkpointing_enable(every_n_layers=2) (gradient_checkpointing_enable's successor)
    flags every other block: the patched tower recomputes exactly those, once each, through the function transformers
    installed, with transformers' gradients. (Its offload=True pins host memory, which needs an accelerator.)"""
    for name, hf, rotary, pixels in towers():
        truth = float64_run(hf, lambda model, p=pixels: gradients(model, p, GRID), *rotary)
        hf.train()
        hf.activation_checkpointing_enable(every_n_layers=2)
        blocks = list(hf.blocks)
        flagged = [block for block in blocks if block.gradient_checkpointing]
        assert 0 < len(flagged) < len(blocks), name
        expected = gradients(hf, pixels, GRID)
        patch_model(hf)
        del block_runs[:]
        got = gradients(hf, pixels, GRID)
        assert block_runs[: len(blocks)] == blocks, name
        assert sorted(map(id, block_runs[len(blocks) :])) == sorted(map(id, flagged)), f"{name}: the flagged, once each"
        for key in got:
            assert_error_within(
                got[key], truth[key], expected[key], what=f"{name} every other block: {key}", stages=MODEL_STAGES
            )


def test_checkpoint_wrapper_recomputes_wrapped_blocks(block_runs):
    """torch's checkpoint_wrapper around the blocks, applied before or after patching: the wrapper's call runs
    qvl's block (not read past), so the blocks are recomputed in backward; gradients as transformers'."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    hf = hf_vision_model(seed=64, **TINY_VISION).train()
    pixels = pixel_values_for(GRID, seed=65)
    truth = float64_run(hf, lambda model: gradients(model, pixels, GRID))
    expected = gradients(hf, pixels, GRID)
    for order in ("wrap, then patch", "patch, then wrap"):
        model = copy.deepcopy(hf)
        if order == "patch, then wrap":
            patch_model(model)
        model.blocks = torch.nn.ModuleList(checkpoint_wrapper(block) for block in model.blocks)
        if order == "wrap, then patch":
            patch_model(model)
        del block_runs[:]
        got = gradients(model, pixels, GRID)
        assert len(block_runs) == 2 * len(model.blocks), order
        for key in got:
            name = key.replace("._checkpoint_wrapped_module", "")
            assert_error_within(got[key], truth[name], expected[name], what=f"{order}: {key}", stages=MODEL_STAGES)
        unpatch_model(model)
        assert all("forward" not in vars(block._checkpoint_wrapped_module) for block in model.blocks)


FSDP_CASES = {
    "reshard": dict(reshard_after_forward=True, checkpointing=False),
    "keep-unsharded": dict(reshard_after_forward=False, checkpointing=False),
    "reshard+checkpointing": dict(reshard_after_forward=True, checkpointing=True),
}


def _fsdp_rank(out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, init_device_mesh

    from qvl.vit.parallel import init_from_env

    init_from_env("cpu")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    hf = hf_vision_model(seed=66, **TINY_VISION).train()
    pixels = pixel_values_for(GRID, seed=67)
    expected = gradients(hf, pixels, GRID)  # every rank passes the whole batch: FSDP's mean is one rank's
    truth = float64_run(hf, lambda model: gradients(model, pixels, GRID))
    results = {"expected": expected, "truth": truth}
    unsharded_blocks = []
    block_step = runner.block_step

    def observed(block, *args, **kwargs):
        blocks = model.blocks
        unsharded_blocks.append(sum(not isinstance(b.norm1.weight, DTensor) for b in blocks))
        return block_step(block, *args, **kwargs)

    runner.block_step = observed
    for case, options in FSDP_CASES.items():
        model = copy.deepcopy(hf)
        if options["checkpointing"]:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        patch_model(model)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=options["reshard_after_forward"])
        fully_shard(model, mesh=mesh, reshard_after_forward=options["reshard_after_forward"])
        del unsharded_blocks[:]
        with force_backend("torch"):
            got = gradients(model, pixels, GRID)
        got = {key: g.full_tensor() if isinstance(g, DTensor) else g for key, g in got.items()}
        results[case] = (got, list(unsharded_blocks))
    # A norm sharded on its own stays sharded through its block's call, where qvl reads it: refused by name.
    model = patch_model(copy.deepcopy(hf))
    for block in model.blocks:
        fully_shard(block.norm1, mesh=mesh)
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    try:
        with force_backend("torch"):
            model(pixels, grid_thw=torch.tensor(GRID))
        results["refusal"] = None
    except RuntimeError as error:
        results["refusal"] = str(error)
    torch.save(results, f"{out_dir}/rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


def test_fsdp2_per_block_sharding_trains_the_patched_tower(tmp_path):
    """fully_shard on each block and the tower (two gloo ranks): the blocks' parameters are unsharded by FSDP2's
    own hooks when qvl calls them, one block at a time where FSDP reshards after forward, and the vision gradients
    are the unpatched, unsharded model's within the suite's rounding bound (and within 1e-6 of its gradient's
    norm)."""
    run_two_ranks(__file__, tmp_path, timeout=600)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        expected, truth = results.pop("expected"), results.pop("truth")
        refusal = results.pop("refusal")
        assert refusal is not None and "LayerNorm in the patched tower is sharded (a DTensor)" in refusal, refusal
        for case, (got, unsharded_blocks) in results.items():
            assert sorted(got) == sorted(expected), case
            for key in got:
                what = f"rank {rank} {case}: {key}"
                assert_error_within(got[key], truth[key], expected[key], what=what, stages=MODEL_STAGES)
                assert (got[key] - expected[key]).abs().max() <= 1e-6 * expected[key].norm(), what
            forward_runs = unsharded_blocks[: TINY_VISION["depth"]]
            if FSDP_CASES[case]["reshard_after_forward"]:
                assert max(forward_runs) == 1, f"{case}: blocks unsharded at once during the forward: {forward_runs}"
            else:
                assert forward_runs == [1, 2], f"{case}: blocks stay unsharded after their forward: {forward_runs}"


def _data_mode_rank(out_dir: str) -> None:
    """verl's layout: the text model's decoder layers FSDP2-sharded, the vision tower split by qvl's data mode."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, init_device_mesh

    from qvl.vit.parallel import init_from_env

    init_from_env("cpu")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    hf = tiny_full_model(seed=68, config=tiny_vl_config()).train()
    inputs = image_inputs(GRID, seed=69)
    expected = full_model_gradients(hf, inputs)
    truth = float64_run(hf, lambda model: full_model_gradients(model, inputs))
    model = patch_model(copy.deepcopy(hf), parallel="data")
    for layer in model.model.language_model.layers:
        fully_shard(layer, mesh=mesh)
    # Each rank's vision gradients cover its share of the images: the tower's unit sums them over the ranks
    # instead of FSDP's default mean, which serves the text model (every rank holds the same tokens).
    tower = fully_shard(model.model.visual, mesh=mesh)
    tower.set_gradient_divide_factor(1.0)
    tower.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum
    fully_shard(model, mesh=mesh)
    with force_backend("torch"):
        got = full_model_gradients(model, inputs)
    got = {key: g.full_tensor() if isinstance(g, DTensor) else g for key, g in got.items()}
    torch.save({"got": got, "expected": expected, "truth": truth}, f"{out_dir}/rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


def full_model_gradients(model, inputs) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of a full model's next-token loss."""
    model.zero_grad()
    with torch.enable_grad():
        loss_of(model, inputs).backward()
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def test_data_mode_vision_beside_fsdp2_text(tmp_path):
    """patch_model(parallel="data") on a full model whose decoder layers are FSDP2-sharded (two gloo ranks, the
    same batch on each): every gradient, vision and text, equals one process's within the rounding bound, with the
    tower's FSDP unit summing its ranks' shares (set_gradient_divide_factor(1.0))."""
    run_two_ranks(__file__, tmp_path, timeout=600, QVL_TEST_RANKS="data")
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        got, expected, truth = results["got"], results["expected"], results["truth"]
        assert sorted(got) == sorted(expected) and any(key.startswith("model.visual.") for key in got)
        for key in got:
            assert_error_within(
                got[key], truth[key], expected[key], what=f"rank {rank} data mode + FSDP2: {key}", stages=MODEL_STAGES
            )


if __name__ == "__main__":
    import os

    from ranks import run_rank

    run_rank({"fsdp": _fsdp_rank, "data": _data_mode_rank}[os.environ.get("QVL_TEST_RANKS", "fsdp")])
