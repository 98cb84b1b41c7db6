"""What the speculative-decoding tests (CPU and GPU) ask of a server: greedy and seeded completions of fixed prompts,
and the same from a server with the MTP drafter, alone and batched, with its draft counters."""

from __future__ import annotations

import json
import threading
import time

K = 3  # draft tokens per step
SPEC = ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": K})]
PROMPTS = [list(range(10, 10 + n)) for n in (3, 17, 40, 150)] + [[5, 900, 31, 7, 7, 7, 64, 2]]


def greedy(srv, prompts, max_tokens=24):
    return srv.complete_many([dict(prompt_ids=p, max_tokens=max_tokens) for p in prompts])


def sampled(srv, prompts, max_tokens=24):
    """Seeded at temperature 1 (seed 100 + the prompt's index)."""
    return srv.complete_many([dict(prompt_ids=p, max_tokens=max_tokens, temperature=1.0, seed=100 + i)
                              for i, p in enumerate(prompts)])


def plain_run(srv) -> dict:
    """A server without drafts: greedy and seeded completions of :data:`PROMPTS`."""
    return {"plain": greedy(srv, PROMPTS), "plain_sampled": sampled(srv, PROMPTS)}


def speculative_run(srv) -> dict:
    """A server with the drafter: greedy and seeded completions of :data:`PROMPTS`, each prompt alone (greedy; the
    first one seeded too), and the server's draft counters."""
    return {"spec": greedy(srv, PROMPTS), "spec_sampled": sampled(srv, PROMPTS),
            "alone": [greedy(srv, [p])[0] for p in PROMPTS], "alone_sampled": sampled(srv, PROMPTS[:1]),
            "accepted": srv.metric_sum("vllm:spec_decode_num_accepted_tokens_total"),
            "drafted": srv.metric_sum("vllm:spec_decode_num_draft_tokens_total")}


ONE_TOKEN = [[3], [250], [17], [901]]


def one_token_prompts(srv) -> tuple[list, list]:
    """One-token prompts sent one after another while three long greedy requests decode (vLLM's scheduler pads such a
    request into a speculative row beside running decodes; its state slots were used by earlier requests), then
    each alone: (beside the decodes, alone)."""
    busy = threading.Thread(target=greedy, args=(srv, PROMPTS[1:4]), kwargs={"max_tokens": 96}, daemon=True)
    busy.start()
    time.sleep(1.0)  # the long requests' prompts are in, their decodes running
    among = [srv.complete(prompt_ids=p, max_tokens=4) for p in ONE_TOKEN]
    busy.join()
    return among, [srv.complete(prompt_ids=p, max_tokens=4) for p in ONE_TOKEN]
