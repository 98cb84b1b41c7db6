"""Float64 reference for the GDN layer core (the math :mod:`gdn_recurrent` must match).

Written independently of :func:`vllm_bi.gdn.recurrent.gdn_recurrent`:
explicit per-head loops, matrix-vector products, float64 throughout. Used only
by tests.
"""

from __future__ import annotations

import torch

__all__ = ["naive_gdn", "naive_kda", "naive_delta_rule", "naive_causal_conv1d"]


def naive_gdn(q, k, v, A_log, a, b, dt_bias, state, eps: float = 1e-6):
    """``q, k [T, H, K]``, ``v [T, HV, V]``, ``a, b [T, HV]``; state ``[HV, V, K]`` -> (o [T, HV, V], state), float64.
    GDN's gating in float64, then :func:`naive_delta_rule`."""
    g = -torch.exp(A_log.double()) * torch.log1p(torch.exp(a.double() + dt_bias.double()))
    beta = 1.0 / (1.0 + torch.exp(-b.double()))
    return naive_delta_rule(q, k, v, g, beta, state, eps)


def naive_kda(q, k, v, A_log, a, b, dt_bias, state, lower_bound=None, eps: float = 1e-6):
    """Kimi Delta Attention in float64: ``q, k, v [T, H, K]``, ``a [T, H, K]`` (the forget-gate projection), ``b [T, H]``
    (raw beta), ``dt_bias [H*K]``, ``A_log [H]``; the decay per key channel is ``exp(g)`` with
    ``g = -exp(A_log) * log(1 + exp(a + dt_bias))``, or ``lower_bound / (1 + exp(-exp(A_log) * (a + dt_bias)))``
    with a lower bound; then :func:`naive_delta_rule`."""
    H, K = a.shape[1], a.shape[2]
    x = a.double() + dt_bias.double().view(H, K)
    rate = torch.exp(A_log.double()).view(H, 1)
    g = -rate * torch.log1p(torch.exp(x)) if lower_bound is None else lower_bound / (1.0 + torch.exp(-rate * x))
    beta = 1.0 / (1.0 + torch.exp(-b.double()))
    return naive_delta_rule(q, k, v, g, beta, state, eps)


def naive_delta_rule(q, k, v, g, beta, state, eps: float = 1e-6):
    """The gated delta rule from its log decay ``g`` and ``beta`` directly, float64: ``q, k [T, H, K]``,
    ``v [T, HV, V]``, ``beta [T, HV]``, ``g [T, HV]`` (one decay per head) or ``[T, HV, K]`` (one per key channel,
    Kimi Delta Attention); state ``[HV, V, K]`` -> (o [T, HV, V], state). Per head: ``S <- S diag(exp(g_t))``,
    ``S <- S + beta_t (v_t - S k_t) k_t^T``, ``o_t = S q_t``."""
    q, k, v, g, beta = q.double(), k.double(), v.double(), g.double(), beta.double()
    S_h = [state[h].double() for h in range(state.shape[0])]  # per-head states, no in-place updates
    T, H, K = q.shape
    HV = v.shape[1]
    rows = []
    for t in range(T):
        o_t = []
        for h in range(HV):
            hk = h // (HV // H)
            qt = q[t, hk] / torch.sqrt((q[t, hk] ** 2).sum() + eps) * K**-0.5
            kt = k[t, hk] / torch.sqrt((k[t, hk] ** 2).sum() + eps)
            S = S_h[h] * torch.exp(g[t, h])  # [V, K] times a scalar, or a decay per key channel (last dim)
            S = S + beta[t, h] * torch.outer(v[t, h] - S @ kt, kt)
            S_h[h] = S
            o_t.append(S @ qt)
        rows.append(torch.stack(o_t))
    return torch.stack(rows), torch.stack(S_h)


def naive_causal_conv1d(x, weight, conv_state):
    """``x [T, D]``, ``weight [D, W]``, ``conv_state [W-1, D]`` -> silu(conv) ``[T, D]`` float64."""
    xe = torch.cat([conv_state.double(), x.double()], 0)
    W = weight.shape[1]
    y = torch.stack([(xe[t : t + W].T * weight.double()).sum(-1) for t in range(x.shape[0])])
    return y * torch.sigmoid(y)
