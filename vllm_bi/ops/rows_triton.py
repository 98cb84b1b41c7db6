"""Row-local ops as one Triton kernel each: the CUDA path of :mod:`vllm_bi.ops.norm` and
:mod:`vllm_bi.ops.activation` under ``VLLM_BI_ROWWISE=triton``.

Batch invariance holds by construction: a norm runs one program per row, and the row's sum of squares is one
``tl.sum`` over a block whose width (``next_pow2(n)``) and warp count depend on the row length ``n`` alone; SiLU-and-mul
is elementwise. No tensor shape other than the row length reaches a kernel's configuration, so a row's bits are the
same in a one-token decode, a 64K-token prefill, a CUDA-graph replay and the trainer's forward.

The arithmetic is the torch path's formula (fp32 math, the same roundings to the input and weight dtypes), but
``exp``, the division and the square root are Triton's, so the bits differ from the torch path's: server and
trainer must agree on this setting (it is part of :meth:`vllm_bi.settings.Settings.arithmetic`).

Gradients: the forward is the kernel; the backward recomputes the op with the torch path and differentiates that
(the same function up to rounding), so the trainer's gradients are the torch path's to within fp32 rounding.
"""

from __future__ import annotations

import torch

from vllm_bi.ops.layout import aligned, canonical_rows
from vllm_bi.ops.layout import wanted as layout_wanted

__all__ = ["wanted", "rows_backend", "rms_norm", "gated_rms_norm", "silu_mul", "MAX_ROW"]

MAX_ROW = 16384  # longest row a norm kernel holds in one block; longer rows take the torch path
SILU_BLOCK = 1024  # SiLU-and-mul elements per program

_KERNELS: dict = {}


def rows_backend(device: torch.device | str) -> str:
    """``"triton"`` or ``"torch"`` for tensors on ``device``, from ``VLLM_BI_ROWWISE``."""
    from vllm_bi.ops._choice import check_triton_device
    from vllm_bi.settings import current

    dev_type = torch.device(device).type
    choice = current().rowwise_op(dev_type)
    check_triton_device("VLLM_BI_ROWWISE", choice, dev_type)
    return choice


def wanted(x: torch.Tensor) -> bool:
    """Whether an op on ``x`` runs its kernel: on CUDA by the setting; on CPU only when it is ``triton`` (the
    interpreter, for tests)."""
    from vllm_bi.settings import current

    if x.device.type == "cpu" and current().rowwise != "triton":
        return False
    return rows_backend(x.device) == "triton"


def _block(n: int) -> tuple[int, int]:
    block = 16
    while block < n:
        block *= 2
    return block, 4 if block <= 1024 else 8 if block <= 4096 else 16


