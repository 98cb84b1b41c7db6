"""The in-place recurrent step (:mod:`vllm_bi.gdn.slots`, CUDA path of the server's recurrent core)
run through Triton's interpreter on CPU: its logic against a float64 recurrence (outputs and the states it
writes back, relative error <= 1e-5), slots that are permuted, fresh (zeros) or padding (slot 0), untouched
slots left as they were, and a sequence alone == the same sequence in a batch (exact). Its bits against
fla-core's fused recurrent kernel, the trainer's forward, are measured on the GPU
(``tests/gpu/test_gdn_cuda.py::test_recurrent_in_slots_equals_fla_core``)."""

import pytest

pytest.importorskip("triton")

RECURRENCE64 = """
def inputs(T, H, HV, K, V, S):
    # q, k [T, H, K] and v [T, HV, V] bf16, log decay and beta [T, HV], a pool of S fp32 states [HV, K, V]
    q, k = torch.randn(T, H, K).bfloat16(), torch.randn(T, H, K).bfloat16()
    v = torch.randn(T, HV, V).bfloat16()
    g = -torch.rand(T, HV) * 0.5
    beta = torch.rand(T, HV)
    return q, k, v, g, beta, torch.randn(S, HV, K, V) * 0.3


def recurrence64(q, k, v, g, beta, st, scale, first, stop):
    # tokens first..stop-1 from the float64 state st [HV, K, V] (updated in place): outputs [T, HV, V], st
    H, HV = q.shape[1], v.shape[1]
    out = []
    for t in range(first, stop):
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
"""

SCRIPT = """
import torch
from vllm_bi.gdn.slots import recurrent_in_slots
""" + RECURRENCE64 + """

torch.manual_seed(0)
H, HV, K, V, S = 2, 4, 16, 16, 7
lens, slots, fresh = [3, 1, 7, 2], [4, 1, 5, 2], [0, 0, 1, 0]
T = sum(lens)
cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
q, k, v, g, beta, pool0 = inputs(T, H, HV, K, V, S)
scale = K ** -0.5


def reference(i):
    st = torch.zeros(HV, K, V, dtype=torch.float64) if fresh[i] else pool0[slots[i]].double()
    return recurrence64(q, k, v, g, beta, st, scale, int(cu[i]), int(cu[i + 1]))


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


KDA = """
import torch
from vllm_bi.gdn.slots import recurrent_in_slots

torch.manual_seed(1)
H = HV = 2
K = V = 16
S = 5
lens, slots = [4, 1, 6], [3, 0, 2]
T = sum(lens)
cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
q, k, v = (torch.randn(T, H, K).bfloat16() for _ in range(3))
g = -torch.rand(T, HV, K) * 0.5  # a decay per key channel
beta = torch.rand(T, HV)
pool0 = torch.randn(S, HV, K, V) * 0.3
scale = K ** -0.5

pool = pool0.clone()
o = recurrent_in_slots(q, k, v, g, beta, pool, torch.tensor(slots), cu, scale)
for i in range(len(lens)):
    st = pool0[slots[i]].double()
    for t in range(int(cu[i]), int(cu[i + 1])):
        for h in range(HV):
            qt, kt = q[t, h].double(), k[t, h].double()
            qt = qt / torch.sqrt((qt * qt).sum() + 1e-6) * scale
            kt = kt / torch.sqrt((kt * kt).sum() + 1e-6)
            st[h] = st[h] * torch.exp(g[t, h].double())[:, None]  # each key row of the [K, V] state
            vt = beta[t, h].double() * (v[t, h].double() - kt @ st[h])
            st[h] = st[h] + torch.outer(kt, vt)
            ref = qt @ st[h]
            assert float((o[t, h].double() - ref).abs().max() / ref.abs().max()) <= 1e-2, (i, t, h)
    assert float((pool[slots[i]].double() - st).abs().max() / st.abs().max()) <= 1e-5, i

