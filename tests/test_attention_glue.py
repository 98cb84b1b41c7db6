"""vLLM glue units on CPU tensors: the paged-cache attention forward (used for CPU_ATTN with vllm_bi's cache
and for TRITON_ATTN's cache on CUDA: the same logical layout [blocks, Hkv, block, 2D]) against the op on
contiguous keys/values (exact equality), and Model Runner V2's token-logprob replacement."""

from types import SimpleNamespace

import pytest
import torch

from vllm_bi.model_executor.attention import bi_attn_forward
from vllm_bi.model_executor.cuda import _token_logprobs, own_ops_requested
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
    assert torch.equal(_token_logprobs(logits, ids), log_softmax(logits, -1, torch.float32).gather(1, ids))


def test_cuda_ops_switch(monkeypatch):
    monkeypatch.delenv("VLLM_BI_CUDA_OPS", raising=False)
    assert own_ops_requested() is True  # the default: the trainer's ops
    monkeypatch.setenv("VLLM_BI_CUDA_OPS", "vllm")
    assert own_ops_requested() is False
    monkeypatch.setenv("VLLM_BI_CUDA_OPS", "fast")
    with pytest.raises(ValueError, match="choose 'vllm_bi'"):
        own_ops_requested()


def test_a_server_on_vllms_own_kernels_is_a_settings_mismatch():
    from vllm_bi.parity import settings_mismatch

    assert settings_mismatch({"gdn_mode": "recurrent", "ops": "vllm_bi"}) is None
    assert "VLLM_BI_CUDA_OPS=vllm" in settings_mismatch({"gdn_mode": "recurrent", "ops": "vllm"})
