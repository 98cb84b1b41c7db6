"""``benchmarks/decode_tiles.py`` decides which launch settings of the chunk decode's kernels may be used, by their
bits: its check must report a setting that changes an output or a state as differing, and one that does not as
equal, though its timed calls write into the state pool. Run through Triton's interpreter on CPU with one request at
Qwen3.5-9B dims, fla-core's launches before the kernels replaced by a torch stand-in (CPU installs have no
fla-core) and the GPU timer by one call."""

import pytest

pytest.importorskip("triton")

SCRIPT = """
import sys
sys.path.insert(0, BENCH)
import torch
import chunk_decode
import decode_tiles as DT
from vllm_bi.gdn import chunk_decode as CD

def stand_in(q, k, v, g, beta, cu):  # q, k, gate cumsum per block, w, u (any finite values serve the check)
    w = k.float().repeat_interleave(v.shape[1] // k.shape[1], 1) * 0.1
    gc = torch.cat([g[cu[j]:cu[j + 1]].cumsum(0) for j in range(len(cu) - 1)])
    return q.float(), k.float(), gc, w, v.float(), torch.tensor(cu)

CD.block_intermediates = stand_in
DT.gpu_ms = lambda fn: (fn(), 0.0)[1]
inputs = chunk_decode._inputs
chunk_decode._inputs = lambda b, r, dev: tuple(
    t.float() if isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 else t for t in inputs(b, r, dev))

# a stand-in setting that changes the written states: 8 warps make the block-state kernel's writes off by one ulp
kernel = CD.partial_block_outputs
def perturbed(*a, **kw):
    o = kernel(*a, **kw)
    if CD.STATE_LAUNCH["num_warps"] == 8 and kw.get("whole", a[9] if len(a) > 9 else None) is not None:
        pool = a[5]
        pool.copy_(torch.nextafter(pool, torch.full_like(pool, float("inf"))))
    return o
CD.partial_block_outputs = perturbed

rows = DT.launch_rows("block state", "STATE_LAUNCH", [DT.STATE[0], DT.STATE[1], DT.STATE[3]], 1, 64, "cpu")
print("\\n".join(rows))
assert [r.split("|")[3].strip() for r in rows] == ["equal", "equal", "**differs**"], rows
rows = DT.launch_rows("partial block", "PARTIAL_LAUNCH", DT.PARTIAL[:2], 1, 9, "cpu")
assert [r.split("|")[3].strip() for r in rows] == ["equal", "equal"], rows
assert CD.STATE_LAUNCH["num_warps"] == 4 and CD.PARTIAL_LAUNCH["all_v"] is True  # the settings are put back
print("ok")
"""


def test_decode_tiles_reports_bits_that_differ(interpreted):
    import os

    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
    interpreted(f"BENCH = {bench!r}\n" + SCRIPT)
