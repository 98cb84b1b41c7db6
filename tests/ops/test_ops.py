"""Op library: batch invariance by exact equality, correctness against float64 references.

Each invariance check has a negative control: the stock torch op it replaces
(or a bf16 state) must differ on the same case, so a silently disabled path fails.
"""

import pytest
import torch
import torch.nn.functional as F

from vllm_bi.ops import bi_linear, gated_rms_norm, log_softmax, moe_experts, rms_norm, row_sum, softmax, softmax_topk
from vllm_bi.ops.attention import causal_attention, causal_attention_rows

torch.manual_seed(0)


def _rows_invariant(fn, x, sizes):
    full = fn(x)
    for m in sizes:
        part = fn(x[:m])
        if not torch.equal(part[0], full[0]) or not torch.equal(part[m - 1], full[m - 1]):
            return False
    return True


# ----------------------------------------------------------------------------- GEMM
@pytest.mark.parametrize("N,K", [(1024, 512), (8, 256), (1000, 300)])
def test_bi_linear_batch_invariant_and_correct(N, K):
    x = torch.randn(300, K).bfloat16()
    w = (torch.randn(N, K) * 0.05).bfloat16()
    assert _rows_invariant(lambda t: bi_linear(t, w), x, [1, 2, 3, 7, 16, 33, 299])
    ref = (x.double() @ w.double().T).to(torch.bfloat16)
    # exact accumulation, one rounding: equal to the correctly rounded float64 product
    assert torch.equal(bi_linear(x, w), ref)


def test_bi_linear_negative_control_torch_fp32_linear_varies():
    w, x = torch.randn(1024, 512), torch.randn(300, 512)
    assert not _rows_invariant(lambda t: F.linear(t, w), x, [1, 2, 3, 7, 16, 33, 299])


def test_bi_linear_out_dtype_and_bias():
    x, w, b = torch.randn(5, 64).bfloat16(), torch.randn(32, 64).bfloat16(), torch.randn(32)
    y = bi_linear(x, w, b, out_dtype=torch.float32)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, x.double() @ w.double().T + b.double(), rtol=0, atol=1e-5, check_dtype=False)


