"""Which head-dim layout a device run's attention takes: ``python -m bench.head_dim_check``.

The split layout (72 = 64 + a 16-wide tail, :func:`qvl.kernels.attention.head_dim_tiles`) is checked in Triton's
interpreter only; the tiling it replaced was right there too and wrong on an H200 wherever a segment ended inside
a key block (bench/results/diag-20261204/). So a device run checks it before anything else uses it: for each head
dim, in the split layouts and the padded one, the forward without rope on segments that end inside key blocks, one
shorter than a key block alone (the H200's NaN case) and block multiples, and forward + backward with rope (as the
towers train) on the ragged segments, each against the float64 reference. A check agrees where its relative error
is within the harness's bound (:data:`bench.harness.TOLERANCE`) or at most :data:`TORCH_ERROR_FACTOR` times torch's
own in the same dtype (SDPA per segment, the gradients through autograd), so bf16 rounding alone never fails one.
On a GPU it also times the forward with rope, the towers' call, at S 4,096 and on a mixed batch.

The split layout goes first: once its rows are done it prints ``head-dim layout: split`` where every split check
agreed. Where one did not, split32 (a 32-wide tail: another shape of the tail's MMA instruction, see
:func:`~qvl.kernels.attention.head_dim_tiles`) is checked next and chosen where all of its checks agree, else
``head-dim layout: padded``. Then the padded layout is checked and timed for comparison (a run cut short there
keeps the verdict; ``--json`` is rewritten after every row). bench/device_check.sh exports the verdict as
``QVL_ATTENTION_HEAD_DIM`` for its later steps (tile sweep, tests, benchmarks), so a wrong split tiling costs the
run its speed, not its numbers.

    python -m bench.head_dim_check [--head-dims 72 80] [--dtype bf16] [--quick] [--json FILE]

``--quick`` takes small shapes (2 heads, segments of at most 128 tokens) and times nothing: the interpreter's run
(``TRITON_INTERPRET=1``; bf16 dots are wrong in the interpreter: check fp16 there).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import multiprocessing
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import torch
import torch.nn.functional as F

from qvl.kernels import attention, rotary_2d_reference
from qvl.kernels.common import backend_for

from .harness import DTYPES, TOLERANCE, attention_flops, max_rel_err, strict_json

# Forward checks without rope, (segment lengths, max_seqlen hint) by name: segments ending inside query tiles and
# key blocks, one shorter than any key block alone (no hint: the long segments' tiles, as on the H200 that failed),
# multiples of every tile, and windows with the window tiles' hint. The rope forward + backward check runs on the
# first.
LENGTHS = {
    "ragged": ((1, 257, 1024, 33, 0, 130), None),
    "short": ((33,), None),
    "aligned": ((1024, 256), None),
    "windows": ((64, 48, 0, 16, 1, 37), 64),
}
QUICK_LENGTHS = {
    "ragged": ((1, 65, 33, 0, 17), None),
    "short": ((33,), None),
    "aligned": ((64, 128), None),
    "windows": ((64, 48, 0, 1, 37), 64),
}
TIMED = {"S 4,096": (4096,), "mixed": (4096, 1024, 1024, 256, 256, 64)}
NUM_HEADS, QUICK_HEADS = 16, 2


def batch(lengths: Sequence[int], num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
    """q, k, v (views of a packed qkv, the towers' layout), cu_seqlens, positions (a patch grid's rows and columns)
    and an output gradient, seeded by the layout."""
    generator = torch.Generator().manual_seed(sum(lengths) * 131 + head_dim)
    num_tokens = sum(lengths)
    qkv = torch.randn(num_tokens, 3, num_heads, head_dim, generator=generator).to(device, dtype)
    cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    positions = torch.randint(0, 64, (num_tokens, 2), generator=generator, dtype=torch.int32).to(device)
    grad_out = torch.randn(num_tokens, num_heads, head_dim, generator=generator).to(device, dtype)
    return (*qkv.unbind(1), cu_seqlens, positions, grad_out)


def relative_error(outputs: Sequence[torch.Tensor], truths: Sequence[torch.Tensor]) -> float:
    """The largest :func:`~bench.harness.max_rel_err` of ``outputs`` against ``truths``; NaN if any is."""
    errors = [max_rel_err(out, truth) for out, truth in zip(outputs, truths)]
    return math.nan if any(map(math.isnan, errors)) else max(errors)


def sdpa_in_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """torch's attention in q's dtype, segment by segment (``scaled_dot_product_attention``: its fused kernels on a
    GPU, as a user would call them): what the dtype itself costs, the scale a kernel's error is judged on."""
    bounds = cu_seqlens.tolist()
    outs = [
        F.scaled_dot_product_attention(*(x[start:end].transpose(0, 1) for x in (q, k, v))).transpose(0, 1)
        for start, end in zip(bounds[:-1], bounds[1:])
        if end > start
    ]
    return torch.cat(outs)


