"""vllm_bi's changes to vLLM, one module per concern, applied from one ledger (:mod:`vllm_bi.patch.ledger`).

- :mod:`~vllm_bi.patch.engine_config` — start-up checks and defaults (``EngineArgs.create_engine_config``);
- :mod:`~vllm_bi.patch.gdn_backend` — the GDN backend and layer forward, state shapes;
- :mod:`~vllm_bi.patch.cpu_layers` — the op library in vLLM's linear, norm, activation, rotary and logprob layers;
- :mod:`~vllm_bi.patch.cpu_moe`, :mod:`~vllm_bi.patch.cuda_moe` — MoE router and experts;
- :mod:`~vllm_bi.patch.sampling` — seeded CPU sampling keyed by (seed, draw index); exact-match verification of speculative drafts;
- :mod:`~vllm_bi.patch.cuda_ops` — CUDA-only entry points and vLLM-kernel norm fixes;
- :mod:`~vllm_bi.patch.aten_overrides` — aten overrides routed to the op library;
- :mod:`~vllm_bi.patch.worker_rpc` — worker methods a trainer calls (weight digest, settings);
- :mod:`~vllm_bi.patch.nonfinite` — a request with NaN / +inf logits fails instead of being served;
- :mod:`~vllm_bi.patch.audit` — refuse any loaded layer vllm_bi has not made batch-invariant.

The modules hold replacements only; nothing is patched except by :func:`~vllm_bi.patch.ledger.apply_all`, which the
plugin calls in every vLLM process when ``VLLM_BATCH_INVARIANT=1``.
"""

from vllm_bi.patch.engine_config import BatchInvarianceConfigError
from vllm_bi.patch.ledger import LEDGER, Patch, active_rows, applied, apply_all

__all__ = ["BatchInvarianceConfigError", "LEDGER", "Patch", "active_rows", "applied", "apply_all"]
