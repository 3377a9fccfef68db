"""Every Triton kernel compiles for Hopper and fits its shared memory, and the attention kernel's sm_90 key loop
is what it should be, checked without a GPU from the launches the ops really make (see compile_sm90.py)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import triton

NVIDIA_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
PTXAS = NVIDIA_BIN / "ptxas"
CUOBJDUMP = NVIDIA_BIN / "cuobjdump"
REPOSITORY = Path(__file__).resolve().parents[2]
# Before 3.9 Triton lowers tl.sin and tl.cos to libdevice functions whose slow path for huge arguments (|x| >=
# 105,615) keeps a 28-byte array in local memory, which the common path branches around (the rotary kernel's PTX
# under Triton 3.6-3.8: bench/results/compat-triton-20261206/). The rotary kernel, which evaluates them, may keep that
# frame there; no other kernel calls them.
TRIG_SLOW_PATH_STACK = 32 if tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 9) else 0


def spilled(lines: list[dict]) -> list[dict]:
    """The compiled launches that keep anything on the stack beyond libdevice's trig slow path."""
    return [
        line for line in lines if line["stack"] > (TRIG_SLOW_PATH_STACK if line["kernel"] == "_rotary_2d_kernel" else 0)
    ]


needs_ptxas = pytest.mark.skipif(
    not PTXAS.exists() and shutil.which("ptxas") is None, reason="Triton's ptxas is not installed"
)
needs_cuobjdump = pytest.mark.skipif(
    not (PTXAS.exists() and CUOBJDUMP.exists()), reason="Triton's ptxas/cuobjdump are not installed"
)