def forward_error(lengths, hint, num_heads, head_dim, dtype, device) -> tuple[float, float]:
    """The forward's relative error against float64, and torch's in the same dtype."""
    q, k, v, cu_seqlens, _, _ = batch(lengths, num_heads, head_dim, dtype, device)
    out = torch.ops.qvl.vision_attn(q, k, v, cu_seqlens, hint)
    truth = attention.vision_attn_reference(q.double(), k.double(), v.double(), cu_seqlens)
    return relative_error([out], [truth]), relative_error([sdpa_in_dtype(q, k, v, cu_seqlens)], [truth])


def rope_training_error(lengths, hint, num_heads, head_dim, dtype, device) -> tuple[float, float]:
    """Forward with rope and the gradients of q, k, v: the relative error against float64, and torch's in the same
    dtype (the rotary reference, then :func:`sdpa_in_dtype`, differentiated by autograd)."""
    q, k, v, cu_seqlens, positions, grad_out = batch(lengths, num_heads, head_dim, dtype, device)
    wide = [x.detach().double().requires_grad_() for x in (q, k, v)]
    truth = attention.vision_attn_reference(*wide, cu_seqlens, positions=positions)
    truths = [truth.detach(), *torch.autograd.grad(truth, wide, grad_out.double())]

    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = torch.ops.qvl.vision_attn(*leaves, cu_seqlens, hint, positions=positions)
    error = relative_error([out.detach(), *torch.autograd.grad(out, leaves, grad_out)], truths)

    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    q_rotated, k_rotated = rotary_2d_reference(leaves[0], leaves[1], positions)
    base = sdpa_in_dtype(q_rotated, k_rotated, leaves[2], cu_seqlens)
    torch_error = relative_error([base.detach(), *torch.autograd.grad(base, leaves, grad_out)], truths)
    return error, torch_error


def checks(head_dim: int, dtype: torch.dtype, device: torch.device, quick: bool) -> dict[str, tuple[float, float]]:
    """Every check's ``(relative error, torch's in the same dtype)``, by name, in the layout in use."""
    lengths = QUICK_LENGTHS if quick else LENGTHS
    num_heads = QUICK_HEADS if quick else NUM_HEADS
    found = {}
    for name, (layout, hint) in lengths.items():
        found[f"forward {name}"] = forward_error(layout, hint, num_heads, head_dim, dtype, device)
    found["rope fwd+bwd ragged"] = rope_training_error(*lengths["ragged"], num_heads, head_dim, dtype, device)
    return found


def timings(head_dim: int, dtype: torch.dtype, device: torch.device) -> dict[str, dict]:
    """The forward with rope (the towers' inference call) per :data:`TIMED` batch: ms and useful TFLOP/s."""
    import triton

    found = {}
    for name, lengths in TIMED.items():
        q, k, v, cu_seqlens, positions, _ = batch(lengths, NUM_HEADS, head_dim, dtype, device)
        ms = triton.testing.do_bench(
            lambda: torch.ops.qvl.vision_attn(q, k, v, cu_seqlens, max(lengths), positions=positions),
            warmup=10,
            rep=40,
        )
        tflops = attention_flops(NUM_HEADS, head_dim, lengths) / (ms * 1e-3) / 1e12
        found[name] = {"ms": round(ms, 5), "tflops": round(tflops, 1)}
    return found


# A check agrees where its error is at most this many times torch's own in the same dtype, or within the harness's
# bound: a kernel as accurate as torch lands near 1x; the tilings that failed on the H200 were hundreds of times off.
TORCH_ERROR_FACTOR = 4.0


def agreed(row: dict, dtype: torch.dtype) -> bool:
    """Whether every check of ``row`` agrees (see :data:`TORCH_ERROR_FACTOR`); NaN never does."""
    return all(
        err <= max(TOLERANCE[dtype], TORCH_ERROR_FACTOR * row["torch_errors"].get(name, 0.0))
        for name, err in row["errors"].items()
    )


# The layouts a run checks, in the order it prefers them: least dot work first; padded is the fallback.
SPLIT_LAYOUTS = ("split", "split32")


def choose(results: dict, dtype: torch.dtype) -> str | None:
    """The first of :data:`SPLIT_LAYOUTS` checked in ``results`` whose checks of every head dim agreed; ``"padded"``
    when every one checked so far disagreed and none is left to check; None while one is left."""
    for layout in SPLIT_LAYOUTS:
        rows = [row for row in results["rows"] if row["layout"] == layout]
        if not rows:
            return None
        if all(agreed(row, dtype) for row in rows):
            return layout
    return "padded"


def layout_rows(
    layout: str,
    head_dims: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    quick: bool,
    results: dict | None = None,
    json_path: Path | None = None,
) -> list[dict]:
    """Every head dim's row in ``layout`` (set for the rest of the process), each printed when done and, given
    ``results``, appended to its rows and saved to ``json_path``."""
    attention.set_head_dim_layout(layout)
    rows = []
    for head_dim in head_dims:
        rows.append(checked_row(head_dim, layout, dtype, device, quick))
        print(describe(rows[-1]), flush=True)
        if results is not None:
            results["rows"].append(rows[-1])
            write_json(results, json_path)
    return rows


