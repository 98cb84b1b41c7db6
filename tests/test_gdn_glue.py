"""The GDN server glue (gdn.bi_gdn_core: scheduled sequences gathered from their cache slots, one varlen
core, states stored back; the same code on CPU and CUDA) agrees exactly with a one-sequence-at-a-time
reference built from gdn_sequence: outputs, conv and fp32 states, for both conv-cache layouts."""
import contextlib
import types
from unittest import mock

import pytest
import torch

from vllm_bi.gdn.layer import gdn_sequence
from vllm_bi.model_executor import gdn as G

H, HV, K, V, W = 1, 2, 128, 128, 4
D = 2 * H * K + HV * V
g = torch.Generator().manual_seed(0)
nslots = 6


def mk(dim_first):
    conv = torch.randn(nslots, *((D, W - 1) if dim_first else (W - 1, D)), generator=g).bfloat16()
    ssm = torch.randn(nslots, HV, V, K, generator=g) * 0.1
    return types.SimpleNamespace(
        kv_cache=(conv, ssm), conv1d=types.SimpleNamespace(weight=torch.randn(D, 1, W, generator=g).bfloat16() * 0.3),
        num_k_heads=H, tp_size=1, head_k_dim=K, head_v_dim=V, A_log=torch.log(torch.tensor([2.0, 9.0])),
        dt_bias=torch.tensor([0.1, -0.3]), activation="silu", prefix="x")


lens = [1, 1, 5, 3]
qsl = [0]
for n in lens:
    qsl.append(qsl[-1] + n)
T = qsl[-1]
slots, has_init = [3, 1, 5, 2], [True, True, False, True]
md = types.SimpleNamespace(
    num_actual_tokens=T, num_spec_decodes=0, spec_sequence_masks=None, non_spec_query_start_loc=torch.tensor(qsl),
    non_spec_state_indices_tensor=torch.tensor(slots), num_decodes=2, num_prefills=2,
    has_initial_state=torch.tensor(has_init))
x = torch.randn(T, D, generator=g).bfloat16()
a = torch.randn(T, HV, generator=g).bfloat16()
b = torch.randn(T, HV, generator=g).bfloat16()


def reference(layer, dim_first, out):
    """One sequence at a time, straight from the cache slots."""
    conv_cache, ssm_cache = layer.kv_cache
    w = layer.conv1d.weight.reshape(D, W)
    for i in range(len(lens)):
        s, e, slot = qsl[i], qsl[i + 1], slots[i]
        if has_init[i]:
            cstate, state = (conv_cache[slot].transpose(0, 1) if dim_first else conv_cache[slot]), ssm_cache[slot]
        else:
            cstate, state = torch.zeros((W - 1, D), dtype=x.dtype), torch.zeros_like(ssm_cache[slot])
        o, new_c, new_s = gdn_sequence(x[s:e], w, cstate, layer.A_log, a[s:e], b[s:e], layer.dt_bias, state, H, K, V)
        out[s:e] = o.to(out.dtype)
        ssm_cache[slot] = new_s
        conv_cache[slot] = (new_c.transpose(0, 1) if dim_first else new_c).to(conv_cache.dtype)


def kv_order(ssm):
    """The same states with each slot's memory in fla-core's [HV, K, V] order (CUDA's slots), shape kept."""
    return ssm.transpose(-1, -2).contiguous().reshape(ssm.shape)


@pytest.mark.parametrize("kv_layout", [False, True], ids=["vk-slots", "kv-slots"])
@pytest.mark.parametrize("dim_first", [False, True])
def test_server_glue_matches_per_sequence_reference(dim_first, kv_layout):
    """kv-slots: the CUDA state layout (gdn.state_memory) exercised on CPU: states read from and written to
    slots whose memory is in [HV, K, V] order give the same outputs and the same state values."""
    l1 = mk(dim_first)
    l2 = types.SimpleNamespace(**vars(l1))
    ssm = l1.kv_cache[1]
    l2.kv_cache = (l1.kv_cache[0].clone(), kv_order(ssm) if kv_layout else ssm.clone())
    o1 = torch.zeros(T, HV, V, dtype=torch.bfloat16)
    o2 = o1.clone()
    reference(l1, dim_first, o1)
    with mock.patch("vllm.model_executor.layers.mamba.mamba_utils.is_conv_state_dim_first", return_value=dim_first), \
            mock.patch.object(G, "_metadata", return_value=md), mock.patch.object(G, "_kv_layout", return_value=kv_layout):
        G.bi_gdn_core(l2, x, b, a, o2)
    assert o1.abs().sum() > 0
    assert torch.equal(o1, o2)
    want = kv_order(l1.kv_cache[1]) if kv_layout else l1.kv_cache[1]
    assert torch.equal(l1.kv_cache[0], l2.kv_cache[0]) and torch.equal(want, l2.kv_cache[1])