def run_compiler(*command: str) -> list[dict]:
    """Run a compile-only command (interpreter off) from the repository root; its JSON output lines."""
    result = subprocess.run(
        [sys.executable, *command],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPOSITORY,
        env={**os.environ, "TRITON_INTERPRET": "0"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def compiled_variants() -> tuple[dict, list[dict]]:
    """compile_sm90.py's header and one line per compiled launch (run once for the tests below)."""
    header, *compiled = run_compiler(str(Path(__file__).with_name("compile_sm90.py")))
    return header, compiled


@needs_ptxas
def test_kernels_compile_for_hopper_and_ada_within_shared_memory(compiled_variants):
    header, compiled = compiled_variants
    assert {line["name"] for line in compiled} == set(header["variants"]), compiled
    too_big = [line for line in compiled if line["shared"] > line["shared_limit"]]
    assert not too_big, too_big


@needs_cuobjdump
def test_attention_training_kernels_do_not_spill_in_16_bit(compiled_variants):
    """The forward that also writes the log-sum-exp and the backward's kernels (delta, dK/dV, dQ, the rotary
    forward and inverse) keep everything in registers in 16-bit dtypes up to D 128, for long segments and
    windows alike (fp32 and D 256 tiles spill, as the forward's do: see backward_launch_config)."""
    _, compiled = compiled_variants
    checked = [
        line
        for line in compiled
        if line["name"].startswith(("vision_attn_with_lse bf16", "vision_attn_backward bf16"))
        and not line["name"].endswith("D=256")
    ]
    kernels = {line["kernel"] for line in checked}
    assert kernels >= {"_vision_attn_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel", "_rotary_2d_kernel"}
    assert not spilled(checked), spilled(checked)


@needs_cuobjdump
def test_the_other_ops_backward_kernels_do_not_spill(compiled_variants):
    """The norms', GELU's, SwiGLU's and the position table's backward kernels (and their partial-sum
    reductions) keep everything in registers on sm_90 at the towers' widths."""
    _, compiled = compiled_variants
    checked = [line for line in compiled if "_backward " in line["name"] and not line["name"].startswith("vision_attn")]
    assert {line["kernel"] for line in checked} >= {
        "_norm_backward_kernel", "_bias_gelu_backward_kernel", "_bias_swiglu_backward_kernel",
        "_pos_embed_interp_backward_kernel", "_sum_partials_kernel",
    }  # fmt: skip
    assert not spilled(checked), checked


@needs_cuobjdump
def test_rotary_kernels_do_not_spill_in_16_bit(compiled_variants):
    """Every rotary launch in 16 bits (standalone, rotating k and writing attention's cos/sin table, the inverse)
    keeps everything in registers on sm_90 (but for the trig slow path's frame before Triton 3.9): the rope path's k
    rotation reached the register cap with 320 bytes of stack when its tiles spanned whole heads."""
    _, compiled = compiled_variants
    checked = [line for line in compiled if line["kernel"] == "_rotary_2d_kernel" and " bf16 " in line["name"]]
    assert {line["name"] for line in checked} >= {
        "rotary_2d_ bf16 D=72", "vision_attn bf16 D=72 rope", "vision_attn bf16 D=80 windows rope",
        "vision_attn_backward bf16 D=72 rope",
    }  # fmt: skip
    assert not spilled(checked), spilled(checked)


@pytest.fixture(scope="module")
def head_dim_72_sass() -> dict[bool, dict]:
    """bench.sass_attention's rows for Qwen3-VL's D = 72 in bf16 on a packed qkv with the heuristic's tiles, keyed
    by rope on q. (The tile table's D 72 entry was measured in the padded head-dim layout, whose key loop is longer;
    test_tile_table_entries_keep_the_key_loop_spill_free checks every entry in its own layout.)"""
    rows = run_compiler("-m", "bench.sass_attention", "--head-dim", "72", "--heuristic", "--json")
    assert [row["rope"] for row in rows] == [False, True], rows
    return {row["rope"]: row for row in rows}


@needs_cuobjdump
def test_attention_key_loop_has_no_local_memory_and_rope_adds_nothing_to_it(head_dim_72_sass):
    """No spill inside the key loop, and rotating q (done once per program) leaves the loop as long as plain
    attention's."""
    plain, rope = head_dim_72_sass[False], head_dim_72_sass[True]
    assert plain["loop_instructions"] > 0 and rope["loop_instructions"] > 0, head_dim_72_sass
    assert plain["loop_local_memory"] == 0 and rope["loop_local_memory"] == 0, head_dim_72_sass
    assert rope["loop_instructions"] <= plain["loop_instructions"] * 1.05, head_dim_72_sass


@needs_cuobjdump
def test_head_dim_72_key_loop_fetches_k_and_v_asynchronously(head_dim_72_sass):
    """A head stride of 72 elements is 16-byte aligned but not a multiple of 16 elements: unless the kernel
    proves the alignment, K and V rows are loaded two bytes at a time and not pipelined."""
    for row in head_dim_72_sass.values():
        assert row["loop_ldg_u16"] == 0, row
        assert row["loop_ldgsts"] + row["loop_utmaldg"] > 0, row


@needs_cuobjdump
def test_window_attention_tiles_keep_the_key_loop_spill_free_and_asynchronous():
    """Qwen2.5-VL's window attention (D 80, 64-token windows, ``max_seqlen=64``: the 64 x 64 short-segment
    tiles), without and with rope on q: no local memory in the key loop, K and V fetched asynchronously."""
    rows = run_compiler("-m", "bench.sass_attention", "--head-dim", "80", "--max-seqlen", "64", "--json")
    assert [row["rope"] for row in rows] == [False, True], rows
    for row in rows:
        assert row["loop_instructions"] > 0 and row["loop_local_memory"] == 0, row
        assert row["loop_ldg_u16"] == 0 and row["loop_ldgsts"] + row["loop_utmaldg"] > 0, row
    assert rows[0]["stack_bytes"] == 0, rows


@needs_cuobjdump
@pytest.mark.parametrize("hint", [[], ["--max-seqlen", "64"]], ids=["long", "windows"])
def test_descriptor_loads_compile_to_tma_without_spills_in_the_key_loop(hint):
    """K and V through TMA descriptors (the path a tile-table entry may choose on sm_90): the key loop fetches
    them with UTMALDG, nothing element by element or through LDGSTS, and touches no local memory."""
    rows = run_compiler("-m", "bench.sass_attention", "--head-dim", "72", "80", *hint, "--descriptors", "--json")
    assert len(rows) == 4, rows
    for row in rows:
        assert row["descriptors"] and row["loop_instructions"] > 0, row
        assert row["loop_utmaldg"] > 0 and row["loop_ldgsts"] == 0 and row["loop_ldg_u16"] == 0, row
        assert row["loop_local_memory"] == 0, row


@needs_cuobjdump
def test_tile_table_entries_keep_the_key_loop_spill_free():
    """Whatever a device run wrote into the tile table for sm_90 compiles without local memory in the key loop,
    with and without rope on q (nothing to compile while the table is empty)."""
    from qvl.kernels.attention import tile_table

    entries = [key for key in tile_table() if key.startswith("cuda:90/")]
    rows = run_compiler("-m", "bench.sass_attention", "--table", "--json")
    assert len(rows) == 2 * len(entries), rows
    assert all(row["loop_local_memory"] == 0 for row in rows), rows


@needs_cuobjdump
def test_row_wise_kernels_move_rows_in_vectors(compiled_variants):
    """The norms', GELU's and SwiGLU's kernels, forward and backward, and attention's backward delta kernel load
    and store their rows in vectors (no 16-bit global access) at the towers' widths in bf16: Qwen2.5-VL's
    3,420-wide SwiGLU too, from two GEMMs and from the halves of one stacked GEMM output (8-byte vectors:
    kernels/tiles.row_vector and aligned_view), and the delta kernel's 72-element head stride (rows of both moved
    element by element before)."""
    _, compiled = compiled_variants
    kernels = (
        "_norm_kernel", "_norm_backward_kernel", "_bias_gelu_kernel", "_bias_gelu_backward_kernel",
        "_bias_swiglu_kernel", "_bias_swiglu_backward_kernel", "_attn_bwd_delta_kernel",
    )  # fmt: skip
    checked = [line for line in compiled if line["kernel"] in kernels and " bf16 " in line["name"]]
    assert {line["name"] for line in checked} >= {"bias_swiglu bf16 F=3420", "bias_swiglu bf16 F=3420 stacked"}
    assert {line["kernel"] for line in checked} == set(kernels)
    assert not [line for line in checked if line["narrow_global"]], checked
