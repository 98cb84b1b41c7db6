"""Trainer-side GDN hybrid (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) built from :mod:`vllm_bi.ops` only.

This is the model the trainer runs. Every op is the same function the vLLM
engine calls under ``VLLM_BATCH_INVARIANT=1`` (see
``vllm_bi/patch/``), composed in the same order with the
same roundings as vLLM 0.32's model code, so a token's logprob here equals the
one the server returned, bit for bit.

Input is a varlen-packed batch: ``input_ids [T]`` and ``cu_seqlens [B+1]``
(every sequence starts at position 0). Output: bf16 logits ``[T, vocab]``;
:meth:`QwenGDNForCausalLM.token_logprobs` gives the logprob of each next token.

Legend: ``T`` packed tokens, ``D`` hidden size, ``H``/``Hkv`` attention heads,
``Hk``/``Hv`` GDN key/value heads, ``K``/``V`` GDN head dims.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from torch import nn

from vllm_bi.gdn.chunk import gdn_mode
from vllm_bi.gdn.layer import gdn_varlen
from vllm_bi.model_dir import QWEN_ARCHITECTURES, read_tensors, write_checkpoint
from vllm_bi.ops import pointwise
from vllm_bi.ops.activation import silu_mul
from vllm_bi.ops.attention import causal_attention_rows
from vllm_bi.ops.attention_triton import attention_backend, packed_attention
from vllm_bi.ops.linear import bi_linear
from vllm_bi.ops.moe import moe_experts, softmax_topk
from vllm_bi.ops.norm import gated_rms_norm, rms_norm_maybe_residual
from vllm_bi.ops.rotary import apply_rotary, rope_cos_sin_cache
from vllm_bi.ops.softmax import log_softmax
from vllm_bi.settings import current

__all__ = ["HybridConfig", "QwenGDNForCausalLM", "attention_block", "completion_logprobs", "decoder_layer",
           "decoder_stack", "gdn_block", "gemma_rms_norm", "mlp_block", "moe_block", "next_token_logprobs",
           "packed_positions", "whole"]

_ARCHS = QWEN_ARCHITECTURES  # config.json architecture -> (family, GDN projections packed per key-head group)


def packed_causal_attention(q, k, v, cu: list[int], scale: float, mla: bool = False) -> torch.Tensor:
    """Causal attention of packed sequences (sequence ``i`` owns rows ``cu[i]:cu[i+1]``, from position 0),
    all rows at once, with the op the server runs on this device (``VLLM_BI_ATTENTION``; ``mla``: for multi-head
    latent attention, as :func:`vllm_bi.ops.attention_triton.attention_backend`): the Triton kernel's
    :func:`packed_attention` or the torch op's :func:`causal_attention_rows`."""
    if attention_backend(q.device, mla) == "triton":
        return packed_attention(q, k, v, cu, scale)
    seq_t = torch.tensor([i for i in range(len(cu) - 1) for _ in range(cu[i + 1] - cu[i])], device=q.device)
    positions = [t - cu[i] for i in range(len(cu) - 1) for t in range(cu[i], cu[i + 1])]
    start = torch.tensor(cu[:-1], device=q.device)
    last = torch.tensor(cu[1:], device=q.device) - 1

    def gather(rows, B):
        seq = seq_t[rows]
        j = torch.minimum(start[seq].unsqueeze(1) + torch.arange(B, device=q.device), last[seq].unsqueeze(1))
        return k[j], v[j]  # keys past a sequence's end repeat its last one: masked in the op

    return causal_attention_rows(q, positions, gather, scale)