def _kda_layer(gen, conv_rows, cache_cols):
    """A Kimi Linear KDA layer as the glue sees it: 2 heads of 32, a forget gate per key channel, a lower bound."""
    Hk, Kk = 2, 32
    P = Hk * Kk
    return types.SimpleNamespace(
        kv_cache=(torch.randn(nslots, conv_rows, cache_cols, generator=gen).bfloat16(),
                  torch.randn(nslots, Hk, Kk, Kk, generator=gen) * 0.1),
        f_b_proj=object(), conv1d=types.SimpleNamespace(weight=(torch.randn(3 * P, 1, W, generator=gen) * 0.3).float()),
        local_num_heads=Hk, head_dim=Kk, gate_lower_bound=-5.0, A_log=torch.log(torch.tensor([2.0, 9.0])),
        dt_bias=torch.randn(P, generator=gen) * 0.3, prefix="kda", num_spec=0)


def _serve_steps(mode, total, steps, dim_first, kv_layout, seed, patches=(), on_step=lambda: None, kda=False,
                 ref_mode=None):
    """Serve requests of ``total`` tokens over scheduler ``steps`` (tokens of each request per step) through
    ``gdn.bi_gdn_core`` in ``mode``, from widened conv-state slots holding garbage (new requests must ignore
    it). One-token chunks of running requests are counted as decodes, as vLLM does. Returns each request's
    outputs and the trainer's call, ``gdn_varlen(mode=...)`` over the whole sequences from zero states.
    ``kda``: a Kimi Linear KDA layer (``a`` its forget gate per key channel, ``b`` its raw beta) instead of GDN's.
    ``ref_mode``: the trainer's call in another mode (for controls)."""
    from vllm_bi.gdn.chunk import CHUNK
    from vllm_bi.gdn.layer import gdn_varlen

    R = CHUNK + W - 1
    n = len(total)
    gen = torch.Generator().manual_seed(seed)
    if kda:
        layer = _kda_layer(gen, R, 2 * 3 * 32 + 2 * 32 + 2)  # rows: [mixed_qkv | forget | beta]
        Dx, a_tail, b_tail = 3 * 64, (2, 32), (2,)
        heads, gate = (2, 32, 32), {"gating": "kda", "lower_bound": -5.0}
    else:
        layer = mk(dim_first)
        layer.kv_cache = (torch.randn(nslots, R, D + 2 * HV, generator=gen).bfloat16(),
                          torch.randn(nslots, HV, V, K, generator=gen))
        Dx, a_tail, b_tail, heads, gate = D, (HV,), (HV,), (H, K, V), {}
    if dim_first:
        layer.kv_cache = (layer.kv_cache[0].transpose(1, 2).contiguous(), layer.kv_cache[1])
    xs = [torch.randn(t, Dx, generator=gen).bfloat16() for t in total]
    as_ = [torch.randn(t, *a_tail, generator=gen).bfloat16() for t in total]
    bs = [torch.randn(t, *b_tail, generator=gen).bfloat16() for t in total]
    out_heads = heads[0] if kda else HV
    slot, done, outs = [4, 0, 2, 5][:n], [0] * n, [[] for _ in range(n)]
    for step in steps:
        on_step()
        dec = [i for i in range(n) if step[i] == 1 and done[i]]
        reqs = dec + [i for i in range(n) if step[i] and i not in dec]
        qsl = [0]
        for i in reqs:
            qsl.append(qsl[-1] + step[i])
        step_md = types.SimpleNamespace(
            num_actual_tokens=qsl[-1], num_spec_decodes=0, spec_sequence_masks=None,
            non_spec_query_start_loc=torch.tensor(qsl), non_spec_state_indices_tensor=torch.tensor([slot[i] for i in reqs]),
            num_decodes=len(dec), num_decode_tokens=len(dec), num_prefills=len(reqs) - len(dec),
            has_initial_state=torch.tensor([done[i] > 0 for i in reqs]),
            vllm_bi_num_computed=torch.tensor([done[i] for i in reqs]))
        cat = [torch.cat([t[i][done[i] : done[i] + step[i]] for i in reqs]) for t in (xs, as_, bs)]
        o = torch.zeros(qsl[-1], out_heads, heads[2], dtype=torch.bfloat16)
        with mock.patch("vllm.model_executor.layers.mamba.mamba_utils.is_conv_state_dim_first", return_value=dim_first), \
                mock.patch.object(G, "_metadata", return_value=step_md), mock.patch.object(G, "gdn_mode", return_value=mode), \
                mock.patch.object(G, "_kv_layout", return_value=kv_layout), contextlib.ExitStack() as stack:
            for name, fn in patches:
                stack.enter_context(mock.patch.object(G, name, fn))
            G.bi_gdn_core(layer, cat[0], cat[2], cat[1], o)
        for j, i in enumerate(reqs):
            outs[i].append(o[qsl[j] : qsl[j + 1]])
            done[i] += step[i]
    assert done == total
    cu = [0, *torch.tensor(total).cumsum(0).tolist()]
    w = layer.conv1d.weight.reshape(Dx, W)
    ref, _, _ = gdn_varlen(torch.cat(xs), [(cu[i], cu[i + 1]) for i in range(n)], w,
                           torch.zeros(n, W - 1, Dx, dtype=torch.bfloat16), layer.A_log, torch.cat(as_), torch.cat(bs),
                           layer.dt_bias, torch.zeros(n, *layer.kv_cache[1].shape[1:]), *heads, mode=ref_mode or mode,
                           **gate)
    return [torch.cat(o) for o in outs], [r.to(torch.bfloat16) for r in ref]