# sequence 2 alone: the same bits as in the batch
alone = pool0.clone()
o2 = recurrent_in_slots(q[cu[2]:], k[cu[2]:], v[cu[2]:], g[cu[2]:], beta[cu[2]:], alone, torch.tensor([slots[2]]),
                        torch.tensor([0, lens[2]]), scale)
assert torch.equal(o2, o[cu[2]:]) and torch.equal(alone[slots[2]], pool[slots[2]])

# a per-channel decay equal across the channels gives the per-head decay's bits; a different one other bits
per_head = -torch.rand(T, HV) * 0.5
a, b = pool0.clone(), pool0.clone()
oa = recurrent_in_slots(q, k, v, per_head, beta, a, torch.tensor(slots), cu, scale)
ob = recurrent_in_slots(q, k, v, per_head[:, :, None].expand(T, HV, K).contiguous(), beta, b, torch.tensor(slots), cu,
                        scale)
assert torch.equal(oa, ob) and torch.equal(a, b)
assert not torch.equal(o, oa)
print("ok")
"""


def test_recurrent_in_slots_per_channel_decay_in_interpreter(interpreted):
    """Kimi Delta Attention's decay per key channel (fla-core's ``gk``): against a float64 recurrence (outputs 1e-2,
    bf16-rounded; states 1e-5, relative), alone == batched exactly, and a per-channel decay equal across the
    channels == the per-head decay bit for bit."""
    interpreted(KDA)


GLUE = """
import sys
from unittest import mock
import types
import torch
sys.path.insert(0, TESTS)
import test_gdn_glue as T
from vllm_bi.model_executor import gdn as G

l1 = T.mk(False)
l2 = types.SimpleNamespace(**vars(l1))
l2.kv_cache = (l1.kv_cache[0].clone(), T.kv_order(l1.kv_cache[1]))
kv0 = l2.kv_cache[1].clone()
o1 = torch.zeros(T.T, T.HV, T.V, dtype=torch.bfloat16)
o2 = o1.clone()
T.reference(l1, False, o1)
real_gather = G.gather_slots


def conv_only(cache, *args):
    assert cache.dtype != torch.float32, "in place: the states are not gathered"
    return real_gather(cache, *args)


with mock.patch("vllm.model_executor.layers.mamba.mamba_utils.is_conv_state_dim_first", return_value=False), \\
        mock.patch.object(G, "_metadata", return_value=T.md), mock.patch.object(G, "_kv_layout", return_value=True), \\
        mock.patch.object(G, "_in_place", return_value=True), \\
        mock.patch.object(G, "gather_slots", side_effect=conv_only):
    G.bi_gdn_core(l2, T.x, T.b, T.a, o2)
assert o1.abs().sum() > 0
assert float((o2.float() - o1.float()).abs().max() / o1.float().abs().max()) <= 1e-2  # bf16 outputs
want = T.kv_order(l1.kv_cache[1])
for s in range(T.nslots):
    if s in T.slots:
        assert float((l2.kv_cache[1][s] - want[s]).abs().max() / want[s].abs().max()) <= 1e-5, s
    else:
        assert torch.equal(l2.kv_cache[1][s], kv0[s]), s
assert torch.equal(l1.kv_cache[0], l2.kv_cache[0])  # the conv path is unchanged: the same bits
print("ok")
"""


def test_server_glue_updates_slots_in_place_in_interpreter(interpreted):
    """``gdn.bi_gdn_core`` in the recurrent mode with CUDA's state layout and the in-place step (CUDA's path),
    through Triton's interpreter: a step of decodes and prefills (one request new) against the per-sequence
    reference of ``tests/test_gdn_glue.py`` (outputs 1e-2 relative, bf16; states 1e-5), slots no request owns
    untouched, no gather of the states."""
    import os

    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    interpreted(f"TESTS = {tests!r}\n" + GLUE)


TILES = """
import os
import torch
from vllm_bi.gdn.slots import Tile, recurrent_in_slots
""" + RECURRENCE64 + """

