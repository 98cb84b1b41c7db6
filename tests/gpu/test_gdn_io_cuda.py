"""The recurrent GDN server step without torch copies around its kernels (``VLLM_BI_GDN_IO=direct``) gives the copying
step's bits on CUDA, ``torch.equal``:

* the slot conv (``ops.conv.slot_causal_conv1d``: states read in and written back into their cache slots, q, k and v
  written apart) == the gathered states through the plain conv kernel, split and stored back
  (``tests/conv_slot_case.py``, both conv-cache layouts; control: without the new-request flags the outputs differ);
* the whole step (``gdn.bi_gdn_core``) at Qwen3.5-9B's GDN dims, from one cache state through both paths: a step of 40
  decodes and prefills (two of them new requests, one resumed) from shuffled slots, then a step of 64 decodes planned
  on the device with padding rows past them; outputs, conv caches and every state slot. Control: the direct step
  without the new-request flags gives other outputs.

Run on a GPU machine: ``pytest tests/gpu/test_gdn_io_cuda.py`` (seconds)."""

import os
import sys
import types
from unittest import mock

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("vllm")

DEV = "cuda"
H, HV, K, V, W = 16, 32, 128, 128, 4  # Qwen3.5-9B's GDN layer


def test_slot_conv_gives_the_copying_paths_bits():
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from conv_slot_case import check_slot_conv

    check_slot_conv(DEV)


def _layer(gen, S):
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    D = 2 * H * K + HV * V
    dim_first = is_conv_state_dim_first()
    conv = torch.randn(S, *((D, W - 1) if dim_first else (W - 1, D)), generator=gen).bfloat16().to(DEV)
    ssm = (torch.randn(S, HV, K, V, generator=gen) * 0.1).to(DEV)  # the slots in fla-core's [HV, K, V] order
    return types.SimpleNamespace(
        conv1d=types.SimpleNamespace(weight=(torch.randn(D, 1, W, generator=gen) * 0.3).bfloat16().to(DEV)),
        num_k_heads=H, tp_size=1, head_k_dim=K, head_v_dim=V, A_log=torch.log(torch.linspace(1, 16, HV)).to(DEV),
        dt_bias=torch.linspace(-0.5, 0.5, HV).to(DEV), activation="silu", prefix="test", kv_cache=(conv, ssm)), D


def _step(layer, md, rows, D, seed, no_fresh=False):
    from vllm_bi.model_executor import gdn as G

    pad = 3
    gen = torch.Generator().manual_seed(seed)
    proj = torch.randn(rows + pad, D + 2 * HV, generator=gen).bfloat16().to(DEV)
    a, b = (torch.randn(rows + pad, HV, generator=gen).bfloat16().to(DEV) for _ in range(2))
    out = torch.zeros(rows + pad, HV, V, dtype=torch.bfloat16, device=DEV)
    with mock.patch.object(G, "_metadata", return_value=md), mock.patch.object(G, "gdn_mode", return_value="recurrent"), \
            mock.patch.object(G.StepPlan, "fresh_flags", lambda self: None) if no_fresh else mock.MagicMock():
        G.bi_gdn_core(layer, proj[:, :D], b, a, out)  # mixed_qkv: a column slice of the projection
    return out


def test_direct_step_gives_the_copying_steps_bits(monkeypatch):
    from vllm_bi import settings

    gen = torch.Generator().manual_seed(5)
    reqs = [(100 + i, 1) for i in range(40)] + [(0, 5), (70, 300), (0, 2)]  # (computed tokens, new tokens)
    N, S = len(reqs), 80
    layer0, D = _layer(gen, S)
    slots = torch.randperm(S - 1, generator=gen)[:N] + 1
    qsl = [0, *torch.tensor([t for _, t in reqs]).cumsum(0).tolist()]
    mixed = types.SimpleNamespace(
        num_actual_tokens=qsl[-1], num_spec_decodes=0, spec_sequence_masks=None,
        non_spec_query_start_loc=torch.tensor(qsl, device=DEV), non_spec_state_indices_tensor=slots.to(DEV),
        num_decodes=40, num_prefills=N - 40, num_decode_tokens=40,
        has_initial_state=torch.tensor([c > 0 for c, _ in reqs], device=DEV))
    decodes = types.SimpleNamespace(
        num_actual_tokens=64, num_spec_decodes=0, spec_sequence_masks=None,
        non_spec_query_start_loc=torch.arange(65, device=DEV),
        non_spec_state_indices_tensor=(torch.randperm(S - 1, generator=gen)[:64] + 1).to(DEV),
        num_decodes=64, num_prefills=0, num_decode_tokens=64, has_initial_state=torch.ones(64, dtype=torch.bool, device=DEV))
    runs = {}
    for io in ("copies", "direct"):
        monkeypatch.setenv("VLLM_BI_GDN_IO", io)
        settings.reload()
        layer = types.SimpleNamespace(**vars(layer0))
        layer.kv_cache = tuple(c.clone() for c in layer0.kv_cache)
        from vllm_bi.model_executor import gdn as G

        with mock.patch.object(G, "_recurrent_direct", wraps=G._recurrent_direct) as direct:
            outs = [_step(layer, mixed, qsl[-1], D, 1), _step(layer, decodes, 64, D, 2)]
        assert (direct.call_count > 0) == (io == "direct"), (io, direct.call_count)  # the path under test ran
        runs[io] = outs + list(layer.kv_cache)
    assert runs["copies"][0].abs().sum() > 0 and runs["copies"][1].abs().sum() > 0
    for name, x, y in zip(("mixed step", "decode step", "conv cache", "state slots"), runs["copies"], runs["direct"]):
        assert torch.equal(x, y), (name, float((x.float() - y.float()).abs().max()))
    layer = types.SimpleNamespace(**vars(layer0))
    layer.kv_cache = tuple(c.clone() for c in layer0.kv_cache)
    assert not torch.equal(_step(layer, mixed, qsl[-1], D, 1, no_fresh=True), runs["copies"][0])