@pytest.mark.parametrize("kv_layout", [False, True], ids=["vk-slots", "kv-slots"])
@pytest.mark.parametrize("dim_first", [False, True])
def test_chunk_glue_resumes_exactly(dim_first, kv_layout):
    """Chunk-aligned mode: three requests served over four scheduler steps (prefills split at unaligned
    offsets, decodes across a 64-token boundary, from a widened conv-state slot holding the raw inputs since
    the boundary) give exactly the outputs of the trainer's call, ``gdn_varlen(mode="chunk")`` over the
    whole sequences from zero states."""
    stored = []  # boundary states written per step: only new requests and those reaching a block boundary
    real_store = G.store_slots

    def store(cache, slot_t, states, kv_layout):
        stored[-1] += slot_t.numel()
        return real_store(cache, slot_t, states, kv_layout)

    steps = [[40, 70, 5], [60, 1, 1], [49, 0, 0], [1, 0, 0]]
    got, ref = _serve_steps("chunk", [150, 71, 6], steps, dim_first, kv_layout, 5, patches=[("store_slots", store)],
                            on_step=lambda: stored.append(0))
    assert stored == [3, 1, 1, 0]  # step 1: request 0 crosses 64, the decodes of 1 and 2 do not; step 3: none
    for i in range(3):
        assert torch.equal(got[i], ref[i]), f"request {i} differs from the trainer"


@pytest.mark.parametrize("kv_layout", [False, True], ids=["vk-slots", "kv-slots"])
@pytest.mark.parametrize("dim_first", [False, True])
def test_kda_chunk_glue_resumes_exactly(dim_first, kv_layout):
    """Kimi Linear's KDA layer in the chunk-aligned mode: prefills split at unaligned offsets, mixed steps, decode-only
    steps (read from the ring) and a decode across a 64-token boundary give exactly the trainer's call,
    ``gdn_varlen(mode="chunk", gating="kda")`` over the whole sequences. Control: the recurrent mode's bits differ,
    so the comparison sees which arithmetic ran."""
    steps = [[40, 70, 5], [60, 1, 1], [1, 1, 1], [49, 0, 0], [1, 0, 0]]
    got, ref = _serve_steps("chunk", [151, 72, 7], steps, dim_first, kv_layout, 5, kda=True)
    for i in range(3):
        assert torch.equal(got[i], ref[i]), f"request {i} differs from the trainer"
    _, rec = _serve_steps("chunk", [151, 72, 7], steps, dim_first, kv_layout, 5, kda=True, ref_mode="recurrent")
    assert not torch.equal(got[0], rec[0]), "control: the recurrent mode should give other bits"


@pytest.mark.parametrize("dim_first", [False, True])
def test_chunk_glue_decode_steps_read_the_ring_after_writing(dim_first):
    """Chunk mode, steps of decodes only (``_chunk_index``'s ``fits``: the new rows go into the ring first and the
    conv reads each block there, through ``RingRows``): a decode 2 tokens into its sequence (conv rows before the start are zeros), one
    completing its block (63 cached rows + 1: the ring's every row) and one just past a boundary, for three steps,
    give exactly the trainer's outputs."""
    from vllm_bi.model_executor.gdn import _chunk_index

    fits = []
    real = _chunk_index

    def spy(plan, R, W_, dev):
        ix = real(plan, R, W_, dev)
        fits.append(ix.fits)
        return ix

    steps = [[2, 63, 65], [1, 1, 1], [1, 1, 1], [1, 1, 1]]
    got, ref = _serve_steps("chunk", [5, 66, 68], steps, dim_first, False, 7, patches=[("_chunk_index", spy)])
    assert fits == [False, True, True, True]  # the first step: new prompts, their rows where they lie
    for i in range(3):
        assert torch.equal(got[i], ref[i]), f"request {i} differs from the trainer"


def _partial_on_cpu(calls):
    """``partial_blocks_in_slots`` (CUDA only) on CPU: the chunk core on the states read from their slots; a
    segment of 64 rows writes the state at its block's end into its slot, and no other slot is written."""
    from vllm_bi.gdn.chunk import CHUNK, gdn_chunk_varlen

    def partial(q, k, v, g_, beta, pool, slot_t, cu, scale):
        lens = [cu[j + 1] - cu[j] for j in range(len(cu) - 1)]
        calls.append(lens)
        before = pool.clone()
        o, finals = gdn_chunk_varlen(q, k, v, g_, beta, pool[slot_t].transpose(-1, -2).contiguous(), cu, scale)
        whole = [j for j, n in enumerate(lens) if n == CHUNK]
        for j in whole:
            pool[slot_t[j]] = finals[j].transpose(-1, -2)
        untouched = sorted(set(range(pool.shape[0])) - {int(slot_t[j]) for j in whole})
        assert torch.equal(pool[untouched], before[untouched])
        return o

    return partial