@dataclass
class HybridConfig:
    arch: str
    interleaved_gdn: bool  # Qwen3-Next packs [q k v z] per key-head group
    vocab_size: int
    hidden_size: int
    layer_types: list
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    max_position_embeddings: int
    rms_norm_eps: float
    attn_output_gate: bool
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    moe: bool
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    tie_word_embeddings: bool

    @classmethod
    def from_pretrained(cls, path: str) -> "HybridConfig":
        with open(os.path.join(path, "config.json")) as f:
            return cls.from_dict(json.load(f), path)

    @classmethod
    def from_dict(cls, c: dict, where: str = "config") -> "HybridConfig":
        """From a ``config.json``'s dict (a multimodal one's ``text_config`` is read); ``where`` names it in errors.
        Raises ValueError for another architecture, NotImplementedError for what the trainer model does not build."""
        c = c.get("text_config", c) | {"architectures": c.get("architectures")}
        arch = (c.get("architectures") or [None])[0]
        if arch not in _ARCHS:
            raise ValueError(f"{where}: architecture {arch!r} is not supported; supported: {', '.join(_ARCHS)}")
        rope = c.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default" or rope.get("mrope_section"):
            raise NotImplementedError(f"{where}: rope {rope} is not supported by the trainer model yet")
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        factor = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
        n_exp = int(c.get("num_experts", 0) or 0)
        moe = arch != "Qwen3_5ForCausalLM" and n_exp > 0
        if arch == "Qwen3NextForCausalLM" and (c.get("mlp_only_layers") or c.get("decoder_sparse_step", 1) != 1):
            raise NotImplementedError(f"{where}: Qwen3-Next with dense layers (mlp_only_layers/decoder_sparse_step) not supported yet")
        return cls(
            arch=arch,
            interleaved_gdn=_ARCHS[arch][1],
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            layer_types=list(c["layer_types"]),
            num_attention_heads=c["num_attention_heads"],
            num_key_value_heads=c["num_key_value_heads"],
            head_dim=head_dim,
            rotary_dim=int(head_dim * factor),
            rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
            max_position_embeddings=c["max_position_embeddings"],
            rms_norm_eps=c["rms_norm_eps"],
            attn_output_gate=c.get("attn_output_gate", True),
            linear_num_key_heads=c["linear_num_key_heads"],
            linear_num_value_heads=c["linear_num_value_heads"],
            linear_key_head_dim=c["linear_key_head_dim"],
            linear_value_head_dim=c["linear_value_head_dim"],
            linear_conv_kernel_dim=c["linear_conv_kernel_dim"],
            moe=moe,
            num_experts=n_exp,
            num_experts_per_tok=int(c.get("num_experts_per_tok", 0) or 0),
            norm_topk_prob=bool(c.get("norm_topk_prob", True)),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        )


# Our parameter names are the HF names without the ``model.`` prefix, and without ``.weight`` for
# raw GEMM weights, conv weights and the GDN output-norm weight (norm modules keep ``.weight``).
_NO_SUFFIX = ("A_log", "dt_bias")


def whole(t: torch.Tensor) -> torch.Tensor:
    """A tensor whole: an FSDP2 shard (``DTensor``) gathered (every rank must call this), any other as it is."""
    return t.full_tensor() if type(t).__name__ == "DTensor" else t


def _hf_name(own: str) -> str:
    if own.endswith(".weight") or own.endswith(_NO_SUFFIX):
        name = own
    else:
        name = own + ".weight"
    return name if own == "lm_head" else "model." + name


def _own_name(hf: str) -> str:
    n = hf[len("model."):] if hf.startswith("model.") else hf
    if n.endswith(".weight") and not (n.endswith("norm.weight") and not n.endswith("linear_attn.norm.weight")):
        n = n[: -len(".weight")]
    return n


def _p(*shape) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=torch.bfloat16))


# The network as functions of its weights: one implementation of the arithmetic, composed by the trainer's modules
# below and by the Hugging Face adapter (vllm_bi.integrations.transformers) over transformers' modules. Weights are
# the raw tensors (GEMM weights [out, in] as nn.Linear keeps them); every function is differentiable in all of them.


def gemma_rms_norm(x, residual, weight, eps: float):
    """Qwen's RMSNorm with scale ``1 + weight`` (``weight`` zero-centred); with ``residual``, vLLM's fused
    ``x + residual`` first, returning ``(normed, new residual)``."""
    return rms_norm_maybe_residual(x, residual, weight.float() + 1.0, eps)


