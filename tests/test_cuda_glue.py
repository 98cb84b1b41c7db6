"""The CUDA GDN glue (cuda.bi_gdn_core_cuda: batched slots, one varlen recurrence) run on CPU tensors
agrees exactly with the CPU glue (gdn.bi_gdn_core, one sequence at a time): outputs, conv and fp32 states."""
import types

import pytest
import torch
from unittest import mock
from vllm_bi.model_executor import gdn as G
from vllm_bi.model_executor.cuda import bi_gdn_core_cuda
H, HV, K, V, W = 1, 2, 128, 128, 4
D = 2*H*K + HV*V
g = torch.Generator().manual_seed(0)
nslots = 6
def mk(dim_first):
    conv = torch.randn(nslots, *( (D, W-1) if dim_first else (W-1, D)), generator=g).bfloat16()
    ssm = torch.randn(nslots, HV, V, K, generator=g)*0.1
    layer = types.SimpleNamespace(kv_cache=(conv, ssm), conv1d=types.SimpleNamespace(weight=torch.randn(D,1,W,generator=g).bfloat16()*0.3),
        num_k_heads=H, tp_size=1, head_k_dim=K, head_v_dim=V, A_log=torch.log(torch.tensor([2.0, 9.0])), dt_bias=torch.tensor([0.1,-0.3]), activation="silu", prefix="x")
    return layer
lens=[1,1,5,3]; qsl=[0]
for n in lens: qsl.append(qsl[-1]+n)
T=qsl[-1]
md = types.SimpleNamespace(num_actual_tokens=T, num_spec_decodes=0, spec_sequence_masks=None, non_spec_query_start_loc=torch.tensor(qsl),
    non_spec_state_indices_tensor=torch.tensor([3,1,5,2]), num_decodes=2, num_prefills=2, has_initial_state=torch.tensor([True,True,False,True]))
x = torch.randn(T, D, generator=g).bfloat16(); a=torch.randn(T,HV,generator=g).bfloat16(); b=torch.randn(T,HV,generator=g).bfloat16()
@pytest.mark.parametrize("dim_first", [False, True])
def test_cuda_glue_matches_cpu_glue(dim_first):
    l1 = mk(dim_first); l2 = types.SimpleNamespace(**vars(l1)); l2.kv_cache=(l1.kv_cache[0].clone(), l1.kv_cache[1].clone())
    o1 = torch.zeros(T,HV,V, dtype=torch.bfloat16); o2=o1.clone()
    with mock.patch("vllm.model_executor.layers.mamba.mamba_utils.is_conv_state_dim_first", return_value=dim_first), mock.patch.object(G, "_metadata", return_value=md):
        G.bi_gdn_core(l1, x, b, a, o1)
        bi_gdn_core_cuda(l2, md, x, b, a, o2)
    assert o1.abs().sum() > 0
    assert torch.equal(o1, o2)
    assert torch.equal(l1.kv_cache[0], l2.kv_cache[0]) and torch.equal(l1.kv_cache[1], l2.kv_cache[1])
