"""The slot conv's check, shared by its interpreter test (tests/ops/test_gdn_conv_triton.py, CPU) and its GPU test
(tests/gpu/test_gdn_io_cuda.py): ``ops.conv.slot_causal_conv1d``, reading each sequence's conv state in its cache
slot and writing the new one back, == the copying path (the states gathered, the new requests' zeroed, the plain conv
kernel, q, k and v split out of its output, the new states of ``gdn.layer.causal_conv1d_varlen`` stored back),
``torch.equal`` for q, k, v and the whole cache, in both of vLLM's conv-cache layouts, from a column slice of a wider
projection (a row stride that is not the width). Slots no sequence owns keep their bytes. Control: the same call
without the new-request flags reads the slot's old rows for the new request and gives other outputs."""

import torch


def check_slot_conv(device: str) -> None:
    from vllm_bi.gdn.layer import causal_conv1d_varlen
    from vllm_bi.ops.conv import BLOCK_D, slot_causal_conv1d, triton_causal_conv1d

    g = torch.Generator().manual_seed(0)
    W, key_dim, S = 4, BLOCK_D, 8
    D = 2 * key_dim + BLOCK_D + 64  # q, k, v; v's last channel block partly masked
    weight = (torch.randn(D, W, generator=g) * 0.5).bfloat16().to(device)
    lens, slots, fresh = [1, 5, 2, 1, 3], [4, 1, 6, 2, 7], [0, 0, 1, 0, 1]  # shorter and longer than W - 1
    N, T = len(lens), sum(lens)
    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    proj = torch.randn(T, D + 9, generator=g).bfloat16().to(device)
    x = proj[:, :D]  # vLLM's mixed_qkv: a column slice of the projection
    seq = torch.repeat_interleave(torch.arange(N), torch.tensor(lens))
    pos = torch.arange(T) - torch.tensor(cu[:-1])[seq]
    idx = [t.to(device) for t in (seq, pos, torch.tensor(cu[:-1]), torch.tensor(lens))]
    slot_t = torch.tensor(slots, device=device)
    flags = torch.tensor(fresh, dtype=torch.int32, device=device)
    for dim_first in (False, True):
        cache0 = torch.randn(S, *((D, W - 1) if dim_first else (W - 1, D)), generator=g).bfloat16().to(device)
        for silu in (True, False):
            # the copying path
            states = cache0[slot_t].clone()
            states = states.transpose(1, 2) if dim_first else states
            states[flags.bool()] = 0
            y = triton_causal_conv1d(x.contiguous(), weight, states.contiguous(), idx[0].int(), idx[1].int(), idx[2],
                                     silu)
            want = (y[:, :key_dim], y[:, key_dim : 2 * key_dim], y[:, 2 * key_dim :])
            _, new_states = causal_conv1d_varlen(x.contiguous().cpu(), cu, weight.cpu(), states.cpu(), None)
            cache_want = cache0.clone()
            cache_want[slot_t] = (new_states.transpose(1, 2) if dim_first else new_states).to(device)
            # in the slots
            cache = cache0.clone()
            q, k, v = slot_causal_conv1d(x, weight, cache, dim_first, slot_t, flags, *idx, silu, key_dim)
            for name, got, ref in zip("qkv", (q, k, v), want):
                assert got.is_contiguous() and got.dtype == x.dtype, name
                assert torch.equal(got, ref), (dim_first, silu, name, float((got.float() - ref.float()).abs().max()))
            assert torch.equal(cache, cache_want), (dim_first, silu, (cache != cache_want).nonzero()[:8].tolist())
            # control: without the flags the new requests read their slots' old rows
            cache = cache0.clone()
            q2, _, _ = slot_causal_conv1d(x, weight, cache, dim_first, slot_t, None, *idx, silu, key_dim)
            assert not torch.equal(q2, want[0]), (dim_first, silu)
