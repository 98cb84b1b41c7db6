"""Kimi Delta Attention's recurrence on CUDA through fla-core's fused recurrent KDA kernel (a decay per key channel,
explicit fp32 states): is it batch-invariant (a sequence packed with others == alone, and a prefill split with its
state carried == in one go, exact), and how close to the float64 delta rule. A probe for a CUDA path of vllm_bi's
KDA core (``gdn.layer`` with ``gating="kda"``, CPU only today); it imports fla-core's kernel directly.

Run on a GPU machine: `pytest -m gpu tests/gpu/test_kda_cuda.py` (skipped without CUDA or fla-core).
Tolerance: outputs against float64 3e-2 absolute (bf16 q/k/v). Negative control: the state carried in bf16 across a
split changes the bits.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("fla")

from fla.ops.kda import fused_recurrent_kda  # noqa: E402

from vllm_bi.gdn.naive import naive_delta_rule  # noqa: E402
from vllm_bi.gdn.recurrent import kda_gating  # noqa: E402

DEV = "cuda"
H, K = 4, 128  # Kimi Linear 48B: 32 heads of 128


def _seq(T, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(T, H, K, generator=g).bfloat16() for _ in range(3))
    a = (torch.randn(T, H, K, generator=g) * 2).bfloat16()
    b = torch.randn(T, H, generator=g).bfloat16()
    return q, k, v, a, b


A_LOG = torch.log(torch.linspace(1, 16, H))
DT_BIAS = torch.linspace(-0.5, 0.5, H * K)


def _run(seqs, states=None):
    """The kernel over packed sequences from ``states`` (zeros when None): ``(o [T, H, K] fp32, finals [N, H, K, K])``."""
    cu = [0]
    for s in seqs:
        cu.append(cu[-1] + s[0].shape[0])
    q, k, v, a, b = (torch.cat([s[i] for s in seqs]).to(DEV) for i in range(5))
    g, beta = kda_gating(A_LOG.to(DEV), a, b, DT_BIAS.to(DEV), -5.0)
    h0 = torch.zeros(len(seqs), H, K, K, device=DEV) if states is None else states
    o, ht = fused_recurrent_kda(q[None], k[None], v[None], g[None].float().contiguous(), beta[None].contiguous(),
                                scale=K**-0.5, initial_state=h0.contiguous(), output_final_state=True,
                                use_qk_l2norm_in_kernel=True, cu_seqlens=torch.tensor(cu, device=DEV))
    return o[0].float(), ht, cu


def test_fused_recurrent_kda_is_batch_invariant_split_exact_and_close():
    seqs = [_seq(T, i) for i, T in enumerate([300, 17, 129, 64, 1])]
    o_all, h_all, cu = _run(seqs)
    for i, s in enumerate(seqs):
        o1, h1, _ = _run([s])
        assert torch.equal(o1, o_all[cu[i] : cu[i + 1]]) and torch.equal(h1[0], h_all[i]), i
    s = seqs[0]
    for p in (1, 63, 64, 200):
        oa, ha, _ = _run([tuple(t[:p] for t in s)])
        ob, hb, _ = _run([tuple(t[p:] for t in s)], states=ha)
        assert torch.equal(torch.cat([oa, ob]), o_all[:300]) and torch.equal(hb[0], h_all[0]), p
    oa, ha, _ = _run([tuple(t[:64] for t in s)])
    ob, _, _ = _run([tuple(t[64:] for t in s)], states=ha.bfloat16().float())
    assert not torch.equal(ob, o_all[64:300]), "control: a bf16 state at the split should change the bits"
    q, k, v, a, b = s
    g, beta = kda_gating(A_LOG, a, b, DT_BIAS, -5.0)
    ref, _ = naive_delta_rule(q, k, v, g, beta, torch.zeros(H, K, K))
    err = float((o_all[:300].cpu().double() - ref).abs().max())
    print(f"fused_recurrent_kda vs float64: max abs {err:.2e}")
    assert err <= 3e-2, err


def test_vllm_bi_kda_core_on_cuda_equals_fla_core_and_its_gradients_float64():
    """vllm_bi's KDA core on CUDA: the trainer's forward (``gdn_recurrent_varlen`` with a per-channel decay) == fla-core's
    fused recurrent gated delta rule with ``gk`` (fla-core's own ``fused_recurrent_kda`` is another kernel, with other
    bits: 1.5e-5 apart on the H200), and the server's in-place step
    (``gdn.slots.recurrent_in_slots``) == both, bit for bit (outputs and the states written into the slots), for
    prefill lengths and a 256-request decode. Gradients through the trainer's forward (its backward recomputes in
    torch) against float64: 2e-2 relative to each gradient's largest entry."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    from vllm_bi.gdn.recurrent import gdn_recurrent_varlen, gdn_torch_varlen
    from vllm_bi.gdn.slots import recurrent_in_slots
    from vllm_bi.ops.device import index_on

    for lens in ([300, 17, 129, 1, 64], [1] * 256):
        seqs = [_seq(T, 200 + i) for i, T in enumerate(lens)]
        gen = torch.Generator().manual_seed(len(lens))
        h0 = (torch.randn(len(lens), H, K, K, generator=gen) * 0.2).to(DEV)  # fla-core order [N, HV, K, V]
        _, _, cu = _run(seqs, h0.clone())
        q, k, v, a, b = (torch.cat([s[i] for s in seqs]).to(DEV) for i in range(5))
        g, beta = kda_gating(A_LOG.to(DEV), a, b, DT_BIAS.to(DEV), -5.0)
        o_fla, ht_fla = fused_recurrent_gated_delta_rule(
            q=q[None], k=k[None], v=v[None], gk=g[None].float().contiguous(), beta=beta[None].contiguous(),
            scale=K**-0.5, initial_state=h0.clone(), output_final_state=True, use_qk_l2norm_in_kernel=True,
            cu_seqlens=torch.tensor(cu, device=DEV))
        o_fla = o_fla[0].float()
        o_tr, fin_tr = gdn_recurrent_varlen(q, k, v, g, beta, h0.transpose(-1, -2).contiguous(), cu, K**-0.5)
        assert torch.equal(o_tr.float(), o_fla) and torch.equal(fin_tr.transpose(-1, -2), ht_fla), lens[:6]
        pool = h0.clone()
        slots = torch.arange(len(lens), device=DEV)
        o_srv = recurrent_in_slots(q, k, v, g.contiguous(), beta.contiguous(), pool, slots, index_on(cu, DEV), K**-0.5)
        assert torch.equal(o_srv.float(), o_fla) and torch.equal(pool, ht_fla), lens[:6]
    seqs = [_seq(T, 300 + i) for i, T in enumerate([40, 7])]
    q, k, v, a, b = (torch.cat([s[i] for s in seqs]).to(DEV) for i in range(5))
    g, beta = kda_gating(A_LOG.to(DEV), a, b, DT_BIAS.to(DEV), -5.0)
    leaves = [t.float().detach().requires_grad_(True) for t in (q, k, v, g, beta)]
    st = torch.zeros(2, H, K, K, device=DEV)
    o, _ = gdn_recurrent_varlen(*leaves, st, [0, 40, 47], K**-0.5)
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(5)).to(DEV)
    got = torch.autograd.grad((o.float() * w).sum(), leaves)
    ref_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
    o64, _ = gdn_torch_varlen(*(t.unsqueeze(0) for t in ref_leaves), st.double(), torch.tensor([0, 40, 47]), K**-0.5)
    ref = torch.autograd.grad((o64[0] * w.double()).sum(), ref_leaves)
    for name, a_, r in zip("q k v g beta".split(), got, ref):
        err = float((a_.double() - r).abs().max() / r.abs().max())
        print(f"KDA gradient {name}: max rel err {err:.2e}")
        assert err <= 2e-2, (name, err)
