"""Trainer-side GDN hybrid (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) built from :mod:`vllm_bi.ops` only.

This is the model the trainer runs. Every op is the same function the vLLM
engine calls under ``VLLM_BATCH_INVARIANT=1`` (see
``vllm_bi/patch/``), composed in the same order with the
same roundings as vLLM 0.32's model code, so a token's logprob here equals the
one the server returned, bit for bit.

Input is a varlen-packed batch: ``input_ids [T]`` and ``cu_seqlens [B+1]``
(every sequence starts at position 0), and, for ``VLLM_BI_GDN_MODE=hybrid``, each sequence's prompt length (its
GDN arithmetic switches at the prompt's last block boundary, as the server's does). Output: bf16 logits
``[T, vocab]``; :meth:`QwenGDNForCausalLM.token_logprobs` gives the logprob of each next token.

Legend: ``T`` packed tokens, ``D`` hidden size, ``H``/``Hkv`` attention heads,
``Hk``/``Hv`` GDN key/value heads, ``K``/``V`` GDN head dims.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from torch import nn

from vllm_bi.gdn.chunk import gdn_mode, hybrid_chunk_rows
from vllm_bi.gdn.layer import gdn_varlen
from vllm_bi.model_dir import ARCHITECTURES
from vllm_bi.ops import pointwise
from vllm_bi.ops.activation import silu_mul
from vllm_bi.ops.attention import causal_attention_rows
from vllm_bi.ops.attention_triton import attention_backend, packed_attention
from vllm_bi.ops.linear import bi_linear
from vllm_bi.ops.moe import moe_experts, softmax_topk
from vllm_bi.ops.norm import gated_rms_norm, rms_norm_maybe_residual
from vllm_bi.ops.rotary import apply_rotary, rope_cos_sin_cache
from vllm_bi.ops.softmax import log_softmax

__all__ = ["HybridConfig", "QwenGDNForCausalLM"]

_ARCHS = ARCHITECTURES  # config.json architecture -> (family, GDN projections packed per key-head group)


def packed_causal_attention(q, k, v, cu: list[int], scale: float) -> torch.Tensor:
    """Causal attention of packed sequences (sequence ``i`` owns rows ``cu[i]:cu[i+1]``, from position 0),
    all rows at once, with the op the server runs on this device (``VLLM_BI_ATTENTION``): the Triton kernel's
    :func:`packed_attention` or the torch op's :func:`causal_attention_rows`."""
    if attention_backend(q.device) == "triton":
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
            c = json.load(f)
        c = c.get("text_config", c) | {"architectures": c.get("architectures")}
        arch = (c.get("architectures") or [None])[0]
        if arch not in _ARCHS:
            raise ValueError(f"{path}: architecture {arch!r} is not supported; supported: {', '.join(_ARCHS)}")
        rope = c.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default" or rope.get("mrope_section"):
            raise NotImplementedError(f"{path}: rope {rope} is not supported by the trainer model yet")
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        factor = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
        n_exp = int(c.get("num_experts", 0) or 0)
        moe = arch != "Qwen3_5ForCausalLM" and n_exp > 0
        if arch == "Qwen3NextForCausalLM" and (c.get("mlp_only_layers") or c.get("decoder_sparse_step", 1) != 1):
            raise NotImplementedError("Qwen3-Next with dense layers (mlp_only_layers/decoder_sparse_step) not supported yet")
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


class GemmaNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight, self.eps = _p(n), eps

    def forward(self, x, residual=None):
        return rms_norm_maybe_residual(x, residual, self.weight.float() + 1.0, self.eps)


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
        c = self.c
        T, H, Hkv, Dh = x_TD.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim
        q = bi_linear(x_TD, self.q_proj)
        gate = None
        if c.attn_output_gate:  # per head: [q (Dh) | gate (Dh)]
            q, gate = q.view(T, H, 2 * Dh).chunk(2, dim=-1)
            gate = gate.reshape(T, H * Dh)
        q = self.q_norm(q.reshape(T, H, Dh)).reshape(T, H * Dh)
        k = self.k_norm(bi_linear(x_TD, self.k_proj).view(T, Hkv, Dh)).reshape(T, Hkv * Dh)
        v = bi_linear(x_TD, self.v_proj)
        cache = rope_cos_sin_cache(c.rotary_dim, c.max_position_embeddings, c.rope_theta, positions_T.device)
        q, k = apply_rotary(positions_T, q, k, cache, Dh, c.rotary_dim, True)
        out = packed_causal_attention(q.view(T, H, Dh), k.view(T, Hkv, Dh), v.view(T, Hkv, Dh), cu, Dh**-0.5)
        out = out.reshape(T, H * Dh)
        if gate is not None:
            out = out * pointwise.sigmoid(gate).to(out.dtype)
        return bi_linear(out, self.o_proj)


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

    def _project(self, x):
        c, T = self.c, x.shape[0]
        Hk, Hv, K, V = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        if c.interleaved_gdn:
            r = Hv // Hk
            qkvz = bi_linear(x, self.in_proj_qkvz).view(T, Hk, 2 * K + 2 * r * V)
            q, k, v, z = torch.split(qkvz, [K, K, r * V, r * V], dim=-1)
            ba = bi_linear(x, self.in_proj_ba).view(T, Hk, 2 * r)
            b, a = torch.split(ba, [r, r], dim=-1)
            mixed = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
            return mixed, z.reshape(T, Hv, V), b.reshape(T, Hv), a.reshape(T, Hv)
        mixed = bi_linear(x, self.in_proj_qkv)
        z = bi_linear(x, self.in_proj_z).view(T, Hv, V)
        return mixed, z, bi_linear(x, self.in_proj_b), bi_linear(x, self.in_proj_a)

    def forward(self, x_TD, positions_T, cu, prompt_lens=None):
        c, T = self.c, x_TD.shape[0]
        Hk, Hv, K, V = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        mixed, z, b, a = self._project(x_TD)
        w = self.conv1d.reshape(self.conv1d.shape[0], -1)
        # The server's GDN core, every sequence from fp32 zero states (CPU: one recurrence per sequence;
        # CUDA: one fla-core varlen launch).
        n, dev = len(cu) - 1, x_TD.device
        mode, chunk_rows = gdn_mode(), None
        if mode == "hybrid":  # chunk arithmetic up to each prompt's last block boundary, then the recurrence
            lens = [cu[i + 1] - cu[i] for i in range(n)]
            chunk_rows = [hybrid_chunk_rows(lens[i] if prompt_lens is None else prompt_lens[i], 0, lens[i])
                          for i in range(n)]
        # packed: one output tensor. Per-sequence slices would each cost the backward a full-size zero
        # tensor (SliceBackward), O(sequences x tokens): 2x the whole layer's training time at 64 x 1K.
        o, _, _ = gdn_varlen(
            mixed, [(cu[i], cu[i + 1]) for i in range(n)], w,
            torch.zeros((n, w.shape[-1] - 1, w.shape[0]), dtype=x_TD.dtype, device=dev), self.A_log, a, b,
            self.dt_bias, torch.zeros((n, Hv, V, K), dtype=torch.float32, device=dev), Hk, K, V,
            mode=mode, packed=True, chunk_rows=chunk_rows,
        )
        core = o.to(x_TD.dtype)
        y = gated_rms_norm(core, z, self.norm, c.rms_norm_eps, True, "silu")
        return bi_linear(y.reshape(T, self.value_dim), self.out_proj)


