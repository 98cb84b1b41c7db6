"""The chunk mode's partial-block kernel (:mod:`vllm_bi.gdn.chunk_decode`, the chunk server's decode on CUDA)
through Triton's interpreter on CPU: its logic against float64 (relative error <= 1e-5), with fp32 inputs because the
interpreter's bf16 ``tl.dot`` is not bf16 arithmetic; the state pool only read, except that a whole block (64 rows)
writes the state at its end into its slot (against float64 too, also at the GPU head-shape test's shapes); a block
alone == the same block in a batch (exact), and == with a program taking a key head's value heads
or every value tile; bad input refused by name. Its bits against fla-core's chunked kernel are measured on the GPU
(``tests/gpu/test_gdn_chunk_cuda.py::test_partial_blocks_in_slots_equal_fla_core``)."""

import pytest

pytest.importorskip("triton")

SCRIPT = """
import torch
from vllm_bi.gdn import chunk_decode as CD
from vllm_bi.gdn.chunk_decode import partial_block_outputs, partial_blocks_in_slots

launch = dict(CD.PARTIAL_LAUNCH)

torch.manual_seed(0)
for H, HV, K, V in ((2, 4, 128, 64), (1, 2, 64, 128)):
    S = 6
    lens, slots = [5, 1, 63, 17], [4, 1, 5, 2]
    T = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    unit = lambda x: x / x.norm(dim=-1, keepdim=True)
    q, k = unit(torch.randn(T, H, K)), unit(torch.randn(T, H, K))
    w, u = torch.randn(T, HV, K) * 0.1, torch.randn(T, HV, V)
    g = torch.cat([-(torch.rand(n, HV) * 0.3).cumsum(0) for n in lens])  # per block, log2 scale
    pool = torch.randn(S, HV, K, V) * 0.3
    pool0 = pool.clone()
    scale = K ** -0.5
    o = partial_block_outputs(q, k, w, u, g, pool, torch.tensor(slots), cu, scale)
    assert torch.equal(pool, pool0)
    for j in range(len(lens)):
        s, e = int(cu[j]), int(cu[j + 1])
        want = []
        for hv in range(HV):
            hk = hv // (HV // H)
            h0 = pool0[slots[j], hv].double()
            v_new = u[s:e, hv].double() - w[s:e, hv].double() @ h0
            gg = g[s:e, hv].double()
            qk = (q[s:e, hk].double() @ k[s:e, hk].double().T) * torch.exp2(gg[:, None] - gg[None, :])
            want.append(((q[s:e, hk].double() @ h0) * torch.exp2(gg)[:, None] + torch.tril(qk) @ v_new) * scale)
        want = torch.stack(want, 1)
        rel = float((o[s:e].double() - want).abs().max() / want.abs().max())
        assert rel <= 1e-5, (K, j, rel)
    # block 2 alone: the same bits as in the batch
    s, e = int(cu[2]), int(cu[3])
    alone = partial_block_outputs(q[s:e], k[s:e], w[s:e], u[s:e], g[s:e], pool, torch.tensor([slots[2]]),
                                  torch.tensor([0, e - s]), scale)
    assert torch.equal(alone, o[s:e])
    # a program taking a key head's value heads and/or every value tile runs the same tile arithmetic: same bits
    for group, all_v in ((False, False), (True, False), (False, True), (True, True)):
        CD.PARTIAL_LAUNCH = dict(launch, group=group, all_v=all_v)
        try:
            other = partial_block_outputs(q, k, w, u, g, pool, torch.tensor(slots), cu, scale)
        finally:
            CD.PARTIAL_LAUNCH = launch
        assert torch.equal(other, o), (H, HV, K, V, group, all_v)

# whole blocks: a 64-row segment's slot gets the state at the block's end, the others' slots stay as they were; also
# at the GPU head-shape test's shapes (key heads 4 and 16, value / key ratios 1, 2, 4, head dims 128)
for H, HV, K, V in ((2, 4, 128, 64), (1, 2, 64, 128), (4, 4, 128, 128), (4, 8, 128, 128), (4, 16, 128, 128),
                    (16, 16, 128, 128), (16, 32, 128, 128), (16, 64, 128, 128)):
    lens, slots = [64, 9, 64], [3, 0, 1]
    T = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    unit = lambda x: x / x.norm(dim=-1, keepdim=True)
    q, k = unit(torch.randn(T, H, K)), unit(torch.randn(T, H, K))
    w, u = torch.randn(T, HV, K) * 0.1, torch.randn(T, HV, V)
    g = torch.cat([-(torch.rand(n, HV) * 0.05).cumsum(0) for n in lens])
    pool = torch.randn(5, HV, K, V) * 0.3
    pool0 = pool.clone()
    o = partial_block_outputs(q, k, w, u, g, pool, torch.tensor(slots), cu, K ** -0.5, torch.tensor([0, 2]))
    for j in (0, 2):
        s, e = int(cu[j]), int(cu[j + 1])
        for hv in range(HV):
            hk = hv // (HV // H)
            h0 = pool0[slots[j], hv].double()
            gg = g[s:e, hv].double()
            v_new = (u[s:e, hv].double() - w[s:e, hv].double() @ h0) * torch.exp2(gg[-1] - gg)[:, None]
            want = h0 * torch.exp2(gg[-1]) + k[s:e, hk].double().T @ v_new
            rel = float((pool[slots[j], hv].double() - want).abs().max() / want.abs().max())
            assert rel <= 1e-5, (K, j, hv, rel)
    for slot in (0, 2, 4):
        assert torch.equal(pool[slot], pool0[slot]), slot
    # the outputs were computed from the boundary states, before the writes
    o0 = partial_block_outputs(q, k, w, u, g, pool0.clone(), torch.tensor(slots), cu, K ** -0.5)
    assert torch.equal(o, o0)

pool = torch.zeros(3, 4, 128, 64)
x = torch.zeros(64, 2, 128)
for bad_cu, what in (([0, 65], "1..64 rows"), ([0, 0, 3], "1..64 rows")):
    try:
        partial_blocks_in_slots(x, x, torch.zeros(64, 4, 64), torch.zeros(64, 4), torch.zeros(64, 4), pool,
                                torch.tensor([0] * (len(bad_cu) - 1)), bad_cu, 1.0)
    except ValueError as e:
        assert what in str(e), e
    else:
        raise AssertionError(f"segments {bad_cu} accepted")
for bad_pool in (pool.double(), pool.transpose(-1, -2).contiguous().transpose(-1, -2)):
    try:
        partial_block_outputs(x, x, torch.zeros(64, 4, 128), torch.zeros(64, 4, 64), torch.zeros(64, 4), bad_pool,
                              torch.tensor([0]), torch.tensor([0, 3]), 1.0)
    except ValueError as e:
        assert "contiguous slots" in str(e), e
    else:
        raise AssertionError("a pool that is not fp32 with contiguous slots was accepted")
print("ok")
"""


def test_partial_block_kernel_logic_in_interpreter(interpreted):
    interpreted(SCRIPT)
