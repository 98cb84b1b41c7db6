"""The trainer's squared gradient norm (:meth:`vllm_bi.trainer.distributed.Dist.sq_norm`) is taken in float64 pieces
of a fixed size, so a 248K-vocabulary embedding's gradient needs no float64 copy of its own size; the pieces give the
norm to float64 accuracy (checked against an exact rational sum, relative tolerance 1e-12) and the same value at
every call."""

from fractions import Fraction

import torch

from vllm_bi.trainer import distributed as D


def test_the_squared_norm_in_pieces_is_the_exact_sum(monkeypatch):
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(1000, 37, generator=g), torch.randn(5, generator=g).to(torch.bfloat16)]
    exact = sum(Fraction(float(x)) ** 2 for t in grads for x in t.double().reshape(-1).tolist())
    monkeypatch.setattr(D, "SQ_SUM_PIECE", 4096)  # nine pieces of the first tensor, the last one short
    dist = D.Dist.__new__(D.Dist)
    dist.world = 1
    got = dist.sq_norm([], grads)
    assert abs(got - float(exact)) <= 1e-12 * float(exact)
    assert dist.sq_norm([], grads) == got
    # a piece smaller than the tensor is what bounds the temporaries: the split yields more than one piece
    assert len(grads[0].reshape(-1).split(D.SQ_SUM_PIECE)) == 10
