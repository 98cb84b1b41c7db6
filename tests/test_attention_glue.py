"""vLLM glue units on CPU tensors: the paged-cache attention forward (used for CPU_ATTN with vllm_bi's cache
and for TRITON_ATTN's cache on CUDA: the same logical layout [blocks, Hkv, block, 2D]) against the op on
contiguous keys/values (exact equality), and Model Runner V2's token-logprob replacement."""

from types import SimpleNamespace

import pytest
import torch

import vllm_bi.settings
from vllm_bi.model_executor.attention import bi_attn_forward
from vllm_bi.patch.cuda_ops import token_logprobs
from vllm_bi.settings import current as current_settings
from vllm_bi.ops.attention import causal_attention
from vllm_bi.ops.softmax import log_softmax


def test_paged_attention_glue_equals_the_op():
    g = torch.Generator().manual_seed(0)
    H, Hkv, D, bs, nblocks = 4, 2, 64, 16, 12
    lens, qlens = [37, 20], [5, 1]  # a prefill chunk at the end of sequence 0, a decode for sequence 1
    kv_cache = torch.zeros(nblocks, Hkv, bs, 2 * D, dtype=torch.bfloat16)
    table = torch.tensor([[7, 2, 9, 0], [4, 11, 0, 0]], dtype=torch.int32)
    ks, vs = [], []
    for i, L in enumerate(lens):
        k = torch.randn(L, Hkv, D, generator=g).bfloat16()
        v = torch.randn(L, Hkv, D, generator=g).bfloat16()
        for t in range(L):
            kv_cache[table[i, t // bs], :, t % bs] = torch.cat([k[t], v[t]], dim=-1)
        ks.append(k)
        vs.append(v)
    q = torch.randn(sum(qlens), H, D, generator=g).bfloat16()
    md = SimpleNamespace(query_start_loc=torch.tensor([0, 5, 6]), seq_lens=torch.tensor(lens), block_table=table,
                         causal=True, num_actual_tokens=6)
    impl = SimpleNamespace(scale=D**-0.5, attn_type="decoder", alibi_slopes=None, sliding_window=None,
                           logits_soft_cap=None, sinks=None, kv_cache_dtype="auto")
    out = torch.empty(6, H * D, dtype=torch.bfloat16)
    bi_attn_forward(impl, None, q.reshape(6, H * D), None, None, kv_cache, md, out)
    want0 = causal_attention(q[:5], ks[0], vs[0], list(range(32, 37)), D**-0.5)
    want1 = causal_attention(q[5:], ks[1], vs[1], [19], D**-0.5)
    assert torch.equal(out.view(6, H, D)[:5], want0) and torch.equal(out.view(6, H, D)[5:], want1)
    impl.sinks = torch.zeros(H)
    with pytest.raises(NotImplementedError, match="attention sinks"):
        bi_attn_forward(impl, None, q.reshape(6, H * D), None, None, kv_cache, md, out)


def test_token_logprobs_is_the_op_library_log_softmax():
    logits = torch.randn(3, 1000).bfloat16()
    ids = torch.tensor([[5, 7], [999, 0], [1, 1]])
    assert torch.equal(token_logprobs(logits, ids), log_softmax(logits, -1, torch.float32).gather(1, ids))


def test_cuda_ops_switch(monkeypatch):
    monkeypatch.delenv("VLLM_BI_CUDA_OPS", raising=False)
    assert current_settings().cuda_ops == "vllm_bi"  # the default: the trainer's ops
    monkeypatch.setenv("VLLM_BI_CUDA_OPS", "vllm")
    assert current_settings().cuda_ops == "vllm"
    monkeypatch.setenv("VLLM_BI_CUDA_OPS", "fast")
    with pytest.raises(ValueError, match="VLLM_BI_CUDA_OPS='fast' is not a setting; use one of vllm_bi, vllm"):
        current_settings()


def test_a_server_on_vllms_own_kernels_is_a_settings_mismatch():
    from vllm_bi.parity import settings_mismatch

    assert settings_mismatch({"gdn_mode": "recurrent", "ops": "vllm_bi"}) is None
    assert settings_mismatch({"gdn_mode": "recurrent", "ops": "vllm_bi", "device": "cpu", "attention": "torch"}) is None
    assert "VLLM_BI_ATTENTION" in settings_mismatch({"gdn_mode": "recurrent", "device": "cpu", "attention": "triton"})
    assert "VLLM_BI_CUDA_OPS=vllm" in settings_mismatch({"gdn_mode": "recurrent", "ops": "vllm"})


GLUE_TRITON = """
import os
from types import SimpleNamespace
import torch
import vllm_bi.settings
from vllm_bi.model_executor.attention import bi_attn_forward
from vllm_bi.models.qwen_gdn import packed_causal_attention

g = torch.Generator().manual_seed(0)
H, Hkv, D, bs = 4, 2, 64, 16
lens = [37, 20]
k = torch.randn(sum(lens), Hkv, D, generator=g).bfloat16()
v = torch.randn(sum(lens), Hkv, D, generator=g).bfloat16()
q = torch.randn(sum(lens), H, D, generator=g).bfloat16()
cu = [0, 37, 57]
table = torch.tensor([[7, 2, 9, 0], [4, 11, 0, 0]], dtype=torch.int32)
cache = torch.full((12, Hkv, bs, 2 * D), float("nan")).bfloat16()
for i, L in enumerate(lens):
    for t in range(L):
        cache[table[i, t // bs], :, t % bs] = torch.cat([k[cu[i] + t], v[cu[i] + t]], -1)
impl = SimpleNamespace(scale=D**-0.5, attn_type="decoder", alibi_slopes=None, sliding_window=None,
                       logits_soft_cap=None, sinks=None, kv_cache_dtype="auto")

def server(rows):  # rows: [(seq, first query position)]: one step; returns each sequence's query rows
    qs = torch.cat([q[cu[i] + f: cu[i + 1]] for i, f in rows])
    qsl = [0]
    for i, f in rows:
        qsl.append(qsl[-1] + lens[i] - f)
    md = SimpleNamespace(query_start_loc=torch.tensor(qsl), seq_lens=torch.tensor([lens[i] for i, _ in rows]),
                         block_table=table[[i for i, _ in rows]], causal=True)
    out = torch.full((qs.shape[0] + 3, H * D), 5.0).bfloat16()  # 3 padding rows: left as they are
    bi_attn_forward(impl, None, torch.cat([qs.view(-1, H * D), torch.zeros(3, H * D).bfloat16()]), None, None,
                    cache, md, out)
    assert bool((out[-3:] == 5.0).all())
    return out[:-3].view(-1, H, D).split([lens[i] - f for i, f in rows])

trainer = {}
for backend in ("triton", "torch"):
    os.environ["VLLM_BI_ATTENTION"] = backend
    vllm_bi.settings.reload()
    trainer[backend] = packed_causal_attention(q, k, v, cu, D**-0.5)
    full = server([(0, 0), (1, 0)])
    assert torch.equal(torch.cat(full), trainer[backend]), backend          # trainer == server, each backend
    # a split prefill of sequence 0 at 30 beside a decode of sequence 1, and sequence 1 alone
    split = server([(0, 30), (1, 19)])
    assert torch.equal(split[0], full[0][30:]) and torch.equal(split[1], full[1][19:]), backend
    if backend == "triton":  # a step of decodes: tiles built on the device, no host read, the same bits
        md = SimpleNamespace(query_start_loc=torch.tensor([0, 1, 2]), seq_lens=torch.tensor(lens), block_table=table,
                             causal=True, max_query_len=1)
        out = torch.empty(2, H * D).bfloat16()
        real_tolist = torch.Tensor.tolist
        torch.Tensor.tolist = lambda *a: (_ for _ in ()).throw(AssertionError("host read in a decode step"))
        try:
            bi_attn_forward(impl, None, torch.stack([q[cu[1] - 1], q[cu[2] - 1]]).view(2, H * D), None, None,
                            cache, md, out)
        finally:
            torch.Tensor.tolist = real_tolist
        assert torch.equal(out.view(2, H, D), torch.stack([full[0][-1], full[1][-1]]))
assert (trainer["triton"].double() - trainer["torch"].double()).abs().max() < 2e-2
assert not torch.equal(trainer["triton"], trainer["torch"])  # two ops, two sets of bits: the setting matters
print("ok")
"""


def test_triton_attention_through_the_glue_equals_the_trainer():
    """``VLLM_BI_ATTENTION=triton`` (the CUDA default) through the server glue and through the trainer's packed
    attention, on CPU under Triton's interpreter: equal bits, also in a split prefill beside a decode; padding rows
    untouched; a step of decodes (tiles built on the device, no host read) gives the same rows; within 2e-2 of the
    torch op (and not its bits)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", GLUE_TRITON], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, (r.stdout + r.stderr)[-4000:]
