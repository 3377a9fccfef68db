"""vision_attn's TMA descriptor loads of K and V and the tile table that chooses them (launch_config).

Triton's interpreter emulates tensor descriptors, zero fill included, so the descriptor path runs here on the
pointer path's cases: against float64 with the suite's rule (tests/tolerance.py), bit for bit against the
pointer path, and falling back to pointers where TMA cannot address a layout or the target has no TMA.
"""

import json
import re

import pytest
import test_attention
import torch
from test_attention import assert_close_to_float64, cu_seqlens_of, packed_qkv
from test_attention_layouts import CU_SEQLENS, odd_head_stride, offset_base, one_misaligned, packed, positions_for

import qvl.kernels.attention as attention
from conftest import ON_GPU
from qvl.kernels import verify
from qvl.kernels.common import ADA, HOPPER, INTERPRETER, run_launches, triton_interpreting

# These launch kernels on CPU tensors for the interpreter's target: a GPU run (TRITON_INTERPRET=0) has the CUDA
# test below instead.
interpreter_only = pytest.mark.skipif(not triton_interpreting(), reason="runs kernels through the interpreter")


@pytest.fixture
def descriptor_loads(monkeypatch, fresh_attention_plans):
    """Every attention launch asks for descriptor loads, as a tile-table entry would; yields the DESCRIPTORS
    flag each attention launch ended up with."""
    heuristic = attention.launch_config
    monkeypatch.setattr(attention.config, "launch_config", lambda *args: {**heuristic(*args), "DESCRIPTORS": True})
    build = attention.vision_attn_launches
    flags = []

    def recording(*args, **kwargs):
        launches = build(*args, **kwargs)
        flags.extend(
            launch.kwargs["DESCRIPTORS"]
            for launch in launches
            if launch.kernel is attention.forward._vision_attn_kernel
        )
        return launches

    monkeypatch.setattr(attention.forward, "vision_attn_launches", recording)
    return flags


