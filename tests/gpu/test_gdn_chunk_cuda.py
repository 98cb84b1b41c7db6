"""The chunk-aligned GDN mode on CUDA (fla-core's chunked kernel, two launches, pinned configs).

The specification (``vllm_bi.gdn.chunk``): a token gets the same bits whatever it is packed
with, wherever its prompt was split (the server resumes at the last 64-token boundary and recomputes the
partial block) and one token at a time in decode; the boundary states of a split run equal the whole
run's. Exact equality throughout. Correctness: outputs and boundary states vs the float64 reference within
3e-2 absolute (bf16 q/k/v), gradients relative L2 <= 3e-2.

Run on a GPU machine: `pytest -m gpu tests/gpu` (skipped without CUDA or fla-core).
"""

import pytest
import torch
from gpu_env import GDN_H, GDN_HV, GDN_K, GDN_V, gdn_gate_params, gdn_run, gdn_seq

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
fla = pytest.importorskip("fla")

from vllm_bi.gdn.chunk import CHUNK, FLA_CHUNK_PINS, gdn_chunk_varlen, pin_fla_chunk_configs  # noqa: E402
from vllm_bi.gdn.naive import naive_gdn  # noqa: E402
from vllm_bi.gdn.recurrent import gdn_gating  # noqa: E402

DEV = "cuda"
H, HV, K, V = GDN_H, GDN_HV, GDN_K, GDN_V
A_LOG, DT_BIAS = gdn_gate_params()
_seq = gdn_seq


def _run(seqs, states=None):
    return gdn_run(gdn_chunk_varlen, seqs, states)


def _rows(s, lo, hi):
    return tuple(t[lo:hi] for t in s)


def test_configs_pinned():
    pinned = pin_fla_chunk_configs()
    assert set(pinned) == {name for _, name in FLA_CHUNK_PINS}
    print("pinned fla-core configs:", pinned)


def test_batch_invariant():
    seqs = [_seq(T, i) for i, T in enumerate([300, 17, 129, 64, 1, 200])]
    o_all, b_all, cu = _run(seqs)
    for i, s in enumerate(seqs):
        o1, b1, _ = _run([s])
        assert torch.equal(o1, o_all[cu[i] : cu[i + 1]]), f"sequence {i}: outputs depend on the batch"
        assert torch.equal(b1[0], b_all[i]), f"sequence {i}: boundary state depends on the batch"
    o2, b2, cu2 = _run([seqs[5], seqs[0]])
    assert torch.equal(o2[cu2[1] :], o_all[: cu[1]]) and torch.equal(b2[1], b_all[0])


def _resume(s, steps, whole):
    """Serve sequence ``s`` in steps ``[(start, end), ...]`` as the server does: each step re-runs the rows
    from the last boundary with the state held there, keeps the new rows, and stores the new boundary."""
    state = torch.zeros(1, HV, V, K, device=DEV)
    for p, e in steps:
        b = p // CHUNK * CHUNK
        o, state, _ = _run([_rows(s, b, e)], states=state)
        assert torch.equal(o[p - b :], whole[p:e]), f"rows {p}..{e} (resumed at boundary {b}) differ"
    return state


def test_split_prefill_and_decode_exact():
    s = _seq(300, 11)
    whole, bound, _ = _run([s])
    for cuts in ([37, 150, 151, 300], [64, 128, 300], [1, 2, 63, 65, 300], [299, 300]):
        steps = list(zip([0, *cuts[:-1]], cuts))
        state = _resume(s, steps, whole)
        assert torch.equal(state[0], bound[0]), f"split {cuts}: boundary state differs"
    # decode: 80 one-token steps after a 120-token prefill, across the boundaries at 128 and 192
    state = _resume(s, [(0, 120)] + [(t, t + 1) for t in range(120, 200)], whole)
    _, ref_bound, _ = _run([_rows(s, 0, 192)])
    assert torch.equal(state[0], ref_bound[0])


