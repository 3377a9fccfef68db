"""qvl's out-of-tree MMEncoderAttention (qvl.vit.engines.vllm.attention), in process, against vLLM's own layer (its
SDPA path, the CPU backend) and a float64 run of that layer; its fallbacks; its compiled form."""

import contextlib

import pytest
import torch
from vllm.config import set_current_vllm_config
from vllm.model_executor.layers.attention.mm_encoder_attention import MMEncoderAttention

from inprocess import vllm_world
from qvl.kernels import verify
from qvl.kernels.common import device_target, force_backend
from qvl.vit.engines.vllm import routes as vllm_routes
from qvl.vit.engines.vllm.attention import QvlEncoderAttention
from towers import cu_seqlens_of

# Segment lengths with an empty one, one of a single token and one over a 64-key block.
LENGTHS = [5, 0, 1, 70, 20]


def layers(num_heads, head_size, dtype, num_kv_heads=None):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with set_current_vllm_config(vllm_world()):
            args = dict(num_heads=num_heads, head_size=head_size, scale=head_size**-0.5, num_kv_heads=num_kv_heads)
            return QvlEncoderAttention(**args), MMEncoderAttention(**args)
    finally:
        torch.set_default_dtype(previous)


def vllm_qkv(num_tokens, num_heads, head_size, dtype, batch=1, seed=0):
    """q, k, v as vLLM's Qwen2.5-VL/Qwen3-VL attention hands them over: views of one packed
    ``(batch, seq, 3, heads, head_size)`` projection (v is not contiguous)."""
    generator = torch.Generator().manual_seed(seed)
    qkv = torch.randn(batch, num_tokens, 3, num_heads, head_size, generator=generator).to(dtype)
    return qkv.unbind(2)


def assert_close(out, truth, baseline, q, k, cu_seqlens, what, max_seqlen=None):
    """The checks' rule (qvl.kernels.verify: the tolerance rule per segment, with the online softmax's fp32
    roundings for the kernel's key block), vLLM's own layer giving the float64 truth and the baseline in the dtype.
    Every tensor is read as ``(T, H, D)``, the tokens of ``cu_seqlens``; ``max_seqlen``: the op's tile hint."""
    q, k = (x.reshape(-1, *x.shape[-2:]) for x in (q, k))
    out, truth, baseline = (x.reshape(q.shape) for x in (out, truth, baseline))
    block_n = verify.key_block(q.shape[-1], q.dtype, device_target(q.device), max_seqlen)
    logits = verify.max_abs_logits(q, k, cu_seqlens)
    for comparison in verify.attention_comparisons(out, truth, baseline, cu_seqlens, block_n, logits, what):
        assert comparison.passed, comparison.message()


@pytest.mark.parametrize(
    "dtype,head_size", [(torch.float32, 72), (torch.float16, 80), (torch.bfloat16, 72), (torch.float32, 16)]
)
def test_matches_vllm_and_float64(dtype, head_size):
    """Every dtype runs the Triton kernel through the interpreter."""
    qvl_layer, vllm_layer = layers(2, head_size, dtype)
    assert qvl_layer.qvl_fallback_reason is None
    q, k, v = vllm_qkv(sum(LENGTHS), 2, head_size, dtype)
    cu_seqlens = cu_seqlens_of(LENGTHS)
    truth = vllm_layer(q.double(), k.double(), v.double(), cu_seqlens=cu_seqlens)
    baseline = vllm_layer(q, k, v, cu_seqlens=cu_seqlens)
    before = vllm_routes.route_counts()["attention"]
    out = qvl_layer(query=q, key=k, value=v, cu_seqlens=cu_seqlens, max_seqlen=torch.tensor(70))
    assert vllm_routes.route_counts()["attention"] == before + 1
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, truth, baseline, q, k, cu_seqlens, what=f"{dtype} D={head_size}")


def test_batched_hidden_layout_without_cu_seqlens():
    """``(batch, seq, heads * head_size)`` inputs without cu_seqlens (SigLIP-style towers): each sequence
    attends over itself, one varlen call for the whole batch."""
    qvl_layer, vllm_layer = layers(2, 64, torch.float32)
    q, k, v = (t.flatten(2).contiguous() for t in vllm_qkv(24, 2, 64, torch.float32, batch=3, seed=1))
    before = vllm_routes.route_counts()["attention"]
    out = qvl_layer(q, k, v)
    assert vllm_routes.route_counts()["attention"] == before + 1  # on qvl's op, not vLLM's forward
    truth = vllm_layer(q.double(), k.double(), v.double())
    assert out.shape == q.shape
    baseline = vllm_layer(q, k, v)
    tokens = [t.view(3 * 24, 2, 64) for t in (q, k)]
    assert_close(out, truth, baseline, *tokens, cu_seqlens_of([24] * 3), "batched")