@pytest.mark.parametrize("whole_blocks", [False, True], ids=["whole-gathered", "whole-in-slots"])
@pytest.mark.parametrize("dim_first", [False, True])
def test_chunk_glue_with_states_in_slots(dim_first, whole_blocks):
    """CUDA's chunk-mode step (``_in_place``: ``gdn_chunk_decode.chunk_in_slots``) on CPU, with the partial-block
    kernels (CUDA only) replaced by the chunk core on the states read from their slots: four steps (one decode
    completes its block) give exactly the trainer's outputs. Only requests that are not new and stay inside one
    block go to the partial-block path, and with ``WHOLE_BLOCKS_IN_SLOTS`` those that complete it too (their slot
    then gets the state at the block's end; no other slot is written there); the others' boundary states are
    gathered and stored."""
    from vllm_bi.gdn import chunk_decode as CD

    calls = []
    steps = [[40, 70, 63], [60, 1, 1], [49, 0, 1], [1, 0, 1]]
    with mock.patch.object(CD, "partial_blocks_in_slots", _partial_on_cpu(calls)), \
            mock.patch.object(CD, "WHOLE_BLOCKS_IN_SLOTS", whole_blocks):
        got, ref = _serve_steps("chunk", [150, 71, 66], steps, dim_first, True, 5,
                                patches=[("_in_place", lambda dev: True)])
    # step 1: the decodes of requests 1 (block rows 6 + 1) and 2 (63 + 1: completes its block, whose end state its
    # next two decodes start from); steps 2 and 3: request 2 (0 + 1, 1 + 1), then request 0 (21 + 1) with it
    assert calls == ([[7, 64], [1], [22, 2]] if whole_blocks else [[7], [1], [22, 2]])
    for i in range(3):
        assert torch.equal(got[i], ref[i]), f"request {i} differs from the trainer"


def _padded_core_on_cpu(calls):
    """``padded_blocks_in_slots`` (fla-core's launches and the partial-block kernels: CUDA only) on CPU: each
    segment's first ``lens[j]`` rows through the chunk core from the state in its slot; a 64-row segment writes the
    state at its block's end into the slot. Its padding rows must not matter: they are filled with NaN here, so a
    real row that read one would be NaN."""
    from vllm_bi.gdn.chunk import CHUNK, gdn_chunk_varlen

    def core(q, k, v, g_, beta, pool, slot_t, lens, scale):
        n = lens.tolist()
        calls.append(n)
        N = slot_t.shape[0]
        assert q.shape[0] == N * CHUNK
        rows = torch.cat([torch.arange(CHUNK * j, CHUNK * j + n[j]) for j in range(N)])
        cu = [0, *torch.tensor(n).cumsum(0).tolist()]
        o_real, finals = gdn_chunk_varlen(q[rows], k[rows], v[rows], g_[rows], beta[rows],
                                          pool[slot_t].transpose(-1, -2).contiguous(), cu, scale)
        for j in range(N):
            if n[j] == CHUNK:
                pool[slot_t[j]] = finals[j].transpose(-1, -2)
        o = torch.full_like(v, float("nan"))
        o[rows] = o_real.to(o.dtype)
        return o

    return core


@pytest.mark.parametrize("dim_first", [False, True])
def test_chunk_glue_padded_decode_steps_give_the_trainers_bits(dim_first):
    """The chunk mode's capturable decode (``VLLM_BI_CHUNK_DECODE=padded``: indices built on the device from the
    computed-token counts, every block padded to 64 rows) mixed with host-planned prefill steps: four requests
    whose decodes sit 2 tokens into the sequence (conv rows before the start are zeros), complete a block (63 cached
    rows + 1), start one and sit mid-block give exactly the trainer's outputs. The padded steps read nothing on the
    host, and the control (padding rows read as real ones) differs."""
    from vllm_bi.gdn import chunk_decode as CD
    from vllm_bi.gdn import layer as L

    calls, host_calls = [], []
    padded = [("_padded_decode", lambda dev: True), ("_in_place", lambda dev: True)]
    steps = [[2, 63, 64, 30], [1, 1, 1, 1], [1, 1, 1, 1], [0, 0, 5, 0], [1, 1, 1, 1]]
    with mock.patch.object(L, "padded_blocks_in_slots", _padded_core_on_cpu(calls)), \
            mock.patch.object(CD, "partial_blocks_in_slots", _partial_on_cpu(host_calls)):
        got, ref = _serve_steps("chunk", [5, 66, 72, 33], steps, dim_first, True, 11, patches=padded)
    # each decode step: one segment per request, its block's rows so far (the prefill step went to the host plan)
    assert calls == [[3, 64, 1, 31], [4, 1, 2, 32], [5, 2, 8, 33]]
    assert host_calls == [[7]]  # the resumed prefill of request 2 (2 cached rows + 5): planned on the host
    for i in range(4):
        assert torch.equal(got[i], ref[i]), f"request {i} differs from the trainer"

    def leaky(calls_):  # the control: the core takes every padded row as a real one
        inner = _padded_core_on_cpu(calls_)
        return lambda q, k, v, g_, beta, pool, slot_t, lens, scale: inner(q, k, v, g_, beta, pool, slot_t,
                                                                          torch.full_like(lens, 64), scale)

    with mock.patch.object(L, "padded_blocks_in_slots", leaky([])), \
            mock.patch.object(CD, "partial_blocks_in_slots", _partial_on_cpu([])):
        bad, _ = _serve_steps("chunk", [5, 66, 72, 33], steps, dim_first, True, 11, patches=padded)
    assert not all(torch.equal(bad[i], ref[i]) for i in range(4))


