"""qvl.vit.parallel: weights and data modes over gloo on CPU against the single-process tower, compile,
bad input, and the data-mode balancer.

The multi-process tests start their own ranks: this file run as a script is one rank
(``python test_parallel.py SPEC``). One launch of three ranks serves them all: the three run the torch-path
cases together (uneven splits), then ranks 0 and 1 run everything else over a two-rank group (the
interpreter case, compile, bad input) while rank 2 checks that it cannot join that group. Each rank saves
its outputs and the tests read them. The launch has a deadline, so a hang fails the tests instead of
stalling CI. The ranks import only torch and qvl (transformers is slow to import): the parent builds the
tiny tower from a transformers config, writes it as a checkpoint and computes the single-process
tower's reference outputs.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

# Six heads (head_dim 24) and widths that divide by 2 and by 3; two blocks keep compiling short.
TOWER = dict(depth=2, deepstack_visual_indexes=[0, 1], num_heads=6, intermediate_size=192)
CASES = {
    "images": [[1, 6, 10], [1, 4, 4], [1, 2, 2], [1, 8, 4]],
    "one_image": [[1, 6, 6]],  # in data mode the other ranks get nothing
    "video": [[5, 4, 4], [1, 2, 6]],  # the video's slices are split over the ranks
    "empty": [],
}
COMPILED = {"compile_first": [[1, 4, 4], [1, 6, 2]], "compile_second": [[3, 2, 4], [1, 8, 6], [1, 2, 2]]}
INTERPRETED = ("weights", "video")
INVALID = [[1, 3, 4]]  # h not divisible by the merge size
WORLD = 3
DEADLINE_S = 300


# --------------------------------------------------------------------------------------------------
# One rank (run as a script)
# --------------------------------------------------------------------------------------------------
def _rank_main(spec_path: str) -> None:
    import torch.distributed as dist

    from qvl.kernels import force_backend
    from qvl.vit import VisionConfig, VisionTransformer
    from qvl.vit.parallel import init_from_env, is_main_rank

    spec = json.loads(Path(spec_path).read_text())
    init_from_env("cpu")
    rank = dist.get_rank()
    inputs = torch.load(spec["inputs"])
    results: dict[str, object] = {"main_rank": is_main_rank()}
    # Every rank creates every group, members or not.
    pair = dist.new_group([0, 1])
    solo = [dist.new_group([r]) for r in range(WORLD)][rank]

    def load(mode, **kwargs):
        return VisionTransformer.from_pretrained(spec["checkpoint"], parallel=mode, **kwargs).eval()

    def record_error(name, call, *args, **kwargs):
        try:
            call(*args, **kwargs)
        except (ValueError, RuntimeError) as error:
            results[f"error/{name}"] = f"{type(error).__name__}: {error}"
        else:
            results[f"error/{name}"] = None

    # The processes interpret Triton (TRITON_INTERPRET=1) for the one interpreted case; everything else
    # takes the torch path, forced.
    with torch.no_grad(), force_backend("torch"):
        for mode in ("weights", "data"):
            tower = load(mode)
            for case in CASES:
                results[f"world/{mode}/{case}"] = tower(*inputs[case])

        alone, single = (load(mode, group=solo)(*inputs["images"]) for mode in ("weights", None))
        results["solo_is_single_process"] = all(
            torch.equal(a, b) for a, b in zip([alone[0], *alone[1]], [single[0], *single[1]], strict=True)
        )

        if rank == 2:
            record_error("not_a_member", load, "data", group=pair)
        else:
            towers = {mode: load(mode, group=pair) for mode in ("weights", "data")}
            results["batch_check_on_host"] = all(tower._parallel.exchanges_on_host for tower in towers.values())
            with force_backend("interpreter"):
                results["pair/interpreter"] = towers[INTERPRETED[0]](*inputs[INTERPRETED[1]])
            for mode, tower in towers.items():
                for case in CASES:
                    results[f"pair/{mode}/{case}"] = tower(*inputs[case])
            for mode in towers:
                compiled = load(mode, group=pair).compile()
                for index, case in enumerate(COMPILED):
                    stance = torch.compiler.set_stance("fail_on_recompile") if index else contextlib.nullcontext()
                    with stance:
                        results[f"compiled/{mode}/{case}"] = compiled(*inputs[case])

            for mode, tower in towers.items():
                mine = inputs["images"] if rank == 0 else inputs["one_image"]
                record_error(f"different/{mode}", tower, *mine)
                mine = inputs["invalid"] if rank == 1 else inputs["one_image"]
                record_error(f"invalid_on_one_rank/{mode}", tower, *mine)
            config = VisionConfig(depth=1, hidden_size=48, num_heads=3, intermediate_size=64, out_hidden_size=32,
                                  deepstack_visual_indexes=())  # fmt: skip
            record_error("indivisible_heads", VisionTransformer, config, parallel="weights", group=pair)
            # The pair is still in step after every error above.
            results["after_errors"] = towers["data"](*inputs["video"])
    torch.save(results, Path(spec["out"]) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from ranks import run_rank

    run_rank(_rank_main)

# --------------------------------------------------------------------------------------------------
# The parent: tiny tower, references, the launch
# --------------------------------------------------------------------------------------------------
import pytest  # noqa: E402

from qvl.kernels import force_backend  # noqa: E402
from qvl.vit import VisionConfig, VisionTransformer  # noqa: E402
from qvl.vit.balance import SegmentCost, balance, greedy_by_patches, lower_bound  # noqa: E402
from qvl.vit.checkpoint import save_vision_checkpoint  # noqa: E402
from qvl.vit.parallel import has_cpu_backend  # noqa: E402
from ranks import python_path_with_tests  # noqa: E402
from tolerance import assert_error_within  # noqa: E402
from towers import MODEL_STAGES  # noqa: E402


def _references(hf, pixel_values, grid) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``[merged, *deepstack]`` of one batch from a float64 copy of transformers' model (the truth) and
    from the model itself in fp32 (its own rounding, the yardstick of tests/tolerance.py)."""
    from towers import float64_vision_outputs, vision_outputs

    if not grid:  # transformers cannot run an empty batch; every output is empty
        outputs = [torch.zeros(0, hf.config.out_hidden_size)] * (1 + len(hf.config.deepstack_visual_indexes))
        return [t.double() for t in outputs], outputs
    return float64_vision_outputs(hf, pixel_values, grid), vision_outputs(hf, pixel_values, grid)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The checkpoint, the inputs, the single-process tower's outputs on the torch path, and per case the
    references of :func:`_references`."""
    from towers import hf_vision_model, pixel_values_for

    root = tmp_path_factory.mktemp("parallel")
    hf = hf_vision_model(seed=7, **TOWER)
    save_vision_checkpoint(root / "checkpoint", hf.config.to_dict(), hf.state_dict())
    grids = {**CASES, **COMPILED, "invalid": INVALID}
    inputs = {
        name: (pixel_values_for(grid, seed=i) if grid else torch.zeros(0, 1536), grid)
        for i, (name, grid) in enumerate(grids.items())
    }
    torch.save(inputs, root / "inputs.pt")
    single = VisionTransformer.from_hf(hf).eval()
    with torch.no_grad(), force_backend("torch"):
        expected = {name: single(*inputs[name]) for name in {**CASES, **COMPILED}}
    references = {name: _references(hf, *inputs[name]) for name in {**CASES, **COMPILED}}
    return dict(root=root, hf=hf, expected=expected, references=references)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(setup) -> list[dict]:
    """What each of the three ranks saved."""
    root = setup["root"]
    spec = root / "spec.json"
    spec.write_text(
        json.dumps(dict(checkpoint=str(root / "checkpoint"), inputs=str(root / "inputs.pt"), out=str(root)))
    )
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": str(WORLD),
        "TRITON_INTERPRET": "1",
        "OMP_NUM_THREADS": "1",  # the ranks share a few cores
        "PYTHONPATH": python_path_with_tests(),  # each rank runs through ranks.run_rank
    }
    processes = [
        subprocess.Popen(
            [sys.executable, __file__, str(spec)],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(WORLD)
    ]
    deadline = time.monotonic() + DEADLINE_S
    logs = []
    try:
        for process in processes:
            logs.append(process.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        for process in processes:
            process.kill()
        pytest.fail(f"the {WORLD} ranks did not finish within {DEADLINE_S} s (a hang?)")
    for rank, (process, log) in enumerate(zip(processes, logs)):
        assert process.returncode == 0, f"rank {rank} exited with {process.returncode}:\n{log[-6000:]}"
    return [torch.load(root / f"rank{rank}.pt") for rank in range(WORLD)]


def _assert_same(got, references) -> None:
    """Outputs within the tower's rounding by the suite's rule (tests/tolerance.py): their error against the
    float64 truth at most twice transformers' own in fp32, plus eps. The single-process tower is held to
    the same bound (test_the_single_process_tower_is_within_rounding), so the ranks match it within
    rounding; not bit for bit, since the ranks' split sums round differently."""
    merged, deepstack = got
    truth, in_transformers = references
    assert [t.shape for t in [merged, *deepstack]] == [t.shape for t in truth]
    assert_error_within([merged, *deepstack], truth, in_transformers, what="[merged, *deepstack]", stages=MODEL_STAGES)
    assert all(features.is_contiguous() for features in deepstack)


