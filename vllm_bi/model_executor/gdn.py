"""vLLM glue for the batch-invariant GDN layer.

``BIGDNAttentionBackend`` is registered over vLLM's ``GDN_ATTN`` backend and
answers ``supports_batch_invariance() -> True``. That claim is true only
because :func:`bi_gdn_forward` replaces ``QwenGatedDeltaNetAttention``'s
forward: one path for decode, prefill and mixed batches, each sequence run by
:func:`vllm_bi.attention.gdn_recurrent.gdn_recurrent` from its fp32 state slot
(zeros when the scheduler says it has none), final state stored back.
"""

from __future__ import annotations

import torch

from vllm_bi.attention.gdn_recurrent import gdn_sequence

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


def scheduled_sequences(layer, md) -> tuple[list[int], list[int], list[bool], torch.Tensor]:
    """From the GDN metadata: query start locations, state slots and whether each scheduled sequence
    (decodes first, then prefills) continues from a stored state; and the conv weight as ``[D, W]``."""
    qsl = md.non_spec_query_start_loc.tolist()
    slots = md.non_spec_state_indices_tensor.tolist()
    n_dec, n_pre = md.num_decodes, md.num_prefills
    has_init = [True] * n_dec
    if n_pre:
        has_init += [bool(x) for x in md.has_initial_state[n_dec : n_dec + n_pre].tolist()]
    weight = layer.conv1d.weight
    return qsl, slots, has_init, weight.reshape(weight.shape[0], weight.shape[-1])


def bi_gdn_core(layer, mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, out: torch.Tensor) -> None:
    """Fill ``out [T, HV, V]`` for every scheduled sequence and update its state slots."""
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
    if mixed_qkv.is_cuda:
        from vllm_bi.model_executor.cuda import bi_gdn_core_cuda

        bi_gdn_core_cuda(layer, md, mixed_qkv, b, a, out)
        return
    dim_first = is_conv_state_dim_first()
    qsl, slots, has_init, weight = scheduled_sequences(layer, md)
    H = layer.num_k_heads // layer.tp_size
    for i in range(len(has_init)):
        s, e, slot = qsl[i], qsl[i + 1], slots[i]
        if e == s:
            continue
        if has_init[i]:
            cstate = conv_cache[slot].transpose(0, 1) if dim_first else conv_cache[slot]
            state = ssm_cache[slot]
        else:
            cstate = torch.zeros((weight.shape[-1] - 1, weight.shape[0]), dtype=mixed_qkv.dtype)
            state = torch.zeros_like(ssm_cache[slot])
        o, new_cstate, new_state = gdn_sequence(
            mixed_qkv[s:e], weight, cstate, layer.A_log, a[s:e], b[s:e], layer.dt_bias, state,
            H, layer.head_k_dim, layer.head_v_dim, layer.activation,
        )
        out[s:e] = o.to(out.dtype)
        ssm_cache[slot] = new_state
        if dim_first:
            conv_cache[slot] = new_cstate.transpose(0, 1).to(conv_cache.dtype)
        else:
            conv_cache[slot] = new_cstate.to(conv_cache.dtype)
