"""The grouped Triton MoE experts (``VLLM_BI_MOE=exact|triton``, ``vllm_bi.ops.moe_triton``) through Triton's
interpreter on CPU, the bf16 mode with fp32 products (the interpreter's bf16 ``tl.dot`` is wrong). Checked: the
device-built block layout (every pair in exactly one block of its expert; an expert with more pairs than a block,
one with none); accuracy against float64 (2e-2 relative L2: bf16 outputs); a token's bits the same alone, in the
batch and in a permuted batch; the routing weight applied on the input; gradients against float64 autograd (5e-2
relative L2); other bits than the float64 loop path for the bf16 mode (the modes are not interchangeable), and
the loop path's very bits for the float64 mode. The compiled kernels' bits and speed are for the GPU."""

import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import torch
    import vllm_bi.ops.moe_triton as M
    from vllm_bi.ops.moe import moe_experts_loop
    from vllm_bi.ops.moe_triton import moe_experts_triton, pair_layout

    g = torch.Generator().manual_seed(0)
    E, H, I, T, k = 8, 64, 48, 21, 3          # w13: N 96 (a partial N block); w2: K 48 (a partial K block)
    x = torch.randn(T, H, generator=g).bfloat16()
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.1).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) * 0.1).bfloat16()
    logits = torch.randn(T, E, generator=g)
    logits[:, 2] += 10                         # every token's first expert: 21 pairs, more than one block
    logits[:, 5] -= 10                         # an expert nobody picks
    ids = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :k].int()
    w = torch.softmax(torch.gather(logits, 1, ids.long()), -1)

    order, be, bs, bc = pair_layout(ids.reshape(-1).long(), E)
    assert sorted(order.tolist()) == list(range(T * k))
    assert int(bc.sum()) == T * k and int(bc.max()) <= M.BLOCK_M and be.numel() == (T * k) // M.BLOCK_M + E
    flat = ids.reshape(-1).long()[order]
    for b in range(be.numel()):
        c, s = int(bc[b]), int(bs[b])
        assert (flat[s : s + c] == be[b]).all(), b
    assert int((bc[be == 2] > 0).sum()) == 2 and int(bc[be == 5].sum()) == 0

    def ref64(x, w13, w2, w, ids, on_input=False):
        out = torch.zeros(x.shape[0], H, dtype=torch.float64)
        rows = []
        for t in range(x.shape[0]):
            acc = 0
            for j in range(ids.shape[1]):
                e = int(ids[t, j])
                xi = x[t].double() * (w[t, j].double() if on_input else 1)
                h = xi @ w13[e].double().T
                a = torch.nn.functional.silu(h[:I]) * h[I:]
                acc = acc + (1 if on_input else w[t, j].double()) * (a @ w2[e].double().T)
            rows.append(acc)
        return torch.stack(rows)

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm()).item()

    out = moe_experts_triton(x, w13, w2, w, ids)
    assert out.dtype == x.dtype and out.shape == (T, H)
    assert rel(out, ref64(x, w13, w2, w, ids)) < 2e-2
    for t in (0, 7, 20):
        assert torch.equal(moe_experts_triton(x[t : t + 1], w13, w2, w[t : t + 1], ids[t : t + 1]), out[t : t + 1]), t
    perm = torch.randperm(T, generator=g)
    assert torch.equal(moe_experts_triton(x[perm], w13, w2, w[perm], ids[perm]), out[perm])

    ids1, w1 = ids[:, :1].contiguous(), w[:, :1].contiguous()
    o1 = moe_experts_triton(x, w13, w2, w1, ids1, True)
    assert rel(o1, ref64(x, w13, w2, w1, ids1, True)) < 2e-2
    assert torch.equal(moe_experts_triton(x[3:4], w13, w2, w1[3:4], ids1[3:4], True), o1[3:4])

    leaves = [t.float().requires_grad_() for t in (x, w13, w2)] + [w.clone().requires_grad_()]
    got = torch.autograd.grad(moe_experts_triton(*[t.bfloat16() for t in leaves[:3]], leaves[3], ids).float().sum(),
                              leaves)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    want = torch.autograd.grad(ref64(*ref_leaves, ids).sum(), ref_leaves)
    for name, a, b in zip(("x", "w13", "w2", "weights"), got, want):
        assert rel(a, b) < 5e-2, (name, rel(a, b))

    loop = moe_experts_loop(x, w13, w2, w, ids)
    assert not torch.equal(loop, out)  # the float64 loop's bits are other bits than the bf16 kernels'

    # exact: float64 grouped kernels give the loop's bits (alone and batched), also with the weight on the input
    ex = moe_experts_triton(x, w13, w2, w, ids, exact=True)
    assert torch.equal(ex, loop)
    assert torch.equal(moe_experts_triton(x[5:6], w13, w2, w[5:6], ids[5:6], exact=True), loop[5:6])
    assert torch.equal(moe_experts_triton(x, w13, w2, w1, ids1, True, exact=True),
                       moe_experts_loop(x, w13, w2, w1, ids1, True))
    print("ok")
