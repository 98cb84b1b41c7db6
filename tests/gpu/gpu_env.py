"""Shared preamble of the GPU tests: skips, and the GDN kernel tests' inputs."""

import pytest


def require_cuda_vllm_fla() -> None:
    """Skip the calling test module unless CUDA, vLLM's GPU build and fla-core are all importable."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA", allow_module_level=True)
    pytest.importorskip("vllm")
    pytest.importorskip("fla")


# GDN kernel tests: 4 key / 8 value heads of dim 128, per-head decay and gate bias
GDN_H, GDN_HV, GDN_K, GDN_V = 4, 8, 128, 128


def gdn_gate_params():
    """``(A_log, dt_bias)`` of the GDN kernel tests (CPU tensors)."""
    import torch

    return torch.log(torch.linspace(1, 16, GDN_HV)), torch.linspace(-0.5, 0.5, GDN_HV)


def gdn_seq(T: int, seed: int):
    """One random sequence ``(q, k, v, a, b)`` (bf16 q/k/v, fp32 a/b) on the CPU."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(T, GDN_H, GDN_K, generator=g).bfloat16()
    k = torch.randn(T, GDN_H, GDN_K, generator=g).bfloat16()
    v = torch.randn(T, GDN_HV, GDN_V, generator=g).bfloat16()
    a, b = torch.randn(T, GDN_HV, generator=g), torch.randn(T, GDN_HV, generator=g)
    return q, k, v, a, b


def gdn_run(fn, seqs, states=None):
    """Pack ``seqs`` (from :func:`gdn_seq`), gate them and run ``fn(q, k, v, g, beta, states, cu)`` on CUDA
    (``gdn_recurrent_varlen`` or ``gdn_chunk_varlen``) from ``states`` (zeros by default): ``(o, states, cu)``."""
    import torch

    from vllm_bi.gdn.recurrent import gdn_gating

    q, k, v, a, b = (torch.cat([s[i] for s in seqs]).to("cuda") for i in range(5))
    cu = [0]
    for s in seqs:
        cu.append(cu[-1] + s[0].shape[0])
    A_log, dt_bias = gdn_gate_params()
    g, beta = gdn_gating(A_log.to("cuda"), a, b, dt_bias.to("cuda"))
    if states is None:
        states = torch.zeros(len(seqs), GDN_HV, GDN_V, GDN_K, device="cuda")
    o, final = fn(q, k, v, g, beta, states, cu)
    return o, final, cu
