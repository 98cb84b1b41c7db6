"""The row-local kernels (``vllm_bi.ops.rows_triton``: RMSNorm with and without the residual add, the GDN gated
norm, SiLU-and-mul; the CUDA path under ``VLLM_BI_ROWWISE=triton``) through Triton's interpreter on CPU.

Checked: the public ops take the kernels when the setting says so (every kernel launched); outputs against float64
references (bf16 outputs within 1.6e-2 relative to the row's max, fp32 within 1e-5); the new residual equal to the
rounded sum (fp32; bf16 within one ulp, as the interpreter truncates where the GPU rounds to nearest); a row's bits the same alone, in any prefix of the batch and at any position (exact); gradients of x,
residual, z and weight against float64 autograd within 2e-2 (bf16 inputs) and 1e-4 (fp32 inputs). The compiled
kernels' invariance, with the negative control (a block width chosen by the batch changes a row's bits), runs on
the GPU (``tests/gpu/test_ops_cuda.py``)."""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    import vllm_bi.ops.rows_triton as R
    from vllm_bi.ops.activation import silu_mul
    from vllm_bi.ops.norm import gated_rms_norm, rms_norm, rms_norm_maybe_residual

    launched = []
    real = R._kernels()
    class Counting(dict):
        def __getitem__(self, k):
            launched.append(k)
            return dict.__getitem__(self, k)
    R._KERNELS = Counting(real)
    R._kernels = lambda: R._KERNELS

    g = torch.Generator().manual_seed(0)
    def rnd(*s, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).to(dtype)

    def rel(a, b):
        return float((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30))

    def invariant(fn, x, *more):
        full = fn(x, *more)
        full = full if isinstance(full, tuple) else (full,)
        for m in (1, 2, 5, x.shape[0]):
            part = fn(x[:m], *[t[:m] for t in more])
            part = part if isinstance(part, tuple) else (part,)
            for a, b in zip(part, full):
                assert torch.equal(a, b[:m]), m
        i = x.shape[0] - 1
        last = fn(x[i:], *[t[i:] for t in more])
        last = last if isinstance(last, tuple) else (last,)
        for a, b in zip(last, full):
            assert torch.equal(a, b[i:]), "last row alone"

    def ref_rms(h, w, eps):
        y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return y if w is None else y * w

    eps = 1e-6
    for dtype, tol in ((torch.bfloat16, 1.6e-2), (torch.float32, 1e-5)):
        for n in (7, 256, 1000):
            x, r = rnd(9, n, dtype=dtype), rnd(9, n, dtype=dtype)
            wg = torch.randn(n, generator=g).float() * 0.1 + 1.0   # a Gemma weight (w + 1 in fp32)
            wb = rnd(n, dtype=dtype)                               # a weight in the input dtype
            for w in (wg, wb, None):
                out = rms_norm(x, w, eps)
                assert out.dtype == dtype and out.shape == x.shape
                assert rel(out, ref_rms(x.double(), None if w is None else w.double(), eps)) < tol, (n, dtype)
                invariant(lambda t, w=w: rms_norm(t, w, eps), x)
                o2, res = rms_norm_maybe_residual(x, r, w, eps)
                h = x.double() + r.double()
                exact = (x.float() + r.float()).to(dtype)
                if dtype == torch.float32:
                    assert torch.equal(res, exact)
                else:  # the interpreter truncates fp32 -> bf16 (the GPU rounds to nearest): one bf16 ulp
                    assert ((res.float() - exact.float()).abs() <= exact.float().abs() * 2**-7).all()
                assert rel(o2, ref_rms(h, None if w is None else w.double(), eps)) < tol
                invariant(lambda t, u, w=w: rms_norm_maybe_residual(t, u, w, eps), x, r)
        # a row view with a stride (q of a fused qkv) and a 3-d input
        qkv = rnd(5, 3, 64, dtype=dtype)
        q = qkv[:, 0]
        assert torch.equal(rms_norm(q, None, eps), rms_norm(q.contiguous(), None, eps))
        assert rms_norm(rnd(2, 3, 64, dtype=dtype), None, eps).shape == (2, 3, 64)

        # gated norm: GDN's (rows of head_v_dim, silu(z) after the norm), groups, sigmoid, gate before the norm
        for shape, group, wn in (((11, 128), None, 128), ((6, 4 * 32), 32, 32), ((6, 4 * 32), 32, 128)):
            x, z = rnd(*shape, dtype=dtype), rnd(*shape, dtype=dtype)
            w = torch.randn(wn, generator=g).to(dtype)
            for before, act in ((True, "silu"), (False, "silu"), (True, "sigmoid")):
                out = gated_rms_norm(x, z, w, eps, before, act, group)
                gn = shape[-1] if group is None else group
                a = F.silu(z.double()) if act == "silu" else torch.sigmoid(z.double())
                xx = x.double() if before else x.double() * a
                y = ref_rms(xx.reshape(*shape[:-1], -1, gn), None, eps).reshape(shape)
                wfull = w.double() if wn == shape[-1] else w.double().repeat(shape[-1] // wn)
                y = y * wfull * (a if before else 1.0)
                assert rel(out, y) < tol, (shape, group, wn, before, act, dtype)
                invariant(lambda t, u, b=before, a_=act: gated_rms_norm(t, u, w, eps, b, a_, group), x, z)
        x = rnd(4, 128, dtype=dtype)
        assert rel(gated_rms_norm(x, None, torch.ones(128), eps), ref_rms(x.double(), None, eps)) < tol

        # SiLU-and-mul: d below and above one program's block, and a 3-d input
        for d in (5, R.SILU_BLOCK + 3):
            x = rnd(7, 2 * d, dtype=dtype, scale=3.0)
            out = silu_mul(x)
            sil = F.silu(x[:, :d].double()).to(dtype).double() if dtype != torch.float32 else F.silu(x[:, :d].double())
            assert rel(out, sil * x[:, d:].double()) < tol, (d, dtype)
            invariant(silu_mul, x)
        assert silu_mul(rnd(2, 3, 20, dtype=dtype)).shape == (2, 3, 10)
    assert {"rms", "gated", "silu"} <= set(launched), launched

    # gradients against float64 autograd
    for dtype, gtol in ((torch.bfloat16, 2e-2), (torch.float32, 1e-4)):
        x, r = rnd(6, 96, dtype=dtype).requires_grad_(), rnd(6, 96, dtype=dtype).requires_grad_()
        w = (torch.randn(96, generator=g) * 0.1).requires_grad_()
        out, res = rms_norm_maybe_residual(x, r, w.float() + 1.0, eps)
        go, gr = torch.randn(out.shape, generator=g), torch.randn(out.shape, generator=g)
        (out.float() * go + res.float() * gr).sum().backward()
        xd, rd, wd = (t.detach().double().requires_grad_() for t in (x, r, w))
        h = xd + rd
        (ref_rms(h, wd + 1.0, eps) * go.double() + h * gr.double()).sum().backward()
        for a, b in ((x.grad, xd.grad), (r.grad, rd.grad), (w.grad, wd.grad)):
            assert rel(a, b) < gtol, (dtype, rel(a, b))

        x, z = rnd(5, 64, dtype=dtype).requires_grad_(), rnd(5, 64, dtype=dtype).requires_grad_()
        w = torch.randn(64, generator=g).requires_grad_()
        out = gated_rms_norm(x, z, w, eps, True, "silu")
        go = torch.randn(out.shape, generator=g)
        (out.float() * go).sum().backward()
        xd, zd, wd = (t.detach().double().requires_grad_() for t in (x, z, w))
        (ref_rms(xd, wd, eps) * F.silu(zd) * go.double()).sum().backward()
        for a, b in ((x.grad, xd.grad), (z.grad, zd.grad), (w.grad, wd.grad)):
            assert rel(a, b) < gtol, (dtype, rel(a, b))

        x = rnd(5, 2 * 40, dtype=dtype, scale=2.0).requires_grad_()
        out = silu_mul(x)
        go = torch.randn(out.shape, generator=g)
        (out.float() * go).sum().backward()
        xd = x.detach().double().requires_grad_()
        (F.silu(xd[:, :40]) * xd[:, 40:] * go.double()).sum().backward()
        assert rel(x.grad, xd.grad) < gtol, (dtype, rel(x.grad, xd.grad))
    print("ok")
""")


def test_rows_triton_logic_in_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", VLLM_BI_ROWWISE="triton")
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.stdout[-2000:], r.stderr[-4000:])


def test_rows_setting_resolves_per_device():
    from vllm_bi.settings import ROWWISE_AUTO_CUDA, Settings

    assert Settings().rowwise_op("cpu") == "torch"
    assert Settings().rowwise_op("cuda") == ROWWISE_AUTO_CUDA
    assert Settings(rowwise="torch").rowwise_op("cuda") == "torch"
    assert Settings(rowwise="triton").arithmetic("cuda")["rowwise"] == "triton"
