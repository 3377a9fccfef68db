"""qvl.kernels.verdicts: a GPU takes a faster kernel variant only with a "right" device verdict for it (the package's
table for its architecture and Triton's minor version, or qvl check's on that very machine), the conservative one
otherwise; settings win; the per-user cache survives concurrent writers, corrupt files and a read-only home.

No GPU here: stand-in CUDA targets and machines (a GPU's name, capability and driver come from the live device).
"""

import json
import multiprocessing
import os
import stat

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget

from qvl.kernels import attention, common, verdicts
from qvl.kernels.attention import config
from qvl.kernels.common import HOPPER, INTERPRETER

TRITON_MINOR = ".".join(triton.__version__.split(".")[:2])
MACHINE = verdicts.Machine("NVIDIA H100 80GB HBM3", 90, "580.1", torch.__version__, triton.__version__, "0.1.0")


@pytest.fixture
def verdict_world(monkeypatch, tmp_path, fresh_attention_plans):
    """A verdict cache in ``tmp_path``, an empty packaged table (``set_packaged`` fills it), the stand-in machine as
    the live device 0 (its target: sm_90), no layout or launch setting; decisions forgotten before and after."""
    monkeypatch.setenv(verdicts.CACHE_VARIABLE, str(tmp_path / "cache"))
    table = tmp_path / "device_verdicts.json"
    monkeypatch.setattr(verdicts, "PACKAGED_VERDICTS_PATH", table)
    monkeypatch.setattr(verdicts, "machine_of", lambda index: MACHINE)
    monkeypatch.setattr(config, "_live_device", lambda target: 0 if target == HOPPER else None)
    monkeypatch.setattr(config, "_head_dim_layout", None)
    monkeypatch.setattr(common, "_fast_launch", None)
    monkeypatch.setattr(common, "_cuda_target", lambda index: HOPPER)
    monkeypatch.setattr(common, "_fast_by_device", {})

    def set_packaged(*entries):
        run = dict(arch=90, triton=TRITON_MINOR, device="NVIDIA H200", date="2026-12-04", run="r", commit="c")
        table.write_text(json.dumps({"verdicts": [{**run, **entry} for entry in entries]}))
        verdicts.reset()

    set_packaged()
    yield set_packaged
    verdicts.reset()


def test_the_packaged_table_names_its_runs_and_keeps_the_conservative_variants():
    entries = verdicts.packaged_verdicts()
    assert entries, "the package ships its verdicts"
    for entry in entries:
        assert {"variant", "arch", "triton", "verdict", "device", "date", "run", "commit"} <= set(entry)
        assert entry["verdict"] in ("right", "wrong")
        assert os.path.isdir(os.path.join(os.path.dirname(__file__), "..", "..", entry["run"])), entry["run"]
    # No faster variant has a "right" verdict yet: a GPU run has never shown one.
    faster = {f"{c.name}:{v}" for c in verdicts.CHOICES.values() for v in c.faster}
    assert not [e for e in entries if e["variant"] in faster and e["verdict"] == "right"]


def test_without_a_verdict_a_gpu_takes_padded_and_tritons_launch(verdict_world, caplog):
    with caplog.at_level("INFO", logger="qvl"):
        assert attention.head_dim_layout(HOPPER) == "padded"
        assert attention.head_dim_tiles(72, target=HOPPER) == (128, 0)
        assert attention.launch_config(80, torch.bfloat16, HOPPER)["D_MAIN"] == 128
        assert not common.fast_launch_enabled(0)
        assert attention.head_dim_layout(HOPPER) == "padded"
    logged = [r.getMessage() for r in caplog.records]
    # Logged once per choice, saying why.
    assert len([m for m in logged if "head_dim padded" in m]) == 1
    assert len([m for m in logged if "launch triton" in m]) == 1
    assert all("no device run verified" in m for m in logged)


def test_the_interpreter_takes_split(verdict_world):
    assert attention.head_dim_layout(INTERPRETER) == "split"
    assert attention.head_dim_tiles(72, target=INTERPRETER) == (64, 16)


def test_a_packaged_right_verdict_is_taken_on_its_architecture_and_triton_only(verdict_world, monkeypatch):
    verdict_world(dict(variant="head_dim:split32", verdict="right"))
    assert attention.head_dim_layout(HOPPER) == "split32"
    assert attention.head_dim_layout(GPUTarget("cuda", 89, 32)) == "padded"
    monkeypatch.setattr(triton, "__version__", "3.99.0")
    verdicts.reset()
    assert attention.head_dim_layout(HOPPER) == "padded"


def test_a_wrong_variant_is_not_taken_and_the_next_right_one_is(verdict_world):
    verdict_world(
        dict(variant="head_dim:split", verdict="wrong"),
        dict(variant="head_dim:split32", verdict="right"),
    )
    decision = verdicts.decision("head_dim", HOPPER, 0)
    assert decision.variant == "split32" and "verified right" in decision.reason