def test_matches_float64_reference_and_gradients():
    q, k, v, a, b = _seq(200, 3)
    s0 = torch.randn(HV, V, K) * 0.1
    leaves = [t.to(DEV).float().requires_grad_(True) for t in (q, k, v, a, b)]
    s0d = s0.to(DEV).requires_grad_(True)
    g, beta = gdn_gating(A_LOG.to(DEV), leaves[3], leaves[4], DT_BIAS.to(DEV))
    o, bound = gdn_chunk_varlen(leaves[0].bfloat16(), leaves[1].bfloat16(), leaves[2].bfloat16(), g, beta,
                                s0d[None], [0, 200])
    ref_leaves = [t.double().requires_grad_(True) for t in (q.float(), k.float(), v.float(), a, b)]
    s064 = s0.double().requires_grad_(True)
    o_ref, _ = naive_gdn(ref_leaves[0], ref_leaves[1], ref_leaves[2], A_LOG, ref_leaves[3], ref_leaves[4],
                         DT_BIAS, s064)
    _, b_ref = naive_gdn(*(t[:192] for t in ref_leaves[:3]), A_LOG, ref_leaves[3][:192], ref_leaves[4][:192],
                         DT_BIAS, s064)
    torch.testing.assert_close(o.double().cpu(), o_ref, rtol=0, atol=3e-2)
    torch.testing.assert_close(bound[0].double().cpu(), b_ref, rtol=0, atol=3e-2)
    w = torch.randn(o.shape)
    (o.float() * w.to(DEV)).sum().backward()
    from vllm_bi.gdn import recurrent as gr

    print("backward path:", "torch recurrence (fla-core refused its chunked kernel)" if gr._warned_fallback
          else "fla-core chunked kernel")
    (o_ref * w.double()).sum().backward()
    for name, mine, ref in zip("q k v a b".split(), leaves, ref_leaves):
        rel = ((mine.grad.double().cpu() - ref.grad).norm() / ref.grad.norm()).item()
        assert rel <= 3e-2, f"d/d{name}: relative error {rel:.3e}"
    rel = ((s0d.grad.double().cpu() - s064.grad).norm() / s064.grad.norm()).item()
    assert rel <= 3e-2, f"d/dstate: relative error {rel:.3e}"


def test_chunk_forward_keeps_its_graph_with_the_no_grad_bits():
    """The trainer's chunk-mode forward (``FLAGatedDeltaRule`` kind "chunk") runs under autograd and keeps
    fla-core's graph, so the backward does not recompute it: its outputs equal the no-gradient call's (the
    server's) bit for bit, and its gradients equal those of the recompute path."""
    from vllm_bi.gdn import recurrent as gr

    T, cu = 200, torch.tensor([0, 70, 200], device=DEV)
    gen = torch.Generator().manual_seed(5)
    q, k = (torch.randn(1, T, H, K, generator=gen).bfloat16().to(DEV) for _ in range(2))
    v = torch.randn(1, T, HV, V, generator=gen).bfloat16().to(DEV)
    g = (-torch.rand(1, T, HV, generator=gen)).to(DEV)
    beta = torch.rand(1, T, HV, generator=gen).to(DEV)
    h0 = (torch.randn(2, HV, K, V, generator=gen) * 0.1).to(DEV)
    scale = K ** -0.5
    with torch.no_grad():
        o_ng, ht_ng = gr.FLAGatedDeltaRule.apply("chunk", q, k, v, g, beta, h0, cu, scale)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, g, beta, h0)]
    o, ht = gr.FLAGatedDeltaRule.apply("chunk", *leaves, cu, scale)
    assert torch.equal(o, o_ng) and torch.equal(ht, ht_ng)
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    try:
        want = gr._recompute_grads(gr._FLA_FORWARDS["chunk"], q, k, v, g, beta, h0, cu, scale, do, dht)
    except RuntimeError as e:
        if gr._HOPPER_REFUSAL in str(e):
            pytest.skip("fla-core refuses its chunked backward here (Hopper, Triton < 3.7.1, no tilelang)")
        raise
    got = torch.autograd.grad([o, ht], leaves, [do, dht])
    for name, a, b in zip("q k v g beta h0".split(), got, want):
        assert torch.equal(a, b), f"d/d{name}"


def _blocks_in_slots(lens, seed, pool_seed):
    """Sequences of ``lens`` rows (from seed ``seed``), a state pool of ``len(lens) + 3`` slots with a padded slot
    stride (``buf`` is its memory), the sequences' shuffled slots, and their states gathered as the server did
    (``[N, HV, V, K]``)."""
    seqs = [_seq(T, seed + i) for i, T in enumerate(lens)]
    N, S = len(lens), len(lens) + 3
    gen = torch.Generator().manual_seed(pool_seed)
    buf = (torch.randn(S, HV * K * V + 16, generator=gen) * 0.2).to(DEV)
    pool = buf[:, : HV * K * V].unflatten(1, (HV, K, V))
    slots = torch.randperm(S, generator=gen)[:N].to(DEV)
    return seqs, buf, pool, slots, pool[slots].transpose(-1, -2).clone()


