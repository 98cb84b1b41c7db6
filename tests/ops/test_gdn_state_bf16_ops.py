"""The bf16 GDN state (``VLLM_BI_GDN_STATE=bf16``): every token's state rounded to bf16 before the next token.

The contract is P3's: a sequence's outputs and final state do not depend on where it was split into calls, each call
loading the state the previous one stored in a bf16 cache. Checked with ``torch.equal`` for the CPU recurrence
(:func:`vllm_bi.gdn.recurrent.gdn_recurrent`, the CPU server's and trainer's) and for the CUDA kernel over the cache
slots (:func:`vllm_bi.gdn.slots.recurrent_in_slots`, step and speculative paths) through Triton's interpreter.

Negative control for each: the fp32 recurrence with its state rounded to bf16 only where a call ends (what a bf16
cache does to a recurrence that keeps fp32 between tokens, as stock vLLM's) gives other bits at some split.
Accuracy: the kernel against a float64 recurrence rounded to bf16 after every token, relative error <= 3e-2 of the
largest value: the outputs are bf16 (a rounding of up to 2^-8), and a state entry that rounds to the neighbouring bf16
value on one side moves that side's later tokens by as much again, a few times over 7 tokens.
"""

import pytest
import torch

from test_gdn_slots import RECURRENCE64  # the float64 recurrence the slot kernel's tests check against

from vllm_bi.gdn.recurrent import gdn_recurrent, state_dtype


