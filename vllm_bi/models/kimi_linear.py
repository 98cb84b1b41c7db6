"""Trainer-side pieces of Kimi Linear (``KimiLinearForCausalLM``), built from :mod:`vllm_bi.ops` and
:mod:`vllm_bi.gdn` only.

Kimi Delta Attention (KDA) is the GDN recurrence with a decay per key channel: :func:`kda_block` is one KDA layer
over packed sequences, each from fp32 zero states, composed as vLLM 0.32's ``KimiGatedDeltaNetAttention`` composes
it (q, k and v projections and their short convs in fp32 weights, beta and the low-rank forget gate ``f_b(f_a(x))``
per key channel, the GDN core with ``gating="kda"``, the output norm gated by ``sigmoid(g_b(g_a(x)))`` with its
fixed eps, the output projection). :func:`mla_block` is the MLA layer in one formulation, keys and values
decompressed from the latent (``kv_b_proj``) for every row: vLLM computes prefill that way but decode in the
weight-absorbed latent form, other arithmetic, so a batch-invariant server must serve this one for both. The model
(:class:`KimiLinearForCausalLM`) composes them with the dense and the sigmoid-routed MoE MLPs. The server serves the
same arithmetic on CPU (``model_executor.gdn.bi_kda_forward``, ``model_executor.attention.bi_mla_forward``, the router
``patch.cpu_moe.grouped_topk``); on CUDA Kimi Linear is refused (``vllm_bi.patch.model_families``).

Legend: ``T`` packed tokens, ``D`` hidden size, ``H`` KDA heads, ``K`` the KDA head dim (q, k and v alike), ``NH``
MLA heads.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from torch import nn

from vllm_bi.gdn.chunk import gdn_mode
from vllm_bi.gdn.layer import gdn_varlen
from vllm_bi.model_dir import read_tensors, write_checkpoint
from vllm_bi.models.qwen_gdn import (completion_logprobs, decoder_layer, mlp_block, next_token_logprobs,
                                     packed_causal_attention, whole)
from vllm_bi.ops.attention import latent_keys_values
from vllm_bi.ops.linear import bi_linear
from vllm_bi.ops.moe import moe_experts, sigmoid_topk
from vllm_bi.ops.norm import gated_rms_norm, rms_norm_maybe_residual

__all__ = ["KDA_NORM_EPS", "KDA_WEIGHTS", "kda_shapes", "kda_block", "KimiDeltaAttention", "KimiConfig", "mla_block",
           "kimi_moe_block", "KimiDecoderLayer", "KimiLinearForCausalLM"]

# vLLM builds the KDA output norm with FusedRMSNormGated's default eps, not the config's rms_norm_eps
KDA_NORM_EPS = 1e-5


def kda_shapes(hidden: int, num_heads: int, head_dim: int, conv_size: int) -> dict[str, tuple[tuple[int, ...],
                                                                                              torch.dtype]]:
    """A KDA layer's tensors under the checkpoint's names (``model.layers.N.self_attn.<name>``), in order: each one's
    shape and the dtype the trainer holds it in."""
    P, bf, f32 = num_heads * head_dim, torch.bfloat16, torch.float32
    return {"q_proj.weight": ((P, hidden), bf), "k_proj.weight": ((P, hidden), bf),
            "v_proj.weight": ((P, hidden), bf), "q_conv1d.weight": ((P, 1, conv_size), bf),
            "k_conv1d.weight": ((P, 1, conv_size), bf), "v_conv1d.weight": ((P, 1, conv_size), bf),
            "b_proj.weight": ((num_heads, hidden), bf), "f_a_proj.weight": ((head_dim, hidden), bf),
            "f_b_proj.weight": ((P, head_dim), bf), "g_a_proj.weight": ((head_dim, hidden), bf),
            "g_b_proj.weight": ((P, head_dim), bf), "A_log": ((1, 1, num_heads, 1), f32), "dt_bias": ((P,), f32),
            "o_norm.weight": ((head_dim,), bf), "o_proj.weight": ((hidden, P), bf)}


KDA_WEIGHTS = tuple(kda_shapes(1, 1, 1, 1))


def kda_block(x_TD: torch.Tensor, cu: list[int], w: dict[str, torch.Tensor], num_heads: int, head_dim: int,
              lower_bound: float | None = None) -> torch.Tensor:
    """One KDA layer over packed sequences ``cu``, each from fp32 zero states, in the settings' GDN mode (the server's):
    ``x [T, D]`` -> ``[T, D]``. ``w``: the layer's tensors by their :data:`KDA_WEIGHTS` names (convs ``[H*K, 1, W]``,
    ``A_log`` any shape of ``H`` elements, ``dt_bias [H*K]``); ``lower_bound``: the checkpoint's
    ``gate_lower_bound``. Differentiable in ``x`` and every weight."""
    T, H, K = x_TD.shape[0], num_heads, head_dim
    mixed = torch.cat([bi_linear(x_TD, w[f"{n}_proj.weight"]) for n in "qkv"], dim=-1)  # [T, 3*H*K]
    conv = torch.cat([w[f"{n}_conv1d.weight"] for n in "qkv"]).reshape(3 * H * K, -1).float()
    beta = bi_linear(x_TD, w["b_proj.weight"])  # [T, H], raw
    forget = bi_linear(bi_linear(x_TD, w["f_a_proj.weight"]), w["f_b_proj.weight"]).view(T, H, K)
    gate = bi_linear(bi_linear(x_TD, w["g_a_proj.weight"]), w["g_b_proj.weight"]).view(T, H, K)
    n, dev = len(cu) - 1, x_TD.device
    o, _, _ = gdn_varlen(
        mixed, [(cu[i], cu[i + 1]) for i in range(n)], conv,
        torch.zeros((n, conv.shape[1] - 1, conv.shape[0]), dtype=x_TD.dtype, device=dev),
        w["A_log"].reshape(H).float(), forget, beta, w["dt_bias"].reshape(H * K),
        torch.zeros((n, H, K, K), dtype=torch.float32, device=dev), H, K, K,
        mode=gdn_mode(), packed=True, gating="kda", lower_bound=lower_bound,
    )
    y = gated_rms_norm(o.to(x_TD.dtype), gate, w["o_norm.weight"], KDA_NORM_EPS, True, "sigmoid")
    return bi_linear(y.reshape(T, H * K), w["o_proj.weight"])


class KimiDeltaAttention(nn.Module):
    """A KDA layer's parameters under the checkpoint's names (dots as underscores), run by :func:`kda_block`."""

    def __init__(self, hidden: int, num_heads: int, head_dim: int, conv_size: int,
                 lower_bound: float | None = None):
        super().__init__()
        self.num_heads, self.head_dim, self.lower_bound = num_heads, head_dim, lower_bound
        for name, (shape, dtype) in kda_shapes(hidden, num_heads, head_dim, conv_size).items():
            self.register_parameter(name.replace(".", "_"), nn.Parameter(torch.zeros(shape, dtype=dtype)))

    def weights(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name.replace(".", "_")) for name in KDA_WEIGHTS}

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy the layer's tensors (keys: :data:`KDA_WEIGHTS`), refusing a missing name or another shape."""
        with torch.no_grad():
            for name, p in self.weights().items():
                if name not in tensors:
                    raise KeyError(f"KDA layer: the checkpoint has no {name}")
                t = tensors[name]
                if tuple(t.shape) != tuple(p.shape):
                    raise ValueError(f"KDA layer: {name} has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
                p.copy_(t.to(p.dtype))

    def forward(self, x_TD: torch.Tensor, cu: list[int]) -> torch.Tensor:
        return kda_block(x_TD, cu, self.weights(), self.num_heads, self.head_dim, self.lower_bound)


@dataclass
class KimiConfig:
    """What the trainer reads of a Kimi Linear ``config.json``."""

    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    rms_norm_eps: float
    intermediate_size: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    kda_layers: tuple[int, ...]  # 1-based, as the config lists them
    kda_heads: int
    kda_head_dim: int
    conv_size: int
    gate_lower_bound: float | None
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    num_shared_experts: int
    renormalize: bool
    routed_scaling_factor: float
    first_k_dense_replace: int

    @classmethod
    def from_dict(cls, c: dict, where: str = "config") -> "KimiConfig":
        la = c.get("linear_attn_config") or {}
        refuse = []
        if c.get("q_lora_rank") is not None:
            refuse.append("q_lora_rank (a low-rank query)")
        if not c.get("mla_use_nope", False):
            refuse.append("mla_use_nope false (rotary MLA)")
        if c.get("mla_use_output_gate", False):
            refuse.append("mla_use_output_gate")
        if la.get("use_full_rank_gate", False):
            refuse.append("linear_attn_config.use_full_rank_gate")
        if c.get("moe_router_activation_func", "sigmoid") != "sigmoid":
            refuse.append(f"moe_router_activation_func {c.get('moe_router_activation_func')!r}")
        if c.get("num_expert_group", 1) != 1 or c.get("routed_expert_hidden_size") is not None:
            refuse.append("grouped or latent MoE routing")
        if refuse:
            raise ValueError(f"{where}: Kimi Linear with {', '.join(refuse)} is not supported by the trainer model yet")
        return cls(
            hidden_size=c["hidden_size"], vocab_size=c["vocab_size"], num_hidden_layers=c["num_hidden_layers"],
            rms_norm_eps=c["rms_norm_eps"], intermediate_size=c["intermediate_size"],
            num_attention_heads=c["num_attention_heads"], kv_lora_rank=c["kv_lora_rank"],
            qk_nope_head_dim=c["qk_nope_head_dim"], qk_rope_head_dim=c["qk_rope_head_dim"],
            v_head_dim=c["v_head_dim"], kda_layers=tuple(la["kda_layers"]), kda_heads=la["num_heads"],
            kda_head_dim=la["head_dim"], conv_size=la["short_conv_kernel_size"],
            gate_lower_bound=la.get("gate_lower_bound"), num_experts=c["num_experts"],
            top_k=c["num_experts_per_token"], moe_intermediate_size=c["moe_intermediate_size"],
            num_shared_experts=c.get("num_shared_experts") or 0, renormalize=bool(c.get("moe_renormalize", True)),
            routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
            first_k_dense_replace=c.get("first_k_dense_replace", 0))

    def is_kda(self, i: int) -> bool:
        return (i + 1) in self.kda_layers

    def is_moe(self, i: int) -> bool:
        return i >= self.first_k_dense_replace


def mla_block(c: KimiConfig, x_TD: torch.Tensor, cu: list[int], w: dict[str, torch.Tensor]) -> torch.Tensor:
    """Kimi Linear's MLA (no rotary, a full-rank query) over packed sequences, keys and values decompressed from the
    latent for every row (:func:`vllm_bi.ops.attention.latent_keys_values`, as the server decompresses its cache):
    ``x [T, D]`` -> ``[T, D]``. ``w``: ``q_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``,
    ``o_proj`` (``.weight``)."""
    T, NH = x_TD.shape[0], c.num_attention_heads
    nope, rope, dv, r = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
    dqk = nope + rope
    q = bi_linear(x_TD, w["q_proj.weight"]).view(T, NH, dqk)
    kv_a = bi_linear(x_TD, w["kv_a_proj_with_mqa.weight"])
    latent = rms_norm_maybe_residual(kv_a[:, :r], None, w["kv_a_layernorm.weight"], c.rms_norm_eps)
    k, v = latent_keys_values(latent, kv_a[:, r:], w["kv_b_proj.weight"], NH, nope, dv)
    out = packed_causal_attention(q, k, v, cu, dqk**-0.5, mla=True)[..., :dv]
    return bi_linear(out.reshape(T, NH * dv), w["o_proj.weight"])


def kimi_moe_block(c: KimiConfig, x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    """The sigmoid-routed MoE with its shared experts: ``gate.weight [E, D]`` (router logits in fp32),
    ``gate.e_score_correction_bias [E]``, experts ``w13 [E, 2I, D]`` (per expert ``[w1; w3]``) and ``w2 [E, D, I]``,
    the shared MLP's ``shared_experts.{gate,up,down}_proj.weight``."""
    logits = bi_linear(x, w["gate.weight"]).float()
    weights, ids = sigmoid_topk(logits, c.top_k, c.renormalize, w["gate.e_score_correction_bias"],
                                c.routed_scaling_factor)
    out = moe_experts(x, w["w13"], w["w2"], weights, ids)
    if c.num_shared_experts:
        out = out + mlp_block(x, *(w[f"shared_experts.{n}_proj.weight"] for n in ("gate", "up", "down")))
    return out


def _name(hf: str) -> str:
    return hf.replace(".", ":")


def _layer_shapes(c: "KimiConfig", i: int):
    """``(name under model.layers.i, shape, dtype)`` of decoder layer ``i``'s parameters."""
    D, bf, f32 = c.hidden_size, torch.bfloat16, torch.float32
    NH, nope, rope, dv, r = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
    yield "input_layernorm.weight", (D,), bf
    yield "post_attention_layernorm.weight", (D,), bf
    if c.is_kda(i):
        for name, (shape, dtype) in kda_shapes(D, c.kda_heads, c.kda_head_dim, c.conv_size).items():
            yield f"self_attn.{name}", shape, dtype
    else:
        yield "self_attn.q_proj.weight", (NH * (nope + rope), D), bf
        yield "self_attn.kv_a_proj_with_mqa.weight", (r + rope, D), bf
        yield "self_attn.kv_a_layernorm.weight", (r,), bf
        yield "self_attn.kv_b_proj.weight", (NH * (nope + dv), r), bf
        yield "self_attn.o_proj.weight", (D, NH * dv), bf
    if c.is_moe(i):
        E, I = c.num_experts, c.moe_intermediate_size
        yield "block_sparse_moe.gate.weight", (E, D), bf
        yield "block_sparse_moe.gate.e_score_correction_bias", (E,), f32
        yield "block_sparse_moe.w13", (E, 2 * I, D), bf
        yield "block_sparse_moe.w2", (E, D, I), bf
        if c.num_shared_experts:
            S = I * c.num_shared_experts
            yield "block_sparse_moe.shared_experts.gate_proj.weight", (S, D), bf
            yield "block_sparse_moe.shared_experts.up_proj.weight", (S, D), bf
            yield "block_sparse_moe.shared_experts.down_proj.weight", (D, S), bf
    else:
        I = c.intermediate_size
        yield "mlp.gate_proj.weight", (I, D), bf
        yield "mlp.up_proj.weight", (I, D), bf
        yield "mlp.down_proj.weight", (D, I), bf


class _Params(nn.Module):
    """Parameters under checkpoint names (dots as colons), zero-initialised."""

    def __init__(self, shapes):
        super().__init__()
        self.params = nn.ParameterDict()
        for name, shape, dtype in shapes:
            self.params[_name(name)] = nn.Parameter(torch.zeros(shape, dtype=dtype))

    def w(self, name: str) -> torch.Tensor:
        return self.params[_name(name)]

    def under(self, prefix: str) -> dict[str, torch.Tensor]:
        key = _name(prefix) + ":"
        return {k[len(key):].replace(":", "."): v for k, v in self.params.items() if k.startswith(key)}


class KimiDecoderLayer(_Params):
    """One decoder layer (a KDA or MLA mixer; a dense or MoE MLP), its parameters named as under
    ``model.layers.i.``; one FSDP2 unit when the trainer is sharded."""

    def __init__(self, c: "KimiConfig", i: int):
        super().__init__(_layer_shapes(c, i))
        self.c, self.kda, self.moe = c, c.is_kda(i), c.is_moe(i)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, cu: list[int]):
        c, attn = self.c, self.under("self_attn")
        if self.kda:
            def mixer(x):
                return kda_block(x, cu, attn, c.kda_heads, c.kda_head_dim, c.gate_lower_bound)
        else:
            def mixer(x):
                return mla_block(c, x, cu, attn)
        if self.moe:
            moe = self.under("block_sparse_moe")

            def mlp(x):
                return kimi_moe_block(c, x, moe)
        else:
            dense = [self.w(f"mlp.{n}_proj.weight") for n in ("gate", "up", "down")]

            def mlp(x):
                return mlp_block(x, *dense)

        def norm(name):
            return lambda x, r: rms_norm_maybe_residual(x, r, self.w(f"{name}.weight"), c.rms_norm_eps)

        return decoder_layer(h, residual, norm("input_layernorm"), mixer, norm("post_attention_layernorm"), mlp)


class KimiLinearForCausalLM(_Params):
    """Kimi Linear for the trainer: embeddings, decoder layers (:class:`KimiDecoderLayer`), the final norm and an
    untied head. Parameters keep the checkpoint's names (dots as colons; a layer's under ``model.layers.i.``); the
    routed experts are held stacked as ``block_sparse_moe.w13`` / ``.w2``. ``layers`` are the FSDP2 units of a
    sharded trainer (``vllm_bi.trainer.distributed``)."""

    def __init__(self, c: KimiConfig):
        D, bf = c.hidden_size, torch.bfloat16
        super().__init__([("model.embed_tokens.weight", (c.vocab_size, D), bf), ("model.norm.weight", (D,), bf),
                          ("lm_head.weight", (c.vocab_size, D), bf)])
        self.c = c
        self.layers = nn.ModuleList(KimiDecoderLayer(c, i) for i in range(c.num_hidden_layers))

    def hf_parameters(self):
        """``(checkpoint name, parameter)`` of every parameter, the stacked experts under their stacked names."""
        for key, p in self.params.items():
            yield key.replace(":", "."), p
        for i, layer in enumerate(self.layers):
            for key, p in layer.params.items():
                yield f"model.layers.{i}." + key.replace(":", "."), p

    @classmethod
    def from_pretrained(cls, path: str) -> "KimiLinearForCausalLM":
        with open(os.path.join(path, "config.json")) as f:
            model = cls(KimiConfig.from_dict(json.load(f), os.path.join(path, "config.json")))
        model.load_hf_state_dict(read_tensors(path))
        return model

    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy a checkpoint's tensors in (per-expert ``w1``/``w3``/``w2`` stacked into ``w13``/``w2``), refusing a
        missing tensor or another shape by name."""
        c = self.c
        have = dict(tensors)
        for i in range(c.num_hidden_layers):
            if not c.is_moe(i):
                continue
            m = f"model.layers.{i}.block_sparse_moe"
            try:
                w1, w3, w2 = ([have.pop(f"{m}.experts.{e}.{n}.weight") for e in range(c.num_experts)]
                              for n in ("w1", "w3", "w2"))
            except KeyError as e:
                raise KeyError(f"Kimi Linear checkpoint: no {e.args[0]}") from None
            have[f"{m}.w13"] = torch.stack([torch.cat([a, b]) for a, b in zip(w1, w3)])
            have[f"{m}.w2"] = torch.stack(w2)
        with torch.no_grad():
            for name, p in self.hf_parameters():
                if name not in have:
                    raise KeyError(f"Kimi Linear checkpoint: no {name}")
                t = have[name]
                if tuple(t.shape) != tuple(p.shape):
                    raise ValueError(f"Kimi Linear checkpoint: {name} has shape {tuple(t.shape)}, expected "
                                     f"{tuple(p.shape)}")
                p.copy_(t.to(p.dtype))

    def hf_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor | None]:
        """The parameters (with ``grads``: their gradients, None where a parameter has none) under the checkpoint's
        names, whole (FSDP2 shards gathered), the stacked experts split back into ``experts.E.w1/w3/w2``."""
        out = {}
        for name, p in self.hf_parameters():
            t = p.grad if grads else p.detach()
            t = None if t is None else whole(t)
            if name.endswith(".block_sparse_moe.w13"):
                I = p.shape[1] // 2
                for e in range(p.shape[0]):
                    out[name[: -len("w13")] + f"experts.{e}.w1.weight"] = None if t is None else t[e, :I].contiguous()
                    out[name[: -len("w13")] + f"experts.{e}.w3.weight"] = None if t is None else t[e, I:].contiguous()
            elif name.endswith(".block_sparse_moe.w2"):
                for e in range(p.shape[0]):
                    out[name[: -len("w2")] + f"experts.{e}.w2.weight"] = None if t is None else t[e].contiguous()
            else:
                out[name] = t
        return out

    def forward(self, input_ids: torch.Tensor, cu_seqlens, rows: torch.Tensor | None = None) -> torch.Tensor:
        """bf16 logits ``[T, vocab]`` of packed sequences (each from position 0); with ``rows`` (indices into ``T``)
        those positions' only, the same bits as those rows of all."""
        c = self.c
        cu = [int(x) for x in cu_seqlens]
        h, residual = self.w("model.embed_tokens.weight")[input_ids], None
        for layer in self.layers:
            h, residual = layer(h, residual, cu)
        # the last residual added in bf16, then the final norm alone: vLLM's Kimi model ends its forward with the sum
        # and normalises in compute_logits (a fused add-and-norm keeps the sum in fp32: other bits)
        h = rms_norm_maybe_residual(h + residual, None, self.w("model.norm.weight"), c.rms_norm_eps)
        return bi_linear(h if rows is None else h[rows], self.w("lm_head.weight"))

    def save_pretrained(self, path: str, like: str, state_dict: dict | None = None) -> str:
        """Write ``model.safetensors`` (the checkpoint's names) to ``path``, with config and tokenizer files copied
        from ``like``; ``state_dict``: an :meth:`hf_state_dict` already taken (default: take it now)."""
        return write_checkpoint(path, self.hf_state_dict() if state_dict is None else state_dict, like)

    def completion_logprobs(self, pairs, entropy: bool = False, masks=None) -> tuple[list[torch.Tensor], float]:
        """:func:`vllm_bi.models.qwen_gdn.completion_logprobs` of this model."""
        return completion_logprobs(self, pairs, entropy, masks)

    def token_logprobs(self, input_ids: torch.Tensor, cu_seqlens) -> torch.Tensor:
        """``[T]`` fp32: each token's logprob of the next one in its sequence (the last of each is NaN)."""
        cu = [int(x) for x in cu_seqlens]
        return next_token_logprobs(self.forward(input_ids, cu), input_ids, cu)