def test_padded_decode_plan_reads_nothing_on_the_host(monkeypatch):
    """The chunk mode's padded decode plan (``VLLM_BI_CHUNK_DECODE=padded``) takes the slots and the computed-token
    counts as device tensors: no host read, which a captured step cannot make."""
    from vllm_bi.model_executor import gdn as G

    md = types.SimpleNamespace(non_spec_query_start_loc=torch.tensor([0, 1, 2]), num_decode_tokens=2,
                               non_spec_state_indices_tensor=torch.tensor([5, -1], dtype=torch.int32), num_decodes=2,
                               num_prefills=0, has_initial_state=None,
                               vllm_bi_num_computed=torch.tensor([70, 3], dtype=torch.int32))

    def no_host_read(self, *a, **k):
        raise AssertionError("the padded decode plan read a tensor on the host")

    monkeypatch.setattr(G, "gdn_mode", lambda: "chunk")
    monkeypatch.setattr(G, "_padded_decode", lambda dev: True)
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "tolist", no_host_read)
        m.setattr(torch.Tensor, "item", no_host_read)
        plan = G.step_plan(md, torch.device("cpu"))
    assert plan.padded and plan.starts.tolist() == [70, 3] and plan.slot_t.tolist() == [5, 0]


@pytest.mark.parametrize("kv_layout", [False, True])
def test_gather_slots_copies_values_and_zeroes_new_requests(kv_layout):
    """The state gather of the server glue: ``cache[slots]`` with new requests' rows zeroed, from slots in the
    cache's order or (CUDA) in fla-core's [HV, K, V] order; the gathered values are the same bits."""
    from vllm_bi.model_executor.gdn import gather_slots

    states = torch.randn(6, 3, 4, 5)
    cache = kv_order(states) if kv_layout else states.clone()
    before = cache.clone()
    slots = torch.tensor([4, 0, 2])
    got = gather_slots(cache, slots, torch.tensor([1]), kv_layout)
    want = states[slots].clone()
    want[1] = 0
    assert got.shape == want.shape and torch.equal(got, want)
    assert got.transpose(-1, -2).is_contiguous() == kv_layout  # fla-core takes it without a copy
    assert torch.equal(cache, before)  # the cache itself is untouched (slot 0 holds the zeroed request)


def test_store_slots_writes_in_place_through_padded_slots():
    """vLLM allocates state slots inside larger pages (slot stride > HV * V * K): the kv-order view must
    still be the cache's own memory, so stores land in it; a cache whose slot rows are not contiguous is
    refused rather than written through a copy."""
    from vllm_bi.model_executor.gdn import gather_slots, state_memory, store_slots

    pages = torch.zeros(5, 3 * 4 * 5 + 7)  # 7 floats of padding per slot
    cache = pages[:, : 3 * 4 * 5].unflatten(-1, (3, 4, 5))  # [slots, HV=3, V=4, K=5]
    new = torch.randn(2, 3, 4, 5)
    slots = torch.tensor([3, 1])
    store_slots(cache, slots, new, kv_layout=True)
    assert torch.equal(state_memory(cache, True)[slots], new.transpose(-1, -2))
    assert torch.equal(gather_slots(cache, slots, None, True), new)
    assert pages[:, 60:].abs().sum() == 0 and pages[[0, 2, 4]].abs().sum() == 0  # only the two slots written
    with pytest.raises(RuntimeError, match="not contiguous"):
        state_memory(cache.transpose(-1, -2), True)


