"""A new request among a speculative step's rows (CPU glue, ``model_executor.gdn.spec_step``).

vLLM's scheduler pads a new request with one token to compute into ``1 + k`` rows when decodes run beside it, and the
runner counts it as a speculative row. Its state slot and conv rows still hold an earlier request's values; the glue
zeroes them before the verify (:func:`new_spec_requests`), as a new prefill's are zeroed. The check: a step over
slots holding other values gives the outputs and caches of the same step over zeroed slots, bit for bit. The
control: the same step with the request not reported new (one computed token) gives that request other outputs,
and the other requests the same ones."""

import types

import torch

from vllm_bi.model_executor import gdn as G

H, HV, K, V, W, KSPEC = 1, 2, 16, 16, 4, 3
D = 2 * H * K + HV * V
LENS, ACCEPTED = [4, 4, 4], [2, 1, 3]  # the new request (index 1): accepted 1, vLLM's count for a first step
N, NEW = len(LENS), 1


def _inputs():
    g = torch.Generator().manual_seed(0)
    qsl = [0]
    for n in LENS:
        qsl.append(qsl[-1] + n)
    S = N * (KSPEC + 1) + 2
    table = torch.randperm(S - 1, generator=g)[: N * (KSPEC + 1)].reshape(N, KSPEC + 1) + 1
    layer = types.SimpleNamespace(num_k_heads=H, num_v_heads=HV, head_k_dim=K, head_v_dim=V, tp_size=1,
                                  activation="silu", num_spec=KSPEC, prefix="layers.0.linear_attn",
                                  A_log=torch.randn(HV, generator=g) * 0.1, dt_bias=torch.randn(HV, generator=g) * 0.1)
    x = (torch.randn(qsl[-1], D, generator=g) * 0.5).bfloat16()
    a, b = torch.randn(qsl[-1], HV, generator=g).bfloat16(), torch.randn(qsl[-1], HV, generator=g).bfloat16()
    weight = (torch.randn(D, W, generator=g) * 0.3).bfloat16()
    conv = torch.randn(S, W - 1 + KSPEC, D, generator=g).bfloat16()  # every slot holds an earlier request's values
    ssm = torch.randn(S, HV, V, K, generator=g) * 0.3
    return qsl, table, layer, x, a, b, weight, conv, ssm


def _md(qsl, table, computed):
    return types.SimpleNamespace(
        spec_sequence_masks=torch.ones(N, dtype=torch.bool), num_prefills=0, num_decodes=0, num_spec_decodes=N,
        spec_query_start_loc=torch.tensor(qsl, dtype=torch.int32), spec_state_indices_tensor=table.int(),
        num_accepted_tokens=torch.tensor(ACCEPTED, dtype=torch.int32), non_spec_token_indx=None,
        spec_token_indx=None, vllm_bi_num_computed=torch.tensor(computed, dtype=torch.int32))


def test_new_request_in_a_speculative_row_starts_from_zeros():
    qsl, table, layer, x, a, b, weight, conv0, ssm0 = _inputs()
    rows = slice(qsl[NEW], qsl[NEW + 1])

    def step(computed, conv, ssm):
        out = torch.zeros(qsl[-1], HV, V, dtype=torch.bfloat16)
        G.spec_step(layer, x, b, a, out, _md(qsl, table, computed), conv, ssm, weight, False, False)
        return out

    # the reference: the new request's start slot and conv window zeroed by hand, nothing reported new
    conv_ref, ssm_ref = conv0.clone(), ssm0.clone()
    ssm_ref[table[NEW, 0]] = 0
    conv_ref[table[NEW, 0], : W - 1] = 0
    ref = step([30, 5, 12], conv_ref, ssm_ref)

    conv, ssm = conv0.clone(), ssm0.clone()
    got = step([30, 0, 12], conv, ssm)  # request 1 has no computed token: new
    assert ref[rows].abs().sum() > 0
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16))
    assert torch.equal(conv.view(torch.int16), conv_ref.view(torch.int16))
    assert torch.equal(ssm.view(torch.int32), ssm_ref.view(torch.int32))

    # control: the same step with request 1 not reported new starts from the earlier request's state
    ctl = step([30, 5, 12], conv0.clone(), ssm0.clone())
    assert not torch.equal(ctl[rows], ref[rows])
    others = torch.ones(qsl[-1], dtype=torch.bool)
    others[rows] = False
    assert torch.equal(ctl[others].view(torch.int16), ref[others].view(torch.int16))