def test_partial_blocks_in_slots_equal_fla_core():
    """The partial-block kernel (``gdn_chunk_decode.partial_blocks_in_slots``: boundary states read from their slots,
    fla-core's state and output kernels replaced by one; the chunk server's decode on CUDA since it passed) == the chunk
    mode's current call (``gdn_chunk_varlen``: fla-core's chunked kernel on gathered states), bit for bit, on partial
    blocks of 1..63 rows from shuffled slots with a padded slot stride, and on a 256-request decode batch (33 rows)."""
    from vllm_bi.gdn.chunk_decode import partial_blocks_in_slots

    for lens in ([1, 2, 5, 17, 31, 32, 33, 48, 62, 63], [33] * 256):
        seqs, buf, pool, slots, states = _blocks_in_slots(lens, 500, len(lens))
        N = len(lens)
        o_ref, _, _ = gdn_run(gdn_chunk_varlen, seqs, states)
        before = buf.clone()
        o, _, _ = gdn_run(lambda q, k, v, g, beta, _s, cu: (partial_blocks_in_slots(q, k, v, g, beta, pool, slots, cu,
                                                                                   K**-0.5), None), seqs)
        assert torch.equal(buf, before)  # the slots are only read
        cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
        bad = [j for j in range(N) if not torch.equal(o[cu[j] : cu[j + 1]], o_ref[cu[j] : cu[j + 1]])]
        assert not bad, f"lens {lens[:10]}: blocks {bad[:10]} differ from fla-core's (rows {[lens[j] for j in bad[:10]]})"


def test_whole_blocks_in_slots_equal_fla_core():
    """``partial_blocks_in_slots`` on segments that complete their block (64 rows), mixed with partial ones: the
    outputs and the state each whole block writes into its slot (fla-core's state kernel's step, repeated by
    ``gdn_chunk_decode._block_state_kernel``) == ``gdn_chunk_varlen``'s outputs and boundary states, bit for bit;
    the partial blocks' slots and the unused ones unchanged. The server sends whole blocks there
    (``gdn_chunk_decode.WHOLE_BLOCKS_IN_SLOTS``, on since this passed on the H200)."""
    from vllm_bi.gdn.chunk_decode import partial_blocks_in_slots

    for lens in ([64, 1, 64, 33, 63, 64], [64] * 256):
        seqs, _, pool, slots, states = _blocks_in_slots(lens, 900, len(lens) + 1)
        N, S = len(lens), pool.shape[0]
        o_ref, finals, _ = gdn_run(gdn_chunk_varlen, seqs, states)
        before = pool.clone()
        o, _, cu = gdn_run(lambda q, k, v, g, beta, _s, cu: (partial_blocks_in_slots(q, k, v, g, beta, pool, slots, cu,
                                                                                       K**-0.5), None), seqs)
        bad = [j for j in range(N) if not torch.equal(o[cu[j] : cu[j + 1]], o_ref[cu[j] : cu[j + 1]])]
        assert not bad, f"outputs of blocks {bad[:10]} differ (rows {[lens[j] for j in bad[:10]]})"
        for j in range(N):
            want = finals[j].transpose(-1, -2) if lens[j] == CHUNK else before[slots[j]]
            assert torch.equal(pool[slots[j]], want), f"slot of block {j} ({lens[j]} rows)"
        others = sorted(set(range(S)) - set(slots.tolist()))
        assert torch.equal(pool[others], before[others])


