"""The ops' torch path (qvl.kernels.torch_path), what a CPU outside Triton's interpreter runs: attention through
torch's fused SDPA per run of equal-length segments, the rotary once per q and k, held to the suite's rule against
float64; memory O(S); traced by torch.compile with no graph break and no recompile as sizes change."""

import sys
from pathlib import Path

import pytest
import torch
from test_attention import assert_close_to_float64, cu_seqlens_of, packed_qkv

from qvl.kernels import force_backend, ops_for, rotary_2d_reference, torch_path
from qvl.kernels.attention import equal_length_runs
from qvl.kernels.common import backend_for

# bench/ is a plain directory run from the repository root, not an installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.harness import peak_tensor_bytes  # noqa: E402

# Two runs of equal lengths (a video's frames, same-size images), empty segments among them, lone ones around.
LENGTHS = [5, 16, 16, 16, 0, 33, 33, 0, 1, 64]


def test_equal_length_runs():
    bounds = cu_seqlens_of(LENGTHS).tolist()
    assert equal_length_runs(bounds) == [(0, 5, 1), (5, 16, 3), (53, 33, 2), (119, 1, 1), (120, 64, 1)]
    assert equal_length_runs([0]) == [] and equal_length_runs([0, 0, 0]) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rotary", [False, True])
def test_attention_matches_float64(dtype, rotary):
    q, k, v = packed_qkv(sum(LENGTHS), 2, 72, dtype, seed=3)
    cu = cu_seqlens_of(LENGTHS)
    positions = torch.randint(0, 40, (sum(LENGTHS), 2), dtype=torch.int32) if rotary else None
    with force_backend("torch"):
        out = torch.ops.qvl.vision_attn(q, k, v, cu, positions=positions)
    assert_close_to_float64(out, q, k, v, cu, positions=positions)


def test_segments_stay_apart_in_a_run():
    """Segments batched into one SDPA call still attend only to themselves: changing one leaves the others'
    outputs bit-identical."""
    q, k, v = (x.contiguous() for x in packed_qkv(48, 2, 64, torch.float32, seed=5))
    cu = cu_seqlens_of([16, 16, 16])
    with force_backend("torch"):
        before = torch.ops.qvl.vision_attn(q, k, v, cu)
        k[16:32] += 4.0
        v[16:32] *= -2.0
        after = torch.ops.qvl.vision_attn(q, k, v, cu)
    assert torch.equal(before[:16], after[:16]) and torch.equal(before[32:], after[32:])
    assert not torch.equal(before[16:32], after[16:32])


