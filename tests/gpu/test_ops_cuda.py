"""The op library on CUDA: every op's output for a row/sequence is the same whatever else is in the
batch (exact equality), and the GEMM gives the same bits on CUDA as on CPU (exact float64 sums).
Then the trainer model on CUDA: a sequence's logprobs packed alone == packed with others.

Run on a GPU machine: `pytest -m gpu tests/gpu` (skipped without CUDA). Correctness tolerances are
stated per test (against float64 references)."""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from vllm_bi.ops.attention import causal_attention  # noqa: E402
from vllm_bi.ops.linear import bi_linear  # noqa: E402
from vllm_bi.ops.norm import rms_norm  # noqa: E402
from vllm_bi.ops.reduce import row_sum  # noqa: E402
from vllm_bi.ops.softmax import log_softmax  # noqa: E402

DEV = "cuda"
MS = (1, 3, 16, 64, 257, 1024, 4096)


def _rows(n, d, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g).to(dtype)


@pytest.mark.parametrize("N,K", [(4096, 4096), (24576, 4096), (4096, 12288)])
def test_triton_gemm_mode_is_invariant_and_close(N, K, monkeypatch):
    """VLLM_BI_GEMM=triton (vLLM's persistent matmul, bf16): row 0 and row 2 have the same bits for every M
    (1 .. 8192, across vLLM's M buckets), and are within bf16 rounding of the exact product (2e-2 relative
    to the row's max)."""
    monkeypatch.setenv("VLLM_BI_GEMM", "triton")
    x, w = _rows(8192, K).to(DEV), (_rows(N, K, 1) * 0.02).to(DEV)
    ref = bi_linear(x[:3], w)
    for m in (1, 3, 16, 64, 257, 1024, 4096, 8192):
        y = bi_linear(x[:m], w)
        assert torch.equal(y[: min(m, 3)], ref[: min(m, 3)]), f"M={m}: rows depend on the batch size"
    exact = x[:3].double() @ w.double().t()
    assert ((ref.double() - exact).abs().max() / exact.abs().max()).item() < 2e-2


def test_bi_linear_is_invariant_and_equals_cpu():
    x, w = _rows(4096, 4096), _rows(4096, 4096, 1) * 0.02
    xc, wc = x.to(DEV), w.to(DEV)
    ref_row0 = bi_linear(x[:1], w)  # CPU
    for m in MS:
        y = bi_linear(xc[:m], wc)
        assert torch.equal(y[:1].cpu(), ref_row0), m
    exact = (x[:4].double() @ w.double().t()).to(torch.bfloat16)  # exact sum, one rounding
    assert torch.equal(bi_linear(xc[:4], wc).cpu(), exact)


