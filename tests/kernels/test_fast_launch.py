"""The fast launch path (qvl.kernels.common): its specialization is Triton's, and it launches directly only what
Triton compiled for the same key. Checked without a GPU: the binders on the ops' real launches (fast_launch_keys.py,
interpreter off), the launch logic on a real JITFunction whose compile and launcher are stand-ins."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from triton.compiler import make_backend
from triton.compiler.compiler import CompiledKernel
from triton.runtime.jit import JITFunction

from conftest import ON_GPU
from qvl.kernels import attention, common
from qvl.kernels.common import HOPPER, KernelLaunch, device_target, run_launches

REPOSITORY = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bound_launches() -> list[dict]:
    result = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("fast_launch_keys.py"))],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPOSITORY,
        env={**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def test_fast_binder_specializes_every_launch_as_tritons_binder(bound_launches):
    """Every kernel family's launches: same specialization, same arguments in the kernel's parameter order, same
    options; and the launches reach the cases that matter (unaligned pointers, integers that are multiples of 16,
    other integers, integers equal to 1, TMA descriptors)."""
    differing = [
        line
        for line in bound_launches
        if not (line["order"] and line["values"] and line["options"])
        or line["specialization"] != line["fast_specialization"]
    ]
    assert not differing, differing
    kernels = {line["kernel"] for line in bound_launches}
    assert kernels >= {
        "_norm_kernel", "_norm_backward_kernel", "_bias_gelu_kernel", "_bias_swiglu_kernel", "_rotary_2d_kernel",
        "_pos_embed_interp_kernel", "_vision_attn_kernel", "_sum_partials_kernel",
    }  # fmt: skip
    specializations = " ".join(line["specialization"] for line in bound_launches)
    for case in ("('*bf16', 'D')", "('*bf16', '')", "('i32', 'D')", "('i32', '')", "('constexpr', 1)", "tensordesc<"):
        assert case in specializations, case


def _copy_kernel(X, Y, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offsets, tl.load(X + offsets, mask=offsets < n), mask=offsets < n)


class _Compiled(CompiledKernel):
    """A compiled kernel whose launcher records its arguments."""

    def __init__(self):
        self.function, self.packed_metadata, self.launches = object(), object(), []
        self.module = None  # nothing loaded, nothing to unload

    @property
    def run(self):
        return lambda *arguments: self.launches.append(arguments)


@pytest.fixture
def kernel(monkeypatch):
    """A real JITFunction (built directly: the suite's interpreter would make an interpreted one) whose
    ``kernel[grid](...)`` records the call and returns a new stand-in compiled kernel, on device 0."""
    kernel = JITFunction(_copy_kernel)
    kernel.normal_launches = []

    def run(*args, grid, warmup, **kwargs):
        kernel.normal_launches.append(kwargs)
        kernel.device_caches[0] = (None, None, HOPPER, make_backend(HOPPER), None)
        return _Compiled()

    monkeypatch.setattr(kernel, "run", run)
    monkeypatch.setattr(kernel, "device_caches", {})
    monkeypatch.setattr(common, "_current_stream", lambda device: 1234)
    return kernel


def _launch(kernel, x, y, n, block=64):
    launch = KernelLaunch(kernel, (3,), dict(X=x, Y=y, n=n), dict(BLOCK=block, num_warps=4))
    common._launch(launch, 0)


def test_a_seen_key_calls_the_compiled_launcher_with_the_arguments_in_order(kernel):
    x, y = torch.empty(2, 256)
    _launch(kernel, x, y, 1000)
    assert len(kernel.normal_launches) == 1
    (compiled,) = common.fast_binder(kernel).compiled.values()
    _launch(kernel, x, y, 1000)
    assert len(kernel.normal_launches) == 1
    (launched,) = compiled.launches
    assert launched == (3, 1, 1, 1234, compiled.function, compiled.packed_metadata, None, None, None, x, y, 1000, 64)


@pytest.mark.parametrize(
    "change",
    [
        lambda x, y: (x[1:], y, 1000),  # X off a 16-byte boundary
        lambda x, y: (x, y, 1024),  # n a multiple of 16
        lambda x, y: (x, y, 1),  # n equal to 1
        lambda x, y: (x.to(torch.float16), y, 1000),  # X's dtype
    ],
    ids=["unaligned", "divisible", "one", "dtype"],
)
def test_another_specialization_goes_through_triton_once(kernel, change):
    x, y = torch.empty(2, 256)
    _launch(kernel, x, y, 1000)
    _launch(kernel, *change(x, y))
    _launch(kernel, *change(x, y))
    assert len(kernel.normal_launches) == 2
    assert len(common.fast_binder(kernel).compiled) == 2


def test_other_meta_parameters_or_options_go_through_triton(kernel):
    x, y = torch.empty(2, 256)
    _launch(kernel, x, y, 1000)
    _launch(kernel, x, y, 1000, block=128)
    common._launch(KernelLaunch(kernel, (3,), dict(X=x, Y=y, n=1000), dict(BLOCK=64, num_warps=8)), 0)
    assert len(kernel.normal_launches) == 3


def test_a_rebound_global_or_a_launch_hook_sends_launches_through_triton(kernel, monkeypatch):
    namespace = {"SCALE": tl.constexpr(2.0)}
    monkeypatch.setattr(kernel, "used_global_vals", {("SCALE", id(namespace)): (tl.constexpr(2.0), namespace)})
    x, y = torch.empty(2, 256)
    _launch(kernel, x, y, 1000)
    _launch(kernel, x, y, 1000)
    assert len(kernel.normal_launches) == 1
    namespace["SCALE"] = tl.constexpr(2.0)
    _launch(kernel, x, y, 1000)
    assert len(kernel.normal_launches) == 2
    triton.knobs.runtime.launch_enter_hook.add(hook := lambda metadata: None)
    try:
        _launch(kernel, x, y, 1000)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    assert len(kernel.normal_launches) == 3
    _launch(kernel, x, y, 1000)
    assert len(kernel.normal_launches) == 3


def test_a_triton_without_its_specializer_launches_every_kernel_through_triton(kernel, monkeypatch):
    monkeypatch.setattr(common, "native_specialize_impl", None)
    monkeypatch.setattr(common, "_fast_binders", {})
    x, y = torch.empty(2, 256)
    _launch(kernel, x, y, 1000)
    _launch(kernel, x, y, 1000)
    assert len(kernel.normal_launches) == 2
    assert common.fast_binder(kernel) is None


@pytest.mark.parametrize(
    ("version", "verified", "on"),
    [
        ("3.6.0", True, True),
        ("3.7.1", True, True),
        ("3.8.0", True, True),
        ("3.9.0+git1a2b3c4", True, True),
        ("3.6.0", False, False),
        ("3.9.0", False, False),
        ("3.10.0", True, False),
        ("4.0.0", True, False),
    ],
)
def test_the_fast_path_is_on_by_default_only_where_verified_on_a_checked_triton(version, verified, on):
    """Unset, the fast path needs both: a Triton whose internals it was checked against, and a device verdict."""
    assert common.fast_launch_default(version, verified) is on


@pytest.mark.parametrize(("setting", "on"), [(None, None), ("1", True), ("yes", True), ("0", False), ("", False)])
def test_qvl_fast_launch_sets_it_outright(setting, on):
    assert common.fast_launch_setting(setting) is on


def _counting_triton_launches(kernel, monkeypatch) -> list:
    """Record each launch of ``kernel`` that goes through Triton's ``JITFunction.run``."""
    calls, run = [], kernel.run

    def counting(*args, **kwargs):
        calls.append(kwargs["grid"])
        return run(*args, **kwargs)

    monkeypatch.setattr(kernel, "run", counting)
    return calls


def _attention(q, k, v, cu_seqlens, positions):
    """vision_attn's launches with K and V as TMA descriptors (TensorDescriptor arguments), run; the output."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    launches = attention.vision_attn_launches(
        q, k, v, out, cu_seqlens, None, positions, 10000.0, device_target(q.device), None, None, {"DESCRIPTORS": True}
    )
    run_launches(launches, q.device)
    return out


@pytest.mark.skipif(not ON_GPU, reason="launches CUDA kernels")
def test_cuda_fast_launches_skip_triton_and_change_no_bit(monkeypatch):
    """On a GPU: a repeated launch bypasses JITFunction.run, an unaligned input goes through it once, and the
    results equal those of Triton's own launches bit for bit (the norm, and attention with descriptor arguments)."""
    monkeypatch.setattr(common, "_fast_launch", True)
    monkeypatch.setattr(common, "_fast_binders", {})  # what earlier tests launched would already be fast
    layer_norm = torch.ops.qvl.layer_norm
    norm_kernel = __import__("qvl.kernels.layer_norm", fromlist=["_"])._norm_kernel
    triton_launches = _counting_triton_launches(norm_kernel, monkeypatch)
    buffer = torch.randn(1 + 64 * 1152, device="cuda", dtype=torch.bfloat16)
    aligned, unaligned = buffer[:-1].view(64, 1152), buffer[1:].view(64, 1152)
    weight, bias = torch.randn(2, 1152, device="cuda", dtype=torch.bfloat16)
    fast = [layer_norm(x, weight, bias, 1e-6) for x in (aligned, aligned, unaligned, unaligned)]
    assert len(triton_launches) == 2, triton_launches
    common.set_fast_launch(False)
    slow = [layer_norm(x, weight, bias, 1e-6) for x in (aligned, unaligned)]
    assert len(triton_launches) == 4
    for got, expected in zip(fast, [slow[0], slow[0], slow[1], slow[1]]):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)

    common.set_fast_launch(True)
    attention_launches = _counting_triton_launches(attention.forward._vision_attn_kernel, monkeypatch)
    q, k, v = torch.randn(256, 3, 16, 72, device="cuda", dtype=torch.bfloat16).unbind(1)
    cu_seqlens = torch.tensor([0, 100, 256], device="cuda", dtype=torch.int32)
    positions = torch.randint(0, 16, (256, 2), device="cuda", dtype=torch.int32)
    fast = [_attention(q, k, v, cu_seqlens, positions) for _ in range(2)]
    assert len(attention_launches) == 1
    common.set_fast_launch(False)
    torch.testing.assert_close(fast[1], _attention(q, k, v, cu_seqlens, positions), rtol=0, atol=0)
    torch.testing.assert_close(fast[0], fast[1], rtol=0, atol=0)
