"""A speculative step's rows scored in one pass per request (``VLLM_BI_SPEC_VERIFY=fused``), run through Triton's
interpreter on CPU, against the position-by-position path it replaces.

- Kernel: :func:`vllm_bi.gdn.slots.recurrent_in_slots` with ``spec_slots`` (each sequence from a source slot, the
  state after its row ``p`` into ``spec_slots[j, p]``) against one call per row, each one token from the slot the
  call before wrote: outputs and every stored state equal bit for bit (compared as integers, so ``-0.0`` and
  ``+0.0`` count as different), per-head and per-key-channel decays, a destination equal to the source (accepted
  = 1), unequal numbers of rows, slots no sequence writes untouched.
- Glue: :func:`vllm_bi.model_executor.gdn.verify_rows` with the setting on (the in-place path) against the same
  function with it off, from copies of the caches: outputs, state slots and conv history equal bit for bit. The
  position-by-position path's core on CUDA is fla-core's fused recurrent kernel, whose bits the in-place kernel
  repeats (``tests/gpu/test_gdn_cuda.py``); here that core is the in-place kernel on a scratch pool, one call per
  position, so the comparison checks everything but that GPU-measured equality.
- Controls: the state of every row stored into one slot, or the rows started from the wrong source slot, make the
  same comparisons fail.
"""

import pytest

pytest.importorskip("triton")

KERNEL = """
import torch
from vllm_bi.gdn.slots import recurrent_in_slots


def bits(t):
    return t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def same(x, y):
    return x.shape == y.shape and torch.equal(bits(x), bits(y))


def one_at_a_time(q, k, v, g, beta, pool, src, table, lens, scale):
    # every row its own call: one token from the slot the row before wrote (the source for row 0)
    o = torch.empty_like(v)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    for j, n in enumerate(lens):
        at = src[j]
        for p in range(n):
            t = cu[j] + p
            kept = pool[at].clone()
            o[t : t + 1] = recurrent_in_slots(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1],
                                              pool, torch.tensor([at]), torch.tensor([0, 1]), scale)
            if table[j][p] != at:  # the call wrote the state after row p into the source slot: moved to its own
                pool[table[j][p]] = pool[at]
                pool[at] = kept
            at = table[j][p]
    return o


torch.manual_seed(0)
for GK in (False, True):
    H, HV, K, V, S = 2, 4, 16, 16, 13
    lens = [4, 1, 3, 2]  # rows per request (k + 1 = 4 slots each)
    table = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [0, 0, 0, 0]]
    # sources: after row 2 (accepted 3), row 0 (accepted 1: the source is the first destination), row 1, row 0
    src = [3, 5, 10, 0]
    T = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    q, k = torch.randn(T, H, K).bfloat16(), torch.randn(T, H, K).bfloat16()
    v = torch.randn(T, HV, V).bfloat16()
    g = -0.7 - (torch.rand(T, HV, K) if GK else torch.rand(T, HV)) * 0.5  # exp(g) < 1/2: -1e-45 decays to -0.0
    beta = torch.rand(T, HV)
    pool0 = torch.randn(S, HV, K, V) * 0.3
    # a tiny negative state that the decay flushes to -0.0, a key channel that is zero: where a state kept in registers
    # and one reloaded (0 + S0) would differ in the sign of a zero
    pool0[3, :, 0, :] = -1e-45
    pool0[5, :, 0, :] = -1e-45
    k[:, :, 0] = 0
    scale = K ** -0.5
    spec = torch.tensor([t[: max(lens)] for t in table])

    fused = pool0.clone()
    o = recurrent_in_slots(q, k, v, g, beta, fused, torch.tensor(src), cu, scale, spec_slots=spec)
    steps = pool0.clone()
    o_ref = one_at_a_time(q, k, v, g, beta, steps, src, table, lens, scale)
    assert same(o, o_ref), GK
    written = {table[j][p] for j in range(len(lens)) for p in range(lens[j])}
    for s in range(S):
        assert same(fused[s], steps[s]), (GK, s)
        if s not in written:
            assert same(fused[s], pool0[s]), (GK, s)  # a slot no row writes keeps its bits
    assert not same(fused[4], pool0[4]) and same(fused[8], pool0[8])  # request 1 writes row 0 only

    # the control: every row's state into the row-0 slot: the stored states are no longer the steps' states
    bad = pool0.clone()
    o_bad = recurrent_in_slots(q, k, v, g, beta, bad, torch.tensor(src), cu, scale,
                               spec_slots=spec[:, :1].expand(-1, spec.shape[1]).contiguous())
    assert same(o_bad, o)  # the same rows computed ...
    assert not all(same(bad[s], steps[s]) for s in written)  # ... but the states after rows 1.. are lost
    # the control: from the wrong source slot (the one before the last accepted): other outputs
    wrong = pool0.clone()
    o_wrong = recurrent_in_slots(q, k, v, g, beta, wrong, torch.tensor([2, 5, 9, 0]), cu, scale, spec_slots=spec)
    assert not same(o_wrong[: lens[0]], o[: lens[0]]) and not same(wrong[1], steps[1])
print("ok")
"""


def test_spec_slots_kernel_equals_one_call_per_row_in_interpreter(interpreted):
    """The ``spec_slots`` variant against one call per row (per-head and per-key-channel decays), with its
    controls."""
    interpreted(KERNEL)