def attention_block(c: HybridConfig, x_TD, positions_T, cu: list[int], q_proj, k_proj, v_proj, o_proj, q_norm,
                    k_norm) -> torch.Tensor:
    """Gated full attention of packed sequences: ``x [T, D]`` -> ``[T, D]``. ``q_norm``/``k_norm``: the per-head
    norms' weights; the rotary table is :func:`rope_cos_sin_cache`'s."""
    T, H, Hkv, Dh = x_TD.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim
    q = bi_linear(x_TD, q_proj)
    gate = None
    if c.attn_output_gate:  # per head: [q (Dh) | gate (Dh)]
        q, gate = q.view(T, H, 2 * Dh).chunk(2, dim=-1)
        gate = gate.reshape(T, H * Dh)
    q = gemma_rms_norm(q.reshape(T, H, Dh), None, q_norm, c.rms_norm_eps).reshape(T, H * Dh)
    k = gemma_rms_norm(bi_linear(x_TD, k_proj).view(T, Hkv, Dh), None, k_norm, c.rms_norm_eps).reshape(T, Hkv * Dh)
    v = bi_linear(x_TD, v_proj)
    cache = rope_cos_sin_cache(c.rotary_dim, c.max_position_embeddings, c.rope_theta, positions_T.device)
    q, k = apply_rotary(positions_T, q, k, cache, Dh, c.rotary_dim, True)
    out = packed_causal_attention(q.view(T, H, Dh), k.view(T, Hkv, Dh), v.view(T, Hkv, Dh), cu, Dh**-0.5)
    out = out.reshape(T, H * Dh)
    if gate is not None:
        out = out * pointwise.sigmoid(gate).to(out.dtype)
    return bi_linear(out, o_proj)


def gdn_project(c: HybridConfig, x_TD, projections: tuple):
    """The GDN input projections: ``(in_proj_qkvz, in_proj_ba)`` (Qwen3-Next's per-key-head-group packing) or
    ``(in_proj_qkv, in_proj_z, in_proj_b, in_proj_a)`` -> ``mixed [T, 2*Hk*K + Hv*V]``, ``z [T, Hv, V]``,
    ``b [T, Hv]``, ``a [T, Hv]``."""
    T = x_TD.shape[0]
    Hk, Hv, K, V = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    if c.interleaved_gdn:
        in_proj_qkvz, in_proj_ba = projections
        r = Hv // Hk
        qkvz = bi_linear(x_TD, in_proj_qkvz).view(T, Hk, 2 * K + 2 * r * V)
        q, k, v, z = torch.split(qkvz, [K, K, r * V, r * V], dim=-1)
        ba = bi_linear(x_TD, in_proj_ba).view(T, Hk, 2 * r)
        b, a = torch.split(ba, [r, r], dim=-1)
        mixed = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
        return mixed, z.reshape(T, Hv, V), b.reshape(T, Hv), a.reshape(T, Hv)
    in_proj_qkv, in_proj_z, in_proj_b, in_proj_a = projections
    mixed = bi_linear(x_TD, in_proj_qkv)
    z = bi_linear(x_TD, in_proj_z).view(T, Hv, V)
    return mixed, z, bi_linear(x_TD, in_proj_b), bi_linear(x_TD, in_proj_a)