def test_chunk_history_is_a_ring_read_and_written_only_where_needed():
    """The chunk mode's widened conv history (``gdn._chunk_index``, ring): the token at absolute position p sits in
    row p % R. A decode step reads each request's partial block and the W - 1 rows before it, and writes one row;
    a new request reads nothing (its conv state is the zero row); a prefill longer than R writes only its last R
    rows. A step of decodes fits in the
    ring at once: its new rows are written first, then the conv reads each block's rows there."""
    from vllm_bi.gdn.chunk import CHUNK
    from vllm_bi.model_executor.gdn import StepPlan, _chunk_index

    R = CHUNK + W - 1
    ranges = [(0, 1), (1, 2), (2, 102)]
    starts = [130, 64, 0]  # a decode 2 rows past a boundary, a decode at a boundary, a new 100-token prompt
    plan = StepPlan(ranges, None, torch.tensor([5, 2, 0]), torch.tensor([2]), starts, [2])
    ix = _chunk_index(plan, R, W, "cpu")
    want_read = [(0, p % R) for p in range(128 - (W - 1), 130)] + [(1, p % R) for p in range(64 - (W - 1), 64)]
    assert list(zip(ix.cache_req.tolist(), ix.cache_row.tolist())) == want_read
    n_read = len(want_read)
    # conv states: request 0's 3 rows before 128, request 1's before 64, request 2's the zero row
    assert ix.conv_rows.tolist() == [1, 2, 3, 6, 7, 8, 0, 0, 0]
    # blocks: request 0 re-runs its 2 cached rows (positions 128, 129) then its new row (raw row 0)
    assert ix.block_rows[:3].tolist() == [4, 5, 1 + n_read + 0] and ix.ranges == [(0, 3), (3, 4), (4, 104)]
    assert ix.keep_rows[:2].tolist() == [2, 3]
    # writes: one row per decode (positions 130, 64), the prompt's last R positions 34..99 from raw rows 36..101
    assert list(zip(ix.write_req.tolist()[:2], ix.write_row.tolist()[:2])) == [(0, 130 % R), (1, 64 % R)]
    assert ix.write_src.tolist() == [0, 1, *range(2 + 100 - R, 102)]
    assert ix.write_row.tolist()[2:] == [p % R for p in range(100 - R, 100)]
    assert ix.store.tolist() == [2]  # only the new request's boundary state: neither decode reached a boundary
    assert not ix.fits  # the prompt's 100 rows do not fit in the ring with its conv rows
    # a step of decodes fits: its new rows go into the ring first, then the conv reads each block in the ring
    # (positions 128..130, 64, 0..2) after the conv rows before it (125..127, 61..63, and -3..-1: zeros)
    dec = StepPlan([(0, 1), (1, 2), (2, 3)], None, torch.tensor([5, 2, 0]), None, [130, 64, 2], [])
    fx = _chunk_index(dec, R, W, "cpu")
    assert fx.fits and fx.direct is None
    assert list(zip(fx.cache_req.tolist(), fx.cache_row.tolist())) == [
        (0, 128 % R), (0, 129 % R), (0, 130 % R), (1, 64 % R), (2, 0), (2, 1), (2, 2)]
    # what the conv reads in the ring: each request's W - 1 conv rows then its block (RingRows' ext entries)
    assert fx.ext_req.tolist() == [0] * 6 + [1] * 4 + [2] * 6
    assert fx.ext_row.tolist() == [125 % R, 126 % R, 127 % R, 128 % R, 129 % R, 130 % R, 61, 62, 63, 64 % R,
                                   -1, -1, -1, 0, 1, 2]
    assert list(zip(fx.write_req.tolist(), fx.write_row.tolist(), fx.write_src.tolist())) == [
        (0, 130 % R, 0), (1, 64 % R, 1), (2, 2, 2)]
    # with the ring one row shorter a decode completing its block (63 cached rows) would not fit
    assert not _chunk_index(StepPlan([(0, 1)], None, torch.tensor([5]), None, [127], []), R - 1, W, "cpu").fits


def test_step_plan_is_read_once_per_step():
    """The scheduler's metadata is read on the host once per step (each read of a device tensor synchronises
    the stream) and shared by every GDN layer; a new step's metadata object gets its own plan."""
    from vllm_bi.model_executor.gdn import step_plan

    def metadata(qsl, slots, has_init):
        return types.SimpleNamespace(non_spec_query_start_loc=torch.tensor(qsl),
                                     non_spec_state_indices_tensor=torch.tensor(slots), num_decodes=1,
                                     num_prefills=len(qsl) - 2, has_initial_state=torch.tensor(has_init))

    md = metadata([0, 1, 1, 6], [7, 3, 5], [True, True, False])  # a decode, an empty prefill, a new prompt
    plan = step_plan(md, torch.device("cpu"))
    assert plan.ranges == [(0, 1), (1, 6)]  # the empty one is skipped
    assert plan.rows.tolist() == [0, 1, 2, 3, 4, 5] and plan.slot_t.tolist() == [7, 5]
    assert plan.fresh.tolist() == [1]  # the new prompt starts from zeros
    md.non_spec_query_start_loc = None  # a second layer of the same step reads nothing from the scheduler
    assert step_plan(md, torch.device("cpu")) is plan
    other = step_plan(metadata([0, 2], [4], [True]), torch.device("cpu"))
    assert other is not plan and other.ranges == [(0, 2)] and other.fresh is None
    assert step_plan(metadata([0, 0], [4], [True]), torch.device("cpu")) is None  # nothing scheduled


def test_a_decode_step_is_planned_without_reading_the_host(monkeypatch):
    """A step of one-token decodes (recurrent mode) gets the plan the host path would build, without a host read
    of the metadata (which a captured CUDA-graph step cannot do); a padded entry (-1) goes to slot 0."""
    from vllm_bi.model_executor import gdn as G

    slots = [7, 3, -1]
    md = types.SimpleNamespace(non_spec_query_start_loc=torch.tensor([0, 1, 2, 3]), num_decode_tokens=3,
                               non_spec_state_indices_tensor=torch.tensor(slots, dtype=torch.int32), num_decodes=3,
                               num_prefills=0, has_initial_state=None)

    def no_host_read(self, *a, **k):
        raise AssertionError("the decode plan read a tensor on the host")

    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "tolist", no_host_read)
        m.setattr(torch.Tensor, "item", no_host_read)
        plan = G.step_plan(md, torch.device("cpu"))
    assert plan.ranges == [(0, 1), (1, 2), (2, 3)] and plan.fresh is None
    assert plan.rows.tolist() == [0, 1, 2] and plan.slot_t.tolist() == [7, 3, 0] and plan.slot_t.dtype == torch.long
    assert md.non_spec_state_indices_tensor.tolist() == slots  # vLLM's own tensor is left as it was
    md64 = types.SimpleNamespace(**{**vars(md), "non_spec_state_indices_tensor": torch.tensor(slots)})
    del md64._vllm_bi_plan
    G.step_plan(md64, torch.device("cpu"))
    assert md64.non_spec_state_indices_tensor.tolist() == slots  # also when it is int64 already
    # the host path over the same (unpadded) step builds the same plan
    host = types.SimpleNamespace(**{**vars(md), "num_decode_tokens": None, "_vllm_bi_plan": None,
                                    "non_spec_state_indices_tensor": torch.tensor([7, 3, 0])})
    del host._vllm_bi_plan
    ref = G.step_plan(host, torch.device("cpu"))
    assert ref.ranges == plan.ranges and torch.equal(ref.rows, plan.rows) and torch.equal(ref.slot_t, plan.slot_t)