def test_the_single_process_tower_is_within_rounding(setup):
    for case in {**CASES, **COMPILED}:
        _assert_same(setup["expected"][case], setup["references"][case])


@pytest.mark.parametrize("mode", ["weights", "data"])
def test_three_ranks_match_the_single_process_tower(ranks, setup, mode):
    for rank, results in enumerate(ranks):
        for case in CASES:
            _assert_same(results[f"world/{mode}/{case}"], setup["references"][case])
        assert results["main_rank"] == (rank == 0)


@pytest.mark.parametrize("mode", ["weights", "data"])
def test_a_two_rank_group_matches_the_single_process_tower(ranks, setup, mode):
    for results in ranks[:2]:
        for case in CASES:
            _assert_same(results[f"pair/{mode}/{case}"], setup["references"][case])


def test_interpreter_path(ranks, setup):
    for results in ranks[:2]:
        _assert_same(results["pair/interpreter"], setup["references"][INTERPRETED[1]])


@pytest.mark.parametrize("mode", ["weights", "data"])
def test_compiled_without_recompiles(ranks, setup, mode):
    """The second batch ran under ``fail_on_recompile``; in weights mode the all-reduces are in the graph."""
    for results in ranks[:2]:
        for case in COMPILED:
            _assert_same(results[f"compiled/{mode}/{case}"], setup["references"][case])