def _inputs(T, H=2, HV=4, K=8, V=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(T, H, K, generator=gen), torch.randn(T, H, K, generator=gen)
    v = torch.randn(T, HV, V, generator=gen)
    g = -torch.rand(T, HV, generator=gen) * 0.3
    beta = torch.rand(T, HV, generator=gen)
    return q, k, v, g, beta, torch.zeros(HV, V, K)


def _split_run(inputs, cuts, cache_dtype):
    """Run the tokens in calls ending at ``cuts``; between calls the state goes through a ``cache_dtype`` cache."""
    q, k, v, g, beta, state = inputs
    outs, start = [], 0
    for stop in [*cuts, q.shape[0]]:
        o, state = gdn_recurrent(q[start:stop], k[start:stop], v[start:stop], g[start:stop], beta[start:stop], state)
        state = state.to(cache_dtype).float()
        outs.append(o)
        start = stop
    return torch.cat(outs), state


def test_state_dtype_follows_the_setting(monkeypatch):
    assert state_dtype() == torch.float32
    monkeypatch.setenv("VLLM_BI_GDN_STATE", "bf16")
    assert state_dtype() == torch.bfloat16


def test_bf16_state_is_refused_outside_the_recurrent_mode(monkeypatch):
    from vllm_bi.settings import Settings

    with pytest.raises(ValueError, match="VLLM_BI_GDN_STATE=bf16 runs in the recurrent GDN mode only"):
        Settings.from_env({"VLLM_BI_GDN_STATE": "bf16", "VLLM_BI_GDN_MODE": "chunk"})
    assert Settings.from_env({"VLLM_BI_GDN_STATE": "bf16"}).arithmetic("cpu")["gdn_state"] == "bf16"


@pytest.mark.parametrize("cuts", [(1,), (5,), (3, 4, 9), tuple(range(1, 16))])
def test_cpu_recurrence_is_split_exact_with_a_bf16_state(monkeypatch, cuts):
    monkeypatch.setenv("VLLM_BI_GDN_STATE", "bf16")
    inputs = _inputs(16)
    whole_o, whole_s = _split_run(inputs, (), torch.bfloat16)
    o, s = _split_run(inputs, cuts, torch.bfloat16)
    assert torch.equal(o, whole_o) and torch.equal(s, whole_s)
    assert torch.equal(whole_s, whole_s.bfloat16().float())  # the final state holds bf16 values: the cache is exact


def test_negative_control_fp32_recurrence_through_a_bf16_cache_is_split_variant():
    inputs = _inputs(16)
    whole_o, _ = _split_run(inputs, (), torch.bfloat16)
    differs = [c for c in range(1, 16) if not torch.equal(_split_run(inputs, (c,), torch.bfloat16)[0], whole_o)]
    assert differs, "rounding the state only where a call ends should change the later tokens' bits"


def test_cpu_recurrence_gradient_passes_straight_through_the_rounding(monkeypatch):
    """The trainer's gradient under the bf16 state is the fp32 recurrence's (the rounding passes gradients unchanged):
    against a float64 reference without rounding, relative error <= 5e-2 (the forward points differ by the
    rounding)."""
    from vllm_bi.gdn.recurrent import gdn_torch_varlen

    monkeypatch.setenv("VLLM_BI_GDN_STATE", "bf16")
    q, k, v, g, beta, state = _inputs(12)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    o, _ = gdn_recurrent(*leaves, g, beta, state)
    o.double().pow(2).sum().backward()
    ref = [t.double().unsqueeze(0).requires_grad_(True) for t in (q, k, v)]
    o64, _ = gdn_torch_varlen(*ref, g.double().unsqueeze(0), beta.double().unsqueeze(0),
                              state.transpose(-1, -2).double().unsqueeze(0), torch.tensor([0, 12]), q.shape[-1] ** -0.5)
    o64.pow(2).sum().backward()
    for got, want in zip(leaves, ref):
        want = want.grad[0]
        assert float((got.grad.double() - want).abs().max() / want.abs().max()) <= 5e-2


KERNEL = """
import torch
from vllm_bi.gdn.slots import recurrent_in_slots, FLA_TILE, Tile
""" + RECURRENCE64 + """

torch.manual_seed(0)
H, HV, K, V, S = 2, 4, 16, 16, 6
lens, slots = [7, 1, 5], [3, 1, 4]
T = sum(lens)
q, k = torch.randn(T, H, K).bfloat16(), torch.randn(T, H, K).bfloat16()
v = torch.randn(T, HV, V).bfloat16()
g, beta = -torch.rand(T, HV) * 0.5, torch.rand(T, HV)
pool0 = (torch.randn(S, HV, K, V) * 0.3).bfloat16()
scale = K ** -0.5
starts = [0, 7, 8]


def calls(pool, pieces, tile=FLA_TILE):
    # every sequence through the kernel in pieces: pieces[i] lists where sequence i's calls end
    out = torch.empty_like(v)
    for i, ends in enumerate(pieces):
        a = starts[i]
        for e in ends:
            b = starts[i] + e
            out[a:b] = recurrent_in_slots(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], pool, torch.tensor([slots[i]]),
                                          torch.tensor([0, b - a]), scale, tile=tile)
            a = b
    return out


# one call for the whole batch == every token its own call, from and into the bf16 slots
whole = pool0.clone()
cu = torch.tensor([0, 7, 8, 13])
o_whole = recurrent_in_slots(q, k, v, g, beta, whole, torch.tensor(slots), cu, scale, tile=FLA_TILE)
steps = pool0.clone()
o_steps = calls(steps, [list(range(1, n + 1)) for n in lens])
assert torch.equal(o_whole, o_steps) and torch.equal(whole, steps)
mixed = pool0.clone()
assert torch.equal(calls(mixed, [[3, 7], [1], [2, 5]]), o_whole) and torch.equal(mixed, whole)

# another tile: its own reduction order, the same split exactness
t16 = pool0.clone()
o16 = recurrent_in_slots(q, k, v, g, beta, t16, torch.tensor(slots), cu, scale, tile=Tile(16, 1, 3))
t16s = pool0.clone()
assert torch.equal(calls(t16s, [list(range(1, n + 1)) for n in lens], tile=Tile(16, 1, 3)), o16) and torch.equal(t16s, t16)

# the speculative path: the state after each row into its own slot, bits of one call per row
spec_pool = torch.cat([pool0, torch.zeros(8, HV, K, V).bfloat16()])
table = torch.tensor([[6, 7, 8, 9, 10], [11, 12, 13, 1, 1], [1, 1, 1, 1, 1]])  # sequence 0's first 5 rows
seq0 = slice(0, 5)
o_spec = recurrent_in_slots(q[seq0], k[seq0], v[seq0], g[seq0], beta[seq0], spec_pool, torch.tensor([3]),
                            torch.tensor([0, 5]), scale, spec_slots=table[:1], tile=FLA_TILE)
one = pool0.clone()
o_one = calls(one, [[1, 2, 3, 4, 5], [], []])
assert torch.equal(o_spec, o_one[seq0]), "speculative rows"
assert torch.equal(spec_pool[10], one[3]), "state after the last speculative row"

# negative control: the fp32 kernel with its state rounded to bf16 only where a call ends
f_whole = pool0.float()
o_f = recurrent_in_slots(q, k, v, g, beta, f_whole, torch.tensor(slots), cu, scale, tile=FLA_TILE)
f_steps = pool0.float()
outs = []
for i, n in enumerate(lens):
    for t in range(starts[i], starts[i] + n):
        outs.append(recurrent_in_slots(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], f_steps,
                                       torch.tensor([slots[i]]), torch.tensor([0, 1]), scale, tile=FLA_TILE))
        f_steps.copy_(f_steps.bfloat16().float())
assert not torch.equal(torch.cat(outs), o_f), "fp32 state rounded only at call ends should differ"

# accuracy against float64 rounded to bf16 after every token
for i, n in enumerate(lens):
    st = pool0[slots[i]].double()
    for t in range(starts[i], starts[i] + n):
        o_ref, st = recurrence64(q, k, v, g, beta, st, scale, t, t + 1)
        st = st.bfloat16().double()
        assert float((o_whole[t].double() - o_ref[0]).abs().max() / o_ref.abs().max()) <= 3e-2, t
    assert float((whole[slots[i]].double() - st).abs().max() / st.abs().max()) <= 3e-2, i
print("ok")
"""


def test_slot_kernel_is_split_exact_with_a_bf16_pool_in_interpreter(interpreted):
    pytest.importorskip("triton")
    interpreted(KERNEL)


TRAINER = """
import torch
from vllm_bi.gdn.recurrent import FLAGatedDeltaRule
from vllm_bi.gdn.slots import recurrent_in_slots, FLA_TILE

torch.manual_seed(1)
H, HV, K, V = 2, 4, 16, 16
lens = [5, 9]
T = sum(lens)
q, k = torch.randn(1, T, H, K).bfloat16(), torch.randn(1, T, H, K).bfloat16()
v = torch.randn(1, T, HV, V).bfloat16()
g, beta = -torch.rand(1, T, HV) * 0.5, torch.rand(1, T, HV)
h0 = torch.zeros(2, HV, K, V)
cu = torch.tensor([0, 5, 14])
o, ht = FLAGatedDeltaRule.apply("recurrent", q, k, v, g, beta, h0, cu, K ** -0.5)
# the server's path: every token its own call on a bf16 pool, fla-core's tile
pool = torch.zeros(2, HV, K, V).bfloat16()
steps = [recurrent_in_slots(q[0, t:t + 1], k[0, t:t + 1], v[0, t:t + 1], g[0, t:t + 1], beta[0, t:t + 1], pool,
                            torch.tensor([0 if t < 5 else 1]), torch.tensor([0, 1]), K ** -0.5, tile=FLA_TILE)
         for t in range(T)]
assert torch.equal(o[0], torch.cat(steps)), "trainer forward != server steps"
assert ht.dtype == torch.float32 and torch.equal(ht, pool.float())
print("ok")
"""


def test_trainer_forward_runs_the_rounding_kernel_under_every_tile_in_interpreter(interpreted):
    """The trainer's CUDA forward (``FLAGatedDeltaRule``, ``kind="recurrent"``) under ``VLLM_BI_GDN_STATE=bf16`` runs
    the in-slot kernel on a bf16 pool even with fla-core's tile (fla-core's own kernel does not round), giving the
    bits of the server's one-token steps; through Triton's interpreter, the tensors on CPU."""
    pytest.importorskip("triton")
    env_script = ("import os\nos.environ['VLLM_BI_GDN_STATE'] = 'bf16'\nos.environ['VLLM_BI_GDN_TILE'] = 'fla'\n"
                  "os.environ['VLLM_BI_GDN_MODE'] = 'recurrent'\n")
    interpreted(env_script + TRAINER)