def test_the_machines_own_verdicts_override_the_packages(verdict_world):
    verdict_world(dict(variant="head_dim:split", verdict="right"))
    assert verdicts.record_verdicts(MACHINE, {"head_dim:split": {"verdict": "wrong", "date": "2026-12-07"}})
    verdicts.reset()
    assert attention.head_dim_layout(HOPPER) == "padded"
    verdicts.record_verdicts(MACHINE, {"head_dim:split32": {"verdict": "right"}, "launch:fast": {"verdict": "right"}})
    verdicts.reset()
    assert attention.head_dim_layout(HOPPER) == "split32"
    assert common.fast_launch_enabled(0) is (TRITON_MINOR in common.FAST_LAUNCH_TRITON)


def test_verdicts_of_another_version_or_device_are_not_used(verdict_world):
    for other in (
        MACHINE._replace(triton="3.99.0"),
        MACHINE._replace(torch="9.9.9"),
        MACHINE._replace(driver="1.0"),
        MACHINE._replace(qvl="9.9"),
        MACHINE._replace(gpu="NVIDIA H200"),
    ):
        verdicts.record_verdicts(other, {"head_dim:split": {"verdict": "right"}})
    verdicts.reset()
    assert verdicts.machine_verdicts(MACHINE) == {}
    assert attention.head_dim_layout(HOPPER) == "padded"
    # A file under this machine's name that records another machine is not this machine's either.
    path = verdicts.record_verdicts(MACHINE, {"head_dim:split": {"verdict": "right"}})
    record = json.loads(path.read_text())
    record["machine"]["triton"] = "3.99.0"
    path.write_text(json.dumps(record))
    assert verdicts.machine_verdicts(MACHINE) == {}


def test_settings_win_over_verdicts(verdict_world):
    verdict_world(dict(variant="head_dim:split", verdict="right"))
    with attention.head_dim_layout_in("padded"):
        assert attention.head_dim_layout(HOPPER) == "padded"
    assert attention.head_dim_layout(HOPPER) == "split"
    common.set_fast_launch(True)
    assert common.fast_launch_enabled(0)
    common.set_fast_launch(None)
    assert not common.fast_launch_enabled(0)


@pytest.mark.parametrize("content", ["{not json", "[]", '{"machine": {"gpu": 1}, "verdicts": {}}', "\x00\x01"])
def test_a_corrupt_cache_is_ignored_with_a_warning(verdict_world, content):
    path = verdicts.record_verdicts(MACHINE, {"head_dim:split": {"verdict": "right"}})
    path.write_text(content)
    with pytest.warns(UserWarning, match="ignoring the corrupt verdict file"):
        assert verdicts.machine_verdicts(MACHINE) == {}
    verdicts.reset()
    with pytest.warns(UserWarning):
        assert attention.head_dim_layout(HOPPER) == "padded"
    # qvl check writes a sound file over it.
    with pytest.warns(UserWarning):
        verdicts.record_verdicts(MACHINE, {"head_dim:split": {"verdict": "wrong"}})
    assert verdicts.machine_verdicts(MACHINE) == {"head_dim:split": {"verdict": "wrong"}}


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_home_keeps_the_defaults(verdict_world, tmp_path):
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache").chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        with pytest.warns(UserWarning, match="cannot record verdicts"):
            assert verdicts.record_verdicts(MACHINE, {"head_dim:split": {"verdict": "right"}}) is None
        assert attention.head_dim_layout(HOPPER) == "padded"
    finally:
        (tmp_path / "cache").chmod(stat.S_IRWXU)


def test_an_unwritable_cache_directory_keeps_the_defaults(verdict_world, tmp_path, monkeypatch):
    """Where the cache's place is a file (or any path that cannot be a directory), as for root on a read-only one."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(verdicts.CACHE_VARIABLE, str(blocker / "cache"))
    with pytest.warns(UserWarning, match="cannot record verdicts"):
        assert verdicts.record_verdicts(MACHINE, {"head_dim:split": {"verdict": "right"}}) is None
    assert attention.head_dim_layout(HOPPER) == "padded"
    assert not any(p.name.endswith(".tmp") for p in tmp_path.rglob("*"))


def _record_many(directory: str, variant: str, count: int) -> None:
    os.environ[verdicts.CACHE_VARIABLE] = directory
    for i in range(count):
        verdicts.record_verdicts(MACHINE, {variant: {"verdict": "right", "round": i}})


def test_concurrent_writers_never_leave_a_partial_file(tmp_path):
    """Ranks checking at once: every read while four processes write sees a whole file of this machine."""
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_record_many, args=(str(tmp_path), f"head_dim:v{i}", 40)) for i in range(4)]
    for writer in writers:
        writer.start()
    os.environ[verdicts.CACHE_VARIABLE] = str(tmp_path)
    try:
        seen = 0
        while any(w.is_alive() for w in writers) or not seen:
            for path in (tmp_path / "verdicts").glob("*.json"):
                record = json.loads(path.read_text())
                assert record["machine"] == MACHINE._asdict()
                seen += 1
        for writer in writers:
            writer.join()
            assert writer.exitcode == 0
        final = verdicts.machine_verdicts(MACHINE)
        assert final and all(v == {"verdict": "right", "round": 39} for v in final.values())
        assert not list((tmp_path / "verdicts").glob("*.tmp"))
    finally:
        del os.environ[verdicts.CACHE_VARIABLE]