def rows_in_fresh_process(
    layout: str, head_dims: Sequence[int], dtype: torch.dtype, device: torch.device, quick: bool
) -> list[dict]:
    """:func:`layout_rows` in a new process. An illegal memory access leaves CUDA unusable in the process where it
    happened (every later call fails), so after a layout raised on the device the next ones are checked in a
    process of their own. A process that dies gives rows that raised."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        try:
            return pool.submit(layout_rows, layout, list(head_dims), dtype, device, quick).result()
        except BrokenProcessPool as exc:
            error = f"{type(exc).__name__}: {exc}"[:200]
    rows = [raised(new_row(head_dim, layout), error) for head_dim in head_dims]
    for row in rows:
        row["agrees"] = False
        print(describe(row), flush=True)
    return rows


def run(
    head_dims: Sequence[int], dtype: torch.dtype, device: torch.device, quick: bool, json_path: Path | None = None
) -> dict:
    """Check (and on a GPU without ``quick``, time) every head dim in the split layout; where any check disagrees,
    in split32 too; print the choice (``head-dim layout: ...``: the first of them that agreed, else padded), then
    check and time the padded layout for comparison: a run cut short there keeps its verdict. The results so far
    go to ``json_path`` after every row (after every layout checked in a fresh process: on a GPU, each one after a
    layout raised). The layout in use before is restored. Returns ``{"rows": [...], "layout": the choice}``."""
    before = attention.head_dim_layout()
    results = {"rows": [], "layout": None}
    fresh = False
    try:
        for layout in (*SPLIT_LAYOUTS, "padded"):
            if layout in SPLIT_LAYOUTS and results["layout"] is not None:
                continue
            if fresh:
                rows = rows_in_fresh_process(layout, head_dims, dtype, device, quick)
                results["rows"] += rows
                write_json(results, json_path)
            else:
                rows = layout_rows(layout, head_dims, dtype, device, quick, results, json_path)
            fresh = fresh or (device.type == "cuda" and any("error" in row for row in rows))
            if results["layout"] is None:
                results["layout"] = choose(results, dtype)
                if results["layout"] is not None:
                    print(f"head-dim layout: {results['layout']}", flush=True)
                    write_json(results, json_path)
    finally:
        attention.set_head_dim_layout(before)
    return results


def checked_row(head_dim: int, layout: str, dtype: torch.dtype, device: torch.device, quick: bool) -> dict:
    """One head dim in the layout in use (``layout`` names it): its checks' errors, whether they agree, and on a GPU
    without ``quick`` its timings where they do."""
    row = new_row(head_dim, layout)
    try:
        found = checks(head_dim, dtype, device, quick)
        row["errors"] = {name: err for name, (err, _) in found.items()}
        row["torch_errors"] = {name: base for name, (_, base) in found.items()}
    except Exception as exc:  # noqa: BLE001 - e.g. an illegal address: the layout fails, the report goes on
        raised(row, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    row["agrees"] = agreed(row, dtype)
    if device.type == "cuda" and not quick and row["agrees"]:
        row["timings"] = timings(head_dim, dtype, device)
    return row


def new_row(head_dim: int, layout: str) -> dict:
    tiles = attention.head_dim_tiles(head_dim, layout)
    return {"head_dim": head_dim, "layout": layout, "tiles": f"{tiles.main}+{tiles.tail}"}


def raised(row: dict, error: str) -> dict:
    """``row`` marked as a check that raised ``error``: its one error NaN, so it never agrees."""
    row["errors"], row["torch_errors"] = {"raised": math.nan}, {}
    row["error"] = error[:200]
    return row


def write_json(results: dict, path: Path | None) -> None:
    if path is not None:
        path.write_text(json.dumps(strict_json(results), indent=2) + "\n")


def describe(row: dict) -> str:
    torch_errors = row.get("torch_errors", {})
    errors = ", ".join(
        f"{name} {err:.1e}" + (f" (torch {torch_errors[name]:.1e})" if name in torch_errors else "")
        for name, err in row["errors"].items()
    )
    timed = "".join(
        f"; rope forward {name}: {t['ms']:.4f} ms, {t['tflops']} TFLOP/s" for name, t in row.get("timings", {}).items()
    )
    verdict = "agrees" if row["agrees"] else "WRONG"
    raised = f" ({row['error']})" if "error" in row else ""
    return f"D {row['head_dim']} {row['layout']} ({row['tiles']}): {verdict}{raised}: {errors}{timed}"


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[72, 80])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--quick", action="store_true", help="small shapes, no timing (the interpreter's run)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if backend_for(device) not in ("triton", "interpreter"):
        parser.error("no Triton kernel runs here: on a CPU set TRITON_INTERPRET=1 (and pass --quick --dtype fp16)")
    dtype = DTYPES[args.dtype]
    results = run(args.head_dims, dtype, device, args.quick, args.json)
    results.update(dtype=args.dtype, device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu")
    write_json(results, args.json)
    return results


if __name__ == "__main__":
    main()