""")


def test_grouped_moe_kernel_in_the_interpreter(interpreted):
    interpreted(SCRIPT)


OFFSETS = textwrap.dedent("""
    import torch
    from vllm_bi.ops.moe_triton import moe_experts_triton

    # the tiny Qwen3.5-MoE's sizes; a token's pairs sit at other places in their expert blocks when the batch changes
    E, k, H, I, T = 8, 2, 256, 128, 40
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.05).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) * 0.05).bfloat16()
    x = torch.randn(T, H, generator=g).bfloat16()
    vals, ids = torch.topk(torch.randn(T, E, generator=g), k, dim=-1)
    w, ids = torch.softmax(vals, -1), ids.int()
    for exact, sizes in ((False, (1, 3, 17, 29)), (True, (17,))):  # the float64 kernel is slow to interpret
        full = moe_experts_triton(x, w13, w2, w, ids, exact=exact)
        for n in sizes:
            sub = moe_experts_triton(x[T - n:], w13, w2, w[T - n:], ids[T - n:], exact=exact)
            assert torch.equal(sub, full[T - n:]), (exact, n)
    print("ok")
""")


def test_a_rows_bits_do_not_depend_on_its_place_in_a_block(interpreted):
    """The last n tokens alone and in a batch of 40: each pair at another offset in its expert's block. The
    interpreter's fp32 ``tl.dot`` (numpy's matmul) gave a row other bits at another offset under numpy 2.3.5 /
    OpenBLAS 0.3.30 (trainer != server for 16 of 128 tokens), so the kernel sums products per row."""
    interpreted(OFFSETS)


def test_backend_choice(monkeypatch):
    from vllm_bi.ops.moe_triton import moe_backend

    MOE_ENV = "VLLM_BI_MOE"

    monkeypatch.delenv(MOE_ENV, raising=False)
    assert moe_backend("cpu") == "loop" and moe_backend("cuda") == "triton"  # the defaults
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for mode in ("exact", "triton"):
        monkeypatch.setenv(MOE_ENV, mode)
        assert moe_backend("cuda") == mode
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            moe_backend("cpu")
    monkeypatch.setenv(MOE_ENV, "fused")
    with pytest.raises(ValueError, match="VLLM_BI_MOE=.fused. is not a setting; use one of auto, loop, exact, triton"):
        moe_backend("cuda")


def test_which_modes_give_the_same_bits():
    from vllm_bi.ops.moe_triton import moe_arithmetic

    assert moe_arithmetic("loop", "fp64") == moe_arithmetic("exact", "fp64") == moe_arithmetic("exact", "triton")
    others = {moe_arithmetic("loop", "fp64"), moe_arithmetic("loop", "triton"), moe_arithmetic("triton", "fp64")}
    assert len(others) == 3