def test_ring_rows_refuse_autograd():
    """The ring conv has no backward: a RingRows input with a weight that wants a gradient is refused by name,
    not run without one."""
    from vllm_bi.gdn.layer import RingRows, gdn_varlen

    ring = RingRows(torch.zeros(2, 7, 8), torch.full((4,), -1), torch.zeros(1, dtype=torch.long))
    weight = torch.zeros(8, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="RingRows .* has no backward"):
        gdn_varlen(ring, [(0, 1)], weight, None, torch.zeros(1), torch.zeros(1, 1), torch.zeros(1, 1),
                   torch.zeros(1), torch.zeros(1, 1, 2, 2), 1, 2, 2)


@pytest.mark.parametrize("dim_first", [False, True])
def test_kda_layer_through_the_server_glue_matches_per_sequence_reference(dim_first):
    """Kimi Linear's KDA layer (a forget gate per key channel, raw beta, a gate lower bound) through the same glue:
    the scheduled sequences from their slots == one sequence at a time from ``gdn_sequence(gating="kda")``, outputs,
    conv and fp32 states exact. Control: the reference with another lower bound differs, so the gate reaches the
    bits. Speculative decoding is refused for KDA by name."""
    Hk, Kk = 2, 32
    P = Hk * Kk
    gen = torch.Generator().manual_seed(7)
    conv = torch.randn(nslots, *((3 * P, W - 1) if dim_first else (W - 1, 3 * P)), generator=gen).bfloat16()
    layer = types.SimpleNamespace(
        kv_cache=(conv, torch.randn(nslots, Hk, Kk, Kk, generator=gen) * 0.1), f_b_proj=object(),
        conv1d=types.SimpleNamespace(weight=(torch.randn(3 * P, 1, W, generator=gen) * 0.3).float()),
        local_num_heads=Hk, head_dim=Kk, gate_lower_bound=-5.0, A_log=torch.log(torch.tensor([2.0, 9.0])),
        dt_bias=torch.randn(P, generator=gen) * 0.3, prefix="kda", num_spec=0)
    before = tuple(t.clone() for t in layer.kv_cache)
    xk = torch.randn(T, 3 * P, generator=gen).bfloat16()
    forget = (torch.randn(T, Hk, Kk, generator=gen) * 2).bfloat16()
    beta = torch.randn(T, Hk, generator=gen).bfloat16()
    out = torch.zeros(T, Hk, Kk, dtype=torch.bfloat16)
    with mock.patch("vllm.model_executor.layers.mamba.mamba_utils.is_conv_state_dim_first", return_value=dim_first), \
            mock.patch.object(G, "_metadata", return_value=md), mock.patch.object(G, "_kv_layout", return_value=False), \
            mock.patch.object(G, "gdn_mode", return_value="recurrent"):
        G.bi_gdn_core(layer, xk, beta, forget, out)
    w = layer.conv1d.weight.reshape(3 * P, W)

    def ref(i, lower_bound):
        s, e, slot = qsl[i], qsl[i + 1], slots[i]
        if has_init[i]:
            c0 = before[0][slot].transpose(0, 1) if dim_first else before[0][slot]
            st0 = before[1][slot]
        else:
            c0, st0 = torch.zeros(W - 1, 3 * P, dtype=torch.bfloat16), torch.zeros(Hk, Kk, Kk)
        return gdn_sequence(xk[s:e], w, c0, layer.A_log, forget[s:e], beta[s:e], layer.dt_bias, st0, Hk, Kk, Kk,
                            gating="kda", lower_bound=lower_bound)

    for i in range(len(lens)):
        o, c, st = ref(i, -5.0)
        assert torch.equal(out[qsl[i] : qsl[i + 1]], o.to(torch.bfloat16)), i
        assert torch.equal(layer.kv_cache[1][slots[i]], st), i
        got_c = layer.kv_cache[0][slots[i]]
        assert torch.equal(got_c.transpose(0, 1) if dim_first else got_c, c.to(torch.bfloat16)), i
    assert not torch.equal(ref(2, -1.0)[0].to(torch.bfloat16), out[qsl[2] : qsl[3]]), "control: the bound matters"
    layer.num_spec = 2
    with mock.patch.object(G, "_metadata", return_value=md):
        with pytest.raises(NotImplementedError, match="without speculative decoding"):
            G.bi_gdn_core(layer, xk, beta, forget, out)


