"""qvl.vit.layers' patch_merger and vision_mlp against transformers' Qwen3-VL modules, sharded, compiled.

The helpers run qvl's ops on the device's default path (the Triton interpreter on CPU, compiled Triton on a
GPU) and on the torch path (the ``backend`` fixture). Each result is held to the suite's rule
(tests/tolerance.py): its error against a float64 copy of the transformers module is at most twice the
module's own error in the same dtype, plus two units of the dtype's resolution at the output's scale.
"""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3VLVisionConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionMLP, Qwen3VLVisionPatchMerger

from conftest import norm_params
from qvl.vit.layers import patch_merger, vision_mlp
from tolerance import assert_error_within
from towers import float64_copy

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# The tanh GELU's exp2 overflows to inf for large negative inputs by design (the result is then -0);
# numpy, under the interpreter, warns about it.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")


def tiny_config() -> Qwen3VLVisionConfig:
    return Qwen3VLVisionConfig(hidden_size=72, out_hidden_size=96, intermediate_size=128, num_heads=4, depth=1)


def randomized(module: torch.nn.Module, dtype, device) -> torch.nn.Module:
    """Random norm parameters too (their init is 1 and 0); linears keep their random init."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name == "norm.weight":
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
            elif name == "norm.bias":
                param.copy_(0.2 * torch.randn_like(param))
    return module.to(device=device, dtype=dtype).eval()


def merger_args(module: Qwen3VLVisionPatchMerger) -> tuple[torch.Tensor, ...]:
    return (
        module.norm.weight, module.norm.bias,
        module.linear_fc1.weight, module.linear_fc1.bias,
        module.linear_fc2.weight, module.linear_fc2.bias,
    )  # fmt: skip


def mlp_args(module: Qwen3VLVisionMLP) -> tuple[torch.Tensor, ...]:
    return module.linear_fc1.weight, module.linear_fc1.bias, module.linear_fc2.weight, module.linear_fc2.bias


@pytest.mark.parametrize("postshuffle_norm", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_patch_merger_matches_transformers(dtype, postshuffle_norm, backend, device):
    torch.manual_seed(5)
    module = randomized(Qwen3VLVisionPatchMerger(tiny_config(), use_postshuffle_norm=postshuffle_norm), dtype, device)
    x = (torch.randn(256, 72, device=device) * 2 + 0.5).to(dtype)
    with torch.no_grad():
        eager = module(x)
        truth = float64_copy(module)(x.double())
        out = patch_merger(x, *merger_args(module), spatial_merge_size=2, postshuffle_norm=postshuffle_norm)
    assert out.shape == (64, 96) and out.dtype == dtype
    assert_error_within(out, truth, eager, what="patch_merger")


@pytest.mark.parametrize("dtype", DTYPES)
def test_vision_mlp_matches_transformers(dtype, backend, device):
    torch.manual_seed(6)
    module = randomized(Qwen3VLVisionMLP(tiny_config()), dtype, device)
    x = (torch.randn(200, 72, device=device) * 2).to(dtype)
    with torch.no_grad():
        eager = module(x)
        truth = float64_copy(module)(x.double())
        out = vision_mlp(x, *mlp_args(module))
    assert out.shape == (200, 72) and out.dtype == dtype
    assert_error_within(out, truth, eager, what="vision_mlp")


def test_tensor_parallel_shards(device):
    """Two simulated ranks: fc1 split by output features, fc2 by input features, one all-reduce of the
    partial fc2 products, fc2's bias added once; every rank then holds the unsharded result (up to the
    rounding of the split sums, which the tolerance rule measures against the unsharded modules')."""
    torch.manual_seed(7)
    config = tiny_config()
    merger = randomized(Qwen3VLVisionPatchMerger(config), torch.float32, device)
    mlp = randomized(Qwen3VLVisionMLP(config), torch.float32, device)
    x = torch.randn(64, 72, device=device)

    def run_sharded(forward, args, fc1_index, fc2_index, hidden):
        shards = [slice(0, hidden // 2), slice(hidden // 2, hidden)]

        def shard_args(s):
            sharded = list(args)
            sharded[fc1_index] = args[fc1_index][s]
            sharded[fc1_index + 1] = args[fc1_index + 1][s]
            sharded[fc2_index] = args[fc2_index][:, s]
            return sharded

        partials = []
        for s in shards:
            forward(x, *shard_args(s), all_reduce=lambda t: partials.append(t) or t)
        total = partials[0] + partials[1]
        return [forward(x, *shard_args(s), all_reduce=lambda t: total) for s in shards]

    with torch.no_grad():
        merger_outs = run_sharded(patch_merger, merger_args(merger), 2, 4, 288)
        mlp_outs = run_sharded(vision_mlp, mlp_args(mlp), 0, 2, 128)
        for module, outs in ((merger, merger_outs), (mlp, mlp_outs)):
            truth, eager = float64_copy(module)(x.double()), module(x)
            for rank, out in enumerate(outs):
                assert_error_within(out, truth, eager, what=f"{type(module).__name__} on rank {rank}")


def test_compile_dynamic_rows_no_recompile(device):
    torch.manual_seed(9)
    config = tiny_config()
    merger = randomized(Qwen3VLVisionPatchMerger(config), torch.float32, device)
    mlp = randomized(Qwen3VLVisionMLP(config), torch.float32, device)
    weight, bias = norm_params(72, torch.float32, device)

    def block_tail(x, attn_out):
        h, normed = torch.ops.qvl.add_layer_norm(x, attn_out, weight, bias, 1e-6)
        h = h + vision_mlp(normed, *mlp_args(mlp))
        merged = patch_merger(torch.ops.qvl.layer_norm(h, weight, bias), *merger_args(merger))
        return h, merged

    def block_tail_in_torch(x, attn_out, mlp, merger):
        """``block_tail`` in torch ops and transformers' modules: in fp32 torch's own result, on float64
        inputs and module copies the ground truth."""
        w, b = weight.to(x.dtype), bias.to(x.dtype)
        h = x + attn_out
        h = h + mlp(F.layer_norm(h, (72,), w, b, 1e-6))
        return h, merger(F.layer_norm(h, (72,), w, b, 1e-6))

    torch._dynamo.reset()
    compiled = torch.compile(block_tail, fullgraph=True, dynamic=True)
    mlp64, merger64 = float64_copy(mlp), float64_copy(merger)
    with torch.no_grad():
        for rows in (64, 96):
            stance = torch.compiler.set_stance("fail_on_recompile") if rows != 64 else contextlib.nullcontext()
            x, attn_out = torch.randn(rows, 72, device=device), torch.randn(rows, 72, device=device)
            with stance:
                got = compiled(x, attn_out)
            truth = block_tail_in_torch(x.double(), attn_out.double(), mlp64, merger64)
            assert_error_within(got, truth, block_tail_in_torch(x, attn_out, mlp, merger), what=f"{rows} rows")


def test_merger_rows_must_fill_merge_blocks(argument_check_inputs):
    x, w, b = (argument_check_inputs[name] for name in ("x", "w", "b"))
    with pytest.raises(ValueError, match="divisible by spatial_merge"):
        patch_merger(x[:6], w, b, w, w, w, w)


def test_a_layer_norm_without_bias_stays_a_layer_norm(backend, device):
    """The runner reads norms off the modules and runs RMSNorm where a norm has no bias: torch's
    ``LayerNorm(bias=False)`` must still subtract its mean."""
    from qvl.vit.runner import _norm

    norm = torch.nn.LayerNorm(40, bias=False, device=device)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(12, 40, device=device) + 3.0
    with torch.no_grad():
        got = _norm(norm, x)
        truth = F.layer_norm(x.double(), (40,), norm.weight.double(), None, norm.eps)
        assert_error_within(got, truth, norm(x), what="LayerNorm(bias=False)")
