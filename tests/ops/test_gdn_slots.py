"""The in-place recurrent step (:mod:`vllm_bi.attention.gdn_slots`, CUDA path of the server's recurrent core)
run through Triton's interpreter on CPU: its logic against a float64 recurrence (outputs and the states it
writes back, relative error <= 1e-5), slots that are permuted, fresh (zeros) or padding (slot 0), untouched
slots left as they were, and a sequence alone == the same sequence in a batch (exact). Its bits against
fla-core's fused recurrent kernel, the trainer's forward, are measured on the GPU
(``tests/gpu/test_gdn_cuda.py::test_recurrent_in_slots_equals_fla_core``)."""

import pytest

pytest.importorskip("triton")

SCRIPT = """
import torch
from vllm_bi.attention.gdn_slots import recurrent_in_slots

torch.manual_seed(0)
H, HV, K, V, S = 2, 4, 16, 16, 7
lens, slots, fresh = [3, 1, 7, 2], [4, 1, 5, 2], [0, 0, 1, 0]
T = sum(lens)
cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
q, k = torch.randn(T, H, K).bfloat16(), torch.randn(T, H, K).bfloat16()
v = torch.randn(T, HV, V).bfloat16()
g = -torch.rand(T, HV) * 0.5
beta = torch.rand(T, HV)
pool0 = torch.randn(S, HV, K, V) * 0.3
scale = K ** -0.5


def reference(i):
    st = torch.zeros(HV, K, V, dtype=torch.float64) if fresh[i] else pool0[slots[i]].double()
    out = []
    for t in range(int(cu[i]), int(cu[i + 1])):
        o_t = []
        for hv in range(HV):
            h = hv // (HV // H)
            qt, kt = q[t, h].double(), k[t, h].double()
            qt = qt / torch.sqrt((qt * qt).sum() + 1e-6) * scale
            kt = kt / torch.sqrt((kt * kt).sum() + 1e-6)
            st[hv] = st[hv] * torch.exp(g[t, hv].double())
            vt = beta[t, hv].double() * (v[t, hv].double() - kt @ st[hv])
            st[hv] = st[hv] + torch.outer(kt, vt)
            o_t.append(qt @ st[hv])
        out.append(torch.stack(o_t))
    return torch.stack(out), st


def rel(a, b):
    return float((a.double() - b).abs().max() / b.abs().max())


pool = pool0.clone()
o = recurrent_in_slots(q, k, v, g, beta, pool, torch.tensor(slots), cu, scale, torch.tensor(fresh))
assert o.dtype == v.dtype and o.shape == v.shape
for i in range(len(lens)):
    o_ref, st_ref = reference(i)
    assert rel(o[cu[i]:cu[i + 1]].float(), o_ref) <= 1e-2, i  # o is rounded to bf16, as fla-core's
    assert rel(pool[slots[i]], st_ref) <= 1e-5, i
for s in set(range(S)) - set(slots):
    assert torch.equal(pool[s], pool0[s]), s  # slots no sequence owns are untouched

# sequence 2 alone: the same bits as in the batch
alone = pool0.clone()
o2 = recurrent_in_slots(q[cu[2]:cu[3]], k[cu[2]:cu[3]], v[cu[2]:cu[3]], g[cu[2]:cu[3]], beta[cu[2]:cu[3]], alone,
                        torch.tensor([slots[2]]), torch.tensor([0, lens[2]]), scale, torch.tensor([1]))
assert torch.equal(o2, o[cu[2]:cu[3]]) and torch.equal(alone[slots[2]], pool[slots[2]])

# without fresh flags every sequence continues from its slot; vLLM's padding rows use slot 0 (the null block)
pool = pool0.clone()
pad_cu = torch.tensor([0, 1, 2, 3])
o3 = recurrent_in_slots(q[:3], k[:3], v[:3], g[:3], beta[:3], pool, torch.tensor([3, 0, 0]), pad_cu, scale)
for s in range(1, S):
    if s != 3:
        assert torch.equal(pool[s], pool0[s]), s
assert not torch.equal(pool[3], pool0[3])

# vLLM may pad the stride between slots: the padding stays as it was, the slots get the same bits
buf = torch.randn(S, HV * K * V + 40)
buf[:, : HV * K * V] = pool0.flatten(1)
buf0 = buf.clone()
padded = buf[:, : HV * K * V].unflatten(1, (HV, K, V))
o4 = recurrent_in_slots(q, k, v, g, beta, padded, torch.tensor(slots), cu, scale, torch.tensor(fresh))
assert torch.equal(o4, o) and torch.equal(buf[:, HV * K * V:], buf0[:, HV * K * V:])
full = pool0.clone()
recurrent_in_slots(q, k, v, g, beta, full, torch.tensor(slots), cu, scale, torch.tensor(fresh))
assert torch.equal(padded, full)

for bad in (pool0.double(), pool0.transpose(-1, -2)):
    try:
        recurrent_in_slots(q, k, v, g, beta, bad, torch.tensor(slots), cu, scale)
    except ValueError as e:
        assert "contiguous slots" in str(e)
    else:
        raise AssertionError("a pool that is not fp32 with contiguous slots was accepted")
print("ok")
"""


def test_recurrent_in_slots_logic_in_interpreter(interpreted):
    interpreted(SCRIPT)