torch.manual_seed(2)
H, HV, K, V = 2, 4, 16, 32
L, S = 9, 24
q, k, v, g, beta, pool0 = inputs(L, H, HV, K, V, S)
scale = K ** -0.5
slot = torch.tensor([3])


def run(lo, hi, pool, tile, spec=None):
    return recurrent_in_slots(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], pool, slot,
                              torch.tensor([0, hi - lo]), scale, spec_slots=spec, tile=tile)


o_ref, st_ref = recurrence64(q, k, v, g, beta, pool0[3].double(), scale, 0, L)
for tile in (Tile(16, 2, 2), Tile(32, 4, 1)):
    whole_pool = pool0.clone()
    whole = run(0, L, whole_pool, tile)
    assert float((whole.double() - o_ref).abs().max() / o_ref.abs().max()) <= 1e-2, tile
    assert float((whole_pool[3].double() - st_ref).abs().max() / st_ref.abs().max()) <= 1e-5, tile
    split_pool, step_pool, spec_pool = pool0.clone(), pool0.clone(), pool0.clone()
    split = torch.cat([run(0, 5, split_pool, tile), run(5, L, split_pool, tile)])
    steps = torch.cat([run(0, 5, step_pool, tile)] + [run(t, t + 1, step_pool, tile) for t in range(5, L)])
    table = torch.tensor([[10, 11, 12, 13]])
    spec = torch.cat([run(0, 5, spec_pool, tile), run(5, L, spec_pool, tile, spec=table)])
    assert torch.equal(whole, split) and torch.equal(whole, steps) and torch.equal(whole, spec), tile
    for p in (split_pool[3], step_pool[3], spec_pool[13]):
        assert torch.equal(p, whole_pool[3]), tile
    # control: a split whose second part does not start from the first part's state gives other bits
    cut_pool = pool0.clone()
    run(0, 5, cut_pool, tile)
    lost = recurrent_in_slots(q[5:], k[5:], v[5:], g[5:], beta[5:], cut_pool, slot, torch.tensor([0, L - 5]), scale,
                              torch.tensor([1]), tile=tile)
    assert not torch.equal(lost, whole[5:]), tile
    # the trainer's forward under this tile runs the server's kernel: the same bits
    os.environ["VLLM_BI_GDN_TILE"] = "x".join(map(str, tile))
    from vllm_bi import settings
    from vllm_bi.gdn.recurrent import _fla_recurrent
    settings.reload()
    o_tr, h_tr = _fla_recurrent(q[None], k[None], v[None], g[None], beta[None], pool0[3:4].clone(),
                                torch.tensor([0, L]), scale)
    assert torch.equal(o_tr[0], whole) and torch.equal(h_tr[0], whole_pool[3]), tile
print("ok")
"""


def test_recurrent_tiles_in_interpreter(interpreted):
    """Tiles of vllm_bi's own (``VLLM_BI_GDN_TILE``): against a float64
    recurrence (outputs 1e-2 relative, bf16-rounded; states 1e-5), a sequence whole == split == prefill then one-token
    steps == through the speculative path, outputs and final states bit for bit, and the trainer's forward under the
    setting == the server's kernel bit for bit. (Their bits against the fla tile's differ on a GPU, where a reduction's
    order follows the tile; the interpreter sums in numpy's order, so that control is the GPU benchmark's
    ``bits = fla`` column, ``benchmarks/gdn_recurrent_tiles.py``.)"""
    interpreted(TILES)


GLUE_IO = """
import os
import sys
import types
from unittest import mock
import torch
sys.path.insert(0, TESTS)
import test_gdn_glue as T
from vllm_bi import settings
from vllm_bi.gdn import layer as L
from vllm_bi.model_executor import gdn as G
from vllm_bi.ops.conv import triton_causal_conv1d

torch_varlen = L.causal_conv1d_varlen


def triton_varlen(x, cu, weight, conv_states, activation):
    # the copying path with CUDA's conv kernel (on CPU it runs the torch conv, whose bits are its own)
    seq, pos, starts, _ = L._slot_conv_index(tuple(cu), "cpu")
    y = triton_causal_conv1d(x, weight, conv_states, seq.int(), pos.int(), starts, activation is not None)
    return y, torch_varlen(x, cu, weight, conv_states, activation)[1]


