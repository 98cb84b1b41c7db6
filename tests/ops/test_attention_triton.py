"""The candidate Triton paged attention (``vllm_bi.ops.attention_triton``) run through Triton's interpreter on
CPU: against a float64 softmax attention (within 2e-2 absolute: bf16 output, fp32 arithmetic); a row's bits
(bf16 and fp32 outputs) the same alone or batched with other sequences' rows, as a decode or inside a
prefill, and whatever the cache's block size; cache entries past a sequence's end (NaN here) never read;
a different key block (BLOCK_N) does change the fp32 bits (negative control). Speed and the compiled
kernel's bits are for the GPU (benchmarks/attention.py)."""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import torch
    from vllm_bi.ops.attention_triton import BLOCK_N, paged_attention

    g = torch.Generator().manual_seed(0)
    H, Hkv, D = 4, 2, 64
    lens = [BLOCK_N + 7, 3, 2 * BLOCK_N + 1]       # block walks of 2, 1 and 3 steps, partial last blocks
    ks = [torch.randn(n, Hkv, D, generator=g).bfloat16() for n in lens]
    vs = [torch.randn(n, Hkv, D, generator=g).bfloat16() for n in lens]

    def cache_for(bs, order):
        # sequences' blocks in the given sequences' order, shuffled, block 0 and the tails NaN
        nb = [(n + bs - 1) // bs for n in lens]
        total = 1 + sum(nb)
        perm = torch.randperm(total - 1, generator=g) + 1
        cache = torch.full((total, Hkv, bs, 2 * D), float("nan")).bfloat16()
        table = torch.zeros(len(lens), max(nb), dtype=torch.int32)
        used = 0
        for i in order:
            for b in range(nb[i]):
                table[i, b] = perm[used]
                used += 1
                t = torch.arange(b * bs, min((b + 1) * bs, lens[i]))
                cache[table[i, b], :, : len(t)] = torch.cat([ks[i][t], vs[i][t]], -1).transpose(0, 1)
        return cache, table

    def ref(i, p, q):
        k, v = ks[i][: p + 1].double().repeat_interleave(H // Hkv, 1), vs[i][: p + 1].double().repeat_interleave(H // Hkv, 1)
        s = torch.einsum("hd,lhd->hl", q.double(), k) * D**-0.5
        return torch.einsum("hl,lhd->hd", s.softmax(-1), v)

    rows = [(0, p) for p in range(lens[0])] + [(1, 2)] + [(2, p) for p in range(BLOCK_N - 3, lens[2])]
    q = torch.randn(len(rows), H, D, generator=g).bfloat16()
    seq = torch.tensor([i for i, _ in rows]); pos = torch.tensor([p for _, p in rows])
    cache, table = cache_for(16, [0, 1, 2])
    out = paged_attention(q, seq, pos, table, cache, D**-0.5)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    err = max((out[r].double() - ref(i, p, q[r])).abs().max().item() for r, (i, p) in enumerate(rows))
    assert err < 2e-2, err
    # each row alone (a one-token decode), and in another cache with another block size and block order
    cache32, table32 = cache_for(32, [2, 0, 1])
    for r in range(len(rows)):
        alone = paged_attention(q[r : r + 1], seq[r : r + 1], pos[r : r + 1], table, cache, D**-0.5)
        assert torch.equal(alone[0], out[r]), rows[r]
    assert torch.equal(paged_attention(q, seq, pos, table32, cache32, D**-0.5), out)
    # fp32 queries give fp32 outputs, where a difference in the arithmetic cannot hide in bf16's rounding
    q32 = q.float()
    out32 = paged_attention(q32, seq, pos, table, cache, D**-0.5)
    for r in (0, lens[0] - 1, len(rows) - 1):
        assert torch.equal(paged_attention(q32[r : r + 1], seq[r : r + 1], pos[r : r + 1], table, cache, D**-0.5)[0],
                           out32[r]), rows[r]
    assert torch.equal(paged_attention(q32, seq, pos, table32, cache32, D**-0.5), out32)
    # negative control: another BLOCK_N (another walk of the keys) gives other fp32 bits
    import vllm_bi.ops.attention_triton as A
    A.BLOCK_N = 16
    assert not torch.equal(paged_attention(q32, seq, pos, table, cache, D**-0.5), out32)
    print("ok", err)
""")


def test_paged_attention_kernel_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0 and "ok" in r.stdout, (r.stdout + r.stderr)[-4000:]
