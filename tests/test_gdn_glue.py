"""The GDN server glue (gdn.bi_gdn_core: scheduled sequences gathered from their cache slots, one varlen
core, states stored back; the same code on CPU and CUDA) agrees exactly with a one-sequence-at-a-time
reference built from gdn_sequence: outputs, conv and fp32 states, for both conv-cache layouts."""
import types
from unittest import mock

import pytest
import torch

from vllm_bi.attention.gdn_recurrent import gdn_sequence
from vllm_bi.model_executor import gdn as G

H, HV, K, V, W = 1, 2, 128, 128, 4
D = 2 * H * K + HV * V
g = torch.Generator().manual_seed(0)
nslots = 6


def mk(dim_first):
    conv = torch.randn(nslots, *((D, W - 1) if dim_first else (W - 1, D)), generator=g).bfloat16()
    ssm = torch.randn(nslots, HV, V, K, generator=g) * 0.1
    return types.SimpleNamespace(
        kv_cache=(conv, ssm), conv1d=types.SimpleNamespace(weight=torch.randn(D, 1, W, generator=g).bfloat16() * 0.3),
        num_k_heads=H, tp_size=1, head_k_dim=K, head_v_dim=V, A_log=torch.log(torch.tensor([2.0, 9.0])),
        dt_bias=torch.tensor([0.1, -0.3]), activation="silu", prefix="x")


lens = [1, 1, 5, 3]
qsl = [0]
for n in lens:
    qsl.append(qsl[-1] + n)
T = qsl[-1]
slots, has_init = [3, 1, 5, 2], [True, True, False, True]
md = types.SimpleNamespace(
    num_actual_tokens=T, num_spec_decodes=0, spec_sequence_masks=None, non_spec_query_start_loc=torch.tensor(qsl),
    non_spec_state_indices_tensor=torch.tensor(slots), num_decodes=2, num_prefills=2,
    has_initial_state=torch.tensor(has_init))
x = torch.randn(T, D, generator=g).bfloat16()
a = torch.randn(T, HV, generator=g).bfloat16()
b = torch.randn(T, HV, generator=g).bfloat16()


def reference(layer, dim_first, out):
    """One sequence at a time, straight from the cache slots."""
    conv_cache, ssm_cache = layer.kv_cache
    w = layer.conv1d.weight.reshape(D, W)
    for i in range(len(lens)):
        s, e, slot = qsl[i], qsl[i + 1], slots[i]
        if has_init[i]:
            cstate, state = (conv_cache[slot].transpose(0, 1) if dim_first else conv_cache[slot]), ssm_cache[slot]
        else:
            cstate, state = torch.zeros((W - 1, D), dtype=x.dtype), torch.zeros_like(ssm_cache[slot])
        o, new_c, new_s = gdn_sequence(x[s:e], w, cstate, layer.A_log, a[s:e], b[s:e], layer.dt_bias, state, H, K, V)
        out[s:e] = o.to(out.dtype)
        ssm_cache[slot] = new_s
        conv_cache[slot] = (new_c.transpose(0, 1) if dim_first else new_c).to(conv_cache.dtype)


@pytest.mark.parametrize("dim_first", [False, True])
def test_server_glue_matches_per_sequence_reference(dim_first):
    l1 = mk(dim_first)
    l2 = types.SimpleNamespace(**vars(l1))
    l2.kv_cache = (l1.kv_cache[0].clone(), l1.kv_cache[1].clone())
    o1 = torch.zeros(T, HV, V, dtype=torch.bfloat16)
    o2 = o1.clone()
    reference(l1, dim_first, o1)
    with mock.patch("vllm.model_executor.layers.mamba.mamba_utils.is_conv_state_dim_first", return_value=dim_first), \
            mock.patch.object(G, "_metadata", return_value=md):
        G.bi_gdn_core(l2, x, b, a, o2)
    assert o1.abs().sum() > 0
    assert torch.equal(o1, o2)
    assert torch.equal(l1.kv_cache[0], l2.kv_cache[0]) and torch.equal(l1.kv_cache[1], l2.kv_cache[1])
