"""Where do the server and the trainer part? (`vllm-bi diag`)

`vllm-bi parity` says *whether* the trainer reproduces the server; this says *where* it stops doing so. It
runs vLLM in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``VLLM_BATCH_INVARIANT=1``) with forward hooks
on every decoder layer and its sub-modules (input norm, mixer, post norm, MLP; the layer's output and
residual), prefills one prompt with ``prompt_logprobs``, then runs the trainer model
(:class:`~vllm_bi.models.qwen_gdn.QwenGDNForCausalLM`) on the same ids with the same hooks,
and compares each module's output exactly. The first row that differs is where to look.
"""

from __future__ import annotations

import os
import re

from vllm_bi.errors import UsageError

__all__ = ["layer_diff", "first_difference", "format_rows"]

_MAX_MODEL_LEN = 512  # the in-process engine's context: the prompt and one sampled token
_SUBS = ("input_layernorm", "linear_attn", "self_attn", "post_attention_layernorm", "mlp", "out", "residual")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.(\w+))?$")


def _output(out, kwargs):
    import torch

    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    o = (kwargs or {}).get("output")  # vLLM's mixers write into an `output` buffer and return None
    return o if isinstance(o, torch.Tensor) else None


def install_hooks(model, store: dict) -> int:
    """Record the first call's output of each decoder layer and of its sub-modules into ``store``."""
    n = 0
    for name, mod in model.named_modules():
        m = _LAYER.search(name)
        if not m or (m.group(2) and m.group(2) not in _SUBS):
            continue
        key = (int(m.group(1)), m.group(2) or "out")

        def hook(mod, args, kwargs, out, key=key):
            if key in store:
                return
            t = _output(out, kwargs)
            if t is not None:
                store[key] = t.detach().float().cpu().clone()
                if key[1] == "out" and isinstance(out, (tuple, list)) and len(out) > 1:
                    store[(key[0], "residual")] = out[1].detach().float().cpu().clone()

        mod.register_forward_hook(hook, with_kwargs=True)
        n += 1
    return n


def layer_diff(model: str, trainer_model: str | None = None, prompt_len: int = 24, seed: int = 0) -> list[dict]:
    """Rows ``{"module", "rows", "rows_differing", "max_abs_diff"}`` in execution order, then the prompt logprobs.
    A missing or corrupt model directory, an architecture the trainer model does not build, a prompt length out of
    range and a bad ``VLLM_BI_*`` value raise :class:`~vllm_bi.errors.UsageError` before vLLM is imported."""
    from vllm_bi.model_dir import read_model_config
    from vllm_bi.settings import current

    read_model_config(model, "--model", qwen_only="vllm-bi diag")
    if trainer_model is not None:
        read_model_config(trainer_model, "--trainer-model", qwen_only="vllm-bi diag")
    if not 1 <= prompt_len < _MAX_MODEL_LEN:
        raise UsageError(f"--prompt-len must be between 1 and {_MAX_MODEL_LEN - 1}, got {prompt_len}")
    current()
    os.environ.setdefault("VLLM_BATCH_INVARIANT", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model lives in this process: hooks reach it
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_bi.models.qwen_gdn import QwenGDNForCausalLM

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(model, enforce_eager=True, gpu_memory_utilization=0.15, max_model_len=_MAX_MODEL_LEN,
              max_num_batched_tokens=_MAX_MODEL_LEN, dtype="bfloat16", max_logprobs=5, generation_config="vllm")
    server: dict = {}
    if not llm.apply_model(lambda m: install_hooks(m, server))[0]:
        raise RuntimeError(f"{model}: no decoder layers found to hook in the served model")
    vocab = llm.get_tokenizer().vocab_size
    ids = torch.randint(3, max(4, vocab - 1), (prompt_len,), generator=torch.Generator().manual_seed(seed)).tolist()
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
    served_lp = [d[ids[i + 1]].logprob for i, d in enumerate(out[0].prompt_logprobs[1:])]
    tm = QwenGDNForCausalLM.from_pretrained(trainer_model or model).to(dev)
    mine: dict = {}
    install_hooks(tm, mine)
    with torch.no_grad():
        trained_lp = tm.token_logprobs(torch.tensor(ids, device=dev), [0, len(ids)])[:-1].cpu().tolist()
    rows = []
    for key in sorted(set(server) | set(mine), key=lambda k: (k[0], _SUBS.index(k[1]))):
        a, b = server.get(key), mine.get(key)
        row = {"module": f"layers.{key[0]}.{key[1]}"}
        if a is None or b is None or a.shape != b.shape:
            row["note"] = (f"server {None if a is None else tuple(a.shape)} vs "
                           f"trainer {None if b is None else tuple(b.shape)}")
        else:
            row.update(rows=a.shape[0], rows_differing=int((a != b).reshape(a.shape[0], -1).any(-1).sum()),
                       max_abs_diff=float((a - b).abs().max()))
        rows.append(row)
    diffs = [abs(x - y) for x, y in zip(served_lp, trained_lp)]
    rows.append({"module": "prompt_logprobs", "rows": len(diffs), "rows_differing": sum(x != y for x, y in
                 zip(served_lp, trained_lp)), "max_abs_diff": max(diffs, default=0.0)})
    return rows


def first_difference(rows: list[dict]) -> dict | None:
    return next((r for r in rows if r.get("rows_differing") or "note" in r), None)


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'module':34s} {'rows differing':>15s} {'max |diff|':>12s}"]
    for r in rows:
        if "note" in r:
            lines.append(f"{r['module']:34s} {r['note']}")
        else:
            lines.append(f"{r['module']:34s} {str(r['rows_differing']) + '/' + str(r['rows']):>15s} "
                         f"{r['max_abs_diff']:12.6g}")
    first = first_difference(rows)
    lines.append("all bitwise equal" if first is None else f"first difference: {first['module']}")
    return "\n".join(lines)