def test_row_sum_log_softmax_rms_norm_invariant():
    x = torch.randn(4096, 151936 // 8, device=DEV)
    for fn in (lambda t: row_sum(t), lambda t: log_softmax(t, -1), lambda t: rms_norm(t.bfloat16(), torch.ones(t.shape[-1], device=DEV), 1e-6)):
        full = fn(x)
        for m in MS:
            assert torch.equal(fn(x[:m])[:1], full[:1]), m
    ref = x[:8].double().sum(-1, keepdim=True)
    assert float(((row_sum(x[:8]).double() - ref).abs() / ref.abs()).max()) < 1e-4  # fp32 accumulation


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_log_softmax_rows_invariant(dtype, monkeypatch):
    """VLLM_BI_LOGPROBS=triton at Qwen3.5's 248,320-token vocabulary and at an odd width: a row's bits are the same
    in 1 .. 256 rows and alone, in a strided view, at an odd offset and widened to fp32 (exact); values within 2e-5 of float64's log-softmax on finite logits of scale 4; the
    gradient within 1e-4 of float64's. Reported, not asserted: the rows whose bits equal the torch formula's (the
    default). Negative control: a batch of rows through torch's own log_softmax at another batch size differs in
    some bits from the kernel, so the equality checks can fail."""
    from vllm_bi import settings

    monkeypatch.setenv("VLLM_BI_LOGPROBS", "triton")
    settings.reload()
    try:
        g = torch.Generator().manual_seed(3)
        for n in (248320, 1000, 3000):
            x = (torch.randn(256, n, generator=g) * 4).to(dtype).to(DEV)
            full = log_softmax(x, -1)
            assert full.dtype == torch.float32
            for m in (1, 7, 64, 255):
                assert torch.equal(log_softmax(x[:m], -1), full[:m]), (n, m)
            assert torch.equal(log_softmax(x[5:6], -1), full[5:6])
            # what the compiler may assume of the arguments must not reach the bits: a padded vocabulary's view (as
            # vLLM slices its logits), a row at an odd offset, the same values in fp32
            wide = torch.zeros(256, n + 8, dtype=dtype, device=DEV)
            wide[:, :n] = x
            flat = torch.zeros(1 + 256 * n, dtype=dtype, device=DEV)
            flat[1:] = x.reshape(-1)
            for other in (wide[:, :n], flat[1:].view(256, n), x.float()):
                assert torch.equal(log_softmax(other, -1), full), (n, other.stride(), other.dtype)
            ref = torch.log_softmax(x.double(), -1)
            assert float((full.double() - ref).abs().max()) <= 2e-5, n
            x32 = x.to(torch.float32)
            from vllm_bi.ops.softmax import logsumexp

            same = (full == x32 - logsumexp(x32)).all(-1)
            print(f"n={n} {dtype}: {int(same.sum())}/256 rows with the torch formula's bits")
        assert not torch.equal(torch.log_softmax(x.float(), -1), full), "control: torch's kernel should differ"
        xg = x[:4].float().requires_grad_(True)
        w = torch.randn(4, x.shape[1], generator=g).to(DEV)
        (log_softmax(xg, -1) * w).sum().backward()
        x64 = x[:4].double().requires_grad_(True)
        (torch.log_softmax(x64, -1) * w.double()).sum().backward()
        assert float((xg.grad.double() - x64.grad).abs().max()) < 1e-4
    finally:
        monkeypatch.delenv("VLLM_BI_LOGPROBS")
        settings.reload()


def test_attention_row_depends_on_position_only():
    g = torch.Generator().manual_seed(0)
    L, H, Hkv, D = 300, 8, 2, 128
    q, k, v = (torch.randn(L, h, D, generator=g).bfloat16().to(DEV) for h in (H, Hkv, Hkv))
    full = causal_attention(q, k, v, list(range(L)), D**-0.5)
    for p in (0, 17, 150, 299):
        one = causal_attention(q[p : p + 1], k[: p + 1], v[: p + 1], [p], D**-0.5)
        assert torch.equal(one, full[p : p + 1]), p


def test_trainer_model_packing_invariant_on_cuda(tiny_model_path):
    pytest.importorskip("fla")
    from vllm_bi.models.qwen_gdn import QwenGDNForCausalLM

    model = QwenGDNForCausalLM.from_pretrained(tiny_model_path("qwen3.5")).to(DEV)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 1000, (n,), generator=g) for n in (37, 5, 120, 64)]
    with torch.no_grad():
        alone = [model.token_logprobs(s.to(DEV), [0, len(s)]).cpu() for s in seqs]
        cu = [0]
        for s in seqs:
            cu.append(cu[-1] + len(s))
        packed = model.token_logprobs(torch.cat(seqs).to(DEV), cu).cpu()
    for i, a in enumerate(alone):
        got = packed[cu[i] : cu[i + 1]]
        assert torch.equal(torch.nan_to_num(a, 7.0), torch.nan_to_num(got, 7.0)), i