@pytest.mark.parametrize("mode", ["recurrent", "chunk"])
def test_kda_forward_over_the_glue_equals_the_trainers_kda_block(mode, monkeypatch):
    """``bi_kda_forward`` (vLLM's KDA layer under batch invariance: its merged projection, the glue's core over the
    cache slots, the sigmoid-gated norm, ``o_proj``) gives the trainer's ``models.kimi_linear.kda_block`` bits for a
    step of fresh prompts, and a decode after it gives the bits of the same token in the longer prompt (exact), in
    each GDN mode, the trainer's taken from the settings as the server's is. The glue tests above carry the controls
    for the core."""
    from vllm_bi import settings
    from vllm_bi.gdn.chunk import CHUNK
    from vllm_bi.model_executor.gdn import bi_kda_forward
    from vllm_bi.models.kimi_linear import KimiDeltaAttention, kda_block
    from vllm_bi.ops.linear import bi_linear

    Dm, Hk, Kk, Wk = 64, 2, 16, 4
    P = Hk * Kk
    gen = torch.Generator().manual_seed(11)
    trainer = KimiDeltaAttention(Dm, Hk, Kk, Wk, lower_bound=-5.0)
    trainer.load({n: torch.randn(p.shape, generator=gen) * (0.3 if p.dim() != 2 else Dm**-0.5)
                  for n, p in trainer.weights().items()})
    w = {n: t.detach() for n, t in trainer.weights().items()}

    def lin(weight):
        return lambda x: (bi_linear(x, weight), None)

    merged = torch.cat([w["q_proj.weight"], w["k_proj.weight"], w["v_proj.weight"], w["b_proj.weight"],
                        w["f_a_proj.weight"]])
    conv = torch.cat([w[f"{n}_conv1d.weight"] for n in "qkv"]).float()  # vLLM keeps it in fp32
    layer = types.SimpleNamespace(
        in_proj_qkvgfab=lin(merged), f_b_proj=lin(w["f_b_proj.weight"]), g_a_proj=lin(w["g_a_proj.weight"]),
        g_b_proj=lin(w["g_b_proj.weight"]), o_proj=lin(w["o_proj.weight"]),
        o_norm=types.SimpleNamespace(weight=w["o_norm.weight"], eps=1e-5), conv1d=types.SimpleNamespace(weight=conv),
        local_num_heads=Hk, head_dim=Kk, gate_lower_bound=-5.0, A_log=w["A_log"].reshape(Hk).float(),
        dt_bias=w["dt_bias"], prefix="kda", num_spec=0, use_full_rank_gate=False,
        kv_cache=(torch.zeros(nslots, *((Wk - 1, 3 * P) if mode == "recurrent" else (CHUNK + Wk - 1, 4 * P + Hk)),
                              dtype=torch.bfloat16), torch.zeros(nslots, Hk, Kk, Kk)))
    x = torch.randn(13, Dm, generator=gen).bfloat16()
    monkeypatch.setenv("VLLM_BI_GDN_MODE", mode)
    settings.reload()
    try:
        want = kda_block(x, [0, 5, 13], w, Hk, Kk, -5.0)  # two prompts of 5 and 8 tokens
        other = "chunk" if mode == "recurrent" else "recurrent"
        monkeypatch.setenv("VLLM_BI_GDN_MODE", other)
        settings.reload()
        assert not torch.equal(kda_block(x, [0, 5, 13], w, Hk, Kk, -5.0), want), f"control: {other} gives other bits"
    finally:
        monkeypatch.delenv("VLLM_BI_GDN_MODE")
        settings.reload()

    def step(rows, lens_, slot_ids, fresh):
        q = [0]
        for n in lens_:
            q.append(q[-1] + n)
        step_md = types.SimpleNamespace(
            num_actual_tokens=q[-1], num_spec_decodes=0, spec_sequence_masks=None,
            non_spec_query_start_loc=torch.tensor(q), non_spec_state_indices_tensor=torch.tensor(slot_ids),
            num_decodes=0 if fresh else len(lens_), num_prefills=len(lens_) if fresh else 0,
            has_initial_state=torch.tensor([not fresh] * len(lens_)), num_decode_tokens=0 if fresh else len(lens_),
            vllm_bi_num_computed=torch.tensor([0, 0] if fresh else [7]))
        with mock.patch("vllm.model_executor.layers.mamba.mamba_utils.is_conv_state_dim_first", return_value=False), \
                mock.patch.object(G, "_metadata", return_value=step_md), \
                mock.patch.object(G, "_kv_layout", return_value=False), \
                mock.patch.object(G, "gdn_mode", return_value=mode):
            return bi_kda_forward(layer, rows)

    with torch.no_grad():
        got = step(torch.cat([x[:5], x[5:12]]), [5, 7], [1, 4], True)  # the second prompt's last token held back
        assert torch.equal(got, torch.cat([want[:5], want[5:12]]))
        assert torch.equal(step(x[12:13], [1], [4], False), want[12:13])  # its decode == the prompt's last row
