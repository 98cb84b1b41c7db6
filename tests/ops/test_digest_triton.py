"""The weight digest's fused kernel (``vllm_bi.ops.digest_triton``: the CUDA path of ``vllm_bi.weights`` under
``VLLM_BI_DIGEST=triton``) run through Triton's interpreter on CPU.

Checked, exactly: its two sums equal the torch path's (``weights._value_sums``, itself checked against numpy's
unsigned words in tests/test_weights.py) for bf16, fp16 and fp32 tensors of 1, 1023 and 4097 values, a 2-D tensor and
non-contiguous views (the kernel reads a flat contiguous copy), holding +0.0, -0.0, +inf, -inf, subnormals, the
largest finite values and NaNs with payloads, under the default block and a small one (many programs, a ragged
last block); ``weight_digest`` of a mixed dict (a float64 tensor keeps the torch path) is the same with the kernel
dispatched and without; the dispatch takes the kernel only for CUDA tensors of those dtypes under the setting.
Negative controls: one flipped bit of one value, or -0.0 for +0.0, changes both sums.

NaN: on CPU torch's widening and the interpreter's (numpy's) both keep a NaN's payload and set its quiet bit, so the
sums agree here; on CUDA the kernel's widening and torch's are each the device's own conversion, and a NaN weight
may digest differently across the two paths there (a NaN weight is a failed load either way)."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import torch
    import vllm_bi.ops.digest_triton as D
    from vllm_bi import weights as W

    launched = []
    real = D.mixed_sums
    def counting(t, *a, **k):
        launched.append(t.dtype)
        return real(t, *a, **k)
    D.mixed_sums = counting

    def kernel(t, block=D.BLOCK):
        a, b = real(t, W._SALTS, W._MUL, block).tolist()
        return a & W._MASK64, b & W._MASK64

    def from_bits(dt, bits):
        width = 8 * dt.itemsize
        ints = torch.tensor([b - (1 << width) if b >> (width - 1) else b for b in bits],
                            dtype=torch.int16 if width == 16 else torch.int32)
        return ints.view(dt)

    # +0, -0, +inf, -inf, the smallest and largest subnormals (and a negative one), +-the largest finite value, the
    # smallest normal; then NaNs: quiet, quiet with a payload, signalling with a payload, negative
    SPECIAL = {
        torch.bfloat16: [0x0000, 0x8000, 0x7F80, 0xFF80, 0x0001, 0x007F, 0x8001, 0x7F7F, 0xFF7F, 0x0080],
        torch.float16: [0x0000, 0x8000, 0x7C00, 0xFC00, 0x0001, 0x03FF, 0x8001, 0x7BFF, 0xFBFF, 0x0400],
        torch.float32: [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x00000001, 0x007FFFFF, 0x80000001,
                        0x7F7FFFFF, 0xFF7FFFFF, 0x00800000],
    }
    NANS = {
        torch.bfloat16: [0x7FC0, 0x7FC1, 0x7F81, 0xFFC1],
        torch.float16: [0x7E00, 0x7E01, 0x7C01, 0xFE01],
        torch.float32: [0x7FC00000, 0x7FC00001, 0x7F800001, 0xFFC00001],
    }

    g = torch.Generator().manual_seed(0)
    for dt in D.DTYPES:
        special = from_bits(dt, SPECIAL[dt])
        assert special[1].item() == 0.0 and torch.signbit(special[1]) and special[7].item() == torch.finfo(dt).max
        cases = {}
        for n in (1, 1023, 4097):
            x = (torch.randn(n, generator=g) * 3).to(dt)
            k = min(n, len(special))
            x[torch.randperm(n, generator=g)[:k]] = special[:k]
            cases[n] = x
        two_d = (torch.randn(37, 29, generator=g)).to(dt)
        two_d[3, :len(special)] = special
        cases["2-D"] = two_d
        cases["transposed"] = two_d.t()
        cases["strided"] = cases[4097][::3]
        cases["nan"] = torch.cat([special, from_bits(dt, NANS[dt]), cases[1023][:50]])
        for name, x in cases.items():
            want = W._value_sums(x)
            assert kernel(x) == want, (dt, name)
            assert kernel(x, block=128) == want, (dt, name, "block 128")
        # negative controls: one bit of one value, and the sign of a zero, change both sums
        x = cases[4097]
        flipped = x.clone()
        bits = flipped.view(torch.int16 if dt.itemsize == 2 else torch.int32)
        bits[2049] ^= 1
        a, b = kernel(x), kernel(flipped)
        assert a[0] != b[0] and a[1] != b[1] and b == W._value_sums(flipped), dt
        plus, minus = from_bits(dt, [0x0000, 0x0001]), from_bits(dt, [0x8000 if dt.itemsize == 2 else 0x80000000, 1])
        kp, km = kernel(plus), kernel(minus)
        assert kp[0] != km[0] and kp[1] != km[1], dt
        assert kernel(x[:0]) == W._value_sums(x[:0]) == (0, 0)

    try:
        real(torch.zeros(3, dtype=torch.float64), W._SALTS, W._MUL)
        raise AssertionError("float64 reached the kernel")
    except NotImplementedError:
        pass

    # weight_digest with the kernel dispatched (as it is for CUDA tensors under VLLM_BI_DIGEST=triton) and without
    state = {
        "model.layers.0.self_attn.qkv_proj.weight": (torch.randn(96, 40, generator=g) * 0.02).to(torch.bfloat16),
        "model.layers.0.mlp.down_proj.weight": (torch.randn(40, 64, generator=g)).to(torch.float16).t(),
        "model.layers.1.linear_attn.A_log": torch.randn(17, generator=g),
        "model.layers.1.linear_attn.dt_bias": torch.randn(5, generator=g, dtype=torch.float64),
        "model.embed_tokens.weight": torch.cat([(torch.randn(50, 40, generator=g)).to(torch.bfloat16),
                                               from_bits(torch.bfloat16, SPECIAL[torch.bfloat16][:8]).view(2, 4).repeat(1, 10)]),
    }
    torch_path = W.weight_digest(state.items())
    assert not launched
    W._kernel_wanted = lambda dtype, device: dtype in D.DTYPES
    fused = W.weight_digest(state.items())
    assert sorted(map(str, launched)) == ["torch.bfloat16", "torch.bfloat16", "torch.float16", "torch.float32"], launched
    assert fused == torch_path, (fused, torch_path)
    changed = dict(state)
    w = state["model.layers.1.linear_attn.A_log"].clone()
    w[4] = torch.nextafter(w[4], torch.tensor(float("inf")))
    changed["model.layers.1.linear_attn.A_log"] = w
    assert W.digest_mismatches(torch_path, W.weight_digest(changed.items())) == ["layer001"]
    print("ok")
""")


def test_kernel_sums_equal_the_torch_path_in_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_dispatch_takes_the_kernel_only_for_cuda_tensors_of_its_dtypes_under_the_setting(monkeypatch):
    from vllm_bi import settings
    from vllm_bi.weights import _kernel_wanted

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.setenv("VLLM_BI_DIGEST", "triton")
    assert all(_kernel_wanted(dt, cuda) for dt in (torch.bfloat16, torch.float16, torch.float32))
    assert not _kernel_wanted(torch.float64, cuda) and not _kernel_wanted(torch.int32, cuda)
    assert not _kernel_wanted(torch.bfloat16, cpu)  # CPU tensors keep the torch path, the reference
    monkeypatch.setenv("VLLM_BI_DIGEST", "torch")
    assert not _kernel_wanted(torch.bfloat16, cuda)
    monkeypatch.setenv("VLLM_BI_DIGEST", "auto")
    assert _kernel_wanted(torch.bfloat16, cuda) == (settings.DIGEST_AUTO_CUDA == "triton")
