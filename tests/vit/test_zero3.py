"""A patched tower trained under DeepSpeed ZeRO-3 (two gloo ranks on CPU, ``DS_ACCELERATOR=cpu``): parameters
partitioned and gathered per module call, gradients equal to the unpatched, unsharded model's."""

from __future__ import annotations

import copy
import importlib.util

import torch
from test_hf_patch import GRID, TINY_VISION, float64_run
from test_training import tower_loss
from test_training import vision_gradients as gradients

from qvl.kernels import force_backend
from qvl.vit import patch_model
from ranks import run_two_ranks
from tolerance import assert_error_within
from towers import MODEL_STAGES, hf_vision_model, pixel_values_for

# Only the ranks import DeepSpeed (it probes the machine's accelerator on import). The test extra installs it: a
# missing one is a broken environment, not a reason to skip.
assert importlib.util.find_spec("deepspeed") is not None, "DeepSpeed is not installed (pip install -e '.[test]')"

# Every parameter partitioned (no persistence threshold): the norms too, which qvl reads inside their block's call.
ZERO3 = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "zero_allow_untested_optimizer": True,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}


def _zero3_rank(out_dir: str) -> None:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_grad
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    deepspeed.init_distributed(dist_backend="gloo")
    hf = hf_vision_model(seed=70, **TINY_VISION).train()
    pixels = pixel_values_for(GRID, seed=71)
    results = {
        "expected": gradients(hf, pixels, GRID),
        "truth": float64_run(hf, lambda model: gradients(model, pixels, GRID)),
    }
    config = {**ZERO3, "train_batch_size": dist.get_world_size()}
    for case in ("deepspeed.initialize", "zero.Init"):
        if case == "zero.Init":  # partitioned as it is built, then given hf's weights
            with deepspeed.zero.Init(config_dict_or_path=config):
                model = Qwen3VLVisionModel(hf.config)
            with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0), torch.no_grad():
                for name, parameter in model.named_parameters():
                    parameter.copy_(hf.get_parameter(name))
            model.train()
        else:
            model = copy.deepcopy(hf)
        patch_model(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        with force_backend("torch"):
            output = engine(pixels, grid_thw=torch.tensor(GRID))
            engine.backward(tower_loss(output.pooler_output, output.deepstack_features))
        resident = [name for name, p in model.named_parameters() if p.numel() > 0]
        results[case] = ({name: safe_get_full_grad(p) for name, p in model.named_parameters()}, resident)
    torch.save(results, f"{out_dir}/rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


def test_zero3_trains_the_patched_tower(tmp_path):
    """ZeRO-3 (after deepspeed.initialize, and with the tower built under zero.Init) holds every parameter of the
    tower as an empty placeholder between module calls; qvl's patched tower calls the modules, so ZeRO gathers
    each for its call, and the vision gradients are the unpatched, unsharded model's within the suite's rounding
    bound (every parameter's; the pixel values' gradient is not compared)."""
    run_two_ranks(__file__, tmp_path, timeout=600, DS_ACCELERATOR="cpu")
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        expected, truth = results.pop("expected"), results.pop("truth")
        for case, (got, resident) in results.items():
            assert resident == [], f"{case}: ZeRO-3 kept these gathered after the step: {resident}"
            assert sorted(got) == sorted(expected.keys() - {"pixels"}), case
            for key in got:
                assert_error_within(
                    got[key], truth[key], expected[key], what=f"rank {rank} {case}: {key}", stages=MODEL_STAGES
                )


if __name__ == "__main__":
    from ranks import run_rank

    run_rank(_zero3_rank)