def run_attention(q, k, v, cu_seqlens, tiles, positions=None, target=INTERPRETER, max_seqlen=None):
    """The attention output and log-sum-exp of one launch list with ``tiles`` overriding launch_config."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[0] * q.shape[1], dtype=torch.float32, device=q.device)
    launches = attention.vision_attn_launches(
        q, k, v, out, cu_seqlens, None, positions, 10000.0, target, max_seqlen, lse, tiles
    )
    run_launches(launches, q.device)
    return out, lse, launches[-1].kwargs["DESCRIPTORS"]


@interpreter_only
@pytest.mark.parametrize(
    "head_dim, dtype", [(64, torch.float16), (72, torch.float16), (80, torch.float32), (96, torch.float16)]
)
def test_boundary_lengths(descriptor_loads, head_dim, dtype):
    test_attention.test_boundary_lengths(head_dim, dtype)
    assert descriptor_loads and all(descriptor_loads)


@interpreter_only
@pytest.mark.parametrize("head_dim", [8, 100, 136])
def test_unusual_head_dims(descriptor_loads, head_dim):
    """Heads narrower than the 16-wide main box (the box's columns past D read as zeros) and wider ones."""
    test_attention.test_unusual_head_dims(head_dim)
    assert descriptor_loads and all(descriptor_loads)


@interpreter_only
@pytest.mark.parametrize(
    "head_dim, dtype, rope, block",
    [(72, torch.float16, True, (128, 64)), (80, torch.float32, False, (32, 16)), (64, torch.float16, False, (64, 128))],
)
def test_descriptors_change_no_bit(head_dim, dtype, rope, block):
    """Same tiles, same arithmetic: only where K and V come from differs, so output and log-sum-exp are equal."""
    lengths = [1, 70, 0, 129, 16]
    q, k, v = packed_qkv(sum(lengths), 2, head_dim, dtype, seed=head_dim)
    cu = cu_seqlens_of(lengths)
    positions = torch.randint(0, 30, (sum(lengths), 2), dtype=torch.int32) if rope else None
    tiles = dict(BLOCK_M=block[0], BLOCK_N=block[1])
    pointer_out, pointer_lse, pointers_used = run_attention(q, k, v, cu, {**tiles, "DESCRIPTORS": False}, positions)
    out, lse, descriptors_used = run_attention(q, k, v, cu, {**tiles, "DESCRIPTORS": True}, positions)
    assert descriptors_used and not pointers_used
    assert torch.equal(out, pointer_out) and torch.equal(lse, pointer_lse)
    assert_close_to_float64(out, q, k, v, cu, positions=positions)


@interpreter_only
def test_bf16_packed_qkv_with_rope():
    q, k, v = packed(72, torch.bfloat16, seed=12)
    positions = positions_for(True)
    pointer_out, _, _ = run_attention(q, k, v, CU_SEQLENS, {"DESCRIPTORS": False}, positions)
    out, _, used = run_attention(q, k, v, CU_SEQLENS, {"DESCRIPTORS": True}, positions)
    assert used and torch.equal(out, pointer_out)


@interpreter_only
@pytest.mark.parametrize("layout", [offset_base, odd_head_stride, one_misaligned])
def test_layouts_tma_cannot_address_take_pointers(descriptor_loads, layout):
    """TMA needs 16-byte aligned bases and strides: other layouts load through pointers, correctly."""
    q, k, v = layout(72, torch.float16, seed=3)
    out = torch.ops.qvl.vision_attn(q, k, v, CU_SEQLENS)
    assert descriptor_loads == [False]
    assert_close_to_float64(out, q, k, v, CU_SEQLENS)


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU with TMA (sm_90+)")
@pytest.mark.parametrize("head_dim", [72, 80])
@pytest.mark.parametrize("attention_case", [pytest.param(c, id=c.name) for c in verify.ATTENTION_CASES])
def test_cuda_descriptor_loads_in_bf16(attention_case, head_dim):
    """On the device: descriptor loads give the pointer path's bits, both within the float64 bound, with rope, on
    the GPU cases (qvl.kernels.verify.ATTENTION_CASES)."""
    from qvl.kernels.common import device_target

    target = device_target(torch.device("cuda"))
    if target.arch < 90:
        pytest.skip(f"sm_{target.arch} has no TMA")
    lengths, hint = attention_case.lengths, attention_case.max_seqlen
    q, k, v = packed_qkv(sum(lengths), 16, head_dim, torch.bfloat16, device="cuda")
    cu = cu_seqlens_of(lengths, "cuda")
    positions = torch.randint(0, 40, (sum(lengths), 2), dtype=torch.int32, device="cuda")
    pointer_out, pointer_lse, _ = run_attention(q, k, v, cu, {"DESCRIPTORS": False}, positions, target, hint)
    out, lse, used = run_attention(q, k, v, cu, {"DESCRIPTORS": True}, positions, target, hint)
    assert used
    assert_close_to_float64(pointer_out, q, k, v, cu, positions=positions, target=target, max_seqlen=hint)
    assert torch.equal(out, pointer_out) and torch.equal(lse, pointer_lse)


def test_targets_without_tma_take_pointers():
    q, k, v = packed(72, torch.float16, seed=4)
    out = torch.empty(q.shape, dtype=q.dtype)
    for target, expected in ((ADA, False), (HOPPER, True), (INTERPRETER, True)):
        launches = attention.vision_attn_launches(
            q, k, v, out, CU_SEQLENS, None, None, 10000.0, target, None, None, {"DESCRIPTORS": True}
        )
        assert launches[-1].kwargs["DESCRIPTORS"] is expected, target


def test_a_size_one_dim_with_an_unaligned_stride_takes_pointers():
    """One head whose head stride is 3 elements: the kernel never steps it, so its rows are aligned, but a TMA
    descriptor checks every stride: the Hopper launch takes pointers instead of failing to build one."""
    q, k, v = (x[:, :1] for x in packed(64, torch.float16, seed=5))
    k = torch.empty(q.shape[0] * 64 + 8, dtype=q.dtype).as_strided(q.shape, (64, 3, 1)).copy_(k)
    out = torch.empty(q.shape, dtype=q.dtype)
    launches = attention.vision_attn_launches(
        q, k, v, out, CU_SEQLENS, None, None, 10000.0, HOPPER, None, None, {"DESCRIPTORS": True}
    )
    assert launches[-1].kwargs["DESCRIPTORS"] is False


# --------------------------------------------------------------------------------------------------
# The tile table
# --------------------------------------------------------------------------------------------------
def test_tile_keys_name_arch_dtype_head_dim_and_segment_class(use_head_dim_layout):
    use_head_dim_layout("split")
    assert attention.tile_key(HOPPER, 72, torch.bfloat16, None) == "cuda:90/bfloat16/D72/long"
    assert attention.tile_key(HOPPER, 72, torch.bfloat16, 65) == "cuda:90/bfloat16/D72/long"
    assert attention.tile_key(ADA, 80, torch.float16, 64) == "cuda:89/float16/D80/short"
    assert attention.tile_key(INTERPRETER, 64, torch.float32, 1) == "interpreter:0/float32/D64/short"


def test_packaged_table_is_well_formed():
    """What bench/tune_attention.py writes: entries under well-formed keys, tiles the kernel takes, each
    entry naming the run (device, versions, date) that measured it."""
    table = json.loads(attention.TILE_TABLE_PATH.read_text())
    assert table["tiles"] == attention.tile_table()
    # A sweep in a layout other than split keys its entries with it (tile_key): padded and split32.
    other_layouts = "|".join(layout for layout in attention.HEAD_DIM_LAYOUTS if layout != "split")
    for key, entry in table["tiles"].items():
        assert re.fullmatch(rf"cuda:\d+/(float16|bfloat16|float32)/D\d+/(short|long)(/({other_layouts}))?", key), key
        assert entry["BLOCK_M"] in (64, 128) and entry["BLOCK_N"] in (32, 64, 128), key
        assert entry["num_warps"] in (4, 8) and entry["num_stages"] in (2, 3, 4), key
        assert isinstance(entry["DESCRIPTORS"], bool), key
        run = table["runs"][entry["run"]]
        assert run["device"] and run["torch"] and run["triton"] and run["date"], key


def test_launch_config_follows_a_table_entry(monkeypatch, fresh_attention_plans, use_head_dim_layout):
    use_head_dim_layout("split")
    entry = dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2, DESCRIPTORS=True, ms=0.1, run=0)
    heuristic = attention.launch_config(72, torch.bfloat16, HOPPER)
    heuristic_fp16 = attention.launch_config(72, torch.float16, HOPPER)
    monkeypatch.setattr(attention.config, "tile_table", lambda: {"cuda:90/bfloat16/D72/long": entry})
    tuned = attention.launch_config(72, torch.bfloat16, HOPPER)
    assert {key: tuned[key] for key in attention.TILE_KEYS} == {key: entry[key] for key in attention.TILE_KEYS}
    # The entry sets the tiles only; the head-dim tiling and options stay, other keys keep the heuristic.
    assert {k: v for k, v in tuned.items() if k not in attention.TILE_KEYS} == {
        k: v for k, v in heuristic.items() if k not in attention.TILE_KEYS
    }
    assert attention.launch_config(72, torch.bfloat16, HOPPER, 64)["BLOCK_M"] == 64
    assert attention.launch_config(72, torch.float16, HOPPER) == heuristic_fp16
    assert attention.launch_config(72, torch.bfloat16, ADA)["DESCRIPTORS"] is False