gen = torch.Generator().manual_seed(1)
n_dec = 3
decode_md = types.SimpleNamespace(
    num_actual_tokens=n_dec, num_spec_decodes=0, spec_sequence_masks=None,
    non_spec_query_start_loc=torch.arange(n_dec + 1), non_spec_state_indices_tensor=torch.tensor([2, 5, 1]),
    num_decodes=n_dec, num_decode_tokens=n_dec, num_prefills=0, has_initial_state=torch.ones(n_dec, dtype=torch.bool))


def step(io, dim_first, layer, md, rows, no_fresh=False):
    os.environ["VLLM_BI_GDN_IO"] = io
    settings.reload()
    pad = 2  # rows past the step's, as a padded (CUDA-graph) batch has
    g = torch.Generator().manual_seed(rows)
    proj = torch.randn(rows + pad, T.D + 7, generator=g).bfloat16()
    a, b = (torch.randn(rows + pad, T.HV, generator=g).bfloat16() for _ in range(2))
    o = torch.zeros(rows + pad, T.HV, T.V, dtype=torch.bfloat16)
    with mock.patch("vllm.model_executor.layers.mamba.mamba_utils.is_conv_state_dim_first", return_value=dim_first), \\
            mock.patch.object(G, "_metadata", return_value=md), mock.patch.object(G, "_kv_layout", return_value=True), \\
            mock.patch.object(G, "_in_place", return_value=True), \\
            mock.patch.object(L, "causal_conv1d_varlen", triton_varlen), \\
            mock.patch.object(G.StepPlan, "fresh_flags", lambda self: None) if no_fresh else mock.MagicMock(), \\
            mock.patch.object(G, "gather_slots", side_effect=AssertionError("gathered")) if io == "direct" \\
            else mock.MagicMock():
        G.bi_gdn_core(layer, proj[:, : T.D], b, a, o)  # mixed_qkv: a column slice of the projection
    return o


for dim_first in (False, True):
    base = T.mk(dim_first)
    base.kv_cache = (base.kv_cache[0], T.kv_order(base.kv_cache[1]))
    runs = {}
    for io in ("copies", "direct"):
        layer = types.SimpleNamespace(**vars(base))
        layer.kv_cache = tuple(c.clone() for c in base.kv_cache)
        outs = [step(io, dim_first, layer, T.md, T.T), step(io, dim_first, layer, decode_md, n_dec)]
        runs[io] = (outs, layer.kv_cache)
    (o1, c1), (o2, c2) = runs["copies"], runs["direct"]
    assert o1[0].abs().sum() > 0 and o1[1].abs().sum() > 0
    for x, y in zip(o1 + list(c1), o2 + list(c2)):
        assert torch.equal(x, y), (dim_first, float((x.float() - y.float()).abs().max()))
    # control: a new request that does not start from zeros reads its slot's old conv rows and state
    layer = types.SimpleNamespace(**vars(base))
    layer.kv_cache = tuple(c.clone() for c in base.kv_cache)
    assert not torch.equal(step("direct", dim_first, layer, T.md, T.T, no_fresh=True), o1[0]), dim_first
print("ok")
"""


def test_direct_io_glue_equals_the_copying_glue_in_interpreter(interpreted):
    """``VLLM_BI_GDN_IO=direct`` (the conv reading and writing its states in their slots, q, k and v written apart,
    the kernel writing the layer's rows) == the copying glue, bit for bit, through Triton's interpreter with CUDA's
    conv kernel on both sides: a step of decodes and prefills with a new request, then a step of decodes planned
    without the host, from a column slice of a wider projection, with padding rows past the step's; outputs, conv
    caches and state slots, in both conv-cache layouts. Control: without the new-request flags the outputs differ."""
    import os

    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    interpreted(f"TESTS = {tests!r}\n" + GLUE_IO)