def gdn_block(c: HybridConfig, x_TD, cu: list[int], projections: tuple, conv1d, A_log, dt_bias, norm,
              out_proj) -> torch.Tensor:
    """A Gated DeltaNet layer over packed sequences, each from fp32 zero states: ``x [T, D]`` -> ``[T, D]``.
    ``projections``: :func:`gdn_project`'s; ``conv1d [C, 1, W]``; ``A_log`` (any float dtype, used in fp32);
    ``norm``: the gated norm's weight ``[V]``."""
    T = x_TD.shape[0]
    Hk, Hv, K, V = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    mixed, z, b, a = gdn_project(c, x_TD, projections)
    w = conv1d.reshape(conv1d.shape[0], -1)
    # The server's GDN core, every sequence from fp32 zero states (CPU: one recurrence per sequence;
    # CUDA: one fla-core varlen launch).
    n, dev = len(cu) - 1, x_TD.device
    # packed: one output tensor. Per-sequence slices would each cost the backward a full-size zero
    # tensor (SliceBackward), O(sequences x tokens): 2x the whole layer's training time at 64 x 1K.
    o, _, _ = gdn_varlen(
        mixed, [(cu[i], cu[i + 1]) for i in range(n)], w,
        torch.zeros((n, w.shape[-1] - 1, w.shape[0]), dtype=x_TD.dtype, device=dev), A_log.float(), a, b,
        dt_bias, torch.zeros((n, Hv, V, K), dtype=torch.float32, device=dev), Hk, K, V,
        mode=gdn_mode(), packed=True,
    )
    core = o.to(x_TD.dtype)
    y = gated_rms_norm(core, z, norm, c.rms_norm_eps, True, "silu")
    return bi_linear(y.reshape(T, Hv * V), out_proj)


