"""GDN recurrence on CUDA (fla-core fused recurrent, explicit fp32 states): invariance by exact
equality, correctness vs the float64 reference, and the chunked backward vs float64 autograd.

Run on a GPU machine: `pytest -m gpu tests/gpu` (skipped without CUDA or fla-core).
Tolerances: outputs vs float64 reference 3e-2 absolute (bf16 q/k/v), gradients relative L2 <= 3e-2.
"""

import pytest
import torch
from gpu_env import GDN_H, GDN_HV, GDN_K, GDN_V, gdn_gate_params, gdn_run, gdn_seq

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
fla = pytest.importorskip("fla")

from vllm_bi.gdn.naive import naive_gdn  # noqa: E402
from vllm_bi.gdn.recurrent import gdn_gating, gdn_recurrent_varlen  # noqa: E402

DEV = "cuda"
H, HV, K, V = GDN_H, GDN_HV, GDN_K, GDN_V
A_LOG, DT_BIAS = gdn_gate_params()
_seq = gdn_seq


def _run(seqs, states=None):
    return gdn_run(gdn_recurrent_varlen, seqs, states)


def test_batch_invariant_split_exact_and_decode_exact():
    seqs = [_seq(T, i) for i, T in enumerate([300, 17, 129, 64, 1])]
    o_all, h_all, cu = _run(seqs)
    for i, s in enumerate(seqs):
        o1, h1, _ = _run([s])
        assert torch.equal(o1, o_all[cu[i] : cu[i + 1]]) and torch.equal(h1[0], h_all[i])
    s = seqs[0]
    for p in (1, 63, 64, 200):
        oa, ha, _ = _run([tuple(t[:p] for t in s)])
        ob, hb, _ = _run([tuple(t[p:] for t in s)], states=ha)
        assert torch.equal(torch.cat([oa, ob]), o_all[:300]) and torch.equal(hb[0], h_all[0])
    h = torch.zeros(1, HV, V, K, device=DEV)
    for t in range(40):
        ot, h, _ = _run([tuple(x[t : t + 1] for x in s)], states=h)
        assert torch.equal(ot[0], o_all[t])


