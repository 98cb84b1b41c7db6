#!/usr/bin/env python3
"""Where do the server and the trainer part? Layer-by-layer comparison on one prompt (CUDA or CPU).

Runs vLLM in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``VLLM_BATCH_INVARIANT=1``) on MODEL with forward
hooks on every decoder layer and its sub-modules (input/post norms, mixer, MLP), one prefill of PROMPT_LEN
tokens with ``prompt_logprobs``; then the trainer model (``GDNHybridForCausalLM``) on the same ids with the
same hooks. Prints, per hooked module in execution order, the max |server - trainer| of its output (0 means
bitwise equal), and the same for the prompt logprobs. The first non-zero row is where they part.

    python3 scripts/gpu_diag_layers.py MODEL [--prompt-len 24] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SUBS = ("input_layernorm", "linear_attn", "self_attn", "post_attention_layernorm", "mlp")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.(\w+))?$")


def _first_tensor(out, kwargs):
    import torch

    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    o = kwargs.get("output") if kwargs else None  # vLLM mixers write into an `output` buffer
    return o if isinstance(o, torch.Tensor) else None


def install_hooks(model, store: dict) -> list[str]:
    """Record the first call's output of each decoder layer and of its SUBS, keyed 'L{i}.{sub}'."""
    names = []
    for name, mod in model.named_modules():
        m = _LAYER.search(name)
        if not m or (m.group(2) and m.group(2) not in SUBS):
            continue
        key = f"L{int(m.group(1))}.{m.group(2) or 'out'}"

        def hook(mod, args, kwargs, out, key=key):
            if key not in store:
                t = _first_tensor(out, kwargs)
                if t is not None:
                    store[key] = t.detach().float().cpu().clone()
                    if key.endswith(".out") and isinstance(out, (tuple, list)) and len(out) > 1:
                        store[key.replace(".out", ".residual")] = out[1].detach().float().cpu().clone()

        mod.register_forward_hook(hook, with_kwargs=True)
        names.append(key)
    return names


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_BATCH_INVARIANT", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_bi.model_executor.models.hybrid import GDNHybridForCausalLM

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(args.model, enforce_eager=True, gpu_memory_utilization=0.15, max_model_len=512,
              max_num_batched_tokens=512, dtype="bfloat16", max_logprobs=5, generation_config="vllm")
    server: dict = {}
    hooked = llm.apply_model(lambda m: install_hooks(m, server))[0]
    ids = [int(x) for x in torch.randint(3, 900, (args.prompt_len,), generator=torch.Generator().manual_seed(0))]
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1, temperature=0.0,
                                                                             prompt_logprobs=0), use_tqdm=False)
    srv_lp = [d[ids[i + 1]].logprob for i, d in enumerate(out[0].prompt_logprobs[1:])]
    tm = GDNHybridForCausalLM.from_pretrained(args.model).to(dev)
    mine: dict = {}
    install_hooks(tm, mine)
    with torch.no_grad():
        t_lp = tm.token_logprobs(torch.tensor(ids, device=dev), [0, len(ids)])[:-1].cpu().tolist()
    rows = []
    for key in sorted(set(server) | set(mine), key=lambda k: (int(k[1:].split(".")[0]), k)):
        a, b = server.get(key), mine.get(key)
        if a is None or b is None or a.shape != b.shape:
            rows.append({"module": key, "note": f"server {None if a is None else tuple(a.shape)} vs "
                                                f"trainer {None if b is None else tuple(b.shape)}"})
            continue
        d = (a - b).abs()
        rows.append({"module": key, "max_abs_diff": float(d.max()), "rows_differing": int((d.amax(-1) > 0).sum()),
                     "rows": a.shape[0]})
    lp_d = [abs(x - y) for x, y in zip(srv_lp, t_lp)]
    rows.append({"module": "prompt_logprobs", "max_abs_diff": max(lp_d), "rows_differing": sum(x > 0 for x in lp_d),
                 "rows": len(lp_d)})
    print(f"hooked in the server: {len(hooked)} modules; env VLLM_BI_CUDA_OPS={os.environ.get('VLLM_BI_CUDA_OPS')}")
    for r in rows:
        print(json.dumps(r))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