def mlp_block(x, gate_proj, up_proj, down_proj) -> torch.Tensor:
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))``."""
    gate_up = torch.cat([bi_linear(x, gate_proj), bi_linear(x, up_proj)], dim=-1)
    return bi_linear(silu_mul(gate_up), down_proj)


def moe_block(c: HybridConfig, x, gate, w13, w2, shared=None, shared_gate=None) -> torch.Tensor:
    """Sparse MoE: router ``gate [E, D]``, experts ``w13 [E, 2I, D]`` (per expert ``[gate_proj; up_proj]``) and
    ``w2 [E, D, I]``; ``shared``: the shared expert's ``(gate_proj, up_proj, down_proj)`` with its sigmoid gate
    ``shared_gate [1, D]``, or None."""
    weights, ids = softmax_topk(bi_linear(x, gate), c.num_experts_per_tok, c.norm_topk_prob)
    routed = moe_experts(x, w13, w2, weights, ids)
    if shared is None:
        return routed
    out = mlp_block(x, *shared)
    out = pointwise.sigmoid(bi_linear(x, shared_gate)).to(out.dtype) * out
    return out + routed


def decoder_layer(h, residual, input_norm, mixer, post_norm, mlp):
    """One pre-norm decoder layer in vLLM's residual form: ``input_norm``/``post_norm`` are ``(x, residual) ->
    (normed, residual)``, ``mixer`` and ``mlp`` ``x -> y``. Returns ``(mlp output, residual)``; the first layer
    takes ``residual=None``."""
    if residual is None:
        residual, h = h, input_norm(h, None)
    else:
        h, residual = input_norm(h, residual)
    h, residual = post_norm(mixer(h), residual)
    return mlp(h), residual


def packed_positions(cu: list[int], device) -> torch.Tensor:
    """``[T]`` positions of packed sequences, each from 0."""
    return torch.cat([torch.arange(cu[i + 1] - cu[i]) for i in range(len(cu) - 1)]).to(device)


def decoder_stack(h, layers, final_norm, cu: list[int]) -> torch.Tensor:
    """The decoder over packed embeddings ``h [T, D]``: every ``layer(h, residual, positions, cu)``
    in order, then ``final_norm(h, residual)``. Returns the final hidden states ``[T, D]``."""
    positions = packed_positions(cu, h.device)
    residual = None
    for layer in layers:
        h, residual = layer(h, residual, positions, cu)
    h, _ = final_norm(h, residual)
    return h


def completion_logprobs(model, pairs, entropy: bool = False, masks=None) -> tuple[list[torch.Tensor], float]:
    """Pack ``pairs`` of (prompt ids, completion ids) into one forward of ``model`` (called as ``model(ids, cu)``,
    bf16 logits). Returns each completion's per-token logprobs (fp32, on the model's device,
    differentiable) and, with ``entropy``, the entropy summed over those positions (no grad; 0.0 otherwise).
    ``masks``: per pair None or one bool per completion token (False: a tool's token in a multi-turn trajectory),
    the positions the entropy counts."""
    dev = next(model.parameters()).device
    cu = [0]
    for p, c in pairs:
        cu.append(cu[-1] + len(p) + len(c))
    ids = torch.tensor([t for p, c in pairs for t in (*p, *c)], device=dev)
    rows = torch.cat([torch.arange(cu[i] + len(p) - 1, cu[i + 1] - 1) for i, (p, _) in enumerate(pairs)]).to(dev)
    if current().trainer_logits_rows(dev.type) == "completions":  # the rows used only: the same bits, less work
        lp = log_softmax(model(ids, cu, rows=rows), dim=-1, dtype=torch.float32)
    else:
        lp = log_softmax(model(ids, cu), dim=-1, dtype=torch.float32)[rows]
    targets = torch.tensor([t for _, c in pairs for t in c], device=dev)
    tok_lp = lp.gather(1, targets.unsqueeze(1)).squeeze(1)
    ent = 0.0
    if entropy:
        with torch.no_grad():
            sel = lp
            if masks is not None and any(m is not None for m in masks):
                keep = [b for (_, c), m in zip(pairs, masks) for b in (m if m is not None else [True] * len(c))]
                sel = sel[torch.tensor(keep, device=dev)]
            ent = float(-(sel.exp() * sel).sum())
    return list(tok_lp.split([len(c) for _, c in pairs])), ent


def next_token_logprobs(logits_TV, input_ids, cu: list[int], temperature: float = 1.0) -> torch.Tensor:
    """``[T]`` fp32: logprob of ``input_ids[t+1]`` given the prefix, per packed sequence (the last of each is NaN),
    through :func:`log_softmax`, the server's logprob op. ``temperature != 1``: of the fp32 logits divided by it
    first, as vLLM's sampler divides them (its ``processed_logprobs`` mode); below 1e-5 (greedy) it counts as 1, as
    vLLM's does."""
    if temperature < 1e-5 or temperature == 1.0:
        lp = log_softmax(logits_TV, dim=-1, dtype=torch.float32)
    else:  # a [T, 1] tensor on the logits' device, as vLLM's (a CPU scalar divisor takes CUDA's reciprocal path)
        temp = torch.full((logits_TV.shape[0], 1), temperature, dtype=torch.float32, device=logits_TV.device)
        lp = log_softmax(logits_TV.to(torch.float32).div(temp), dim=-1, dtype=torch.float32)
    out = torch.full((input_ids.shape[0],), float("nan"), device=input_ids.device)
    for i in range(len(cu) - 1):
        s, e = cu[i], cu[i + 1]
        if e - s > 1:
            out[s : e - 1] = lp[s : e - 1].gather(1, input_ids[s + 1 : e].unsqueeze(1)).squeeze(1)
    return out


class GemmaNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight, self.eps = _p(n), eps

    def forward(self, x, residual=None):
        return gemma_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, c: HybridConfig):
        super().__init__()
        self.c = c
        H, Hkv, Dh = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = _p(H * Dh * (2 if c.attn_output_gate else 1), c.hidden_size)
        self.k_proj, self.v_proj = _p(Hkv * Dh, c.hidden_size), _p(Hkv * Dh, c.hidden_size)
        self.o_proj = _p(c.hidden_size, H * Dh)
        self.q_norm, self.k_norm = GemmaNorm(Dh, c.rms_norm_eps), GemmaNorm(Dh, c.rms_norm_eps)

    def forward(self, x_TD, positions_T, cu):
        return attention_block(self.c, x_TD, positions_T, cu, self.q_proj, self.k_proj, self.v_proj, self.o_proj,
                               self.q_norm.weight, self.k_norm.weight)


