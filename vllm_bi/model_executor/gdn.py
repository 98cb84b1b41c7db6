"""vLLM glue for the batch-invariant GDN layer.

``BIGDNAttentionBackend`` is registered over vLLM's ``GDN_ATTN`` backend and
answers ``supports_batch_invariance() -> True``. That claim is true only
because :func:`bi_gdn_forward` replaces ``QwenGatedDeltaNetAttention``'s
forward: one path for decode, prefill and mixed batches on every device, the
scheduled sequences run together by :func:`vllm_bi.attention.gdn_recurrent.gdn_varlen`
(on CPU one recurrence per sequence, on CUDA one fla-core varlen launch), each
from its fp32 state slot (zeros when the scheduler says it has none), final
state stored back.
"""

from __future__ import annotations

import torch

from vllm_bi.attention.gdn_recurrent import gdn_varlen

__all__ = ["BIGDNAttentionBackend", "bi_gdn_forward", "bi_gdn_core"]

try:
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionBackend as _GDNBase
except ImportError:  # vLLM missing or moved: the plugin's version check reports it
    _GDNBase = object


class BIGDNAttentionBackend(_GDNBase):
    """vLLM's GDN metadata backend, declared batch-invariant (the forward is vllm_bi's)."""

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return True


def _split_qkvz(layer, hidden_states: torch.Tensor):
    mixed_qkvz, _ = layer.in_proj_qkvz(hidden_states)
    ba, _ = layer.in_proj_ba(hidden_states)
    T = hidden_states.shape[0]
    if layer.gqa_interleaved_layout:  # Qwen3-Next
        q, k, v, z, b, a = layer.fix_query_key_value_ordering(mixed_qkvz, ba)
        mixed_qkv = torch.cat((q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)), dim=-1)
    else:  # Qwen3.5: [q, k, v, z] and [b, a]
        qkv_size = (layer.key_dim * 2 + layer.value_dim) // layer.tp_size
        z_size = layer.value_dim // layer.tp_size
        mixed_qkv, z = mixed_qkvz.split([qkv_size, z_size], dim=-1)
        z = z.reshape(T, -1, layer.head_v_dim)
        b, a = layer.split_ba(ba)
    return mixed_qkv, z, b, a


def bi_gdn_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """Replacement for ``QwenGatedDeltaNetAttention.forward_*`` under batch invariance."""
    mixed_qkv, z, b, a = _split_qkvz(self, hidden_states)
    core = torch.zeros(
        (hidden_states.shape[0], self.num_v_heads // self.tp_size, self.head_v_dim),
        dtype=hidden_states.dtype,
        device=hidden_states.device,
    )
    bi_gdn_core(self, mixed_qkv, b, a, core)
    return self._output_projection(core, z)


def _metadata(layer):
    from vllm.forward_context import get_forward_context

    md = get_forward_context().attn_metadata
    if md is None:
        return None
    if isinstance(md, dict):
        md = md.get(layer.prefix)
    return md


def bi_gdn_core(layer, mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, out: torch.Tensor) -> None:
    """Fill ``out [T, HV, V]`` for every scheduled sequence and update its state slots (CPU and CUDA)."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    md = _metadata(layer)
    if md is None or md.num_actual_tokens == 0:
        return  # profiling / dummy run
    if md.num_spec_decodes or md.spec_sequence_masks is not None:
        raise NotImplementedError("vllm_bi: speculative decoding is not batch-invariant yet")
    conv_cache, ssm_cache = layer.kv_cache[0], layer.kv_cache[1]
    if ssm_cache.dtype != torch.float32:
        raise RuntimeError(
            f"vllm_bi: GDN state cache is {ssm_cache.dtype}, batch invariance needs float32 "
            "(--mamba-ssm-cache-dtype float32)"
        )
    # Scheduled sequences: decodes first, then prefills; a decode always continues from its state.
    qsl = md.non_spec_query_start_loc.tolist()
    slots = md.non_spec_state_indices_tensor.tolist()
    n_dec, n_pre = md.num_decodes, md.num_prefills
    has_init = [True] * n_dec
    if n_pre:
        has_init += [bool(x) for x in md.has_initial_state[n_dec : n_dec + n_pre].tolist()]
    seqs = [i for i in range(n_dec + n_pre) if qsl[i + 1] > qsl[i]]
    if not seqs:
        return
    weight = layer.conv1d.weight
    weight = weight.reshape(weight.shape[0], weight.shape[-1])
    W = weight.shape[-1]
    dev = mixed_qkv.device
    slot_t = torch.tensor([slots[i] for i in seqs], dtype=torch.long, device=dev)
    init_t = torch.tensor([has_init[i] for i in seqs], dtype=torch.bool, device=dev)
    dim_first = is_conv_state_dim_first()
    conv_states = conv_cache[slot_t]
    if dim_first:
        conv_states = conv_states.transpose(1, 2)  # -> [N, W-1, D]
    conv_states = torch.where(init_t.view(-1, 1, 1), conv_states, torch.zeros_like(conv_states))
    states = torch.where(init_t.view(-1, 1, 1, 1), ssm_cache[slot_t], torch.zeros_like(ssm_cache[slot_t]))
    ranges = [(qsl[i], qsl[i + 1]) for i in seqs]
    o, new_conv, new_states = gdn_varlen(
        mixed_qkv, ranges, weight, conv_states[:, -(W - 1) :], layer.A_log, a, b, layer.dt_bias, states,
        layer.num_k_heads // layer.tp_size, layer.head_k_dim, layer.head_v_dim, layer.activation,
    )
    for j, (s, e) in enumerate(ranges):
        out[s:e] = o[j].to(out.dtype)
    ssm_cache[slot_t] = new_states
    if dim_first:
        new_conv = new_conv.transpose(1, 2)
    conv_cache[slot_t] = new_conv.to(conv_cache.dtype)
