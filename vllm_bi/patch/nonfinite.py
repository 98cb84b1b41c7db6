"""Never serve a NaN: under batch invariance a step whose logits hold a NaN or +inf for a request fails that request.

A NaN or +inf logit makes the sampled token's logprob NaN, and a token sampled from it is meaningless; served, it
reaches the client as a JSON error (``Out of range float values``) or, worse, as a plausible token whose logprob the
trainer cannot reproduce. ``-inf`` stays legitimate (a masked token; vLLM reports it as -9999.0).

How, with what vLLM 0.32 already has (its ``VLLM_COMPUTE_NANS_IN_LOGITS`` accounting):

- each step counts, on the device and per request row, the logits that are NaN or +inf (vLLM's per-row count,
  widened from NaN alone); the counts travel to the host with the step's sampled tokens (the V1 runner reads them
  with the step's other outputs, the V2 runner copies them asynchronously), so no layer reads anything on the host
  and decode CUDA graphs are unaffected;
- the scheduler drops such a request's sampled token, finishes the request with vLLM's error status (the API
  server answers HTTP 500) and logs the request id; every other request of the step goes on as before;
- the API server's error message for such a request says what happened.

``VLLM_BI_DEBUG_NONFINITE=1`` (``model_executor.gdn``) localises the first GDN layer with a non-finite value.

The guard is on by default on every device; ``VLLM_BI_NONFINITE_GUARD=0`` turns it off (vLLM then serves what the
logits give).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

__all__ = ["guard_enabled", "count_nonfinite_per_row", "prepare", "wrap_update_from_output", "raise_if_error"]

logger = logging.getLogger("vllm_bi")

MESSAGE = ("vllm_bi: the server failed this request: under VLLM_BATCH_INVARIANT=1 a NaN or +inf logit fails its "
           "request instead of being served (the server log names the request; VLLM_BI_DEBUG_NONFINITE=1 names the "
           "first GDN layer with one)")


def guard_enabled() -> bool:
    """Whether the guard runs: ``VLLM_BI_NONFINITE_GUARD`` (``1``/``0``), on by default (CPU and CUDA alike)."""
    from vllm_bi.settings import current

    return current().nonfinite_guard


def count_nonfinite_per_row(logits: torch.Tensor) -> torch.Tensor:
    """Per row, the number of NaN or +inf entries (int32, on the logits' device; ``-inf`` is not counted)."""
    return (torch.isnan(logits) | torch.isposinf(logits)).sum(dim=-1, dtype=torch.int32)


def wrap_update_from_output(orig):
    @functools.wraps(orig)
    def update_from_output(self, scheduler_output, model_runner_output):
        counts = getattr(model_runner_output, "num_nans_in_logits", None) or {}
        bad = sorted(r for r, n in counts.items() if n and r in scheduler_output.num_scheduled_tokens)
        if bad:
            tokens = model_runner_output.sampled_token_ids
            for r in bad:
                i = model_runner_output.req_id_to_index.get(r)
                if tokens and i is not None and i < len(tokens):
                    tokens[i] = []  # the token sampled from a non-finite distribution is never emitted
                logger.error("vllm_bi: request %s: %d NaN or +inf logits in this step; the request fails (HTTP "
                             "500), the others go on", r, counts[r])
            # vLLM's channel for requests that fail in a step: finished with its error status after the others'
            # outputs are made (update_from_output reads and clears it)
            self.encoder_cache_mismatch_reqs.update(bad)
        return orig(self, scheduler_output, model_runner_output)

    return update_from_output


def raise_if_error(self, finish_reason, request_id) -> None:
    if finish_reason == "error":
        from vllm.exceptions import GenerationError

        logger.error("vllm_bi: request %s failed on the server", request_id)
        raise GenerationError(MESSAGE)


def prepare() -> None:
    """Before the guard's patches: turn on vLLM's per-request count (read when the model runner starts), and check
    that this vLLM's scheduler has the channel that fails one request."""
    import inspect

    from vllm.v1.core.sched.scheduler import Scheduler

    os.environ["VLLM_COMPUTE_NANS_IN_LOGITS"] = "1"
    if "encoder_cache_mismatch_reqs" not in inspect.getsource(Scheduler.update_from_output):
        raise RuntimeError("vllm_bi: this vLLM's scheduler has no channel to fail one request; the non-finite "
                           "guard needs vLLM 0.32 (or set VLLM_BI_NONFINITE_GUARD=0)")