@pytest.mark.parametrize("H,Hkv,D", [(16, 4, 256), (8, 2, 128), (6, 2, 64)])
def test_triton_attention_rows_invariant_on_cuda(H, Hkv, D):
    """The compiled Triton attention kernel: a row's bits the same as a one-row decode, inside a prefill, in a
    split prefill, batched with another sequence, through the trainer's packed path; float64 within 2e-2."""
    from vllm_bi.ops.attention_triton import packed_attention, paged_attention, rows_per_tile, tiles_for

    g = torch.Generator().manual_seed(0)
    lens, bs = [300, 77], 16
    qs = [torch.randn(n, H, D, generator=g).bfloat16().to(DEV) for n in lens]
    ks = [torch.randn(n, Hkv, D, generator=g).bfloat16().to(DEV) for n in lens]
    vs = [torch.randn(n, Hkv, D, generator=g).bfloat16().to(DEV) for n in lens]
    nb = [(n + bs - 1) // bs for n in lens]
    cache = torch.full((1 + sum(nb), Hkv, bs, 2 * D), float("nan"), device=DEV).bfloat16()
    table = (1 + torch.randperm(sum(nb), generator=g)).int().to(DEV)
    table = torch.stack([torch.nn.functional.pad(t, (0, max(nb) - len(t))) for t in table.split(nb)])
    for i, n in enumerate(lens):
        for j in range(n):
            cache[table[i, j // bs], :, j % bs] = torch.cat([ks[i][j], vs[i][j]], -1)

    def run(rows, dtype=torch.float32):  # rows: [(seq, first row)], one step
        q = torch.cat([qs[i][f:] for i, f in rows])
        n = [lens[i] - f for i, f in rows]
        starts = [sum(n[:r]) for r in range(len(n))]
        tiles = tiles_for(H, Hkv, starts, n, [f for _, f in rows])
        per = rows_per_tile(H, Hkv)
        tiles[:, 0] = torch.tensor([i for (i, _), m in zip(rows, n) for _ in range(0, m, per)], dtype=torch.int32)
        out = torch.empty(q.shape, dtype=dtype, device=DEV)
        return paged_attention(q, cache, table, tiles.to(DEV), D**-0.5, out=out)

    full = run([(0, 0), (1, 0)])
    a, b = full.split(lens)
    assert torch.equal(run([(0, 0)]), a) and torch.equal(run([(1, 0)]), b)
    for p in (0, 17, 63, 64, 150, 299):
        assert torch.equal(run([(0, p)])[0], a[p]), p  # decode tile / split prefill starting at p
        assert torch.equal(run([(1, 76), (0, p)])[1], a[p]), p
    kk, vv = ks[0].double().repeat_interleave(H // Hkv, 1), vs[0].double().repeat_interleave(H // Hkv, 1)
    s = torch.einsum("thd,lhd->htl", qs[0].double(), kk) * D**-0.5
    s = s.masked_fill(torch.ones(300, 300, device=DEV).triu(1).bool(), float("-inf"))
    assert float((torch.einsum("htl,lhd->thd", s.softmax(-1), vv) - a.double()).abs().max()) < 2e-2
    packed = packed_attention(torch.cat(qs), torch.cat(ks), torch.cat(vs), [0, lens[0], sum(lens)], D**-0.5)
    assert torch.equal(packed, run([(0, 0), (1, 0)], torch.bfloat16))


def test_triton_gemm_tiles_by_batch_size_keep_rows_equal(tmp_path, monkeypatch):
    """The Triton GEMM mode with a tile table whose BLOCK_M, BLOCK_N, warps and stages change with M (one BLOCK_K
    per shape, ``VLLM_BI_GEMM_CONFIGS``): each row of an M-row batch equals the same row of the largest batch."""
    import json

    from vllm_bi.ops import gemm_configs
    from vllm_bi.ops.linear import bi_linear

    N, K = 3072, 4096
    buckets = [[1, 16, 64, 4, 3], [16, 16, 256, 8, 4], [64, 32, 128, 4, 4], [512, 64, 256, 8, 3],
               [4096, 128, 128, 8, 3]]
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps({"format": 1, "arch": "hopper", "shapes": {f"{N}x{K}": {"block_k": 64,
                                                                                      "m_buckets": buckets}}}))
    monkeypatch.setenv("VLLM_BI_GEMM", "triton")
    monkeypatch.setenv("VLLM_BI_GEMM_CONFIGS", str(path))
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(N, K, generator=g) * 0.02).bfloat16().to(DEV)
    x = torch.randn(5000, K, generator=g).bfloat16().to(DEV)
    full = bi_linear(x, w)
    for m in (1, 2, 15, 16, 17, 64, 65, 300, 512, 513, 4096, 4097):
        assert torch.equal(bi_linear(x[:m], w), full[:m]), m
    err = (full[:64].double() - (x[:64].double() @ w.double().t())).abs().max().item()
    assert err < 2e-2, err  # bf16 output of an fp32 accumulation
    gemm_configs._installed.clear()


def test_rotary_table_on_device_once_and_capturable():
    """The RoPE table is copied to the GPU once (same tensor on every call) with the host table's bits, and a
    rotation can be captured in a CUDA graph (a pageable host copy inside a capture raises; the served decode
    graphs failed so before the table was cached) and replays to the eager bits."""
    from vllm_bi.ops.rotary import apply_rotary, rope_cos_sin_cache

    host = rope_cos_sin_cache(64, 262144, 1e7)
    dev = rope_cos_sin_cache(64, 262144, 1e7, DEV)
    assert dev.is_cuda and dev is rope_cos_sin_cache(64, 262144, 1e7, DEV)
    assert torch.equal(dev.cpu(), host)
    pos = torch.randint(0, 262144, (32,), device=DEV)
    q, k = _rows(32, 16 * 256).to(DEV), _rows(32, 4 * 256, 1).to(DEV)
    eager = apply_rotary(pos, q, k, dev, 256, 64, True)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        apply_rotary(pos, q, k, rope_cos_sin_cache(64, 262144, 1e7, DEV), 256, 64, True)  # warm-up on the stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = apply_rotary(pos, q, k, rope_cos_sin_cache(64, 262144, 1e7, DEV), 256, 64, True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], eager[0]) and torch.equal(out[1], eager[1])


@pytest.mark.parametrize("N,K", [(12288, 2048), (24576, 4096), (4096, 2048)])
def test_triton_gemm_fused_layer_gives_its_parts_bits(N, K, monkeypatch):
    """VLLM_BI_GEMM=triton: the server's fused product (vLLM's gate_up / qkv) equals, column for column, the
    trainer's products of the parts, for every M. On Hopper vLLM's own table gives (12288, 2048) BLOCK_K 128 and its
    halves the default 64; ops.gemm_configs.consistent_tiles gives every shape of one K the same BLOCK_K."""
    monkeypatch.setenv("VLLM_BI_GEMM", "triton")
    w = (_rows(N, K, 1) * 0.02).to(DEV)
    parts = (w[: N // 2].contiguous(), w[N // 2 :].contiguous(), w[: N // 4].contiguous())
    for m in (1, 16, 300, 4096):
        x = _rows(m, K, m).to(DEV)
        fused = bi_linear(x, w)
        assert torch.equal(torch.cat([bi_linear(x, parts[0]), bi_linear(x, parts[1])], dim=-1), fused), m
        assert torch.equal(bi_linear(x, parts[2]), fused[:, : N // 4]), m


def test_weight_digest_sums_equal_on_cpu_and_cuda():
    """The weight digest's integer arithmetic (int64 multiplies and sums wrapping modulo 2^64) gives the same words on
    the GPU as on the CPU, where tests/test_weights.py checks it against numpy's unsigned words."""
    from vllm_bi import weights

    t = torch.randn(3_000_001).to(torch.bfloat16)
    t[:4] = torch.tensor([0.0, -0.0, float("inf"), -1e30])
    assert weights._value_sums(t, "cpu") == weights._value_sums(t, DEV) == weights._value_sums(t.to(DEV), DEV)


def test_moe_triton_rows_invariant_close_and_capturable():
    """VLLM_BI_MOE=triton on CUDA (bf16 tensor cores): a token's bits the same alone, batched and in a permuted
    batch, within 2e-2 (relative L2) of the exact float64 loop path, and a call captured in a CUDA graph (no host
    read) replays to the eager bits. VLLM_BI_MOE=exact: the loop path's very bits."""
    from vllm_bi.ops.moe import moe_experts_loop
    from vllm_bi.ops.moe_triton import moe_experts_triton

    E, k, H, I, T = 64, 8, 1024, 256, 300
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.02).bfloat16().to(DEV)
    w2 = (torch.randn(E, H, I, generator=g) * 0.02).bfloat16().to(DEV)
    x = torch.randn(T, H, generator=g).bfloat16().to(DEV)
    vals, ids = torch.topk(torch.randn(T, E, generator=g), k, dim=-1)
    w, ids = torch.softmax(vals, -1).to(DEV), ids.int().to(DEV)
    out = moe_experts_triton(x, w13, w2, w, ids)
    ref = moe_experts_loop(x, w13, w2, w, ids)
    assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 2e-2
    for t in (0, 17, 299):
        assert torch.equal(moe_experts_triton(x[t : t + 1], w13, w2, w[t : t + 1], ids[t : t + 1]), out[t : t + 1])
    perm = torch.randperm(T, generator=g).to(DEV)
    assert torch.equal(moe_experts_triton(x[perm], w13, w2, w[perm], ids[perm]), out[perm])
    xs, ws, idss = x[:64].clone(), w[:64].clone(), ids[:64].clone()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        moe_experts_triton(xs, w13, w2, ws, idss)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = moe_experts_triton(xs, w13, w2, ws, idss)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, out[:64])
    # VLLM_BI_MOE=exact: Triton's float64 products give the float64 loop's bits, alone and batched
    assert torch.equal(moe_experts_triton(x, w13, w2, w, ids, exact=True), ref)
    assert torch.equal(moe_experts_triton(x[9:10], w13, w2, w[9:10], ids[9:10], exact=True), ref[9:10])


def test_rowwise_kernels_invariant_close_capturable_and_control(monkeypatch):
    """VLLM_BI_ROWWISE=triton at Qwen3.5-9B's widths: the residual-add RMSNorm (4096, a Gemma weight), the head norm
    (rows of 256), the GDN gated norm (rows of 128, silu gate) and SiLU-and-mul (12288): a row's bits the same for
    every batch size 1..8192 and in a CUDA-graph replay; within bf16 rounding of float64 (1.6e-2 relative to the
    largest value); the new residual is torch's rounded fp32 sum. Negative control: the same rows with a block width
    chosen by the batch (8192 lanes instead of 4096) give other bits for some row."""
    import torch.nn.functional as F

    from vllm_bi.ops import rows_triton
    from vllm_bi.ops.activation import silu_mul
    from vllm_bi.ops.norm import gated_rms_norm, rms_norm_maybe_residual

    monkeypatch.setenv("VLLM_BI_ROWWISE", "triton")
    eps = 1e-6
    x, r = _rows(8192, 4096).to(DEV), _rows(8192, 4096, 1).to(DEV)
    w = (torch.randn(4096, generator=torch.Generator().manual_seed(2)) * 0.1).to(DEV) + 1.0
    hq = _rows(8192 * 4, 256, 3).to(DEV)
    wq = torch.ones(256, device=DEV) + 0.05
    core, z = _rows(8192 * 8, 128, 4).to(DEV), _rows(8192 * 8, 128, 5).to(DEV)
    wg = _rows(1, 128, 6)[0].to(DEV)
    up = _rows(8192, 2 * 12288, 7).to(DEV)

    def ops(m):
        out, res = rms_norm_maybe_residual(x[:m], r[:m], w, eps)
        return (out, res, rms_norm_maybe_residual(hq[: 4 * m], None, wq, eps),
                gated_rms_norm(core[: 8 * m], z[: 8 * m], wg, eps, True, "silu"), silu_mul(up[:m]))

    full = ops(8192)
    for m in (1, 3, 16, 64, 257, 1024, 4096):
        for i, (a, b) in enumerate(zip(ops(m), full)):
            assert torch.equal(a, b[: a.shape[0]]), (m, i)

    h = x[:64].double() + r[:64].double()
    ref = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    assert ((full[0][:64].double() - ref).abs().max() / ref.abs().max()).item() < 1.6e-2
    assert torch.equal(full[1], (x.float() + r.float()).bfloat16())
    c = core[:512].double()
    refg = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + eps) * wg.double() * F.silu(z[:512].double())
    assert ((full[3][:512].double() - refg).abs().max() / refg.abs().max()).item() < 1.6e-2
    refs = F.silu(up[:64, :12288].double()).bfloat16().double() * up[:64, 12288:].double()
    assert ((full[4][:64].double() - refs).abs().max() / refs.abs().max()).item() < 1.6e-2

    # a decode step's shapes in a CUDA graph replay to the eager bits
    m = 64
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        ops(m)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ops(m)
    graph.replay()
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(captured, full)):
        assert torch.equal(a, b[: a.shape[0]]), ("graph", i)

    wide = rows_triton._rms_norm_fwd(x[:1024], r[:1024], w, eps, block=8192)[0]
    assert not torch.equal(wide, full[0][:1024]), "a wider block gave the same bits: the control shows nothing"


@pytest.mark.parametrize("n", [4096, 256, 3000])
def test_reducing_kernels_bits_do_not_follow_the_layout(n, monkeypatch):
    """The Triton RMSNorm (with a residual), the gated norm and ``row_sum``: a row's bits are the same from a
    contiguous tensor, a padded strided view (as vLLM slices its buffers), a view at an odd element offset and one
    row alone (exact). What Triton assumes of a pointer's alignment and a stride's divisibility sets the register
    layout, and with it the order of a float ``tl.sum``; with ``settings.CANONICAL_ROWS_CUDA`` every kernel reads its
    rows in one layout (``ops.layout.canonical_rows``). Negative control: with the rows passed as the caller holds
    them (the setting off), some view gets other bits in some op (``row_sum`` on the H100), so the equalities can
    fail."""
    from vllm_bi import settings
    from vllm_bi.ops import reduce
    from vllm_bi.ops.norm import gated_rms_norm, rms_norm_maybe_residual

    monkeypatch.setenv("VLLM_BI_ROWWISE", "triton")
    monkeypatch.setattr(settings, "CANONICAL_ROWS_CUDA", True)
    g = torch.Generator().manual_seed(11)
    T = 512
    x, r = (torch.randn(T, n, generator=g) * 3).bfloat16().to(DEV), torch.randn(T, n, generator=g).bfloat16().to(DEV)
    z = torch.randn(T, n, generator=g).bfloat16().to(DEV)
    w = (torch.randn(n, generator=g) * 0.1 + 1).bfloat16().to(DEV)
    xf = (torch.randn(T, n, generator=g) * 3).to(DEV)

    def views(t):
        wide = torch.zeros(T, n + 8, dtype=t.dtype, device=DEV)
        wide[:, :n] = t
        flat = torch.zeros(1 + T * n, dtype=t.dtype, device=DEV)
        flat[1:] = t.reshape(-1)
        return {"padded": wide[:, :n], "odd offset": flat[1:].view(T, n)}

    def ops(xx, rr, zz, ff):
        out, res = rms_norm_maybe_residual(xx, rr, w, 1e-6)
        return {"rms_norm": out, "residual": res, "gated": gated_rms_norm(xx, zz, w, 1e-6, False, "silu"),
                "row_sum": reduce.row_sum(ff)}

    def check():
        base = ops(x, r, z, xf)
        bad = []
        for kind in ("padded", "odd offset"):
            got = ops(views(x)[kind], views(r)[kind], views(z)[kind], views(xf)[kind])
            bad += [(kind, name) for name in base if not torch.equal(got[name], base[name])]
        alone = ops(x[7:8].clone(), r[7:8].clone(), z[7:8].clone(), xf[7:8].clone())
        bad += [("alone", name) for name in base if not torch.equal(alone[name], base[name][7:8])]
        return bad

    assert check() == []
    monkeypatch.setattr(settings, "CANONICAL_ROWS_CUDA", False)
    bad = check()
    print(f"n={n}: without one layout, differing: {bad}")
    assert bad, "rows in their caller's layout gave the same bits: the control shows nothing"
