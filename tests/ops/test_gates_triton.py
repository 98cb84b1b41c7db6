"""The GDN gates as one Triton kernel (``VLLM_BI_GDN_GATES=triton``, :mod:`vllm_bi.ops.gates_triton`), through
Triton's interpreter on CPU: the logic, not CUDA's bits (``tests/gpu/test_gates_cuda.py`` checks those against the
torch path with ``torch.equal``).

- values: within 2e-6 relative of the float64 formula (fp32 rounding of exp, log1p and the division), on both
  sides of softplus's threshold, with strided ``a`` and ``b`` (vLLM hands them as column slices), and equal to the
  torch path within the same tolerance;
- batch invariance: an element's value is the same whatever the number of rows and the element's offset (the
  first 5 rows of a 3000-row call are ``torch.equal`` to a 5-row call's);
- gradients: within 1e-5 relative of float64 autograd of the formula, for ``A_log``, ``a``, ``b`` and ``dt_bias``;
- the setting: ``gdn_gating`` takes the kernel only where ``VLLM_BI_GDN_GATES`` says so, and the setting is part of
  the arithmetic (control: a torch server and a triton trainer differ).
"""

from vllm_bi import settings as S

SCRIPT = r'''
import torch
from vllm_bi.ops.gates_triton import gdn_gates
from vllm_bi.gdn import recurrent as R

torch.manual_seed(0)
HV = 32
A_log = torch.randn(HV) * 0.5
dt_bias = torch.randn(HV)
proj = torch.randn(3000, 2 * HV + 7, dtype=torch.bfloat16) * 8  # a and b are column slices of one projection
edge = torch.tensor([25.0, 20.0, 19.9, -30.0, 0.0, 60.0, -60.0])  # both sides of softplus's threshold
proj[:7, 3], proj[:7, 3 + HV] = edge, edge  # the first column of a and of b
a, b = proj[:, 3:3 + HV], proj[:, 3 + HV:3 + 2 * HV]
assert (a.float() + dt_bias > 20).any() and (a.float() + dt_bias < 20).any()
assert not a.is_contiguous()


def ref64(A_log, a, b, dt_bias):
    x = a.double() + dt_bias.double()
    soft = torch.where(x > 20, x, torch.log1p(torch.exp(x.clamp(max=20))))
    return -torch.exp(A_log.double()) * soft, torch.sigmoid(b.double())


g, beta = gdn_gates(A_log, a, b, dt_bias)
g64, b64 = ref64(A_log, a, b, dt_bias)
assert g.dtype == beta.dtype == torch.float32 and g.shape == (3000, HV)
rel = lambda x, y: ((x.double() - y).abs() / y.abs().clamp(min=1e-30)).max().item()
assert rel(g, g64) <= 2e-6 and rel(beta, b64) <= 2e-6, (rel(g, g64), rel(beta, b64))
g_t, beta_t = R.gdn_gating(A_log, a, b, dt_bias)  # the torch path (the setting is unset here)
assert rel(g, g_t.double()) <= 4e-6 and rel(beta, beta_t.double()) <= 4e-6
g5, beta5 = gdn_gates(A_log, a[:5], b[:5], dt_bias)
assert torch.equal(g5, g[:5]) and torch.equal(beta5, beta[:5])

leaves = [t.detach().double().requires_grad_() for t in (A_log, a[:64], b[:64], dt_bias)]
lo = [t.detach().float().requires_grad_() for t in (A_log, a[:64], b[:64], dt_bias)]
w1, w2 = torch.randn(64, HV, dtype=torch.float64), torch.randn(64, HV, dtype=torch.float64)
G, B = ref64(*leaves)
((G * w1).sum() + (B * w2).sum()).backward()
G, B = gdn_gates(*lo)
((G.double() * w1).sum() + (B.double() * w2).sum()).backward()
for x, y in zip(lo, leaves):
    err = ((x.grad.double() - y.grad).norm() / y.grad.norm()).item()
    assert err <= 1e-5, err
print("ok")
'''


def test_gates_kernel_in_interpreter(interpreted):
    interpreted(SCRIPT)


def test_the_gates_setting_picks_the_path_and_is_part_of_the_arithmetic(monkeypatch):
    import torch

    from vllm_bi.gdn import recurrent as R
    from vllm_bi.ops import gates_triton

    assert S.Settings.from_env({}).gdn_gates_op("cpu") == "torch"
    assert S.Settings.from_env({}).gdn_gates_op("cuda") == S.GDN_GATES_AUTO_CUDA
    # the portable preset (and so CUDA under tensor parallelism) keeps torch's gates and the copying glue
    portable = S.Settings.from_env({"VLLM_BI_PRESET": "portable"})
    assert (portable.gdn_gates_op("cuda"), portable.gdn_io_op("cuda")) == ("torch", "copies")
    trit = S.Settings.from_env({"VLLM_BI_GDN_GATES": "triton"})
    torch_side = S.Settings.from_env({"VLLM_BI_GDN_GATES": "torch"})
    assert S.diff(torch_side.arithmetic("cuda"), trit.arithmetic("cuda")) == [("gdn_gates", "torch", "triton")]
    assert "VLLM_BI_GDN_GATES" in S.describe_diff(torch_side.arithmetic("cuda"), trit.arithmetic("cuda"))
    calls = []
    monkeypatch.setattr(gates_triton, "gdn_gates", lambda *args: calls.append(args) or ("g", "beta"))
    A_log, dt_bias, a, b = torch.zeros(4), torch.zeros(4), torch.zeros(3, 4), torch.zeros(3, 4)
    monkeypatch.delenv("VLLM_BI_GDN_GATES", raising=False)  # the suite's monkeypatch re-reads settings
    R.gdn_gating(A_log, a, b, dt_bias)
    assert calls == []
    monkeypatch.setenv("VLLM_BI_GDN_GATES", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert R.gdn_gating(A_log, a, b, dt_bias) == ("g", "beta") and len(calls) == 1
    monkeypatch.delenv("TRITON_INTERPRET")
    import pytest

    with pytest.raises(RuntimeError, match="VLLM_BI_GDN_GATES=triton on cpu needs TRITON_INTERPRET=1"):
        R.gdn_gating(A_log, a, b, dt_bias)
