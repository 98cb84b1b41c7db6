"""The GDN gates' Triton kernel (``VLLM_BI_GDN_GATES=triton``, :mod:`vllm_bi.ops.gates_triton`) on CUDA gives the
torch path's bits: ``torch.equal`` of ``g`` and ``beta`` against :func:`vllm_bi.gdn.recurrent.gdn_gating` under
``VLLM_BI_GDN_GATES=torch``, on Qwen3.5-9B's 32 value heads, bf16 and fp32 inputs, column slices of one projection
(as vLLM hands them), values on both sides of softplus's threshold, and inf / NaN; and the same bits in a 1-row and a
16K-row call (batch invariance). Control: Triton's own ``exp`` in place of libdevice's gives other bits for some
element (so the equality is the libdevice choice's, not a check that cannot fail).

Run on a GPU machine: ``pytest tests/gpu/test_gates_cuda.py`` (seconds)."""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

DEV = "cuda"
HV = 32


def _inputs(T: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    proj = (torch.randn(T, 2 * HV + 5, generator=g) * 6).to(dtype)
    special = torch.tensor([25.0, 20.0, 19.999, -30.0, 0.0, 88.0, -88.0, float("inf"), float("-inf"), float("nan")])
    proj[: len(special), 5] = special.to(dtype)  # the first column of a
    proj[: len(special), 5 + HV] = special.to(dtype)  # and of b
    proj = proj.to(DEV)
    A_log = (torch.randn(HV, generator=g) * 0.7).to(DEV)
    dt_bias = torch.randn(HV, generator=g).to(DEV)
    return A_log, proj[:, 5 : 5 + HV], proj[:, 5 + HV : 5 + 2 * HV], dt_bias


def _torch_path(monkeypatch, *args):
    from vllm_bi.gdn.recurrent import gdn_gating

    monkeypatch.setenv("VLLM_BI_GDN_GATES", "torch")  # the suite's monkeypatch re-reads settings
    return gdn_gating(*args)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gates_kernel_gives_the_torch_paths_bits(dtype, monkeypatch):
    from vllm_bi.ops.gates_triton import gdn_gates

    args = _inputs(16384, dtype)
    g_t, beta_t = _torch_path(monkeypatch, *args)
    g, beta = gdn_gates(*args)
    assert torch.equal(g.nan_to_num(7.0), g_t.nan_to_num(7.0)) and torch.equal(g.isnan(), g_t.isnan())
    assert torch.equal(beta.nan_to_num(7.0), beta_t.nan_to_num(7.0)) and torch.equal(beta.isnan(), beta_t.isnan())
    one = gdn_gates(args[0], args[1][:1], args[2][:1], args[3])
    assert torch.equal(one[0], g[:1]) and torch.equal(one[1], beta[:1])


def test_control_triton_exp_gives_other_bits(monkeypatch):
    """The same kernel with Triton's approximate ``exp`` (the interpreter branch, ``LIBDEVICE=False``) on the GPU."""
    from vllm_bi.ops import gates_triton as G

    A_log, a, b, dt_bias = _inputs(16384, torch.float32)
    g_t, beta_t = _torch_path(monkeypatch, A_log, a, b, dt_bias)
    g, beta = G._launch(A_log, a, b, dt_bias, libdevice=False)
    fin = g_t.isfinite() & beta_t.isfinite()
    assert not (torch.equal(g[fin], g_t[fin]) and torch.equal(beta[fin], beta_t[fin]))