@pytest.mark.parametrize("mode", ["weights", "data"])
def test_different_batches_raise_on_every_rank(ranks, mode):
    for results in ranks[:2]:
        assert "every rank must pass the same batch" in results[f"error/different/{mode}"]


@pytest.mark.parametrize("mode", ["weights", "data"])
def test_an_invalid_batch_on_one_rank_raises_on_every_rank(ranks, mode):
    seen_by_0, seen_by_1 = (results[f"error/invalid_on_one_rank/{mode}"] for results in ranks[:2])
    assert "divisible by spatial_merge_size" in seen_by_1
    assert "rank(s) [1] passed an invalid batch" in seen_by_0


def test_the_group_stays_in_step_after_errors(ranks, setup):
    for results in ranks[:2]:
        _assert_same(results["after_errors"], setup["references"]["video"])


def test_indivisible_heads_raise_at_construction(ranks):
    for results in ranks[:2]:
        assert "num_heads" in results["error/indivisible_heads"]


def test_a_group_of_one_is_the_single_process_tower(ranks):
    assert all(results["solo_is_single_process"] for results in ranks)


def test_a_group_without_this_process(ranks):
    assert "not a member" in ranks[2]["error/not_a_member"]


def test_the_batch_check_runs_on_the_host_over_gloo(ranks):
    assert all(results["batch_check_on_host"] for results in ranks[:2])


@pytest.mark.parametrize(
    "config, on_host",
    [("cpu:gloo,cuda:nccl", True), ("cpu:gloo,cuda:gloo", True), ("cuda:nccl", False), ("cpu:none,cuda:nccl", False)],
)
def test_has_cpu_backend(monkeypatch, config, on_host):
    """Only an nccl-only group makes the batch check read its fingerprint back from the GPU."""
    monkeypatch.setattr(torch.distributed, "get_backend_config", lambda group=None: config)
    assert has_cpu_backend() is on_host


def test_without_a_process_group(setup):
    with pytest.raises(RuntimeError, match="init_process_group"):
        VisionTransformer.from_hf(setup["hf"], parallel="weights")
    with pytest.raises(RuntimeError, match="init_process_group"):
        VisionTransformer.from_pretrained(setup["root"] / "checkpoint", parallel="data")
    with pytest.raises(ValueError, match="parallel must be"):
        VisionTransformer(VisionConfig(depth=1, deepstack_visual_indexes=()), parallel="tensor")


