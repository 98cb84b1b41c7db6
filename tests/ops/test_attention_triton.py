"""The Triton attention kernel (``vllm_bi.ops.attention_triton``, the CUDA attention op) through Triton's
interpreter on CPU, where its products run in fp32 (the interpreter's bf16 ``tl.dot`` is wrong; fp32 holds bf16
products exactly). Checked here: accuracy against float64 (within 2e-2: bf16 output, P rounded to bf16); a row's
fp32 output bits the same as a one-row decode tile, inside a prefill tile, in a split prefill (other tile
boundaries), batched with other sequences' tiles, and for any cache block size and block order; cache entries past
a sequence's end (NaN here) never read; the trainer's packed path gives the server's bits and float64-accurate
gradients (5e-2 for bf16 inputs); a different key block (``BLOCK_N``) changes the fp32 bits (negative control).
The compiled kernel's bits and speed are for the GPU (``benchmarks/attention.py``, ``tests/gpu``)."""

import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import torch
    import vllm_bi.ops.attention_triton as A
    from vllm_bi.ops.attention_triton import packed_attention, paged_attention, tiles_for

    g = torch.Generator().manual_seed(0)
    H, Hkv, D = 6, 2, 64                       # 3 query heads per KV head: padded to 4 in the tile
    per = A.rows_per_tile(H, Hkv)              # query rows per tile
    lens = [per + 7, 3, 2 * A.BLOCK_N + 5]     # tiles of 2, 1, 2 (partial) rows; key walks of 2, 1, 3 blocks
    ks = [torch.randn(n, Hkv, D, generator=g).bfloat16() for n in lens]
    vs = [torch.randn(n, Hkv, D, generator=g).bfloat16() for n in lens]
    qs = [torch.randn(n, H, D, generator=g).bfloat16() for n in lens]
    scale = D**-0.5

    def cache_for(bs):
        nb = [(n + bs - 1) // bs for n in lens]
        total = 1 + sum(nb)
        perm = torch.randperm(total - 1, generator=g) + 1   # blocks shuffled, block 0 unused
        cache = torch.full((total, Hkv, bs, 2 * D), float("nan")).bfloat16()
        table = torch.zeros(len(lens), max(nb), dtype=torch.int32)
        used = 0
        for i in range(len(lens)):
            for b in range(nb[i]):
                table[i, b] = perm[used]
                used += 1
                t = torch.arange(b * bs, min((b + 1) * bs, lens[i]))
                cache[table[i, b], :, : len(t)] = torch.cat([ks[i][t], vs[i][t]], -1).transpose(0, 1)
        return cache, table

    def run(seqs, first, cache, table, out_dtype=torch.float32):
        # rows first[i]..lens[i]-1 of each sequence in seqs, as one step
        q = torch.cat([qs[i][f:] for i, f in zip(seqs, first)])
        starts, n = [], []
        for i, f in zip(seqs, first):
            starts.append(sum(n)); n.append(lens[i] - f)
        tiles = tiles_for(H, Hkv, starts, n, list(first))
        tiles[:, 0] = torch.tensor(seqs, dtype=torch.int32).repeat_interleave(tiles_per(n))
        out = torch.empty(q.shape, dtype=out_dtype)
        return paged_attention(q, cache, table, tiles, scale, out=out)

    def tiles_per(n):
        return torch.tensor([(x + per - 1) // per for x in n])

    def ref(i):
        k = ks[i].double().repeat_interleave(H // Hkv, 1); v = vs[i].double().repeat_interleave(H // Hkv, 1)
        s = torch.einsum("thd,lhd->htl", qs[i].double(), k) * scale
        s = s.masked_fill(torch.ones(lens[i], lens[i]).triu(1).bool(), float("-inf"))
        return torch.einsum("htl,lhd->thd", s.softmax(-1), v)

    cache, table = cache_for(16)
    allseq = list(range(len(lens)))
    full = run(allseq, [0] * len(lens), cache, table)
    full_bf = run(allseq, [0] * len(lens), cache, table, torch.bfloat16)
    assert not full.isnan().any()
    parts = torch.split(full, lens)
    err = max((parts[i].double() - ref(i)).abs().max().item() for i in allseq)
    assert err < 2e-2, err
    # each sequence alone, each row as a one-row decode tile, split prefills at other tile boundaries
    for i in allseq:
        assert torch.equal(run([i], [0], cache, table), parts[i]), i
        for p in range(lens[i]):
            one = run([i], [p], cache, table)
            assert torch.equal(one[0], parts[i][p]), (i, p)
        for cut in (1, 5, per + 1):
            if cut < lens[i]:
                assert torch.equal(run([i], [cut], cache, table), parts[i][cut:]), (i, cut)
    # blocks padded in memory (a hybrid model's attention blocks share the GDN state's page size)
    pad = torch.full((cache.shape[0], cache[0].numel() + 48), float("nan")).bfloat16()
    pad[:, : cache[0].numel()] = cache.reshape(cache.shape[0], -1)
    strided = pad[:, : cache[0].numel()].view(cache.shape)
    assert not strided.is_contiguous()
    assert torch.equal(run(allseq, [0] * len(lens), strided, table), full)
    # another block size and block order
    cache32, table32 = cache_for(32)
    assert torch.equal(run(allseq, [0] * len(lens), cache32, table32), full)
    # the trainer's packed path: the server's bits (bf16) and accurate gradients
    q = torch.cat(qs).requires_grad_(); k = torch.cat(ks).requires_grad_(); v = torch.cat(vs).requires_grad_()
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    out = packed_attention(q, k, v, cu, scale)
    assert torch.equal(out.detach(), full_bf)
    w = torch.randn(out.shape, generator=g)
    (out.float() * w).sum().backward()
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref_out = []
    for a, b in zip(cu[:-1], cu[1:]):
        kk = k64[a:b].repeat_interleave(H // Hkv, 1); vv = v64[a:b].repeat_interleave(H // Hkv, 1)
        s = torch.einsum("thd,lhd->htl", q64[a:b], kk) * scale
        s = s.masked_fill(torch.ones(b - a, b - a).triu(1).bool(), float("-inf"))
        ref_out.append(torch.einsum("htl,lhd->thd", s.softmax(-1), vv))
    (torch.cat(ref_out) * w.double()).sum().backward()
    for name, a, b in (("q", q, q64), ("k", k, k64), ("v", v, v64)):
        e = (a.grad.double() - b.grad).abs().max().item() / b.grad.abs().max().item()
        assert e < 5e-2, (name, e)
    # negative control: another walk of the keys gives other fp32 bits
    A.BLOCK_N = 16
    assert not torch.equal(run(allseq, [0] * len(lens), cache, table), full)
    print("ok", err)
""")


def test_attention_kernel_in_the_interpreter(interpreted):
    interpreted(SCRIPT)


def test_backend_choice(monkeypatch):
    from vllm_bi.ops.attention_triton import attention_backend

    ATTENTION_ENV = "VLLM_BI_ATTENTION"

    monkeypatch.delenv(ATTENTION_ENV, raising=False)
    assert attention_backend("cpu") == "torch" and attention_backend("cuda") == "triton"  # the default: auto
    monkeypatch.setenv(ATTENTION_ENV, "auto")
    assert attention_backend("cpu") == "torch" and attention_backend("cuda") == "triton"
    # multi-head latent attention: auto takes the torch op on CUDA too (head dims 128 + 64); a name is obeyed
    assert attention_backend("cuda", mla=True) == "torch" and attention_backend("cpu", mla=True) == "torch"
    monkeypatch.setenv(ATTENTION_ENV, "torch")
    assert attention_backend("cuda") == "torch"
    monkeypatch.setenv(ATTENTION_ENV, "triton")
    assert attention_backend("cuda", mla=True) == "triton"
    monkeypatch.setenv(ATTENTION_ENV, "flash")
    with pytest.raises(ValueError, match="VLLM_BI_ATTENTION=.flash. is not a setting; use one of auto, torch, triton"):
        attention_backend("cpu")
    monkeypatch.setenv(ATTENTION_ENV, "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        attention_backend("cpu")
