"""The attention kernels with every floating-point tensor they read or write inside NaN guard bands
(tests/guards.py): q, k, v, the output, the log-sum-exp, the output's gradient and dq, dk, dv are views into
NaN-filled buffers with rows of their own stride, so a load outside a tensor, a lane used without its mask, or a
row stepped with another tensor's stride turns the interpreter's result into NaN, and a stray store shows in a
band. On a GPU a read outside an allocation faults or returns garbage; the interpreter forgives it (masked lanes
read as 0, no address faults), which is how a wrong head-dim tail passed here once and failed on an H200.

Segments end inside key and query blocks ([1, 100, 64, 0, 33]: every tile class of 64- and 128-row tiles), head
dims 72 (a tail sharing 8 columns with the main tile), 80 (a tail flush with the main tile) and 24 (one tile wider
than the head), 72 and 80 in the split32 head-dim layout (32-wide tails sharing 24 and 16 columns with the main
tile) and in the padded one (one 128-wide tile, the fallback of a device run), pointer and TMA-descriptor loads,
with and without the fused rotary.
"""

import pytest
import torch
from test_attention import assert_close_to_float64, cu_seqlens_of
from test_attention_backward import assert_gradients_close_to_float64

from conftest import ON_GPU
from guards import LAYOUTS, assert_clean, guarded, guarded_empty, layout_pads
from qvl.kernels.attention import head_dim_tiles, tma_capable, vision_attn_backward_launches, vision_attn_launches
from qvl.kernels.common import device_target, run_launches

LENGTHS = [1, 100, 64, 0, 33]


def guarded_inputs(head_dim, dtype, layout, with_positions, seed, device):
    """q, k, v and the output's gradient as guarded views, each with a row stride of its own; positions or None."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(LENGTHS)
    pads = layout_pads(layout, dtype)
    values = torch.randn(4, num_tokens, 2, head_dim, generator=gen).to(device, dtype)
    q, k, v, grad_out = (guarded(x, pad=next(pads)) for x in values)
    positions = None
    if with_positions:
        positions = torch.randint(0, 30, (num_tokens, 2), generator=gen, dtype=torch.int32).to(device)
    return (q, k, v, grad_out, positions), pads


@pytest.mark.parametrize("descriptors", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("with_positions", [False, True], ids=["plain", "rope"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "head_dim, head_dim_layout",
    [(72, "split"), (80, "split"), (24, "split"), (72, "split32"), (80, "split32"), (72, "padded"), (80, "padded")],
)
def test_forward_and_backward_inside_guard_bands(
    head_dim, head_dim_layout, layout, with_positions, descriptors, device, use_head_dim_layout
):
    """fp16 in the interpreter, which multiplies bf16 dots wrongly; bf16 on a GPU, the towers' dtype."""
    use_head_dim_layout(head_dim_layout)
    dtype = torch.bfloat16 if ON_GPU else torch.float16
    (q, k, v, grad_out, positions), pads = guarded_inputs(head_dim, dtype, layout, with_positions, head_dim, device)
    cu = cu_seqlens_of(LENGTHS, device)
    target = device_target(q.device)
    out = guarded_empty(q.shape, dtype, device, pad=next(pads))
    lse = guarded_empty((q.shape[1] * q.shape[0],), torch.float32, device, pad=next(pads))
    launches = vision_attn_launches(
        q, k, v, out, cu, None, positions, 10000.0, target, max(LENGTHS), lse, tiles={"DESCRIPTORS": descriptors}
    )
    # TMA needs every K and V row on a 16-byte boundary (the unaligned layout takes pointers whatever is asked) and a
    # target that has it.
    assert launches[-1].kwargs["DESCRIPTORS"] == (descriptors and layout == "aligned" and tma_capable(target))
    assert (launches[-1].kwargs["D_MAIN"], launches[-1].kwargs["D_TAIL"]) == head_dim_tiles(head_dim, head_dim_layout)
    run_launches(launches, q.device)
    assert_clean(q, k, v, out, lse)
    assert_close_to_float64(out.contiguous(), q, k, v, cu, positions=positions, max_seqlen=max(LENGTHS))

    dq, dk, dv = (guarded_empty(q.shape, dtype, device, pad=next(pads)) for _ in range(3))
    backward = vision_attn_backward_launches(
        grad_out, q, k, v, out, lse, dq, dk, dv, cu, None, positions, 10000.0, target, max(LENGTHS)
    )
    tilings = {(launch.kwargs["D_MAIN"], launch.kwargs["D_TAIL"]) for launch in backward if "D_MAIN" in launch.kwargs}
    assert tilings == {head_dim_tiles(head_dim, head_dim_layout)}
    run_launches(backward, q.device)
    assert_clean(q, k, v, out, lse, grad_out, dq, dk, dv)
    grads = tuple(g.contiguous() for g in (dq, dk, dv))
    assert_gradients_close_to_float64(grads, q, k, v, cu, grad_out, positions=positions)
