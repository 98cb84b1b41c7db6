"""The served MLA layer (``model_executor.attention.bi_mla_forward``, Kimi Linear's attention) against the trainer's
``models.kimi_linear.mla_block``, bit for bit, on vLLM's latent cache layout without an engine: two prompts in one
step (their blocks out of order in the cache) and a decode of the second prompt's last token.

Negative control: vLLM's own decode arithmetic for MLA (the query absorbed into the latent space, attention over
the latents, the value projection after) is the same function, but gives other bits than the prefill formulation,
so a decode served that way would break P3."""

import types
from unittest import mock

import torch

import vllm_bi.model_executor.attention as A
from vllm_bi.models.kimi_linear import mla_block
from vllm_bi.ops.linear import bi_linear

H, NOPE, ROPE, DV, R, D, BS = 2, 32, 64, 32, 256, 64, 16


def _weights(gen):
    def w(*shape):
        return (torch.randn(*shape, generator=gen) * shape[-1] ** -0.5).bfloat16()

    return {"q_proj.weight": w(H * (NOPE + ROPE), D), "kv_a_proj_with_mqa.weight": w(R + ROPE, D),
            "kv_a_layernorm.weight": (1 + 0.1 * torch.randn(R, generator=gen)).bfloat16(),
            "kv_b_proj.weight": w(H * (NOPE + DV), R), "o_proj.weight": w(D, H * DV)}


def _layer(w, blocks: int):
    def lin(weight):
        return lambda x: (bi_linear(x, weight), None)

    return types.SimpleNamespace(
        q_proj=lin(w["q_proj.weight"]), kv_a_proj_with_mqa=lin(w["kv_a_proj_with_mqa.weight"]),
        kv_a_layernorm=types.SimpleNamespace(weight=w["kv_a_layernorm.weight"], variance_epsilon=1e-6),
        kv_b_proj=types.SimpleNamespace(weight=w["kv_b_proj.weight"]), o_proj=lin(w["o_proj.weight"]),
        num_local_heads=H, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=DV, kv_lora_rank=R,
        scale=(NOPE + ROPE) ** -0.5, q_lora_rank=None, rotary_emb=None, use_output_gate=False,
        kv_cache_dtype="auto", dcp_world_size=1, layer_name="mla",
        kv_cache=torch.zeros(blocks, BS, R + ROPE, dtype=torch.bfloat16))


def _step(layer, rows, query_lens, seq_lens, tables):
    """One scheduler step: ``rows`` the step's hidden states, per sequence its query length, its length after the
    step and its block table (the slots follow the tables)."""
    q = [0]
    for n in query_lens:
        q.append(q[-1] + n)
    slots = [tables[i][p // BS] * BS + p % BS for i, (n, L) in enumerate(zip(query_lens, seq_lens))
             for p in range(L - n, L)]
    width = max(len(t) for t in tables)
    md = types.SimpleNamespace(
        num_actual_tokens=q[-1], query_start_loc=torch.tensor(q, dtype=torch.int32), max_seq_len=max(seq_lens),
        max_query_len=max(query_lens),
        vllm_bi_layout=(torch.tensor(seq_lens, dtype=torch.int32),
                        torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)))
    with mock.patch.object(A, "_mla_step", return_value=(md, torch.tensor(slots))):
        return A.bi_mla_forward(layer, None, rows)


def _absorbed_decode(layer, w, x_row, latents):
    """vLLM's weight-absorbed decode of one row over its cached latents ``[L, R + ROPE]``, in bf16 matmuls with an
    fp32 softmax (as its MQA decode kernels compute it)."""
    q = bi_linear(x_row, w["q_proj.weight"]).view(H, NOPE + ROPE)
    kv_b = w["kv_b_proj.weight"].view(H, NOPE + DV, R)
    w_uk, w_uv = kv_b[:, :NOPE], kv_b[:, NOPE:]  # [H, NOPE, R], [H, DV, R]
    ql = torch.einsum("hn,hnr->hr", q[:, :NOPE], w_uk)  # the query in the latent space
    s = (ql.float() @ latents[:, :R].float().T + q[:, NOPE:].float() @ latents[:, R:].float().T) * layer.scale
    o_latent = (torch.softmax(s, -1) @ latents[:, :R].float()).bfloat16()  # [H, R]
    v = torch.einsum("hr,hvr->hv", o_latent, w_uv)
    return bi_linear(v.reshape(1, H * DV), w["o_proj.weight"])


def test_served_mla_equals_the_trainers_in_prefill_and_decode_and_the_absorbed_decode_does_not():
    gen = torch.Generator().manual_seed(5)
    w = _weights(gen)
    c = types.SimpleNamespace(num_attention_heads=H, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=DV,
                              kv_lora_rank=R, rms_norm_eps=1e-6)
    x = torch.randn(26, D, generator=gen).bfloat16()
    want = mla_block(c, x, [0, 5, 26], w)  # two prompts: 5 and 21 tokens
    layer = _layer(w, blocks=4)
    with torch.no_grad():
        # prompt 1 in block 3; prompt 2 (its last token held back) in blocks 1 then 0
        got = _step(layer, torch.cat([x[:5], x[5:25]]), [5, 20], [5, 20], [[3], [1, 0]])
        assert torch.equal(got, torch.cat([want[:5], want[5:25]]))
        dec = _step(layer, x[25:26], [1], [21], [[1, 0]])
        assert torch.equal(dec, want[25:26])  # the decode == the prompt's row
        # control: vLLM's absorbed decode over the same cached latents is the same function, other bits
        latents = torch.cat([layer.kv_cache[1], layer.kv_cache[0, :5]])
        absorbed = _absorbed_decode(layer, w, x[25:26], latents)
        assert not torch.equal(absorbed, dec)
        torch.testing.assert_close(absorbed.float(), dec.float(), rtol=0.05, atol=0.05)


def test_a_dummy_step_writes_no_cache_and_an_unsupported_layer_is_refused():
    w = _weights(torch.Generator().manual_seed(6))
    layer = _layer(w, blocks=2)
    with mock.patch.object(A, "_mla_step", return_value=(None, None)):
        out = A.bi_mla_forward(layer, None, torch.randn(3, D).bfloat16())
    assert out.shape == (3, D) and not layer.kv_cache.any()
    for attr, value, name in (("q_lora_rank", 64, "low-rank query"), ("rotary_emb", object(), "rotary"),
                              ("use_output_gate", True, "output gate"), ("kv_cache_dtype", "fp8", "fp8")):
        bad = types.SimpleNamespace(**{**vars(layer), attr: value})
        assert name in A.mla_unsupported(bad)
        try:
            A.bi_mla_forward(bad, None, torch.randn(1, D).bfloat16())
        except NotImplementedError as e:
            assert name in str(e) and "not batch-invariant yet" in str(e)
        else:
            raise AssertionError(f"{attr}={value!r} was served")
