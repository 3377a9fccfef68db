"""Bias + GELU, the epilogue of a bias-less GEMM: ``torch.ops.qvl.bias_gelu`` and its in-place twin
``torch.ops.qvl.bias_gelu_`` (exact-erf GELU for the patch mergers, tanh GELU for Qwen3-VL's blocks' MLP,
QuickGELU ``x * sigmoid(1.702 x)`` for Qwen2-VL's blocks' MLP).

The kernel is memory bound: it reads x and the bias once and writes once, computing in fp32 and rounding
once on the store. Its tiling and sigmoid are the row-wise epilogues' (:func:`qvl.kernels.tiles.row_tiles`,
:func:`qvl.kernels.tiles.times_sigmoid`), shared with the SwiGLU epilogue (:mod:`qvl.kernels.swiglu`).

Backward (``torch.ops.qvl.bias_gelu_backward``, bias_gelu's autograd formula): one kernel recomputes
``v = x + bias`` from the saved inputs (the output is not saved: the derivative needs v, not gelu(v)), writes
``dx = grad_y * gelu'(v)`` and sums it over each program's rows into fp32 partial rows, which a second
launch adds in a fixed order into ``dbias`` (:mod:`qvl.kernels.tiles`: no atomics, deterministic). The
in-place ``bias_gelu_`` has no backward (torch.library gives mutating custom ops none) and refuses calls
that would need one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

from .autocast import follow_autocast, in_autocast_dtype, like_written
from .common import (
    FLOAT_DTYPES,
    KernelLaunch,
    backend_for,
    cached_config,
    cdiv,
    check_no_internal_overlap,
    check_same_device,
    check_tensor,
    device_target,
    refuse_autograd,
    run_launches,
    runs_torch,
)
from .tiles import (
    LOG2E,
    epilogue_backward_config,
    last_dim_contiguous,
    round_to,
    row_tiles,
    sum_partials_launch,
    times_sigmoid,
)

__all__ = [
    "GELU_APPROXIMATIONS",
    "bias_gelu",
    "bias_gelu_",
    "bias_gelu_backward",
    "bias_gelu_backward_launches",
    "bias_gelu_backward_reference",
    "bias_gelu_launches",
    "bias_gelu_reference",
    "bias_gelu_torch",
    "bias_gelu_torch_",
    "launch_config",
]

# "none": exact erf GELU; "tanh": torch's tanh approximation; "quick": the sigmoid approximation
# x * sigmoid(1.702 x) (Hendrycks and Gimpel's, transformers' QuickGELUActivation).
GELU_APPROXIMATIONS = ("none", "tanh", "quick")

_SQRT1_2 = tl.constexpr(0.7071067811865476)
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_GELU_KAPPA = tl.constexpr(0.044715)
_QUICK_GELU_SCALE = tl.constexpr(1.702)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


@triton.jit(do_not_specialize=["num_rows"])
def _bias_gelu_kernel(
    # pointers
    X,
    Bias,
    Y,
    # sizes
    num_rows,
    num_cols,
    # strides (rows); the last dim is contiguous
    stride_xm,
    stride_ym,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    APPROXIMATE: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = cols < num_cols
    mask = (rows < num_rows)[:, None] & mask_n[None, :]

    x = tl.load(X + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
    bias = tl.load(Bias + cols, mask=mask_n, other=0.0)
    v = x.to(tl.float32) + bias.to(tl.float32)[None, :]
    if APPROXIMATE == "tanh":
        # v * (1 + tanh(u)) / 2 == v * sigmoid(2u): one exp2 and no tanh (which the interpreter lacks),
        # and no cancellation in 1 + tanh(u) for u << 0.
        u = v * (_SQRT_2_OVER_PI + (_SQRT_2_OVER_PI * _GELU_KAPPA) * v * v)
        y = times_sigmoid(v, 2.0 * u)
    elif APPROXIMATE == "quick":
        y = times_sigmoid(v, v * _QUICK_GELU_SCALE)
    else:
        y = 0.5 * v * (1.0 + tl.math.erf(v * _SQRT1_2))
    tl.store(Y + rows[:, None] * stride_ym + cols[None, :], round_to(y, Y.dtype.element_ty), mask=mask)


@triton.jit
def gelu_derivative(v, APPROXIMATE: tl.constexpr):
    """d gelu(v) / dv in fp32 for the GELU ``APPROXIMATE`` names. Sigmoids of both signs come from
    :func:`times_sigmoid`, so no ``1 - sigmoid`` cancels and saturated tails give exact 0 or 1 (never inf * 0)."""
    if APPROXIMATE == "tanh":
        # gelu = v * s, s = sigmoid(2u), u = sqrt(2/pi) (v + k v^3): gelu' = s + 2 v s (1 - s) u'.
        u = v * (_SQRT_2_OVER_PI + (_SQRT_2_OVER_PI * _GELU_KAPPA) * v * v)
        du = v * v * (3.0 * _SQRT_2_OVER_PI * _GELU_KAPPA) + _SQRT_2_OVER_PI
        s = times_sigmoid(1.0, 2.0 * u)
        derivative = s + 2.0 * v * s * times_sigmoid(1.0, -2.0 * u) * du
    elif APPROXIMATE == "quick":
        # gelu = v * s, s = sigmoid(a v): gelu' = s + a v s (1 - s).
        s = times_sigmoid(1.0, v * _QUICK_GELU_SCALE)
        derivative = s + _QUICK_GELU_SCALE * v * s * times_sigmoid(1.0, -v * _QUICK_GELU_SCALE)
    else:
        # gelu = v Phi(v): gelu' = Phi(v) + v phi(v).
        phi = tl.exp2(v * v * (-0.5 * LOG2E)) * _INV_SQRT_2PI
        derivative = 0.5 * (1.0 + tl.math.erf(v * _SQRT1_2)) + v * phi
    return derivative


@triton.jit(do_not_specialize=["num_rows", "blocks_per_program"])
def _bias_gelu_backward_kernel(
    # pointers
    X,
    Bias,
    DY,
    DX,
    Partials,
    # sizes
    num_rows,
    num_cols,
    blocks_per_program,
    # strides (rows); the last dims are contiguous
    stride_xm,
    stride_dym,
    stride_dxm,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    APPROXIMATE: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = cols < num_cols
    bias = tl.load(Bias + cols, mask=mask_n, other=0.0).to(tl.float32)
    dbias = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for block in range(0, blocks_per_program):
        rows = (pid * blocks_per_program + block).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (rows < num_rows)[:, None] & mask_n[None, :]
        x = tl.load(X + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
        dy = tl.load(DY + rows[:, None] * stride_dym + cols[None, :], mask=mask, other=0.0)
        # Masked elements have dy = 0, so they add nothing to dbias.
        dv = dy.to(tl.float32) * gelu_derivative(x.to(tl.float32) + bias[None, :], APPROXIMATE)
        tl.store(DX + rows[:, None] * stride_dxm + cols[None, :], round_to(dv, DX.dtype.element_ty), mask=mask)
        dbias += tl.sum(dv, axis=0)
    tl.store(Partials + pid.to(tl.int64) * num_cols + cols, dbias, mask=mask_n)


@cached_config
def launch_config(num_cols: int, approximate: str, target: GPUTarget) -> dict:
    """Everything the bias + GELU launch passes besides tensors and scalars, for rows of ``num_cols`` and
    the GELU ``approximate`` on ``target``: :func:`~qvl.kernels.tiles.row_tiles` and the approximation. Every
    target gets the same values (the interpreter ignores warps and options)."""
    return dict(row_tiles(num_cols), APPROXIMATE=approximate)


def bias_gelu_launches(x, bias, y, approximate: str, target: GPUTarget) -> list[KernelLaunch]:
    """The launch writing ``gelu(x + bias)`` into ``y`` for checked arguments; empty when x is. Reads shapes
    and strides only (no device sync)."""
    num_rows, num_cols = x.shape
    if x.numel() == 0:
        return []
    config = launch_config(num_cols, approximate, target)
    # Row blocks on grid axis 0 (up to 2**31 - 1); axis 1 (column blocks) is capped at 65535.
    grid = (cdiv(num_rows, config["BLOCK_M"]), cdiv(num_cols, config["BLOCK_N"]))
    args = dict(X=x, Bias=bias, Y=y, num_rows=num_rows, num_cols=num_cols, stride_xm=x.stride(0), stride_ym=y.stride(0))
    return [KernelLaunch(_bias_gelu_kernel, grid, args, config)]


def bias_gelu_backward_launches(grad_y, x, bias, dx, partials, dbias, approximate: str) -> list[KernelLaunch]:
    """The launches of bias_gelu's backward for checked arguments: ``dx = grad_y * gelu'(x + bias)`` (x's
    shape and dtype) and its fp32 per-program column sums into ``partials`` ``(1, programs, F)``
    (:func:`~qvl.kernels.tiles.epilogue_backward_config`), then their reduction into ``dbias``. Mutates dx,
    partials, dbias; empty when x is. Reads shapes and strides only (no device sync)."""
    num_rows, num_cols = x.shape
    if x.numel() == 0:
        return []
    config = epilogue_backward_config(num_rows, num_cols)
    grid = (config.pop("programs"), cdiv(num_cols, config["BLOCK_N"]))
    args = dict(
        # pointers
        X=x,
        Bias=bias,
        DY=grad_y,
        DX=dx,
        Partials=partials,
        # sizes
        num_rows=num_rows,
        num_cols=num_cols,
        blocks_per_program=config.pop("blocks_per_program"),
        # strides
        stride_xm=x.stride(0),
        stride_dym=grad_y.stride(0),
        stride_dxm=dx.stride(0),
    )
    return [
        KernelLaunch(_bias_gelu_backward_kernel, grid, args, dict(config, APPROXIMATE=approximate)),
        sum_partials_launch(partials, (dbias,)),
    ]


def _launch_bias_gelu(x, bias, y, approximate: str) -> None:
    run_launches(bias_gelu_launches(x, bias, y, approximate, device_target(x.device)), x.device)


def bias_gelu_reference(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """Pure-torch ``gelu(x + bias)`` in fp32 (float64 stays float64), one rounding to x's dtype,
    returned contiguous."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    v = x.to(compute) + bias.to(compute)
    y = v * torch.sigmoid(1.702 * v) if approximate == "quick" else F.gelu(v, approximate=approximate)
    return y.to(x.dtype).contiguous()