def test_new_spec_requests_reads_the_speculative_requests_of_a_mixed_step():
    """In a step with other requests, the speculative ones are ``spec_sequence_masks``'s: a new prefill (computed 0)
    beside them is not one of them."""
    md = types.SimpleNamespace(num_prefills=1, num_decodes=0,
                               spec_sequence_masks=torch.tensor([True, False, True, True]),
                               vllm_bi_num_computed=torch.tensor([7, 0, 0, 9], dtype=torch.int32))
    assert G.new_spec_requests(md, 3) == [1]
    md.vllm_bi_num_computed = torch.tensor([7, 0, 4, 9], dtype=torch.int32)
    assert G.new_spec_requests(md, 3) == []
    alone = types.SimpleNamespace(num_prefills=0, num_decodes=0, spec_sequence_masks=torch.ones(2, dtype=torch.bool),
                                  vllm_bi_num_computed=torch.tensor([0, 3, 0], dtype=torch.int32))  # a padding row
    assert G.new_spec_requests(alone, 2) == [0]


def test_cuda_zeroes_new_rows_with_its_feature(monkeypatch):
    """CPU always; CUDA where ``speculative-one-token`` is on: by default (a gated CUDA feature, in
    ``settings.CUDA_FEATURES``), and where it is not only with ``VLLM_BI_CUDA_PREVIEW`` naming it (the negative
    control: taken out of ``CUDA_FEATURES``, CUDA does not zero; another feature's preview does not either)."""
    from vllm_bi import settings

    assert "speculative-one-token" in settings.CUDA_FEATURES
    monkeypatch.delenv("VLLM_BI_CUDA_PREVIEW", raising=False)  # the suite's monkeypatch re-reads settings
    assert G._zero_new_spec_rows(torch.device("cpu"))
    assert G._zero_new_spec_rows(torch.device("cuda"))
    monkeypatch.cuda_feature_off("speculative-one-token")
    assert G._zero_new_spec_rows(torch.device("cpu"))
    assert not G._zero_new_spec_rows(torch.device("cuda"))
    monkeypatch.setenv("VLLM_BI_CUDA_PREVIEW", "speculative")
    assert not G._zero_new_spec_rows(torch.device("cuda"))
    monkeypatch.setenv("VLLM_BI_CUDA_PREVIEW", "speculative-one-token")
    assert G._zero_new_spec_rows(torch.device("cuda"))


def test_model_runner_v2_counts_a_padded_new_request_a_speculative_row_under_the_feature():
    """Model Runner V2 (CUDA) runs a new one-token request that the scheduler padded with ``k`` placeholder drafts as
    a ``1 + k``-token prefill; under the ``speculative-one-token`` feature ``wrap_mamba_prepare_attn`` makes that row a
    decode (``prefill_runs_as_decode_np``), as V1 counts it, so the glue's zeroing and verify take it. Only that row:
    not a decode with drafts, not a new prompt of several tokens, not a prompt tail V2 already runs as a decode; a
    batch without such a row goes through unchanged (control). The fields read are V2's ``InputBatch``'s."""
    import dataclasses

    import numpy as np
    from vllm.v1.worker.gpu.input_batch import InputBatch

    @dataclasses.dataclass
    class Batch:
        num_reqs: int
        num_draft_tokens_per_req: np.ndarray | None
        has_prefill: bool
        is_prefilling_np: np.ndarray
        num_computed_prefill_tokens_np: np.ndarray
        num_scheduled_tokens: np.ndarray
        prefill_runs_as_decode_np: np.ndarray | None = None

    assert {f.name for f in dataclasses.fields(Batch)} <= {f.name for f in dataclasses.fields(InputBatch)}
    # a decode with drafts, the padded new request, a new 4-token prompt, a prompt tail padded with drafts
    batch = Batch(4, np.array([3, 3, 0, 3]), True, np.array([False, True, True, True]), np.array([9, 0, 0, 5]),
                  np.array([4, 4, 4, 4]), np.array([False, False, False, True]))
    assert G.padded_new_requests(batch).tolist() == [False, True, False, False]
    seen = []
    prepare = G.wrap_mamba_prepare_attn(lambda self, b, *a, **k: seen.append((b, a, k)) or "meta")
    assert prepare(None, batch, "mode", x=1) == "meta"
    assert seen[-1][0].prefill_runs_as_decode_np.tolist() == [False, True, False, True]
    assert seen[-1][1:] == (("mode",), {"x": 1}) and batch.prefill_runs_as_decode_np.tolist() == [False, False, False, True]
    plain = dataclasses.replace(batch, is_prefilling_np=np.array([False, False, True, True]),
                                num_computed_prefill_tokens_np=np.array([9, 9, 0, 5]))
    assert G.padded_new_requests(plain) is None
    prepare(None, plain)
    assert seen[-1][0] is plain
    no_drafts = dataclasses.replace(batch, num_draft_tokens_per_req=None)
    assert G.padded_new_requests(no_drafts) is None