# ----------------------------------------------------------------------------- reductions, softmax
def test_row_sum_long_row_invariant_and_negative_control():
    x = torch.randn(8, 100_000)
    for i in range(8):
        assert torch.equal(row_sum(x[i : i + 1]), row_sum(x)[i : i + 1])
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # ATen splits a single long row across threads (CI pins each shard to one core)
    try:
        stock_diff = sum(int(not torch.equal(x[i : i + 1].sum(-1), x.sum(-1)[i : i + 1])) for i in range(8))
    finally:
        torch.set_num_threads(threads)
    assert stock_diff > 0, "torch.sum of a single long row == the batched row everywhere: control broken"
    torch.testing.assert_close(row_sum(x).double().squeeze(-1), x.double().sum(-1), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("V", [1024, 151_936])
def test_log_softmax_and_softmax(V):
    x = (torch.randn(17, V) * 3).bfloat16()
    for fn in (lambda t: log_softmax(t, -1, torch.float32), lambda t: softmax(t, -1, torch.float32)):
        assert _rows_invariant(fn, x, [1, 2, 5, 16])
    ref = torch.log_softmax(x.double(), -1)
    torch.testing.assert_close(log_softmax(x, -1, torch.float32).double(), ref, rtol=0, atol=2e-5)
    torch.testing.assert_close(softmax(x, -1, torch.float32).double(), ref.exp(), rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- norms
def test_rms_norms():
    x = torch.randn(200, 4096).bfloat16()
    w = torch.randn(4096) * 0.1 + 1
    assert _rows_invariant(lambda t: rms_norm(t, w, 1e-6), x, [1, 3, 64])
    ref = x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    torch.testing.assert_close(rms_norm(x, w, 1e-6).double(), ref, rtol=1e-2, atol=1e-2)  # bf16 output
    xg, z = torch.randn(50, 2, 128).bfloat16(), torch.randn(50, 2, 128).bfloat16()
    wg = torch.randn(128) * 0.1 + 1
    assert _rows_invariant(lambda t: gated_rms_norm(t, z[: t.shape[0]], wg, 1e-6), xg, [1, 7])
    refg = (xg.double() / torch.sqrt(xg.double().pow(2).mean(-1, keepdim=True) + 1e-6)) * wg.double()
    refg = refg * F.silu(z.double())
    torch.testing.assert_close(gated_rms_norm(xg, z, wg, 1e-6).double(), refg, rtol=1e-2, atol=2e-2)


def test_torch_mean_negative_control():
    # one row alone vs in a 64-row batch: with two threads stock mean splits a lone row's reduction between them and
    # a batch's by rows, so some rows' bits differ (any one row can agree by chance; all 64 agreeing would mean the
    # control shows nothing). Two threads whatever the process was given (CI pins each shard to one core).
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.randn(64, 151_936, generator=torch.Generator().manual_seed(0))
        batched = x.mean(-1)
        alone = torch.stack([x[i : i + 1].mean(-1)[0] for i in range(64)])
    finally:
        torch.set_num_threads(threads)
    assert not torch.equal(alone, batched)


# ----------------------------------------------------------------------------- attention
def _ref_attention(q, k, v, positions, scale):
    H, Hkv = q.shape[1], k.shape[1]
    k, v = k.double().repeat_interleave(H // Hkv, 1), v.double().repeat_interleave(H // Hkv, 1)
    out = []
    for i, p in enumerate(positions):
        s = torch.einsum("hd,lhd->hl", q[i].double(), k[: p + 1]) * scale
        out.append(torch.einsum("hl,lhd->hd", s.softmax(-1), v[: p + 1]))
    return torch.stack(out)


def test_causal_attention_correct_and_position_invariant():
    L, H, Hkv, D = 70, 4, 2, 64
    q, k, v = (torch.randn(L, n, D).bfloat16() for n in (H, Hkv, Hkv))
    scale = D**-0.5
    full = causal_attention(q, k, v, list(range(L)), scale)
    torch.testing.assert_close(full.double(), _ref_attention(q, k, v, range(L), scale), rtol=0, atol=2e-2)
    # a decode (one query) and a split prefill (second half) equal the one-shot prefill bit for bit
    for p in (0, 15, 16, 17, 40, 69):
        assert torch.equal(causal_attention(q[p : p + 1], k[: p + 1], v[: p + 1], [p], scale)[0], full[p])
    assert torch.equal(causal_attention(q[35:], k, v, list(range(35, L)), scale), full[35:])


def test_attention_rows_of_many_sequences_equal_each_alone(monkeypatch):
    """causal_attention_rows: rows of three sequences at once (a whole prefill, a decode, the tail of a split
    prefill) give each row the bits it gets alone, and chunking the rows (down to one per chunk) changes no
    bit; keys past a sequence's end may hold anything (here NaN)."""
    import vllm_bi.ops.attention as A

    g = torch.Generator().manual_seed(3)
    H, Hkv, D, scale = 4, 2, 64, 64**-0.5
    lens = [37, 5, 130]
    ks = [torch.randn(n, Hkv, D, generator=g).bfloat16() for n in lens]
    vs = [torch.randn(n, Hkv, D, generator=g).bfloat16() for n in lens]
    want_rows = [(0, p) for p in range(37)] + [(1, 4)] + [(2, p) for p in range(100, 130)]
    q = torch.randn(len(want_rows), H, D, generator=g).bfloat16()
    pad = 200  # each sequence's keys in a table with NaN after its end
    kt = torch.full((3, pad, Hkv, D), float("nan")).bfloat16()
    vt = kt.clone()
    for i, n in enumerate(lens):
        kt[i, :n], vt[i, :n] = ks[i], vs[i]

    seq_t = torch.tensor([i for i, _ in want_rows])

    def gather(rows, B):
        seq = seq_t[rows]
        return kt[seq, :B], vt[seq, :B]

    positions = [p for _, p in want_rows]
    got = causal_attention_rows(q, positions, gather, scale)
    for i in range(3):
        sel = [r for r, (s_, _) in enumerate(want_rows) if s_ == i]
        alone = causal_attention(q[sel], ks[i], vs[i], [want_rows[r][1] for r in sel], scale)
        assert torch.equal(got[sel], alone), i
    assert not got.isnan().any()
    monkeypatch.setattr(A, "CHUNK_BYTES", 1)  # one row per chunk
    assert torch.equal(causal_attention_rows(q, positions, gather, scale), got)


def test_sdpa_negative_control():
    q, k, v = (torch.randn(1, 2, 50, 64) for _ in range(3))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    last = F.scaled_dot_product_attention(q[:, :, 29:30], k[:, :, :30], v[:, :, :30])
    assert not torch.equal(full[:, :, 29:30], last)


# ----------------------------------------------------------------------------- MoE
def test_moe_experts_token_invariant_and_correct():
    T, Hd, I, E, k = 40, 128, 64, 8, 2
    x = torch.randn(T, Hd).bfloat16()
    w13 = (torch.randn(E, 2 * I, Hd) * 0.05).bfloat16()
    w2 = (torch.randn(E, Hd, I) * 0.05).bfloat16()
    logits = bi_linear(x, (torch.randn(E, Hd) * 0.1).bfloat16())
    tw, ti = softmax_topk(logits, k, True)
    full = moe_experts(x, w13, w2, tw, ti)
    for m in (1, 5, 39):
        assert torch.equal(moe_experts(x[:m], w13, w2, tw[:m], ti[:m]), full[:m])
    ref = torch.zeros(T, Hd, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            e = int(ti[t, j])
            h = x[t].double() @ w13[e].double().T
            h = F.silu(h[:I]) * h[I:]
            ref[t] += tw[t, j].double() * (h @ w2[e].double().T)
    torch.testing.assert_close(full.double(), ref, rtol=0, atol=3e-2)


def test_router_gate_same_bits_as_bmm_or_mm():
    """The MoE router logits are the same bits whether the caller lowers them to mm or to bmm."""
    from vllm_bi.ops import bi_bmm

    x = torch.randn(37, 256).bfloat16()
    gate = (torch.randn(64, 256) * 0.05).bfloat16()
    via_mm = bi_linear(x, gate)
    via_bmm = bi_bmm(x.unsqueeze(0), gate.t().unsqueeze(0), torch.bfloat16)[0]
    assert torch.equal(via_mm, via_bmm)


def test_cpu_mean_override_takes_scalars_and_matches_a_row_sum():
    """The CPU ``aten::mean.dim`` override (``patch.aten_overrides``) on a 0-d tensor (a trainer's gathered loss in
    the server's process, e.g. TRL's colocated vLLM): the value itself, whatever the dim spelling; on a matrix the
    op library's row sum over the count. Control: without the scalar case the permute of no dims raised."""
    from vllm_bi.patch.aten_overrides import _mean_dim
    from vllm_bi.ops.reduce import row_sum

    s = torch.tensor(2.5, dtype=torch.bfloat16)
    for dim in (None, [], [0], [-1]):
        m = _mean_dim(s, dim)
        assert m.dim() == 0 and m.dtype == torch.bfloat16 and m.item() == 2.5 and m.data_ptr() != s.data_ptr()
    assert _mean_dim(s, [0], dtype=torch.float32).dtype == torch.float32
    x = torch.randn(5, 7)
    assert torch.equal(_mean_dim(x, [-1]), (row_sum(x, torch.float32) / 7).squeeze(-1))
    assert _mean_dim(x, [1], keepdim=True).shape == (5, 1)


def test_sigmoid_topk_routes_by_biased_scores_and_weights_by_unbiased_ones():
    """Kimi Linear's router (``ops.moe.sigmoid_topk``): experts chosen by sigmoid score + correction bias, weighted by
    the unbiased scores, renormalised then scaled; against float64 (1e-6 relative); a row's result alone == in the
    batch (exact); a tie goes to the lower expert id. Control: without the bias another expert is chosen."""
    from vllm_bi.ops.moe import sigmoid_topk

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 8, generator=g)
    bias = torch.zeros(8)
    bias[5] = 3.0  # expert 5 is chosen for every row
    w, ids = sigmoid_topk(logits, 2, True, bias, 2.5)
    assert bool((ids == 5).any(-1).all())
    s = torch.sigmoid(logits.double())
    ref_ids = torch.sort(s + bias.double(), dim=-1, descending=True, stable=True).indices[:, :2]
    ref_w = s.gather(1, ref_ids)
    ref_w = ref_w / ref_w.sum(-1, keepdim=True) * 2.5
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(w.double(), ref_w, rtol=1e-6, atol=0)
    for r in (0, 17, 63):
        w1, i1 = sigmoid_topk(logits[r : r + 1], 2, True, bias, 2.5)
        assert torch.equal(w1, w[r : r + 1]) and torch.equal(i1, ids[r : r + 1])
    tie = torch.zeros(1, 4)
    assert sigmoid_topk(tie, 2, False, None)[1].tolist() == [[0, 1]]
    _, plain = sigmoid_topk(logits, 2, True, None, 2.5)
    assert not torch.equal(plain, ids), "control: the bias should change the choice"


def test_cpu_grouped_router_is_the_trainers_sigmoid_router_under_the_ledger(monkeypatch):
    """The ledger row for vLLM's CPU grouped top-k router (what a Kimi Linear MoE calls) gives ``sigmoid_topk``'s
    weights and ids bit for bit, and refuses softmax scores or several expert groups by name."""
    from vllm.model_executor.layers.fused_moe.router import cpu_router

    from vllm_bi.ops.moe import sigmoid_topk
    from vllm_bi.patch.ledger import LEDGER, apply_row

    row = next(p for p in LEDGER if p.target.endswith("cpu_router:_grouped_topk"))
    apply_row(row, monkeypatch.setattr)
    g = torch.Generator().manual_seed(1)
    logits, bias = torch.randn(33, 16, generator=g), torch.randn(16, generator=g) * 0.1
    w, ids = cpu_router._grouped_topk(logits, 8, True, 1, 1, "sigmoid", 2.5, bias)
    w_ref, ids_ref = sigmoid_topk(logits, 8, True, bias, 2.5)
    assert torch.equal(w, w_ref) and torch.equal(ids, ids_ref)
    for scoring, groups in (("softmax", 1), ("sigmoid", 4)):
        with pytest.raises(NotImplementedError, match="not batch-invariant yet"):
            cpu_router._grouped_topk(logits, 8, True, groups, 1, scoring, 1.0, bias)