def bias_gelu_torch(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """:func:`bias_gelu` on the ops' torch path: eager torch's ``gelu(x + bias)`` in x's dtype (a 16-bit ``x + bias``
    rounded before the GELU, where transformers' ``Linear`` + GELU rounds its biased product too: one rounding more
    than :func:`bias_gelu_reference`, which computes in fp32 throughout). Returns a new contiguous tensor.

    Traced by torch.compile, the tanh GELU is written as the Triton kernel computes it, ``v * sigmoid(2u)``: Inductor's
    CPU code takes its vectorized exp there, where its vectorized tanh made that loop 3-5x slower (one fused pass
    over a 4,096 x 4,304 fp32 block: 6 ms against 30 ms on the benchmark's 2-core Xeon)."""
    v = x + bias
    if approximate == "quick":
        return v * torch.sigmoid(1.702 * v)
    if approximate == "tanh" and torch.compiler.is_compiling():
        return _tanh_gelu_as_sigmoid(v)
    return F.gelu(v, approximate=approximate)


def _tanh_gelu_as_sigmoid(v: torch.Tensor) -> torch.Tensor:
    """``0.5 v (1 + tanh(u)) = v sigmoid(2u) = v / (1 + exp(-2u))``, ``u = sqrt(2/pi) (v + 0.044715 v^3)``: for
    ``v << 0`` the exp overflows to inf and the quotient is -0, as the GELU's limit."""
    u = v * (_SQRT_2_OVER_PI.value + (_SQRT_2_OVER_PI.value * _GELU_KAPPA.value) * v * v)
    return v / (1.0 + torch.exp(-2.0 * u))


def bias_gelu_torch_(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> None:
    """:func:`bias_gelu_` on the ops' torch path: :func:`bias_gelu_torch`'s result (the same bits) written into ``x``.
    A contiguous ``x`` (a matmul's output) takes the bias and the GELU in place, two passes where the reference's
    fp32 copies and copy back make three (fp32) to five (16-bit); a strided one is copied back, since torch's
    vectorized GELU, which contiguous tensors get, rounds differently from its strided loop. Traced by
    torch.compile, a tanh GELU is :func:`bias_gelu_torch`'s sigmoid form copied back: one fused pass."""
    if not x.is_contiguous() or (approximate == "tanh" and torch.compiler.is_compiling()):
        x.copy_(bias_gelu_torch(x, bias, approximate))
        return
    x.add_(bias)
    if approximate == "quick":
        x.mul_(torch.sigmoid(1.702 * x))
    else:
        torch.ops.aten.gelu_(x, approximate=approximate)


def bias_gelu_backward_reference(
    grad_y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, approximate: str = "none"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch bias_gelu backward in fp32 (float64 stays float64): ``(dx, dbias)`` in x's dtype, dx
    contiguous, through torch's own GELU derivatives (QuickGELU's by the kernel's formula)."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    v = x.to(compute) + bias.to(compute)
    dy = grad_y.to(compute)
    if approximate == "quick":
        s = torch.sigmoid(1.702 * v)
        dv = dy * (s + 1.702 * v * s * torch.sigmoid(-1.702 * v))
    else:
        dv = torch.ops.aten.gelu_backward(dy, v, approximate=approximate)
    return dv.to(x.dtype).contiguous(), dv.sum(0).to(x.dtype)


def _check_bias_gelu_args(op: str, x, bias, approximate) -> None:
    check_tensor(op, "x", x, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    check_tensor(op, "bias", bias, ndim=1, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    if bias.shape[0] != x.shape[1]:
        raise ValueError(f"{op}: bias must have shape (F,) = ({x.shape[1]},), got {tuple(bias.shape)}")
    if bias.dtype != x.dtype:
        raise TypeError(f"{op}: bias must have x's dtype {x.dtype}, got {bias.dtype}")
    check_same_device(op, {"x": x, "bias": bias})
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"{op}: approximate must be one of {GELU_APPROXIMATIONS}, got {approximate!r}")


@torch.library.custom_op("qvl::bias_gelu", mutates_args=(), device_types=("cpu", "cuda"))
def bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``gelu(x + bias)``: the epilogue of a bias-less ``x = h @ W^T``.

    Args:
        x: ``(N, F)`` fp16/bf16/fp32, last dim contiguous (row stride free).
        bias: contiguous ``(F,)`` in x's dtype, on x's device.
        approximate: ``"none"`` (exact erf GELU, the patch mergers' ``nn.GELU()``), ``"tanh"``
            (``gelu_pytorch_tanh``, Qwen3-VL's blocks' MLP) or ``"quick"`` (``x * sigmoid(1.702 x)``,
            transformers' ``QuickGELUActivation``, ``hidden_act="quick_gelu"`` of Qwen2-VL's blocks' MLP).
            QuickGELU is GELU's sigmoid approximation, as "tanh" is its tanh approximation, and needs
            exactly this op's epilogue, in-place twin and rounding, so it is a third value of
            ``approximate`` (a string in the schema) rather than a sibling op.

    Returns a new contiguous ``(N, F)`` tensor in x's dtype. ``x + bias`` and the GELU are computed in
    fp32 and rounded once. Compared with eager ``F.gelu(F.linear(h, W, b))``, which rounds
    ``h @ W^T + b`` to the dtype before the GELU, the caller's bias-less GEMM rounds ``h @ W^T`` before
    the bias instead: results agree within one rounding of the dtype at the GELU's input (in fp32, within
    fp32 rounding). transformers' QuickGELU in a 16-bit dtype also rounds ``1.702 x`` and the sigmoid
    before the product; qvl rounds once. Nothing is mutated. Differentiable in x and bias
    (:func:`bias_gelu_backward`; saves x and bias).
    """
    _check_bias_gelu_args("bias_gelu", x, bias, approximate)
    backend = backend_for(x.device)
    if backend == "torch":
        return bias_gelu_torch(x, bias, approximate)
    if backend == "reference":
        return bias_gelu_reference(x, bias, approximate)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_bias_gelu(x, bias, y, approximate)
    return y


@bias_gelu.register_fake
def _(x, bias, approximate="none"):
    _check_bias_gelu_args("bias_gelu", x, bias, approximate)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("qvl::bias_gelu_", mutates_args=("x",), device_types=("cpu", "cuda"))
def bias_gelu_(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> None:
    """In-place :func:`bias_gelu`: overwrites ``x`` with ``gelu(x + bias)`` where it lies (row-strided
    views included; ``bias`` must not overlap ``x``). Returns nothing.

    No backward: torch.library supports autograd for functional custom ops only. Called with grad mode on
    and ``x`` or ``bias`` requiring grad it raises a RuntimeError pointing to the out-of-place
    :func:`bias_gelu` (which has one), instead of mutating ``x`` behind autograd's back; under
    ``torch.no_grad()`` or with inputs that need no grad it runs as before."""
    _check_bias_gelu_args("bias_gelu_", x, bias, approximate)
    check_no_internal_overlap("bias_gelu_", "x", x)
    backend = backend_for(x.device)
    if backend == "torch":
        bias_gelu_torch_(x, bias, approximate)
        return
    if backend == "reference":
        x.copy_(bias_gelu_reference(x, bias, approximate))
        return
    _launch_bias_gelu(x, bias, x, approximate)


@bias_gelu_.register_fake
def _(x, bias, approximate="none"):
    _check_bias_gelu_args("bias_gelu_", x, bias, approximate)


refuse_autograd("bias_gelu_", "torch.ops.qvl.bias_gelu(x, bias, approximate)")


@torch.library.custom_op("qvl::bias_gelu_backward", mutates_args=(), device_types=("cpu", "cuda"))
def bias_gelu_backward(
    grad_y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, approximate: str = "none"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward of :func:`bias_gelu`.

    Args:
        grad_y: ``(N, F)`` gradient of the output, x's dtype, last dim contiguous (row stride free).
        x, bias, approximate: the forward's inputs, checked as :func:`bias_gelu` checks them.

    Returns new ``(dx (N, F) contiguous, dbias (F,))`` in x's dtype: ``dx = grad_y * gelu'(x + bias)`` in fp32,
    rounded once; ``dbias`` its column sums in fp32 (per-program partial sums added in a fixed order:
    deterministic), rounded once. Nothing is mutated.
    """
    _check_bias_gelu_backward_args(grad_y, x, bias, approximate)
    if runs_torch(x.device):
        return bias_gelu_backward_reference(grad_y, x, bias, approximate)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    # With no rows nothing is launched and the bias gradient is zeros.
    dbias = torch.empty_like(bias) if x.shape[0] else torch.zeros_like(bias)
    programs = epilogue_backward_config(x.shape[0], x.shape[1])["programs"]
    partials = torch.empty((1, programs, x.shape[1]), dtype=torch.float32, device=x.device)
    run_launches(bias_gelu_backward_launches(grad_y, x, bias, dx, partials, dbias, approximate), x.device)
    return dx, dbias


def _check_bias_gelu_backward_args(grad_y, x, bias, approximate) -> None:
    op = "bias_gelu_backward"
    _check_bias_gelu_args(op, x, bias, approximate)
    check_tensor(op, "grad_y", grad_y, ndim=2, dtypes=(x.dtype,), last_dim_contiguous=True)
    if grad_y.shape != x.shape:
        raise ValueError(f"{op}: grad_y must have x's shape {tuple(x.shape)}, got {tuple(grad_y.shape)}")
    check_same_device(op, {"x": x, "grad_y": grad_y})


@bias_gelu_backward.register_fake
def _(grad_y, x, bias, approximate="none"):
    _check_bias_gelu_backward_args(grad_y, x, bias, approximate)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty_like(bias)


def _bias_gelu_setup_context(ctx, inputs, output):
    x, bias, approximate = inputs
    ctx.save_for_backward(x, bias)
    ctx.approximate = approximate


def _bias_gelu_backward(ctx, grad_y):
    x, bias = ctx.saved_tensors
    dx, dbias = bias_gelu_backward(last_dim_contiguous(grad_y), x, bias, ctx.approximate)
    return dx, dbias, None


bias_gelu.register_autograd(_bias_gelu_backward, setup_context=_bias_gelu_setup_context)
# The bias and activation of a linear layer's output: in the autocast dtype, as the linear's bias.
follow_autocast("bias_gelu", in_autocast_dtype(0, 1))
follow_autocast("bias_gelu_", like_written(0))
follow_autocast("bias_gelu_backward")