class MLP(nn.Module):
    def __init__(self, D: int, inter: int):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = _p(inter, D), _p(inter, D), _p(D, inter)

    def forward(self, x):
        gate_up = torch.cat([bi_linear(x, self.gate_proj), bi_linear(x, self.up_proj)], dim=-1)
        return bi_linear(silu_mul(gate_up), self.down_proj)


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
        weights, ids = softmax_topk(bi_linear(x, self.gate), self.c.num_experts_per_tok, self.c.norm_topk_prob)
        routed = moe_experts(x, self.w13, self.w2, weights, ids)
        if self.shared_expert is None:
            return routed
        shared = self.shared_expert(x)
        shared = pointwise.sigmoid(bi_linear(x, self.shared_expert_gate)).to(shared.dtype) * shared
        return shared + routed


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

    def forward(self, h, residual, positions, cu, prompt_lens=None):
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        if self.layer_type == "linear_attention":
            h = self.linear_attn(h, positions, cu, prompt_lens)
        else:
            h = self.self_attn(h, positions, cu)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


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
        from safetensors.torch import load_file

        c = HybridConfig.from_pretrained(path)
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        raw = raw.get("text_config", raw)
        model = cls(c, raw)
        tensors = {}
        for name in sorted(os.listdir(path)):
            if name.endswith(".safetensors"):
                tensors.update(load_file(os.path.join(path, name)))
        model.load_hf_state_dict(tensors)
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
            t = p.detach()
            if type(t).__name__ == "DTensor":
                t = t.full_tensor()
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
        import shutil

        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        for name in os.listdir(like):
            if not name.endswith(".safetensors") and not name.endswith(".safetensors.index.json"):
                src = os.path.join(like, name)
                if os.path.isfile(src):
                    shutil.copy(src, os.path.join(path, name))
        state_dict = self.hf_state_dict() if state_dict is None else state_dict
        save_file({k: v.contiguous() for k, v in state_dict.items()},
                  os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return path

    def forward(self, input_ids: torch.Tensor, cu_seqlens: list[int] | torch.Tensor,
                prompt_lens: list[int] | None = None) -> torch.Tensor:
        """``input_ids [T]`` packed, ``cu_seqlens [B+1]`` -> bf16 logits ``[T, vocab]``. ``prompt_lens``: each
        sequence's prompt length (the hybrid GDN mode's switch; default: the whole sequence is prompt)."""
        if prompt_lens is not None and len(prompt_lens) != len(cu_seqlens) - 1:
            raise ValueError(f"{len(prompt_lens)} prompt lengths for {len(cu_seqlens) - 1} sequences")
        cu = [int(x) for x in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens)]
        positions = torch.cat([torch.arange(cu[i + 1] - cu[i]) for i in range(len(cu) - 1)]).to(input_ids.device)
        h = self.embed_tokens[input_ids]
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, positions, cu, prompt_lens)
        h, _ = self.norm(h, residual)
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return bi_linear(h, head)

    def token_logprobs(self, input_ids: torch.Tensor, cu_seqlens) -> torch.Tensor:
        """``[T]`` fp32: logprob of ``input_ids[t+1]`` given the prefix, per sequence (last of each is NaN)."""
        cu = [int(x) for x in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens)]
        lp = log_softmax(self(input_ids, cu), dim=-1, dtype=torch.float32)
        out = torch.full((input_ids.shape[0],), float("nan"), device=input_ids.device)
        for i in range(len(cu) - 1):
            s, e = cu[i], cu[i + 1]
            if e - s > 1:
                out[s : e - 1] = lp[s : e - 1].gather(1, input_ids[s + 1 : e].unsqueeze(1)).squeeze(1)
        return out

    def completion_logprobs(self, pairs, entropy: bool = False) -> tuple[list[torch.Tensor], float]:
        """Pack ``pairs`` of (prompt ids, completion ids) into one forward. Returns each completion's
        per-token logprobs (fp32, on the model's device, differentiable) and, with ``entropy``, the
        entropy summed over those positions (no grad; 0.0 otherwise)."""
        dev = next(self.parameters()).device
        cu = [0]
        for p, c in pairs:
            cu.append(cu[-1] + len(p) + len(c))
        ids = torch.tensor([t for p, c in pairs for t in (*p, *c)], device=dev)
        lp = log_softmax(self(ids, cu, [len(p) for p, _ in pairs]), dim=-1, dtype=torch.float32)
        rows = torch.cat([torch.arange(cu[i] + len(p) - 1, cu[i + 1] - 1) for i, (p, _) in enumerate(pairs)]).to(dev)
        targets = torch.tensor([t for _, c in pairs for t in c], device=dev)
        tok_lp = lp[rows].gather(1, targets.unsqueeze(1)).squeeze(1)
        ent = 0.0
        if entropy:
            with torch.no_grad():
                sel = lp[rows]
                ent = float(-(sel.exp() * sel).sum())
        return list(tok_lp.split([len(c) for _, c in pairs])), ent