def test_empty_batches():
    q, k, v = packed_qkv(0, 2, 64, torch.float32)
    with force_backend("torch"):
        assert torch.ops.qvl.vision_attn(q, k, v, cu_seqlens_of([])).shape == (0, 2, 64)
        assert torch.ops.qvl.vision_attn(q, k, v, cu_seqlens_of([0, 0])).shape == (0, 2, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_equals_the_reference_bit_for_bit(dtype):
    """The same fp32 arithmetic as the reference, in fewer passes: equal by construction, forward and inverse."""
    q, k, _ = packed_qkv(40, 3, 72, dtype, seed=9)
    positions = torch.randint(0, 30, (40, 2), dtype=torch.int32)
    for inverse in (False, True):
        expected = rotary_2d_reference(q, k, positions, inverse=inverse)
        got = torch_path.rotary_2d(q, k, positions, inverse=inverse)
        assert all(torch.equal(g, e) and g.is_contiguous() for g, e in zip(got, expected, strict=True))
        q_rot, k_by_head = torch_path.rotary_2d(q, k, positions, inverse=inverse, k_head_major=True)
        assert torch.equal(q_rot, expected[0]) and torch.equal(k_by_head, expected[1])
        assert q_rot.is_contiguous() and k_by_head.transpose(0, 1).is_contiguous()


@pytest.mark.parametrize("rotary", [False, True])
def test_attention_reads_keys_and_values_head_major(monkeypatch, rotary):
    """k and v reach torch's attention as views of head-major tensors (each head's rows adjacent, the layout its CPU
    kernel sweeps fastest), per run of equal-length segments; q goes as given (rotated: contiguous), so the output
    comes back token-major without a copy; k and v already head-major are not copied again."""
    import qvl.kernels.attention.forward as forward

    layouts, sdpa = [], forward.F.scaled_dot_product_attention

    def recording(q, k, v, **kwargs):
        # A dim of size 1 has no meaningful stride.
        strides = [tuple(st if n > 1 else None for n, st in zip(x.shape, x.stride(), strict=True)) for x in (q, k, v)]
        layouts.append((strides, [x.untyped_storage().data_ptr() for x in (q, k, v)]))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(forward.F, "scaled_dot_product_attention", recording)
    q, k, v = packed_qkv(sum(LENGTHS), 2, 72, torch.float32, seed=4)
    positions = torch.randint(0, 40, (sum(LENGTHS), 2), dtype=torch.int32) if rotary else None
    with force_backend("torch"):
        out = torch.ops.qvl.vision_attn(q, k, v, cu_seqlens_of(LENGTHS), positions=positions)
    assert out.is_contiguous()
    tokens, runs = sum(LENGTHS), equal_length_runs(cu_seqlens_of(LENGTHS).tolist())
    for (_, length, _), (strides, _) in zip(runs, layouts, strict=True):
        rows = 72 if length > 1 else None
        # (segments, heads, rows, head dim): k and v rows 72 apart, heads a whole (tokens, 72) block apart.
        assert strides[1][1:] == strides[2][1:] == (tokens * 72, rows, 1), length
        q_rows = (2 if rotary else 6) * 72 if length > 1 else None
        assert strides[0][1:] == (72, q_rows, 1), length
    k_by_head, v_by_head = (x.transpose(0, 1).contiguous().transpose(0, 1) for x in (k, v))
    layouts.clear()
    with force_backend("torch"):
        torch.ops.qvl.vision_attn(q, k_by_head, v_by_head, cu_seqlens_of(LENGTHS))
    assert layouts[0][1][1:] == [x.untyped_storage().data_ptr() for x in (k_by_head, v_by_head)]


def test_attention_memory_grows_linearly():
    """One 4,096-token segment: the reference would hold 2 x 4096^2 fp32 logits (128 MiB); the torch path holds the
    output and SDPA's per-thread blocks, far below a quarter of that."""
    q, k, v = packed_qkv(4096, 2, 64, torch.float32, seed=11)
    cu = cu_seqlens_of([4096])
    with force_backend("torch"), torch.no_grad():
        peak = peak_tensor_bytes(lambda: torch.ops.qvl.vision_attn(q, k, v, cu), "cpu")
    logits = 2 * 4096 * 4096 * 4
    assert peak < logits / 4, (peak, logits)


def test_ops_for_follows_the_path_and_grad_mode():
    """Plain torch for inference on the torch path; the custom ops (fp32 backward formulas) under grad mode and on
    every other path."""
    cpu = torch.device("cpu")
    with force_backend("torch"):
        with torch.no_grad():
            assert ops_for(cpu) is torch_path
        with torch.enable_grad():
            assert ops_for(cpu) is torch.ops.qvl
    with force_backend("reference"), torch.no_grad():
        assert ops_for(cpu) is torch.ops.qvl and backend_for(cpu) == "reference"


def test_compiles_without_graph_breaks_or_recompiles():
    """A block's attention half on the torch path, traced whole (fullgraph) with the token count dynamic: other
    segment layouts reuse the graph (fail_on_recompile) and give the eager torch path's bits (the traced graph runs
    the same aten kernels; attention stays the custom op). The erf GELU: traced, the tanh one takes another form
    (test_gelu.py::test_torch_path_tanh_gelu_compiled)."""
    weight, bias = torch.randn(128), torch.randn(128)

    def block_half(x, cu, positions):
        ops = ops_for(x.device)
        h = ops.layer_norm(x, weight, bias, 1e-6)
        q = k = v = h.view(h.shape[0], 2, 64)
        a = ops.vision_attn(q, k, v, cu, positions=positions)
        out = a.flatten(1) @ torch.eye(128)
        ops.bias_gelu_(out, bias, "none")
        return out

    compiled = torch.compile(block_half, fullgraph=True, dynamic=True, backend="aot_eager")
    with force_backend("torch"), torch.no_grad():
        for index, lengths in enumerate(([24, 24], [7, 0, 30, 30, 30], [100])):
            x = torch.randn(sum(lengths), 128)
            cu = cu_seqlens_of(lengths)
            positions = torch.randint(0, 12, (sum(lengths), 2), dtype=torch.int32)
            with torch.compiler.set_stance("fail_on_recompile" if index else "default"):
                got = compiled(x, cu, positions)
            assert torch.equal(got, block_half(x, cu, positions)), lengths