class GatedDeltaNet(nn.Module):
    def __init__(self, c: HybridConfig):
        super().__init__()
        self.c = c
        Hk, Hv, K, V, D = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                           c.linear_value_head_dim, c.hidden_size)
        self.key_dim, self.value_dim = Hk * K, Hv * V
        if c.interleaved_gdn:
            self.in_proj_qkvz = _p(2 * self.key_dim + 2 * self.value_dim, D)
            self.in_proj_ba = _p(2 * Hv, D)
        else:
            self.in_proj_qkv = _p(2 * self.key_dim + self.value_dim, D)
            self.in_proj_z = _p(self.value_dim, D)
            self.in_proj_b, self.in_proj_a = _p(Hv, D), _p(Hv, D)
        self.conv1d = _p(2 * self.key_dim + self.value_dim, 1, c.linear_conv_kernel_dim)
        self.A_log = nn.Parameter(torch.zeros(Hv, dtype=torch.float32))
        self.dt_bias = _p(Hv)
        self.norm = _p(V)
        self.out_proj = _p(D, self.value_dim)

    def forward(self, x_TD, positions_T, cu):
        if self.c.interleaved_gdn:
            projections = (self.in_proj_qkvz, self.in_proj_ba)
        else:
            projections = (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
        return gdn_block(self.c, x_TD, cu, projections, self.conv1d, self.A_log, self.dt_bias, self.norm,
                         self.out_proj)


class MLP(nn.Module):
    def __init__(self, D: int, inter: int):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = _p(inter, D), _p(inter, D), _p(D, inter)

    def forward(self, x):
        return mlp_block(x, self.gate_proj, self.up_proj, self.down_proj)


class SparseMoE(nn.Module):
    def __init__(self, c: HybridConfig, moe_inter: int, shared_inter: int):
        super().__init__()
        self.c = c
        D, E = c.hidden_size, c.num_experts
        self.gate = _p(E, D)
        self.w13 = _p(E, 2 * moe_inter, D)  # per expert: [gate_proj; up_proj]
        self.w2 = _p(E, D, moe_inter)
        self.shared_expert = MLP(D, shared_inter) if shared_inter else None
        self.shared_expert_gate = _p(1, D) if shared_inter else None

    def forward(self, x):
        s = self.shared_expert
        shared = None if s is None else (s.gate_proj, s.up_proj, s.down_proj)
        return moe_block(self.c, x, self.gate, self.w13, self.w2, shared, self.shared_expert_gate)


class DecoderLayer(nn.Module):
    def __init__(self, c: HybridConfig, layer_type: str, moe_inter: int, shared_inter: int, inter: int):
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm = GemmaNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = GemmaNorm(c.hidden_size, c.rms_norm_eps)
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(c)
        elif layer_type == "full_attention":
            self.self_attn = Attention(c)
        else:
            raise ValueError(f"unknown layer type {layer_type!r}")
        self.mlp = SparseMoE(c, moe_inter, shared_inter) if c.moe else MLP(c.hidden_size, inter)

    def forward(self, h, residual, positions, cu):
        if self.layer_type == "linear_attention":
            def mixer(x):
                return self.linear_attn(x, positions, cu)
        else:
            def mixer(x):
                return self.self_attn(x, positions, cu)
        return decoder_layer(h, residual, self.input_layernorm, mixer, self.post_attention_layernorm, self.mlp)


class QwenGDNForCausalLM(nn.Module):
    """The trainer's model. ``from_pretrained(dir)`` reads ``config.json`` and ``*.safetensors``."""

    def __init__(self, c: HybridConfig, raw: dict):
        super().__init__()
        self.config = c
        D = c.hidden_size
        self.embed_tokens = _p(c.vocab_size, D)
        self.layers = nn.ModuleList(
            DecoderLayer(c, t, raw.get("moe_intermediate_size", 0), raw.get("shared_expert_intermediate_size", 0),
                         raw.get("intermediate_size", 0))
            for t in c.layer_types
        )
        self.norm = GemmaNorm(D, c.rms_norm_eps)
        self.lm_head = None if c.tie_word_embeddings else _p(c.vocab_size, D)

    @classmethod
    def from_pretrained(cls, path: str) -> "QwenGDNForCausalLM":
        c = HybridConfig.from_pretrained(path)
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        raw = raw.get("text_config", raw)
        model = cls(c, raw)
        model.load_hf_state_dict(read_tensors(path))
        return model

    def load_hf_state_dict(self, tensors: dict) -> None:
        """Copy HF-named tensors into this model; every parameter must be filled exactly once."""
        own = dict(self.named_parameters())
        filled: set[str] = set()

        def put(name: str, value: torch.Tensor):
            p = own[name]
            if tuple(p.shape) != tuple(value.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)} != model {tuple(p.shape)}")
            with torch.no_grad():
                p.copy_(value.to(p.dtype))
            filled.add(name)

        experts: dict = {}
        for k, t in tensors.items():
            k = k.replace("model.language_model.", "model.")
            if k.startswith("mtp."):
                continue
            parts = k.split(".")
            if ".mlp.experts." in k:  # model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight
                experts.setdefault(int(parts[2]), {}).setdefault(int(parts[5]), {})[parts[6]] = t
                continue
            if k == "lm_head.weight" and self.lm_head is None:
                continue
            n = _own_name(k)
            if n not in own:
                raise KeyError(f"checkpoint tensor {k!r} has no place in the trainer model")
            put(n, t)
        for li, per_e in experts.items():
            E = len(per_e)
            put(f"layers.{li}.mlp.w13", torch.stack([torch.cat([per_e[e]["gate_proj"], per_e[e]["up_proj"]]) for e in range(E)]))
            put(f"layers.{li}.mlp.w2", torch.stack([per_e[e]["down_proj"] for e in range(E)]))
        missing = sorted(set(own) - filled)
        if missing:
            raise KeyError(f"checkpoint lacks tensors for: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """This model's weights under the HF checkpoint names (the inverse of :meth:`load_hf_state_dict`).

        Sharded (FSDP2) parameters are gathered: under torchrun every rank must call this."""
        out: dict[str, torch.Tensor] = {}
        for n, p in self.named_parameters():
            t = whole(p.detach())
            if n.endswith(".mlp.w13") or n.endswith(".mlp.w2"):
                layer = n.split(".")[1]
                for e in range(t.shape[0]):
                    base = f"model.layers.{layer}.mlp.experts.{e}"
                    if n.endswith("w13"):
                        gate, up = t[e].chunk(2, dim=0)
                        out[f"{base}.gate_proj.weight"], out[f"{base}.up_proj.weight"] = gate.clone(), up.clone()
                    else:
                        out[f"{base}.down_proj.weight"] = t[e].clone()
                continue
            out[_hf_name(n)] = t.clone()
        return out

    def save_pretrained(self, path: str, like: str, state_dict: dict | None = None) -> str:
        """Write ``model.safetensors`` (HF names) to ``path``, with config and tokenizer files copied from ``like``.

        ``state_dict``: an :meth:`hf_state_dict` already gathered (default: gather it now)."""
        return write_checkpoint(path, self.hf_state_dict() if state_dict is None else state_dict, like)

    def forward(self, input_ids: torch.Tensor, cu_seqlens: list[int] | torch.Tensor,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids [T]`` packed, ``cu_seqlens [B+1]`` -> bf16 logits ``[T, vocab]``; with ``rows`` (indices into
        ``T``) the logits of those positions only, ``[len(rows), vocab]``, the same bits as those rows of all."""
        cu = [int(x) for x in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens)]
        h = decoder_stack(self.embed_tokens[input_ids], self.layers, self.norm, cu)
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return bi_linear(h if rows is None else h[rows], head)

    def token_logprobs(self, input_ids: torch.Tensor, cu_seqlens) -> torch.Tensor:
        """``[T]`` fp32: logprob of ``input_ids[t+1]`` given the prefix, per sequence (last of each is NaN)."""
        cu = [int(x) for x in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens)]
        return next_token_logprobs(self(input_ids, cu), input_ids, cu)

    def completion_logprobs(self, pairs, entropy: bool = False, masks=None) -> tuple[list[torch.Tensor], float]:
        """:func:`completion_logprobs` of this model."""
        return completion_logprobs(self, pairs, entropy, masks)
