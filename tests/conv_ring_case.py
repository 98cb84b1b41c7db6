"""The ring conv's check, shared by its interpreter test (tests/ops/test_gdn_conv_triton.py, CPU) and its GPU test
(tests/gpu/test_gdn_conv_cuda.py): ``ops.conv.ring_causal_conv1d`` reading rows in place in a history ring ==
the same rows gathered (``gdn_recurrent.RingRows.gather``) through the plain conv kernel, split into q, k, v,
``torch.equal``, in both of vLLM's conv-cache layouts (rows or channels first)."""

import torch


def check_ring_conv(device: str) -> None:
    from vllm_bi.gdn.layer import RingRows
    from vllm_bi.ops.conv import BLOCK_D, ring_causal_conv1d, triton_causal_conv1d

    g = torch.Generator().manual_seed(0)
    W, key_dim, S, R = 4, BLOCK_D, 6, 11
    D = 2 * key_dim + BLOCK_D + 64  # q, k, v; v's last channel block partly masked
    C = D + 12  # the ring also holds other columns (a, b), which the conv does not read
    weight = (torch.randn(D, W, generator=g) * 0.5).bfloat16().to(device)
    lens, slots = [1, 5, 3, 2], [4, 1, 5, 2]
    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    ext_rows = []
    for j, n in enumerate(lens):  # W - 1 conv rows then n block rows, in ring order from a random start
        first = int(torch.randint(0, R, (1,), generator=g))
        rows = [slots[j] * R + (first + i) % R for i in range(W - 1 + n)]
        if j == 3:  # a sequence's start: its conv rows before position 0 are zeros
            rows[: W - 1] = [-1] * (W - 1)
        ext_rows += rows
    ext = torch.tensor(ext_rows, device=device)
    seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)).to(device)
    for dim_first in (False, True):
        base = torch.randn(S, C, R, generator=g) if dim_first else torch.randn(S, R, C, generator=g)
        base = base.bfloat16().to(device)
        src = base.transpose(1, 2) if dim_first else base  # [S, R, C] either way
        for silu in (True, False):
            q, k, v = ring_causal_conv1d(src, ext, seq, weight, silu, key_dim)
            x, conv = RingRows(src, ext, seq).gather(weight.shape, cu)
            T = cu[-1]
            pos = torch.arange(T, device=device) - torch.tensor(cu[:-1], device=device)[seq]
            y = triton_causal_conv1d(x, weight, conv, seq.int(), pos.int(), torch.tensor(cu[:-1], device=device),
                                     silu)
            want = (y[:, :key_dim], y[:, key_dim : 2 * key_dim], y[:, 2 * key_dim :])
            for name, got, ref in zip("qkv", (q, k, v), want):
                assert got.is_contiguous() and got.dtype == src.dtype, name
                assert torch.equal(got, ref), (dim_first, silu, name, float((got.float() - ref.float()).abs().max()))