@pytest.mark.parametrize(
    "num_heads,head_size,num_kv_heads,reason",
    [(4, 64, 2, "fewer heads"), (2, 288, None, "head size 288")],
)
def test_layers_qvl_does_not_cover_run_vllm_forward(num_heads, head_size, num_kv_heads, reason):
    qvl_layer, vllm_layer = layers(num_heads, head_size, torch.float32, num_kv_heads)
    assert reason in qvl_layer.qvl_fallback_reason
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(1, 12, num_heads, head_size, generator=generator)
    k, v = (torch.randn(1, 12, num_kv_heads or num_heads, head_size, generator=generator) for _ in range(2))
    cu_seqlens = cu_seqlens_of([5, 7])
    before = vllm_routes.route_counts()
    out = qvl_layer(q, k, v, cu_seqlens=cu_seqlens)
    assert torch.equal(out, vllm_layer(q, k, v, cu_seqlens=cu_seqlens))
    after = vllm_routes.route_counts()
    assert (after["attention_fallback"], after["attention"]) == (before["attention_fallback"] + 1, before["attention"])


def test_cross_attention_call_runs_vllm_forward():
    qvl_layer, vllm_layer = layers(2, 64, torch.float32)
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(2, 6, 2, 64, generator=generator)
    k, v = (torch.randn(2, 9, 2, 64, generator=generator) for _ in range(2))
    assert torch.equal(qvl_layer(q, k, v), vllm_layer(q, k, v))


def test_compiles_whole_without_recompiles():
    """vLLM compiles encoder blocks with the token dim dynamic (``compile_mm_encoder``): the layer traces into
    one graph (the op is opaque, with a fake implementation) and serves other lengths without recompiling."""
    qvl_layer, vllm_layer = layers(2, 72, torch.float32)
    compiled = torch.compile(qvl_layer, fullgraph=True, dynamic=True)
    torch._dynamo.reset()
    for index, lengths in enumerate([LENGTHS, [9, 30], [3]]):
        q, k, v = vllm_qkv(sum(lengths), 2, 72, torch.float32, seed=index)
        cu_seqlens = cu_seqlens_of(lengths)
        for tensor in (q, k, v, cu_seqlens):
            torch._dynamo.mark_dynamic(tensor, tensor.dim() - 1 if tensor is cu_seqlens else 1)
        stance = torch.compiler.set_stance("fail_on_recompile") if index else contextlib.nullcontext()
        with stance, force_backend("torch"):
            out = compiled(q, k, v, cu_seqlens=cu_seqlens)
        truth = vllm_layer(q.double(), k.double(), v.double(), cu_seqlens=cu_seqlens)
        assert_close(out, truth, vllm_layer(q, k, v, cu_seqlens=cu_seqlens), q, k, cu_seqlens, f"compiled {lengths}")


def test_vllm_max_seqlen_becomes_the_tile_hint():
    """Qwen2.5-VL's windows with vLLM's CPU-side max_seqlen (its flash backends fill it): the op gets it as its
    tile hint (64-token windows run on 64-row tiles) and the result is unchanged by the tolerance rule."""
    from qvl.vit.engines.routes import host_tile_hint

    assert host_tile_hint(torch.tensor(64, dtype=torch.int32), tracing=False) == 64
    assert host_tile_hint(torch.tensor(0), tracing=False) is None  # vLLM's CPU backend leaves it 0
    assert host_tile_hint(torch.tensor(64), tracing=True) is None
    assert host_tile_hint(64, tracing=True) == 64 and host_tile_hint(0, tracing=False) is None
    windows = [64, 16, 0, 48, 1, 64]
    qvl_layer, vllm_layer = layers(2, 80, torch.float16)
    q, k, v = vllm_qkv(sum(windows), 2, 80, torch.float16, seed=5)
    cu_seqlens = cu_seqlens_of(windows)
    out = qvl_layer(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=torch.tensor(64, dtype=torch.int32))
    truth = vllm_layer(q.double(), k.double(), v.double(), cu_seqlens=cu_seqlens)
    assert_close(out, truth, vllm_layer(q, k, v, cu_seqlens=cu_seqlens), q, k, cu_seqlens, "windows", 64)