def test_negative_control_fla_initial_state_none_differs_from_zeros():
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    q, k, v, a, b = (t.to(DEV) for t in _seq(500, 7))
    g, beta = gdn_gating(A_LOG.to(DEV), a, b, DT_BIAS.to(DEV))
    cu = torch.tensor([0, 500], device=DEV)
    kw = dict(q=q[None], k=k[None], v=v[None], g=g[None], beta=beta[None], scale=K**-0.5, output_final_state=True,
              cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    o_none, _ = fused_recurrent_gated_delta_rule(initial_state=None, **kw)
    o_zero, _ = fused_recurrent_gated_delta_rule(initial_state=torch.zeros(1, HV, K, V, device=DEV), **kw)
    assert not torch.equal(o_none, o_zero)


def test_matches_float64_reference_and_gradients():
    q, k, v, a, b = _seq(96, 3)
    s0 = torch.randn(HV, V, K) * 0.1
    leaves = [t.to(DEV).float().requires_grad_(True) for t in (q, k, v, a, b)]
    s0d = s0.to(DEV).requires_grad_(True)
    g, beta = gdn_gating(A_LOG.to(DEV), leaves[3], leaves[4], DT_BIAS.to(DEV))
    o, ht = gdn_recurrent_varlen(leaves[0].bfloat16(), leaves[1].bfloat16(), leaves[2].bfloat16(), g, beta,
                                 s0d[None], [0, 96])
    ref_leaves = [t.double().requires_grad_(True) for t in (q.float(), k.float(), v.float(), a, b)]
    s064 = s0.double().requires_grad_(True)
    o_ref, s_ref = naive_gdn(ref_leaves[0], ref_leaves[1], ref_leaves[2], A_LOG, ref_leaves[3], ref_leaves[4],
                             DT_BIAS, s064)
    torch.testing.assert_close(o.double().cpu(), o_ref, rtol=0, atol=3e-2)
    torch.testing.assert_close(ht[0].double().cpu(), s_ref, rtol=0, atol=3e-2)
    w = torch.randn(o.shape)
    (o.float() * w.to(DEV)).sum().backward()  # fla-core's chunked kernel, or the torch recurrence where refused
    from vllm_bi.gdn import recurrent as gr

    print("backward path:", "torch recurrence (fla-core refused its chunked kernel)" if gr._warned_fallback
          else "fla-core chunked kernel")
    (o_ref * w.double()).sum().backward()
    for name, mine, ref in zip("q k v a b".split(), leaves, ref_leaves):
        rel = ((mine.grad.double().cpu() - ref.grad).norm() / ref.grad.norm()).item()
        assert rel <= 3e-2, f"d/d{name}: relative error {rel:.3e}"
    rel = ((s0d.grad.double().cpu() - s064.grad).norm() / s064.grad.norm()).item()
    assert rel <= 3e-2, f"d/dstate: relative error {rel:.3e}"


@pytest.mark.parametrize("tile", ["fla", "32x2x3", "16x1x3"])
def test_recurrent_in_slots_equals_fla_core(tile, monkeypatch):
    """The server's in-place recurrent step (``gdn_slots.recurrent_in_slots``: states read from and written to
    their cache slots) == the trainer's forward (``gdn_recurrent_varlen``), bit for bit: the outputs and the states
    written into the slots. Slots no sequence owns, and the padding between slots, stay as they were. Prefill-like
    lengths, then a 256-request decode. Under ``VLLM_BI_GDN_TILE=fla`` the trainer's forward is fla-core's fused
    recurrent kernel on gathered states; under a tile of vllm_bi's own it is the same kernel as the server's, and the
    control checks that such a tile's bits do differ from fla-core's (so the setting decides them)."""
    from vllm_bi import settings
    from vllm_bi.ops.device import index_on
    from vllm_bi.gdn.slots import FLA_TILE, recurrent_in_slots

    monkeypatch.setattr(settings, "_CURRENT", None)  # the settings are read again here and restored after the test
    monkeypatch.setenv("VLLM_BI_GDN_TILE", tile)
    settings.reload()
    for lens in ([300, 17, 1, 64, 129, 1, 2], [1] * 256):
        seqs = [_seq(T, 100 + i) for i, T in enumerate(lens)]
        N, S = len(lens), len(lens) + 5
        gen = torch.Generator().manual_seed(N)
        pool0 = (torch.randn(S, HV * K * V + 16, generator=gen) * 0.2).to(DEV)  # padded slot stride, as vLLM may
        slots = torch.randperm(S, generator=gen)[:N]
        fresh = torch.zeros(N, dtype=torch.int32)
        fresh[::3] = 1
        states = pool0[slots.to(DEV), : HV * K * V].unflatten(1, (HV, K, V)).transpose(-1, -2).clone()  # [N,HV,V,K]
        states[fresh.bool().to(DEV)] = 0
        o_ref, fin_ref, _ = gdn_run(gdn_recurrent_varlen, seqs, states)
        buf = pool0.clone()
        pool = buf[:, : HV * K * V].unflatten(1, (HV, K, V))

        def in_slots(q, k, v, g, beta, _states, cu):
            o = recurrent_in_slots(q, k, v, g, beta, pool, slots.to(DEV), index_on(cu, DEV), K**-0.5, fresh.to(DEV))
            return o, None

        o, _, _ = gdn_run(in_slots, seqs)
        assert torch.equal(o, o_ref), f"lens {lens[:8]}: outputs differ from fla-core's"
        for i in range(N):
            assert torch.equal(pool[int(slots[i])], fin_ref[i].transpose(-1, -2)), f"lens {lens[:8]}: slot of seq {i}"
        others = sorted(set(range(S)) - set(slots.tolist()))
        assert torch.equal(buf[others], pool0[others]) and torch.equal(buf[:, HV * K * V :], pool0[:, HV * K * V :])
        if tile != "fla" and lens[0] > 1:  # control: the fla tile's bits are not this tile's
            ctrl = pool0.clone()[:, : HV * K * V].unflatten(1, (HV, K, V))
            o_fla, _, _ = gdn_run(lambda q, k, v, g, beta, _s, cu: (recurrent_in_slots(
                q, k, v, g, beta, ctrl, slots.to(DEV), index_on(cu, DEV), K**-0.5, fresh.to(DEV), tile=FLA_TILE), None),
                seqs)
            assert not torch.equal(o_fla, o), f"tile {tile}: the same bits as fla-core's tile"
