"""Trainer-side pieces of Kimi Linear (``KimiLinearForCausalLM``), built from :mod:`vllm_bi.ops` and
:mod:`vllm_bi.gdn` only.

Kimi Delta Attention (KDA) is the GDN recurrence with a decay per key channel: :func:`kda_block` is one KDA layer
over packed sequences, each from fp32 zero states, composed as vLLM 0.32's ``KimiGatedDeltaNetAttention`` composes
it (q, k and v projections and their short convs in fp32 weights, beta and the low-rank forget gate ``f_b(f_a(x))``
per key channel, the GDN core with ``gating="kda"``, the output norm gated by ``sigmoid(g_b(g_a(x)))`` with its
fixed eps, the output projection). The rest of the model (MLA attention, the MoE router) is not built yet: Kimi
Linear is refused under batch invariance until it is (``vllm_bi.patch.model_families``).

Legend: ``T`` packed tokens, ``D`` hidden size, ``H`` KDA heads, ``K`` the KDA head dim (q, k and v alike).
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_bi.gdn.layer import gdn_varlen
from vllm_bi.ops.linear import bi_linear
from vllm_bi.ops.norm import gated_rms_norm

__all__ = ["KDA_NORM_EPS", "KDA_WEIGHTS", "kda_block", "KimiDeltaAttention"]

# vLLM builds the KDA output norm with FusedRMSNormGated's default eps, not the config's rms_norm_eps
KDA_NORM_EPS = 1e-5
# a KDA layer's tensors under the checkpoint's names (``model.layers.N.self_attn.<name>``)
KDA_WEIGHTS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv1d.weight", "k_conv1d.weight",
               "v_conv1d.weight", "b_proj.weight", "f_a_proj.weight", "f_b_proj.weight", "g_a_proj.weight",
               "g_b_proj.weight", "A_log", "dt_bias", "o_norm.weight", "o_proj.weight")


def kda_block(x_TD: torch.Tensor, cu: list[int], w: dict[str, torch.Tensor], num_heads: int, head_dim: int,
              lower_bound: float | None = None) -> torch.Tensor:
    """One KDA layer over packed sequences ``cu``, each from fp32 zero states: ``x [T, D]`` -> ``[T, D]``. ``w``: the
    layer's tensors by their :data:`KDA_WEIGHTS` names (convs ``[H*K, 1, W]``, ``A_log`` any shape of ``H``
    elements, ``dt_bias [H*K]``); ``lower_bound``: the checkpoint's ``gate_lower_bound``. Differentiable in ``x`` and
    every weight."""
    T, H, K = x_TD.shape[0], num_heads, head_dim
    mixed = torch.cat([bi_linear(x_TD, w[f"{n}_proj.weight"]) for n in "qkv"], dim=-1)  # [T, 3*H*K]
    conv = torch.cat([w[f"{n}_conv1d.weight"] for n in "qkv"]).reshape(3 * H * K, -1).float()
    beta = bi_linear(x_TD, w["b_proj.weight"])  # [T, H], raw
    forget = bi_linear(bi_linear(x_TD, w["f_a_proj.weight"]), w["f_b_proj.weight"]).view(T, H, K)
    gate = bi_linear(bi_linear(x_TD, w["g_a_proj.weight"]), w["g_b_proj.weight"]).view(T, H, K)
    n, dev = len(cu) - 1, x_TD.device
    o, _, _ = gdn_varlen(
        mixed, [(cu[i], cu[i + 1]) for i in range(n)], conv,
        torch.zeros((n, conv.shape[1] - 1, conv.shape[0]), dtype=x_TD.dtype, device=dev),
        w["A_log"].reshape(H).float(), forget, beta, w["dt_bias"].reshape(H * K),
        torch.zeros((n, H, K, K), dtype=torch.float32, device=dev), H, K, K,
        packed=True, gating="kda", lower_bound=lower_bound,
    )
    y = gated_rms_norm(o.to(x_TD.dtype), gate, w["o_norm.weight"], KDA_NORM_EPS, True, "sigmoid")
    return bi_linear(y.reshape(T, H * K), w["o_proj.weight"])


class KimiDeltaAttention(nn.Module):
    """A KDA layer's parameters under the checkpoint's names (dots as underscores), run by :func:`kda_block`."""

    def __init__(self, hidden: int, num_heads: int, head_dim: int, conv_size: int,
                 lower_bound: float | None = None):
        super().__init__()
        self.num_heads, self.head_dim, self.lower_bound = num_heads, head_dim, lower_bound
        P = num_heads * head_dim
        shapes = {"q_proj.weight": (P, hidden), "k_proj.weight": (P, hidden), "v_proj.weight": (P, hidden),
                  "q_conv1d.weight": (P, 1, conv_size), "k_conv1d.weight": (P, 1, conv_size),
                  "v_conv1d.weight": (P, 1, conv_size), "b_proj.weight": (num_heads, hidden),
                  "f_a_proj.weight": (head_dim, hidden), "f_b_proj.weight": (P, head_dim),
                  "g_a_proj.weight": (head_dim, hidden), "g_b_proj.weight": (P, head_dim),
                  "A_log": (1, 1, num_heads, 1), "dt_bias": (P,), "o_norm.weight": (head_dim,),
                  "o_proj.weight": (hidden, P)}
        fp32 = {"A_log", "dt_bias"}
        for name in KDA_WEIGHTS:
            dtype = torch.float32 if name in fp32 else torch.bfloat16
            self.register_parameter(name.replace(".", "_"), nn.Parameter(torch.zeros(shapes[name], dtype=dtype)))

    def weights(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name.replace(".", "_")) for name in KDA_WEIGHTS}

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy the layer's tensors (keys: :data:`KDA_WEIGHTS`), refusing a missing name or another shape."""
        with torch.no_grad():
            for name, p in self.weights().items():
                if name not in tensors:
                    raise KeyError(f"KDA layer: the checkpoint has no {name}")
                t = tensors[name]
                if tuple(t.shape) != tuple(p.shape):
                    raise ValueError(f"KDA layer: {name} has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
                p.copy_(t.to(p.dtype))

    def forward(self, x_TD: torch.Tensor, cu: list[int]) -> torch.Tensor:
        return kda_block(x_TD, cu, self.weights(), self.num_heads, self.head_dim, self.lower_bound)