# --------------------------------------------------------------------------------------------------
# The balancer (pure functions)
# --------------------------------------------------------------------------------------------------
COST = SegmentCost.from_config(VisionConfig())


def _random_batch(rng: random.Random) -> list[list[int]]:
    def frame(low, high):
        return 2 * rng.randint(low, high), 2 * rng.randint(low, high)

    batch = [[1, *frame(4, 64)] for _ in range(rng.randint(0, 12))]
    batch += [[rng.randint(2, 24), *frame(8, 24)] for _ in range(rng.randint(0, 3))]
    rng.shuffle(batch)
    return batch


def _check_plan(plan, grid, world) -> None:
    assert len(plan.shares) == len(plan.loads) == world
    covered = {entry: [] for entry in range(len(grid))}
    for rank, share in enumerate(plan.shares):
        assert plan.loads[rank] == sum((p.stop - p.start) * COST(grid[p.entry][1] * grid[p.entry][2]) for p in share)
        for piece in share:
            covered[piece.entry].append((piece.start, piece.stop))
    for entry, ranges in covered.items():
        bounds = [bound for piece in sorted(ranges) for bound in piece]
        # Consecutive, non-empty, from 0 to t: each slice exactly once.
        assert bounds[0] == 0 and bounds[-1] == grid[entry][0] and bounds[1:-1:2] == bounds[2::2]
        assert all(start < stop for start, stop in ranges)


def test_balance_covers_every_slice_once_and_is_never_worse_than_greedy():
    rng = random.Random(0)
    for _ in range(150):
        grid, world = _random_batch(rng), rng.choice([1, 2, 3, 4, 8])
        plan = balance(grid, world, COST)
        _check_plan(plan, grid, world)
        assert plan == balance(torch.tensor(grid, dtype=torch.int64).reshape(-1, 3), world, COST)  # deterministic
        assert lower_bound(grid, world, COST) <= plan.makespan <= greedy_by_patches(grid, world, COST).makespan


def test_balance_beats_greedy_where_it_should():
    # A video: greedy keeps it on one rank, qvl spreads its slices.
    grid = [[16, 32, 32], [1, 16, 16], [1, 20, 20]]
    plan, greedy = balance(grid, 4, COST), greedy_by_patches(grid, 4, COST)
    assert plan.makespan < 0.5 * greedy.makespan
    assert sum(piece.entry == 0 for share in plan.shares for piece in share) == 4
    # Images of equal patch count but unequal cost: greedy balances patches, not the quadratic term.
    grid = [[1, 128, 128]] + [[1, 64, 64]] * 4 + [[1, 32, 32]] * 8
    plan, greedy = balance(grid, 2, COST), greedy_by_patches(grid, 2, COST)
    assert plan.makespan < greedy.makespan
    assert plan.makespan == lower_bound(grid, 2, COST)


def test_gather_index_restores_input_order():
    rng = random.Random(1)
    merge = 2
    for _ in range(50):
        grid, world = _random_batch(rng), rng.choice([2, 3, 8])
        plan = balance(grid, world, COST)
        # Label every merged row by (entry, row within entry), laid out as each rank would output them.
        labels = [[(p.entry, r) for p in share for r in range(p.start * grid[p.entry][1] * grid[p.entry][2] // 4,
                                                                p.stop * grid[p.entry][1] * grid[p.entry][2] // 4)]
                  for share in plan.shares]  # fmt: skip
        stride = max(plan.merged_rows(rank, merge) for rank in range(world))
        assert [len(rows) for rows in labels] == [plan.merged_rows(rank, merge) for rank in range(world)]
        gathered = [row for rows in labels for row in rows + [None] * (stride - len(rows))]
        restored = [gathered[i] for i in plan.gather_index(merge, stride)]
        expected = [(entry, r) for entry, (t, h, w) in enumerate(grid) for r in range(t * h * w // 4)]
        assert restored == expected


def test_segment_cost_counts_the_towers_flops():
    config = VisionConfig()  # Qwen3-VL-8B: about 30.5 MFLOP per token per block, attention 4 * n * 1152
    assert COST.quadratic == config.depth * 4 * 1152
    per_block = (COST.linear - 2 * 1536 * 1152 - 4 * 2 * 1152 * (4608 + 4096)) / config.depth
    assert abs(per_block - 30.5e6) < 0.1e6
    assert COST(1000) == 1000 * COST.linear + 1000**2 * COST.quadratic
