"""The bf16 GDN state (``VLLM_BI_GDN_STATE=bf16``) on CUDA.

* The in-slot kernel at Qwen3.5-9B's GDN dims with a bf16 pool, CUDA's default tile and fla-core's: one sequence run
  whole == as a split prefill == as a prefill then one-token steps == through the speculative path (outputs and
  stored states, ``torch.equal``). Control: the fp32 kernel with its state rounded to bf16 only where a call ends
  (what a bf16 cache does to an fp32 recurrence) differs between the whole and the stepped run.
* Served: ``run_parity`` with the setting (8 prompts x 4 samples, prompts split by 64-token batches, decode steps in
  CUDA graphs by default): every sampled token's logprob recomputed by the trainer on CUDA bitwise equal.

Run on a GPU machine: ``pytest tests/gpu/test_gdn_state_bf16_cuda.py`` (about two minutes; the kernel tests need only
torch, Triton and fla-core).
"""

import pytest
import torch

pytestmark = [pytest.mark.gpu]

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")
pytest.importorskip("fla")  # the kernels' exp is fla-core's (the kernel tests need no vLLM; the served one does)

H, HV, K, V = 16, 32, 128, 128  # Qwen3.5-9B's GDN layer
DEV = "cuda"


def _inputs(T, dtype):
    gen = torch.Generator().manual_seed(3)
    q, k = (torch.randn(T, H, K, generator=gen).bfloat16().to(DEV) for _ in range(2))
    v = torch.randn(T, HV, V, generator=gen).bfloat16().to(DEV)
    g, beta = (-torch.rand(T, HV, generator=gen) * 0.3).to(DEV), torch.rand(T, HV, generator=gen).to(DEV)
    pool = (torch.randn(T + 2, HV, K, V, generator=gen) * 0.1).to(DEV, dtype)
    return q, k, v, g, beta, pool


def _run(inputs, pool, lo, hi, tile, **kw):
    from vllm_bi.gdn.slots import recurrent_in_slots

    q, k, v, g, beta, _ = inputs
    return recurrent_in_slots(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], pool, torch.tensor([1], device=DEV),
                              torch.tensor([0, hi - lo], device=DEV), K**-0.5, tile=tile, **kw)


@pytest.mark.parametrize("tile_name", ["fla", "auto"])
def test_bf16_pool_kernel_is_split_exact(tile_name):
    from vllm_bi.gdn.slots import parse_tile
    from vllm_bi.settings import GDN_TILE_AUTO_CUDA

    tile = parse_tile(GDN_TILE_AUTO_CUDA if tile_name == "auto" else tile_name)
    T, cut = 160, 97
    inputs = _inputs(T, torch.bfloat16)
    pool0 = inputs[-1]
    whole_pool = pool0.clone()
    whole = _run(inputs, whole_pool, 0, T, tile)
    split_pool = pool0.clone()
    split = torch.cat([_run(inputs, split_pool, 0, cut, tile), _run(inputs, split_pool, cut, T, tile)])
    step_pool = pool0.clone()
    steps = torch.cat([_run(inputs, step_pool, 0, cut, tile)]
                      + [_run(inputs, step_pool, t, t + 1, tile) for t in range(cut, cut + 8)])
    spec_pool = pool0.clone()
    head = _run(inputs, spec_pool, 0, cut, tile)
    table = torch.tensor([[2 + j for j in range(T - cut)]], device=DEV)  # slots 2.. hold the state after each row
    spec_pool = torch.cat([spec_pool, torch.zeros(T - cut, HV, K, V, device=DEV, dtype=torch.bfloat16)])
    spec = _run(inputs, spec_pool, cut, T, tile, spec_slots=table)
    assert torch.equal(whole, split) and torch.equal(whole_pool[1], split_pool[1])
    assert torch.equal(whole[: cut + 8], steps)
    assert torch.equal(whole, torch.cat([head, spec])) and torch.equal(whole_pool[1], spec_pool[int(table[0, -1])])
    assert whole.abs().sum() > 0 and not torch.isnan(whole.float()).any()


def test_negative_control_fp32_state_rounded_at_call_ends_differs():
    from vllm_bi.gdn.slots import FLA_TILE

    T, cut = 64, 40
    inputs = _inputs(T, torch.float32)
    pool0 = inputs[-1].bfloat16().float()
    whole = _run(inputs, pool0.clone(), 0, T, FLA_TILE)
    pool = pool0.clone()
    parts = [_run(inputs, pool, 0, cut, FLA_TILE)]
    for t in range(cut, T):
        pool.copy_(pool.bfloat16().float())
        parts.append(_run(inputs, pool, t, t + 1, FLA_TILE))
    assert not torch.equal(whole, torch.cat(parts))


@pytest.mark.server
def test_trainer_equals_a_bf16_state_server(tmp_path_factory, monkeypatch):
    pytest.importorskip("vllm")
    from vllm_bi.parity import run_parity
    from vllm_bi.tiny_models import build_tiny_model

    model = build_tiny_model("qwen3.5", str(tmp_path_factory.mktemp("m") / "qwen3.5"))
    monkeypatch.setenv("VLLM_BI_GDN_STATE", "bf16")
    rep = run_parity(model, n=4, max_tokens=24, trainer_device="cuda", show_progress=False, log=print)
    print(rep.table())
    assert rep.tokens >= 8 * 4 * 20 and rep.ok, rep.table()