@pytest.mark.parametrize("whole_blocks", [False, True], ids=["whole-blocks-gathered", "whole-blocks-in-slots"])
def test_chunk_server_step_in_slots_equals_gathered_states(whole_blocks):
    """The chunk server's step on CUDA (``gdn.bi_gdn_core``: boundary states read in their slots,
    ``gdn_chunk_decode.chunk_in_slots``) == the same step with the states gathered out of their slots and stored
    back (the CPU path, and CUDA's before the in-slot kernels), bit for bit: outputs, widened conv histories and every state slot. The
    step mixes decodes inside a block, at a boundary and completing a block, a new short prompt, a resumed
    prefill crossing a boundary and a new prompt of two blocks and more, from shuffled slots; with
    ``WHOLE_BLOCKS_IN_SLOTS`` on and off (the decodes that complete a block in the slots or gathered)."""
    import types
    from unittest import mock

    pytest.importorskip("vllm")
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    from vllm_bi.gdn import chunk_decode as CD
    from vllm_bi.model_executor import gdn as G

    W = 4
    D, R = 2 * H * K + HV * V, CHUNK + W - 1
    # (computed tokens, new tokens): 40 decodes at every offset in a block, then prefills
    reqs = [(4 * CHUNK + (7 * i) % CHUNK, 1) for i in range(40)] + [(0, 5), (70, 100), (0, 130)]
    n_dec = 40
    gen = torch.Generator().manual_seed(13)
    N, S = len(reqs), len(reqs) + 5
    T = sum(t for _, t in reqs)
    dim_first = is_conv_state_dim_first()
    conv = torch.randn(S, *((D + 2 * HV, R) if dim_first else (R, D + 2 * HV)), generator=gen).bfloat16().to(DEV)
    ssm = (torch.randn(S, HV, V, K, generator=gen) * 0.1).to(DEV)
    mixed = torch.randn(T, D, generator=gen).bfloat16().to(DEV)
    a, b = (torch.randn(T, HV, generator=gen).bfloat16().to(DEV) for _ in range(2))
    layer = types.SimpleNamespace(
        conv1d=types.SimpleNamespace(weight=(torch.randn(D, 1, W, generator=gen) * 0.3).bfloat16().to(DEV)),
        num_k_heads=H, tp_size=1, head_k_dim=K, head_v_dim=V, A_log=A_LOG.to(DEV), dt_bias=DT_BIAS.to(DEV),
        activation="silu", prefix="test")
    qsl = [0, *torch.tensor([t for _, t in reqs]).cumsum(0).tolist()]
    md = types.SimpleNamespace(
        num_actual_tokens=T, num_spec_decodes=0, spec_sequence_masks=None,
        non_spec_query_start_loc=torch.tensor(qsl, device=DEV),
        non_spec_state_indices_tensor=torch.randperm(S, generator=gen)[:N].to(DEV),
        num_decodes=n_dec, num_prefills=N - n_dec, num_decode_tokens=n_dec,
        has_initial_state=torch.tensor([c > 0 for c, _ in reqs], device=DEV),
        vllm_bi_num_computed=torch.tensor([c for c, _ in reqs], device=DEV))
    results = []
    for in_place in (False, True):
        layer.kv_cache = (conv.clone(), ssm.clone())
        out = torch.zeros(T, HV, V, device=DEV, dtype=torch.bfloat16)
        with mock.patch.object(G, "_metadata", return_value=md), mock.patch.object(G, "gdn_mode", return_value="chunk"), \
                mock.patch.object(G, "_in_place", return_value=in_place), \
                mock.patch.object(CD, "WHOLE_BLOCKS_IN_SLOTS", whole_blocks):
            G.bi_gdn_core(layer, mixed, b, a, out)
        results.append((out, *layer.kv_cache))
    (o1, c1, s1), (o2, c2, s2) = results
    assert o1.abs().sum() > 0
    bad = [j for j in range(N) if not torch.equal(o1[qsl[j] : qsl[j + 1]], o2[qsl[j] : qsl[j + 1]])]
    assert not bad, f"requests {bad} differ: {[reqs[j] for j in bad]}"
    assert torch.equal(c1, c2)
    assert torch.equal(s1, s2)


def _decode_step_case(counts, seed):
    """A chunk-mode layer, widened conv histories and state slots holding garbage (a padded row that read one would
    show), and one decode step's inputs and metadata for requests with ``counts`` computed tokens each, in
    shuffled slots (slot 0, vLLM's null block, left out)."""
    import types

    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    W = 4
    D, R = 2 * H * K + HV * V, CHUNK + W - 1
    gen = torch.Generator().manual_seed(seed)
    N, S = len(counts), len(counts) + 4
    dim_first = is_conv_state_dim_first()
    conv = torch.randn(S, *((D + 2 * HV, R) if dim_first else (R, D + 2 * HV)), generator=gen).bfloat16().to(DEV)
    ssm = (torch.randn(S, HV, V, K, generator=gen) * 0.1).to(DEV)
    layer = types.SimpleNamespace(
        conv1d=types.SimpleNamespace(weight=(torch.randn(D, 1, W, generator=gen) * 0.3).bfloat16().to(DEV)),
        num_k_heads=H, tp_size=1, head_k_dim=K, head_v_dim=V, A_log=A_LOG.to(DEV), dt_bias=DT_BIAS.to(DEV),
        activation="silu", prefix="test")
    inputs = [torch.randn(N, D, generator=gen).bfloat16().to(DEV),
              *(torch.randn(N, HV, generator=gen).bfloat16().to(DEV) for _ in range(2))]
    md = types.SimpleNamespace(
        num_actual_tokens=N, num_spec_decodes=0, spec_sequence_masks=None,
        non_spec_query_start_loc=torch.arange(N + 1, device=DEV),
        non_spec_state_indices_tensor=(1 + torch.randperm(S - 1, generator=gen)[:N]).int().to(DEV),
        num_decodes=N, num_prefills=0, num_decode_tokens=N, has_initial_state=None,
        vllm_bi_num_computed=torch.tensor(counts, dtype=torch.int32, device=DEV))
    return layer, (conv, ssm), inputs, md