GLUE = """
import os
import types
from unittest import mock
import torch
from vllm_bi import settings
from vllm_bi.gdn import layer as L
from vllm_bi.gdn.slots import recurrent_in_slots
from vllm_bi.model_executor import gdn as G


def bits(t):
    return t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def same(x, y):
    return x.shape == y.shape and torch.equal(bits(x), bits(y))


def in_place_core(q, k, v, g, beta, states, cu, scale=None):
    # the position-by-position path's core as CUDA runs it (fla-core), here the in-place kernel on a scratch pool
    CORE_CALLS[-1] += 1
    pool = states.transpose(-1, -2).contiguous()  # [N, HV, K, V]
    o = recurrent_in_slots(q, k, v, g, beta, pool, torch.arange(pool.shape[0]), torch.tensor(cu), q.shape[-1] ** -0.5)
    return o, pool.transpose(-1, -2)


CORE_CALLS = []
torch.manual_seed(0)
H, HV, K, V, W, k_spec = 1, 2, 16, 16, 4, 3
D = 2 * H * K + HV * V
lens, accepted = [4, 2, 1, 3], [3, 1, 2, 4]  # rows this step, rows accepted of the step before
N = len(lens)
qsl = [0]
for n in lens:
    qsl.append(qsl[-1] + n)
T = qsl[-1]
S = N * (k_spec + 1) + 3
table = torch.randperm(S - 1)[: N * (k_spec + 1)].reshape(N, k_spec + 1) + 1  # distinct slots, never slot 0
layer = types.SimpleNamespace(num_k_heads=H, num_v_heads=HV, head_k_dim=K, head_v_dim=V, tp_size=1,
                              activation="silu", num_spec=k_spec, prefix="layers.0.linear_attn",
                              A_log=torch.randn(HV) * 0.1, dt_bias=torch.randn(HV) * 0.1)
x = (torch.randn(T, D) * 0.5).bfloat16()
a, b = torch.randn(T, HV).bfloat16(), torch.randn(T, HV).bfloat16()
weight = (torch.randn(D, W) * 0.3).bfloat16()


def md():
    return types.SimpleNamespace(spec_sequence_masks=torch.ones(N, dtype=torch.bool), num_prefills=0, num_decodes=0,
                                 num_spec_decodes=N, spec_query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                                 spec_state_indices_tensor=table.int(),
                                 num_accepted_tokens=torch.tensor(accepted, dtype=torch.int32),
                                 non_spec_token_indx=None, spec_token_indx=None,
                                 vllm_bi_num_computed=torch.full((N,), 40, dtype=torch.int32))


def step(mode, caches, dim_first, store_at_row0=False):
    os.environ["VLLM_BI_SPEC_VERIFY"] = mode
    settings.reload()
    seen = []
    CORE_CALLS.append(0)

    def spy(*args, spec_slots=None, **kw):
        seen.append(spec_slots is not None)
        if store_at_row0 and spec_slots is not None:  # the control: every row's state into its row-0 slot
            spec_slots = spec_slots[:, :1].expand(-1, spec_slots.shape[1]).contiguous()
        return recurrent_in_slots(*args, spec_slots=spec_slots, **kw)

    outs = []
    m = md()
    with mock.patch.object(G, "_in_place", return_value=True), \\
        mock.patch.object(L, "gdn_recurrent_varlen", in_place_core), mock.patch.object(L, "recurrent_in_slots", spy):
        for conv, ssm in caches:  # two GDN layers of one step, each its own caches (the second: the offsets cached)
            outs.append(torch.zeros(T, HV, V, dtype=torch.bfloat16))
            G.spec_step(layer, x, b, a, outs[-1], m, conv, ssm, weight, dim_first, True)
    assert seen == ([True, True] if mode == "fused" else []), (mode, seen)  # steps: in_place_core, once per position
    assert CORE_CALLS.pop() == (0 if mode == "fused" else 2 * max(lens)), mode
    if mode == "fused":
        assert m._vllm_bi_spec_qsl[1] == qsl
    return torch.stack(outs)


for dim_first in (False, True):
    R = W - 1 + k_spec
    conv0 = torch.randn(S, *((D, R) if dim_first else (R, D))).bfloat16()
    ssm0 = torch.randn(S, HV, V, K) * 0.3
    results = {}
    for mode in ("steps", "fused", "control"):
        caches = [(conv0.clone(), ssm0.clone()) for _ in range(2)]
        o = step("fused" if mode == "control" else mode, caches, dim_first, store_at_row0=mode == "control")
        results[mode] = (o, torch.stack([c for c, _ in caches]), torch.stack([s for _, s in caches]))
    (o1, c1, s1), (o2, c2, s2), (o3, c3, s3) = results["steps"], results["fused"], results["control"]
    assert o1.abs().sum() > 0 and not same(c1[0], conv0) and not same(s1[0], ssm0)
    assert same(o1, o2), dim_first
    assert same(c1, c2), dim_first  # the conv history: every slot, every row
    assert same(s1, s2), dim_first  # every state slot (the written ones and the untouched ones)
    # the control: the states of rows 1.. stored over row 0's slot: the same outputs, other stored states
    assert same(o3, o1) and same(c3, c1) and not same(s3, s1), dim_first
print("ok")
"""


def test_fused_verify_rows_equals_position_by_position_in_interpreter(interpreted):
    """``spec_step`` over two GDN layers of a step with ``VLLM_BI_SPEC_VERIFY=fused`` on the in-place path against
    ``steps``: outputs, every state slot and the conv history equal bit for bit, both conv-cache layouts, requests
    with different row and accepted counts; the control stores every row's state into the row-0 slot and must
    differ."""
    interpreted(GLUE)
