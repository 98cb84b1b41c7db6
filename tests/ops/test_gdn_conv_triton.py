"""The CUDA path of the GDN short conv (``vllm_bi.ops.conv``: Triton kernels) run through Triton's
interpreter on CPU: the forward's logic (sequence starts, conv-state taps, channel masking, SiLU) against the
float64 formula (within 1e-2 absolute + 1e-2 relative: bf16 output), a sequence's rows alone == the same rows
in a packed batch, exactly; the backward's gradients of x, weight and the conv states against float64
autograd of the formula (relative L2 <= 1e-2: bf16 inputs, fp32 arithmetic). The ring conv (the chunk mode's
decode: rows read in place, q, k, v written apart) == the plain kernel on the same rows gathered, exactly
(``tests/conv_ring_case.py``); so does the slot conv (states read and written in their cache slots) equal the
copying path (``tests/conv_slot_case.py``). Invariance and speed in compiled form are measured on the GPU
(tests/gpu/test_gdn_conv_cuda.py)."""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import torch
    from vllm_bi.ops.conv import BLOCK_D, CausalConv1dTriton, triton_causal_conv1d, triton_causal_conv1d_backward
    torch.manual_seed(0)
    W, D = 4, BLOCK_D + 40          # two channel blocks, the second partly masked
    lens = [5, 1, 2, 37]            # shorter than W-1: the output reads the conv state
    x = torch.randn(sum(lens), D).bfloat16()
    w = (torch.randn(D, W) * 0.5).bfloat16()
    st = torch.randn(len(lens), W - 1, D).bfloat16()

    def meta(ls):
        cu = torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()])
        seq = torch.repeat_interleave(torch.arange(len(ls)), torch.tensor(ls))
        return seq.int(), (torch.arange(sum(ls)) - cu[seq]).int(), cu[:-1]

    def reference(j, silu, x=x, w=w, st=st):
        ext = torch.cat([st[j].double(), x[sum(lens[:j]):sum(lens[:j + 1])].double()])
        y = sum(ext[w_ : w_ + lens[j]] * w[:, w_].double() for w_ in range(W))
        return y * torch.sigmoid(y) if silu else y

    for silu in (True, False):
        y = triton_causal_conv1d(x, w, st, *meta(lens), silu)
        assert y.dtype == torch.bfloat16 and y.shape == x.shape
        s = 0
        for j, n in enumerate(lens):
            ref = reference(j, silu)
            err = (y[s:s + n].double() - ref).abs() - 1e-2 * ref.abs()
            assert float(err.max()) <= 1e-2, (silu, j, float(err.max()))
            alone = triton_causal_conv1d(x[s:s + n], w, st[j:j + 1], *meta([n]), silu)
            assert torch.equal(alone, y[s:s + n]), (silu, j)
            s += n
        # backward: (dx, dweight, dconv_states) for a random output gradient, vs float64 autograd
        gy = torch.randn(x.shape).bfloat16()
        seq, pos, starts = meta(lens)
        got = triton_causal_conv1d_backward(gy, x, w, st, seq, pos, starts, torch.tensor(lens), silu)
        leaves = [t.double().requires_grad_(True) for t in (x, w, st)]
        ref = torch.cat([reference(j, silu, *leaves) for j in range(len(lens))])
        want = torch.autograd.grad((ref * gy.double()).sum(), leaves)
        for name, g_, w_ in zip(("dx", "dweight", "dstate"), got, want):
            assert g_.shape == w_.shape and g_.dtype == {"dx": x, "dweight": w, "dstate": st}[name].dtype
            rel = float((g_.double() - w_).norm() / w_.norm())
            assert rel <= 1e-2, (silu, name, rel)
        # the autograd wrapper hands those gradients on, and none for an input that needs none
        xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        y = CausalConv1dTriton.apply(xg, wg, st, seq, pos, starts, torch.tensor(lens), silu)
        y.backward(gy)
        assert torch.equal(xg.grad, got[0]) and torch.equal(wg.grad, got[1])
    print("ok")
""")


def test_triton_conv_logic_in_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def _run_case(module: str, check: str) -> None:
    """``tests/<module>.py``'s ``check('cpu')`` in a subprocess under Triton's interpreter."""
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = f"import sys; sys.path.insert(0, {tests!r}); from {module} import {check}; {check}('cpu'); print('ok')"
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_ring_conv_logic_in_interpreter():
    _run_case("conv_ring_case", "check_ring_conv")


def test_slot_conv_logic_in_interpreter():
    """The conv with its states read in and written back into their cache slots (the recurrent server step under
    ``VLLM_BI_GDN_IO=direct``) == the copying path, exactly (``tests/conv_slot_case.py``)."""
    _run_case("conv_slot_case", "check_slot_conv")
