"""A speculative step's rows scored in one pass per request (``VLLM_BI_SPEC_VERIFY=fused``) against the
position-by-position path on CUDA, with the cores each path runs there: fla-core's fused recurrent kernel one
position at a time (``steps``), the in-place kernel's ``spec_slots`` variant over each request's rows (``fused``).

``spec_step`` over a step of two GDN layers at Qwen3.5-9B's GDN dims (16 key / 32 value heads of 128, conv width 4,
k = 3), requests with different row and accepted counts, both conv-cache layouts: outputs, every state slot and
the conv history equal bit for bit (compared as integers). Control: the fused kernel told to store every row's state
into its row-0 slot leaves other state slots.

On the device: ``pytest -m gpu tests/gpu/test_spec_verify_fused_cuda.py`` (seconds).
"""

import types
from unittest import mock

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("fla")

from vllm_bi.gdn import layer as L  # noqa: E402
from vllm_bi.gdn.slots import recurrent_in_slots  # noqa: E402
from vllm_bi.model_executor import gdn as G  # noqa: E402

DEV = "cuda"
H, HV, K, V, W, KSPEC = 16, 32, 128, 128, 4, 3
D = 2 * H * K + HV * V
LENS, ACCEPTED = [4, 2, 1, 3, 4, 4], [3, 1, 2, 4, 1, 4]


def _bits(t):
    return t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def _same(x, y):
    return x.shape == y.shape and torch.equal(_bits(x), _bits(y))


def _inputs():
    g = torch.Generator(device="cpu").manual_seed(0)
    N = len(LENS)
    qsl = [0]
    for n in LENS:
        qsl.append(qsl[-1] + n)
    T, S = qsl[-1], N * (KSPEC + 1) + 3
    table = (torch.randperm(S - 1, generator=g)[: N * (KSPEC + 1)].reshape(N, KSPEC + 1) + 1).to(DEV)
    layer = types.SimpleNamespace(num_k_heads=H, num_v_heads=HV, head_k_dim=K, head_v_dim=V, tp_size=1,
                                  activation="silu", num_spec=KSPEC, prefix="layers.0.linear_attn",
                                  A_log=torch.log(torch.linspace(1, 16, HV)).to(DEV),
                                  dt_bias=torch.linspace(-0.5, 0.5, HV).to(DEV))
    x = (torch.randn(T, D, generator=g) * 0.5).bfloat16().to(DEV)
    a = torch.randn(T, HV, generator=g).bfloat16().to(DEV)
    b = torch.randn(T, HV, generator=g).bfloat16().to(DEV)
    weight = (torch.randn(D, W, generator=g) * 0.3).bfloat16().to(DEV)
    ssm = (torch.randn(S, HV, V, K, generator=g) * 0.3).to(DEV)  # vLLM's [V, K] state order per slot
    return qsl, table, layer, x, a, b, weight, ssm, S


def _md(qsl, table):
    N = len(qsl) - 1
    return types.SimpleNamespace(
        spec_sequence_masks=torch.ones(N, dtype=torch.bool, device=DEV), num_prefills=0, num_decodes=0,
        num_spec_decodes=N, spec_query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEV),
        spec_state_indices_tensor=table.int(), num_accepted_tokens=torch.tensor(ACCEPTED, dtype=torch.int32,
                                                                                device=DEV),
        non_spec_token_indx=None, spec_token_indx=None)


@pytest.mark.parametrize("dim_first", [False, True])
def test_fused_verify_equals_position_by_position_on_cuda(dim_first, monkeypatch):
    qsl, table, layer, x, a, b, weight, ssm0, S = _inputs()
    R = W - 1 + KSPEC
    g = torch.Generator(device="cpu").manual_seed(1)
    conv0 = torch.randn(S, *((D, R) if dim_first else (R, D)), generator=g).bfloat16().to(DEV)

    def step(mode, to_row0=False):
        monkeypatch.setenv("VLLM_BI_SPEC_VERIFY", mode)  # the suite's monkeypatch re-reads the settings
        caches = [(conv0.clone(), ssm0.clone()) for _ in range(2)]
        outs, m = [], _md(qsl, table)

        def spy(*args, spec_slots=None, **kw):
            if to_row0 and spec_slots is not None:  # the control: every row's state into its row-0 slot
                spec_slots = spec_slots[:, :1].expand(-1, spec_slots.shape[1]).contiguous()
            return recurrent_in_slots(*args, spec_slots=spec_slots, **kw)

        with mock.patch.object(L, "recurrent_in_slots", spy):
            for conv, ssm in caches:
                outs.append(torch.zeros(qsl[-1], HV, V, dtype=torch.bfloat16, device=DEV))
                G.spec_step(layer, x, b, a, outs[-1], m, conv, ssm, weight, dim_first, True)
        torch.cuda.synchronize()
        return torch.stack(outs), torch.stack([c for c, _ in caches]), torch.stack([s for _, s in caches])

    o1, c1, s1 = step("steps")
    o2, c2, s2 = step("fused")
    o3, c3, s3 = step("fused", to_row0=True)
    assert o1.abs().sum() > 0 and not _same(s1[0], ssm0) and not _same(c1[0], conv0)
    assert _same(o1, o2) and _same(c1, c2) and _same(s1, s2)
    assert _same(o3, o1) and not _same(s3, s1)  # the control: the states after rows 1.. land elsewhere