def _step(layer, caches, inputs, md, padded):
    from unittest import mock

    from vllm_bi.model_executor import gdn as G

    layer.kv_cache = caches
    mixed, a, b = inputs
    out = torch.zeros(mixed.shape[0], HV, V, device=DEV, dtype=torch.bfloat16)
    with mock.patch.object(G, "_metadata", return_value=md), mock.patch.object(G, "gdn_mode", return_value="chunk"), \
            mock.patch.object(G, "_padded_decode", return_value=padded):
        G.bi_gdn_core(layer, mixed, b, a, out)
    return out


def test_padded_chunk_decode_equals_the_host_plan_and_replays_in_a_cuda_graph():
    """The chunk mode's capturable decode step (``VLLM_BI_CHUNK_DECODE=padded``: every block padded to 64 rows,
    indices built on the device) == the host-planned step, bit for bit: outputs, conv histories and every state slot,
    for 256 decodes at every offset in a block (2 tokens into the sequence, just past a boundary, completing a
    block) from slots holding garbage. Then the step captured in a CUDA graph and replayed on new inputs and new
    computed-token counts written into the captured buffers == the same step run eagerly."""
    pytest.importorskip("vllm")
    counts = [2, 1, 63, 64, 127] + [3 * CHUNK + (7 * i) % CHUNK for i in range(251)]
    layer, (conv, ssm), inputs, md = _decode_step_case(counts, 21)
    import copy

    host = _step(layer, (conv.clone(), ssm.clone()), inputs, copy.copy(md), False)
    caches_h = layer.kv_cache
    padded = _step(layer, (conv.clone(), ssm.clone()), inputs, copy.copy(md), True)
    caches_p = layer.kv_cache
    assert host.abs().sum() > 0 and torch.isfinite(host.float()).all()
    bad = [j for j in range(len(counts)) if not torch.equal(host[j], padded[j])]
    assert not bad, f"requests {bad[:10]} differ (computed tokens {[counts[j] for j in bad[:10]]})"
    assert torch.equal(caches_h[0], caches_p[0]), "conv histories differ"
    assert torch.equal(caches_h[1], caches_p[1]), "state slots differ"

    # the graph: captured on static buffers, replayed after new inputs and counts are written into them
    counts2 = [(c + 5) % (4 * CHUNK) + 1 for c in counts]
    _, _, inputs2, md2 = _decode_step_case(counts2, 22)
    static = [t.clone() for t in inputs]
    static_md = copy.copy(md)
    static_md.vllm_bi_num_computed = md.vllm_bi_num_computed.clone()
    g_conv, g_ssm = conv.clone(), ssm.clone()
    _step(layer, (conv.clone(), ssm.clone()), static, copy.copy(static_md), True)  # warm-up: compile, tune
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out = _step(layer, (g_conv, g_ssm), static, copy.copy(static_md), True)
    for s, t in zip(static, inputs2):
        s.copy_(t)
    static_md.vllm_bi_num_computed.copy_(md2.vllm_bi_num_computed)
    static_md.non_spec_state_indices_tensor.copy_(md2.non_spec_state_indices_tensor)
    graph.replay()
    torch.cuda.synchronize()
    eager = _step(layer, (conv.clone(), ssm.clone()), inputs2, copy.copy(md2), True)
    e_conv, e_ssm = layer.kv_cache
    bad = [j for j in range(len(counts2)) if not torch.equal(g_out[j], eager[j])]
    assert not bad, f"replayed requests {bad[:10]} differ (computed tokens {[counts2[j] for j in bad[:10]]})"
    assert torch.equal(g_conv, e_conv) and torch.equal(g_ssm, e_ssm), "the replay's caches differ"
