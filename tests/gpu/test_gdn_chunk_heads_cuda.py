"""The chunk mode's server core on CUDA (``gdn_chunk_decode.chunk_in_slots``: boundary states in their slots, the
partial-block and block-state kernels, fla-core's chunked launches) over several GDN head shapes: 4 and 16 key heads,
value / key head ratios 1, 2 and 4, head dims 128.

Each case serves six sequences (prompts of 5, 63, 64, 65, 130 and 300 tokens) as the server does: prefills split by
a 48-token budget at unaligned offsets, then one-token decodes across two block boundaries, every step resuming at
each sequence's last block boundary with the state in its slot. Every output row must be finite and equal, bit for
bit, to the trainer's call on the whole sequence (``gdn_chunk_varlen``), and every slot must end holding the whole
run's state at its last boundary. A new sequence's slot starts filled with NaN (vLLM may hand out a slot holding
anything): a new sequence must never read it.

Run on a GPU machine: ``pytest -m gpu tests/gpu`` (skipped without CUDA or fla-core).
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("fla")

from vllm_bi.gdn.chunk import CHUNK, gdn_chunk_varlen  # noqa: E402
from vllm_bi.gdn.recurrent import gdn_gating  # noqa: E402

DEV = "cuda"
K = V = 128
PROMPTS = (5, 63, 64, 65, 130, 300)
DECODES = 140  # every sequence crosses at least two block boundaries while decoding
BUDGET = 48  # prefill tokens per sequence per step


def _sequences(H: int, HV: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    A_log = torch.log(torch.linspace(1, 16, HV)).to(DEV)
    dt_bias = torch.linspace(-0.5, 0.5, HV).to(DEV)
    seqs = []
    for P in PROMPTS:
        T = P + DECODES
        q, k = (torch.randn(T, H, K, generator=gen).bfloat16().to(DEV) for _ in range(2))
        v = torch.randn(T, HV, V, generator=gen).bfloat16().to(DEV)
        a, b = (torch.randn(T, HV, generator=gen).to(DEV) for _ in range(2))
        g, beta = gdn_gating(A_log, a, b, dt_bias)
        seqs.append((q, k, v, g, beta))
    return seqs


def _steps(P: int) -> list[tuple[int, int]]:
    cuts = list(range(0, P, BUDGET)) + [P]
    return list(zip(cuts[:-1], cuts[1:])) + [(t, t + 1) for t in range(P, P + DECODES)]


@pytest.mark.parametrize("H,ratio", [(4, 1), (4, 2), (4, 4), (16, 1), (16, 2), (16, 4)],
                         ids=lambda x: str(x))
def test_chunk_in_slots_equals_the_trainer_over_head_shapes(H, ratio):
    from vllm_bi.gdn.chunk_decode import chunk_in_slots

    HV = H * ratio
    seqs = _sequences(H, HV, seed=H * 10 + ratio)
    N = len(seqs)
    refs = []
    for s in seqs:
        o, bound = gdn_chunk_varlen(*s, torch.zeros(1, HV, V, K, device=DEV), [0, s[0].shape[0]])
        refs.append((o, bound[0]))
    S = N + 3
    pool = torch.randn(S, HV, K, V, device=DEV) * 0.1
    slots = torch.randperm(S, generator=torch.Generator().manual_seed(1))[:N]
    pool[slots] = float("nan")  # what a new sequence finds in its slot must not matter
    slots_t = slots.to(DEV)
    plans = [_steps(P) for P in PROMPTS]
    for step in range(max(len(p) for p in plans)):
        live = [j for j in range(N) if step < len(plans[j])]
        cu, fresh, parts = [0], [], []
        for i, j in enumerate(live):
            start, end = plans[j][step]
            b0 = start // CHUNK * CHUNK  # resume at the last block boundary: its cached rows run again
            parts.append([t[b0:end] for t in seqs[j]])
            cu.append(cu[-1] + end - b0)
            if start == 0:
                fresh.append(i)
        x = [torch.cat([p[c] for p in parts]) for c in range(5)]
        o = chunk_in_slots(*x, pool, slots_t[live], cu, fresh=fresh)
        for i, j in enumerate(live):
            start, end = plans[j][step]
            b0 = start // CHUNK * CHUNK
            got = o[cu[i] + start - b0 : cu[i + 1]]
            assert torch.isfinite(got).all(), f"H={H} HV={HV}: sequence {j} rows {start}..{end}: not finite"
            assert torch.equal(got, refs[j][0][start:end]), (
                f"H={H} HV={HV}: sequence {j} (prompt {PROMPTS[j]}) rows {start}..{end} differ from the trainer's")
    for j in range(N):
        assert torch.equal(pool[slots[j]], refs[j][1].transpose(-1, -2)), f"H={H} HV={HV}: slot of sequence {j}"