def _kernels():
    if _KERNELS:
        return _KERNELS
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_ptr, n, sx, sr, eps,
                        HAS_RES: tl.constexpr, HAS_W: tl.constexpr, W_ROUND: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        live = offs < n
        h = tl.load(x_ptr + row * sx + offs, mask=live, other=0.0).to(tl.float32)
        if HAS_RES:
            h += tl.load(r_ptr + row * sr + offs, mask=live, other=0.0).to(tl.float32)
            tl.store(res_ptr + row * n + offs, h.to(res_ptr.dtype.element_ty), mask=live)
        rstd = 1.0 / tl.sqrt_rn(tl.sum(h * h, axis=0) / n + eps)
        y = h * rstd
        if HAS_W:
            w = tl.load(w_ptr + offs, mask=live, other=0.0)
            if W_ROUND:  # a low-precision weight multiplies the normalised row rounded to its dtype
                y = y.to(w.dtype)
            y = y.to(tl.float32) * w.to(tl.float32)
        tl.store(out_ptr + row * n + offs, y.to(out_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def gated_rms_norm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, n, groups, sx, sz, eps,
                              HAS_Z: tl.constexpr, BEFORE: tl.constexpr, SIGMOID: tl.constexpr,
                              BLOCK: tl.constexpr):
        # rows of n elements; a row of x's last dim holds ``groups`` of them, each with its own slice of w
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        live = offs < n
        base_x = (row // groups) * sx + (row % groups) * n
        x = tl.load(x_ptr + base_x + offs, mask=live, other=0.0).to(tl.float32)
        if HAS_Z:
            z = tl.load(z_ptr + (row // groups) * sz + (row % groups) * n + offs, mask=live, other=0.0)
            z = z.to(tl.float32)
            a = 1.0 / (1.0 + tl.exp(-z))
            if not SIGMOID:
                a = z * a
            if not BEFORE:
                x = x * a
        rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / n + eps)
        w = tl.load(w_ptr + (row % groups) * n + offs, mask=live, other=0.0).to(tl.float32)
        y = x * rstd * w
        if HAS_Z:
            if BEFORE:
                y = y * a
        tl.store(out_ptr + row * n + offs, y.to(out_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def silu_mul_kernel(x_ptr, out_ptr, d, sx, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = offs < d
        a = tl.load(x_ptr + row * sx + offs, mask=live, other=0.0)
        b = tl.load(x_ptr + row * sx + d + offs, mask=live, other=0.0)
        a32 = a.to(tl.float32)
        s = (a32 / (1.0 + tl.exp(-a32))).to(a.dtype)  # silu, rounded to the input dtype first
        tl.store(out_ptr + row * d + offs, (s.to(tl.float32) * b.to(tl.float32)).to(out_ptr.dtype.element_ty),
                 mask=live)

    _KERNELS.update(rms=rms_norm_kernel, gated=gated_rms_norm_kernel, silu=silu_mul_kernel)
    return _KERNELS


def _rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x`` as ``[rows, n]``: in the one layout every norm kernel reads where :func:`vllm_bi.ops.layout.wanted` says
    so (:func:`~vllm_bi.ops.layout.canonical_rows`: the row's sum of squares then adds in the same order whatever view
    the caller holds), else with unit stride along a row (a view where possible)."""
    if layout_wanted(x):
        return canonical_rows(x, n)
    x2 = x.reshape(-1, n)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _weight(w: torch.Tensor) -> torch.Tensor:
    return aligned(w) if layout_wanted(w) else w


def _rms_norm_fwd(x, residual, weight, eps, block=None):
    """The kernel's forward (``block``: another block width than the row length's, for the GPU test's control)."""
    n = x.shape[-1]
    x2 = _rows(x, n)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else out
    r2 = _rows(residual, n) if residual is not None else x2
    block, warps = _block(n) if block is None else (block, _block(block)[1])
    if x2.shape[0]:
        _kernels()["rms"][(x2.shape[0],)](
            x2, r2, _weight(weight) if weight is not None else x2, out, res_out, n, x2.stride(0), r2.stride(0),
            float(eps),
            HAS_RES=residual is not None, HAS_W=weight is not None,
            W_ROUND=weight is not None and weight.dtype != torch.float32, BLOCK=block, num_warps=warps)
    return out if residual is None else (out, res_out)


def _gated_fwd(x, z, weight, eps, norm_before_gate, activation, group_size):
    D = x.shape[-1]
    n = D if group_size is None else group_size
    w = _weight(weight.reshape(-1))
    # one weight for every group: each group is a row; a weight per group: a row of x holds D // n groups
    width, groups = (n, 1) if w.numel() == n else (D, D // n)
    xr = _rows(x, width)
    zr = _rows(z, width) if z is not None else xr
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block, warps = _block(n)
    if xr.shape[0]:
        _kernels()["gated"][(xr.shape[0] * groups,)](
            xr, zr, w, out, n, groups, xr.stride(0), zr.stride(0), float(eps), HAS_Z=z is not None,
            BEFORE=bool(norm_before_gate), SIGMOID=activation == "sigmoid", BLOCK=block, num_warps=warps)
    return out


def _silu_mul_fwd(x):
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)  # elementwise: no sum whose order a layout could change
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    if x2.shape[0] and d:
        _kernels()["silu"][(x2.shape[0], _cdiv(d, SILU_BLOCK))](x2, out, d, x2.stride(0), BLOCK=SILU_BLOCK,
                                                                      num_warps=4)
    return out


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _KernelWithTorchBackward(torch.autograd.Function):
    """Forward by a kernel; backward by differentiating the torch path's ``reference`` on the saved inputs."""

    @staticmethod
    def forward(ctx, kernel, reference, kwargs, *tensors):
        ctx.reference, ctx.kwargs = reference, kwargs
        ctx.save_for_backward(*tensors)
        return kernel(*tensors, **kwargs)

    @staticmethod
    def backward(ctx, *grads):
        need = ctx.needs_input_grad[3:]
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(bool(k)) if t is not None else None
                      for t, k in zip(ctx.saved_tensors, need)]
            outs = ctx.reference(*leaves, **ctx.kwargs)
            outs = outs if isinstance(outs, tuple) else (outs,)
            pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
            wrt = [t for t, k in zip(leaves, need) if k]
            got = iter(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
                       if pairs and wrt else [None] * len(wrt))
        return (None, None, None, *[next(got) if k else None for k in need])


def rms_norm(x, residual, weight, eps, reference):
    """:func:`vllm_bi.ops.norm.rms_norm_maybe_residual` on the kernel (``reference``: the torch path)."""
    if x.shape[-1] > MAX_ROW:
        return reference(x, residual, weight, eps=eps)
    return _KernelWithTorchBackward.apply(_rms_norm_fwd, reference, {"eps": eps}, x, residual, weight)


def gated_rms_norm(x, z, weight, eps, norm_before_gate, activation, group_size, reference):
    """:func:`vllm_bi.ops.norm.gated_rms_norm` on the kernel (``reference``: the torch path)."""
    kwargs = {"eps": eps, "norm_before_gate": norm_before_gate, "activation": activation, "group_size": group_size}
    n = x.shape[-1] if group_size is None else group_size
    if n > MAX_ROW or x.shape[-1] % n or weight.numel() not in (n, x.shape[-1]):
        return reference(x, z, weight, **kwargs)
    return _KernelWithTorchBackward.apply(_gated_fwd, reference, kwargs, x, z, weight)


def silu_mul(x, reference):
    """:func:`vllm_bi.ops.activation.silu_mul` on the kernel (``reference``: the torch path)."""
    return _KernelWithTorchBackward.apply(_silu_mul_fwd, reference, {}, x)
