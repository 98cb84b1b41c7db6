"""``VLLM_BI_DEBUG_NONFINITE=1`` (``model_executor.gdn``): a GDN layer's NaN or inf is logged once, with the layer, the
rows, the requests (index, rows, first position, new) and the state slots that hold one; finite values log nothing."""

import logging
import types

import torch

from vllm_bi.model_executor import gdn as G


def _plan():
    return types.SimpleNamespace(ranges=[(0, 3), (3, 5)], starts=[0, 64], fresh_host=[0],
                                 slot_t=torch.tensor([2, 5]))


def test_the_first_nonfinite_gdn_layer_is_named(caplog, monkeypatch):
    monkeypatch.setattr(G, "_REPORTED", set())
    layer = types.SimpleNamespace(prefix="model.layers.0.linear_attn")
    x, a, b = torch.zeros(5, 6), torch.zeros(5, 2), torch.zeros(5, 2)
    cache = torch.zeros(8, 2, 4, 4)
    with caplog.at_level(logging.ERROR, logger="vllm_bi"):
        G._check_finite(layer, "input", _plan(), x, a, b, cache)  # control: all finite
    assert not caplog.records
    x[4, 1] = float("nan")
    cache[5, 1, 0, 0] = float("inf")
    with caplog.at_level(logging.ERROR, logger="vllm_bi"):
        G._check_finite(layer, "input", _plan(), x, a, b, cache)
        G._check_finite(layer, "input", _plan(), x, a, b, cache)  # once per layer and place
    (rec,) = caplog.records
    msg = rec.getMessage()
    assert "GDN layer model.layers.0.linear_attn" in msg and "mixed_qkv: rows [4]" in msg, msg
    assert "(1, (3, 5), 64, False)" in msg, msg  # request 1: rows 3..5, first position 64, not new
    assert "state slots not finite (request, slot) [(1, 5)]" in msg, msg


def test_the_setting_reads_its_variable(monkeypatch):
    monkeypatch.delenv("VLLM_BI_DEBUG_NONFINITE", raising=False)
    assert not G.debug_nonfinite()
    monkeypatch.setenv("VLLM_BI_DEBUG_NONFINITE", "1")
    assert G.debug_nonfinite()
