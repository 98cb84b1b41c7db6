"""Benchmark: what speculative decoding with the model's MTP drafter buys, stock vLLM and vllm_bi side by side.

    python benchmarks/spec_decode.py --model DIR [--k 3] [--clients 1,8,64] [--window 15] [--sides ...] [--parity]

Sides (``--sides``, comma-separated; one server each, the same ``vllm serve`` arguments): ``stock`` and ``vllm_bi``
(``VLLM_BATCH_INVARIANT=1``, the defaults), each without drafts, and ``stock+mtp`` / ``vllm_bi+mtp`` with
``--speculative-config {"method": "mtp", "num_speculative_tokens": K}``; a vllm_bi side may name settings of its
own (``vllm_bi+mtp:VLLM_BI_SPEC_VERIFY=fused``), compared like its name. On each server, for each client count, over
a fixed window of wall time: clients sending 256-token prompts for 128 tokens back to back, greedy, then seeded at
temperature 1 -> generated tokens/s of wall time and the mean time per output token (the server's histogram); and
the drafter's acceptance over the whole side (accepted / drafted tokens, the server's counters) and the mean tokens a
verify step emits. The table gives each speculative side's speed-up over the same side without drafts, and
vllm_bi / stock.

The checkpoint needs an MTP layer (``vllm-bi make-checkpoint`` writes one). A random MTP layer rarely agrees with its
target; ``vllm-bi make-checkpoint ... --lm-head-rows N`` writes an LM head with N nonzero rows in opposite pairs, so
that decoding (greedy or at T = 1) picks among N tokens and target and drafter agree about 1 / N of the time: run the
table at a few N for speed-up against acceptance. ``--parity`` adds ``vllm-bi parity`` (16 prompts x 4 samples x 128
tokens) against a speculative vllm_bi server. Ratios hold only within one run (the machine is shared); split the
sides over calls with ``--sides`` and ``--json-in`` to add rows to an earlier run's JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import sys
import time

from full_scale import (DEVIATIONS, PeakMemory, _file_label, _prompts, cell, closed_loop, parity_part, parse_side,
                        side_env)

SIDES = ("stock", "stock+mtp", "vllm_bi", "vllm_bi+mtp")
SERVER_ARGS = "--gpu-memory-utilization 0.85 --max-model-len 4096 --max-num-seqs 256"
PROMPT_LEN, MAX_TOKENS = 256, 128


def spec_args(k: int) -> list[str]:
    return ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": k})]


def split_side(side: str) -> tuple[str, str]:
    """``(name, server side)`` of a side: its name among :data:`SIDES` and the ``full_scale`` side its server runs
    (``vllm_bi+mtp:VLLM_BI_X=V`` -> ``("vllm_bi+mtp", "vllm_bi:VLLM_BI_X=V")``)."""
    name, colon, sets = side.partition(":")
    return name, name.partition("+")[0] + colon + sets


def plain_of(side: str) -> str:
    """The side without drafts a side is compared with: its name without ``+mtp`` (and without settings)."""
    return split_side(side)[0].partition("+")[0]


def parse_sides(text: str) -> list[str]:
    """The sides of ``--sides``: names among :data:`SIDES`, a vllm_bi one optionally with ``:VLLM_BI_X=VALUE``
    settings (``vllm_bi+mtp:VLLM_BI_SPEC_VERIFY=fused``); raises ``ValueError`` naming a bad one."""
    sides = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in sides if split_side(s)[0] not in SIDES]
    if bad or not sides:
        raise ValueError(f"--sides {text!r}: choose among {', '.join(SIDES)} (vllm_bi ones may add "
                         ":VLLM_BI_X=VALUE)")
    for s in sides:
        parse_side(split_side(s)[1])  # a bad setting, or settings on a stock side, named
    if len(set(sides)) != len(sides):
        raise ValueError(f"--sides {text!r}: a side is listed twice")
    return sides


def _drafts(srv) -> tuple[float, float, float]:
    """(drafted tokens, accepted tokens, verify steps with drafts) so far (0 on a server without drafts)."""
    return (srv.metric_sum("vllm:spec_decode_num_draft_tokens_total"),
            srv.metric_sum("vllm:spec_decode_num_accepted_tokens_total"),
            srv.metric_sum("vllm:spec_decode_num_drafts_total"))


def phase(srv, clients: int, window: float, vocab: int, seed: int, temperature: float) -> dict:
    """``full_scale.closed_loop`` at ``clients`` (``PROMPT_LEN``-token prompts, ``MAX_TOKENS`` tokens), with the drafts
    the server made and kept meanwhile."""
    d0 = _drafts(srv)
    m = closed_loop(srv, clients, window, PROMPT_LEN, MAX_TOKENS, vocab, seed, temperature=temperature)
    m["drafted"], m["accepted"], m["verify_steps"] = (b - a for a, b in zip(d0, _drafts(srv)))
    return m


def serve_side(side: str, model: str, server_args: str, k: int, clients: list[int], window: float, vocab: int,
               log_dir: str) -> dict:
    from vllm_bi.launcher import VllmServer

    name, server = split_side(side)
    mtp = name.endswith("+mtp")
    args = shlex.split(server_args) + shlex.split(DEVIATIONS) + (spec_args(k) if mtp else [])
    log_path = os.path.join(log_dir, f"server-{_file_label(side)}.log")
    r: dict = {"side": side, "k": k if mtp else 0}
    t0 = time.time()
    with PeakMemory() as mem:
        with VllmServer(model, batch_invariant=name.startswith("vllm_bi"), args=args, env=side_env(server),
                        startup_timeout=480, log_path=log_path) as srv:
            r["startup_s"] = time.time() - t0
            print(f"[spec] {side}: up in {r['startup_s']:.0f} s", flush=True)
            warm = _prompts(max(clients), PROMPT_LEN, vocab, random.Random(1))
            srv.complete_many([dict(prompt_ids=p, max_tokens=8) for p in warm])  # warm-up, unmeasured
            for c in clients:
                for name, temp in (("greedy", 0.0), ("t1", 1.0)):
                    m = phase(srv, c, window, vocab, seed=100 + c, temperature=temp)
                    r[f"{name}{c}"] = m
                    print(f"[spec] {side}: {name} at {c}: {m['tok_s']:.0f} tok/s, TPOT {m['tpot_ms']} ms, "
                          f"accepted {m['accepted']:.0f}/{m['drafted']:.0f}", flush=True)
    r["peak_mem_mib"] = mem.peak
    return r


def table(rows: list[dict], clients: list[int]) -> list[str]:
    """One line per (sampling, clients): each side's tokens/s and TPOT, each speculative side's speed-up over the
    same side without drafts and its acceptance, and vllm_bi / stock; then each side's acceptance over the run."""
    by = {r["side"]: r for r in rows if "error" not in r}
    sides = sorted(by, key=lambda s: (SIDES.index(split_side(s)[0]), s))
    head = ["sampling", "clients"] + [f"{s} tok/s (TPOT ms)" for s in sides]
    extra = [s for s in sides if split_side(s)[0].endswith("+mtp") and plain_of(s) in by]
    head += [f"{s} speed-up" for s in extra]
    bi_vs = [(a, b) for a in sides if a.startswith("vllm_bi")
             for b in ("stock+mtp" if split_side(a)[0].endswith("+mtp") else "stock",) if b in by]
    head += [f"{a} / {b} time" for a, b in bi_vs]
    out = ["| " + " | ".join(head) + " |", "| --- | ---: |" + " ---: |" * (len(head) - 2)]
    for name in ("greedy", "t1"):
        for c in clients:
            key = f"{name}{c}"
            get = lambda s: by[s].get(key, {})  # noqa: E731
            cells = [("greedy" if name == "greedy" else "T = 1, seeded"), str(c)]
            for s in sides:
                m = get(s)
                acc = (f", {m['accepted'] / m['drafted']:.0%} kept" if m.get("drafted") else "")
                cells.append(f"{cell(m.get('tok_s'))} ({cell(m.get('tpot_ms'))}{acc})")
            for s in extra:
                a, b = get(s).get("tok_s"), get(plain_of(s)).get("tok_s")
                cells.append(f"{a / b:.2f}x" if a and b else "")
            for a, b in bi_vs:
                x, y = get(a).get("tok_s"), get(b).get("tok_s")
                cells.append(f"{y / x:.2f}x" if x and y else "")
            out.append("| " + " | ".join(cells) + " |")
    out.append("")
    for s in sides:
        phases = [v for v in by[s].values() if isinstance(v, dict) and "drafted" in v]
        drafted = sum(p["drafted"] for p in phases)
        if drafted:
            accepted, steps = sum(p["accepted"] for p in phases), sum(p["verify_steps"] for p in phases)
            out.append(f"{s}: {accepted:.0f} of {drafted:.0f} drafts kept ({accepted / drafted:.1%}), "
                       f"{1 + accepted / steps:.2f} tokens per verify step" if steps else
                       f"{s}: {accepted:.0f} of {drafted:.0f} drafts kept")
    for r in rows:
        if "error" in r:
            out.append(f"{r['side']}: failed: {r['error']}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a checkpoint with an MTP layer (vllm-bi make-checkpoint)")
    ap.add_argument("--k", type=int, default=3, help="draft tokens per step (1-4)")
    ap.add_argument("--clients", default="1,8,64", help="comma-separated client counts")
    ap.add_argument("--window", type=float, default=15.0, help="seconds of wall time per measured phase")
    ap.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, among {', '.join(SIDES)}")
    ap.add_argument("--server-args", default=SERVER_ARGS, help="`vllm serve` arguments for every side")
    ap.add_argument("--parity", action="store_true", help="also vllm-bi parity against a speculative vllm_bi server")
    ap.add_argument("--parity-settings", default="", help="VLLM_BI_* variables for the parity run's server and trainer "
                    "(comma-separated NAME=VALUE; none by default)")
    ap.add_argument("--json-in", default=None, help="an earlier run's JSON: its rows are kept, this run's added")
    ap.add_argument("--out", default="spec_decode.md", help="the table (rewritten as rows come; JSON beside it)")
    args = ap.parse_args()
    try:
        sides = parse_sides(args.sides)
        clients = [int(c) for c in args.clients.split(",") if c.strip()]
    except ValueError as e:
        ap.error(str(e))
    parity_settings = {}
    for kv in filter(None, args.parity_settings.split(",")):
        if not (kv.startswith("VLLM_BI_") and "=" in kv):
            ap.error(f"--parity-settings: {kv!r} is not VLLM_BI_NAME=VALUE")
        name, value = kv.split("=", 1)
        parity_settings[name] = value
    if not 1 <= args.k <= 4 or not clients or min(clients) < 1:
        ap.error("--k takes 1 to 4 and --clients positive counts")
    if not os.path.exists(os.path.join(args.model, "config.json")):
        ap.error(f"{args.model}: no config.json; write one with `vllm-bi make-checkpoint qwen3.5-9b {args.model}`")
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(args.model).get_text_config()
    if not int(getattr(cfg, "mtp_num_hidden_layers", 0) or 0):
        ap.error(f"{args.model}: the checkpoint has no MTP layer (mtp_num_hidden_layers), nothing to draft with")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    rows: list[dict] = []
    if args.json_in:
        with open(args.json_in) as f:
            rows = [r for r in json.load(f)["serve"] if r["side"] not in sides]
    parity = None
    head = [f"# speculative decoding with the MTP drafter, k = {args.k}: {args.model} ({cfg.num_hidden_layers} layers, "
            f"hidden {cfg.hidden_size}, vocab {cfg.vocab_size:,})", "",
            "command: " + shlex.join([sys.executable, *sys.argv]), "",
            f"every side: `vllm serve {args.server_args} {DEVIATIONS}`; {PROMPT_LEN}-token prompts, {MAX_TOKENS} "
            f"tokens; window {args.window:.0f} s per phase; tok/s of wall time, TPOT from the server's histogram", ""]

    def write():
        text = head + table(rows, clients)
        if parity is not None:
            text += ["", "## trainer parity with speculation on (`vllm-bi parity`, 16 prompts x 4 x 128 tokens)", "",
                     "```", json.dumps(parity, indent=1), "```"]
        with open(args.out, "w") as f:
            f.write("\n".join(text) + "\n")
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump({"serve": rows, "parity": parity, "clients": clients, "k": args.k}, f, indent=1)

    for side in sides:
        try:
            rows.append(serve_side(side, args.model, args.server_args, args.k, clients, args.window,
                                   cfg.vocab_size, out_dir))
        except Exception as e:  # noqa: BLE001 - recorded, the next side still runs
            rows.append({"side": side, "error": str(e).splitlines()[0][:300]})
            print(f"[spec] {side} failed: {e}", flush=True)
        write()
    if args.parity:
        parity = parity_part(args.model, out_dir, extra_server_args=shlex.join(spec_args(args.k)),
                             settings=parity_settings)
        if parity_settings:
            parity["settings"] = parity_settings
        write()
    print(open(args.out).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
