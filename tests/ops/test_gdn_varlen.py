"""gdn_varlen (the packed multi-sequence GDN core the CUDA server path uses) gives, for every
sequence, exactly what gdn_sequence gives for that sequence alone (CPU; exact equality)."""

import torch

from vllm_bi.gdn.layer import gdn_sequence, gdn_varlen

H, HV, K, V, W = 1, 2, 128, 128, 4
D = 2 * H * K + HV * V


def test_gdn_varlen_matches_gdn_sequence_per_sequence():
    g = torch.Generator().manual_seed(0)
    lens = [5, 1, 9, 2]
    T = sum(lens)
    x = torch.randn(T, D, generator=g).bfloat16()
    a, b = torch.randn(T, HV, generator=g).bfloat16(), torch.randn(T, HV, generator=g).bfloat16()
    w = torch.randn(D, W, generator=g).bfloat16() * 0.3
    A_log, dt_bias = torch.log(torch.tensor([2.0, 9.0])), torch.tensor([0.1, -0.3])
    conv = torch.randn(len(lens), W - 1, D, generator=g).bfloat16()
    conv[1] = 0
    states = torch.randn(len(lens), HV, V, K, generator=g) * 0.1
    states[1] = 0
    ranges, s = [], 0
    for n in lens:
        ranges.append((s, s + n))
        s += n
    outs, new_conv, new_states = gdn_varlen(x, ranges, w, conv, A_log, a, b, dt_bias, states, H, K, V)
    for j, (s, e) in enumerate(ranges):
        o, c, st = gdn_sequence(x[s:e], w, conv[j], A_log, a[s:e], b[s:e], dt_bias, states[j], H, K, V)
        assert torch.equal(outs[j], o)
        assert torch.equal(new_conv[j], c)
        assert torch.equal(new_states[j], st)
    o_packed, _, _ = gdn_varlen(x, ranges, w, conv, A_log, a, b, dt_bias, states, H, K, V, packed=True)
    assert torch.equal(o_packed, torch.cat(outs))  # the server glue's form: one tensor, sequences in order


def test_index_tensors_are_built_once_per_layout():
    """The GDN core's index tensors depend only on the batch layout, the same for every layer of a step: they
    are built and copied once and shared; another layout gets its own."""
    from vllm_bi.ops.device import index_on, rows_of

    a = rows_of([(0, 2), (5, 7)], "cpu")
    assert a.tolist() == [0, 1, 5, 6] and rows_of([(0, 2), (5, 7)], torch.device("cpu")) is a
    assert rows_of([(0, 3)], "cpu").tolist() == [0, 1, 2]
    assert index_on([0, 4, 9], "cpu") is index_on((0, 4, 9), "cpu")
    assert index_on([0, 4], "cpu").tolist() == [0, 4]
