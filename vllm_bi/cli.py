"""``vllm-bi``: the vllm_bi command line.

    vllm-bi demo         serve a built-in small GDN model with VLLM_BATCH_INVARIANT=1 and show that a
                         request's tokens and logprobs are identical alone and in a busy batch
    vllm-bi parity       sample from a BI server, recompute with the trainer model, report bitwise equality
    vllm-bi plot         PNG curves of a trainer run (python -m vllm_bi.trainer) from its metrics.jsonl
    vllm-bi diag         where server and trainer part: each decoder sub-module compared exactly
    vllm-bi make-model   write a small random-weight GDN hybrid (and tokenizer) to a directory
    vllm-bi make-checkpoint  write a full-size random-weight checkpoint with a published config (Qwen3.5-9B, ...)
    vllm-bi info         versions, the GDN / CUDA-op / GEMM / attention / MoE modes, GEMM tiles, CUDA graphs,
                         and whether vLLM finds the plugin
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import sys
import time

__all__ = ["main"]


def _cmd_make_model(args) -> int:
    from vllm_bi.tiny_models import SPECS, build_tiny_model

    path = build_tiny_model(args.family, args.out, seed=args.seed, spec=SPECS[args.spec], overwrite=args.overwrite)
    print(f"wrote {args.family} (spec {args.spec}, seed {args.seed}) to {path}")
    return 0


def _cmd_make_checkpoint(args) -> int:
    from vllm_bi.checkpoints import write_checkpoint

    overrides = {"num_hidden_layers": args.layers} if args.layers else None
    try:
        path = write_checkpoint(args.name, args.out, seed=args.seed, overrides=overrides, device=args.device,
                                entropy=args.entropy, overwrite=args.overwrite)
    except (ValueError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.name} (seed {args.seed}{f', {args.layers} layers' if args.layers else ''}) to {path}")
    return 0


def _cmd_info(args) -> int:
    from importlib.metadata import entry_points, version

    import vllm_bi

    print(f"vllm_bi {vllm_bi.__version__}")
    for dist in ("vllm", "torch", "transformers"):
        try:
            print(f"{dist} {version(dist)}")
        except Exception as e:  # noqa: BLE001
            print(f"{dist}: not found ({e})")
    from vllm_bi.settings import SETTINGS, Settings

    try:
        settings = Settings.from_env()
    except ValueError as e:  # a bad value: the server refuses it at start; say why here too
        print(f"settings: refused ({e})")
        settings = None
    if settings is not None:
        print("settings (VLLM_BI_*; env: set, preset: from VLLM_BI_PRESET, default):")
        for spec in SETTINGS:
            print(f"  {spec.env} = {getattr(settings, spec.name)!r} ({settings.source(spec.name)})")
        from vllm_bi.ops.attention_triton import attention_backend
        from vllm_bi.ops.moe_triton import moe_backend

        for dev in ("cpu", "cuda"):
            try:
                arith = settings.arithmetic(dev)
                attention_backend(dev), moe_backend(dev)  # refuses Triton ops where they cannot run
                arith = ", ".join(f"{k} {v}" for k, v in arith.items())
            except (ValueError, RuntimeError) as e:
                arith = f"refused ({e})"
            print(f"  arithmetic on {dev}: {arith}")
    from vllm_bi.gpu_gate import load_record, status

    print(f"GPU gate: {status(load_record())[1]}")
    eps = [e for e in entry_points(group="vllm.general_plugins") if e.name == "vllm_bi"]
    print("vLLM plugin entry point:", eps[0].value if eps else "MISSING (reinstall vllm_bi)")
    return 0 if eps else 1


def _fmt(xs, n=6):
    return "[" + ", ".join(f"{x:.6f}" if isinstance(x, float) else str(x) for x in xs[:n]) + (", ...]" if len(xs) > n else "]")


def _cmd_demo(args) -> int:
    from vllm_bi.launcher import VllmServer
    from vllm_bi.tiny_models import build_tiny_model

    model = args.model
    if model is None:
        model = os.path.abspath(os.path.join(args.workdir, f"tiny-{args.family}"))
        print(f"[1/4] building the built-in small model ({args.family}, random weights) in {model}", flush=True)
        build_tiny_model(args.family, model, seed=0)
    else:
        print(f"[1/4] using model {model}", flush=True)
    rng = random.Random(args.seed)
    prompt = [rng.randrange(3, 1000) for _ in range(args.prompt_len)]
    others = [[rng.randrange(3, 1000) for _ in range(rng.randint(5, 300))] for _ in range(args.busy)]
    print(
        f"[2/4] starting `VLLM_BATCH_INVARIANT=1 vllm serve` (max_num_batched_tokens {args.max_num_batched_tokens}); "
        "this takes about a minute on 2 CPU cores",
        flush=True,
    )
    t0 = time.time()
    server_args = ["--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-num-seqs", "16"]
    ok = True
    with VllmServer(model, batch_invariant=True, args=server_args) as srv:
        print(f"      server up in {time.time() - t0:.0f}s at {srv.url} (log: {srv.log_path})", flush=True)
        rows = []
        for label, kw in (("greedy", {"temperature": 0.0}), ("T=1.0 seed=7", {"temperature": 1.0, "seed": 7})):
            print(f"[3/4] {label}: the request alone, then with {args.busy} other requests in flight", flush=True)
            alone = srv.complete(prompt, max_tokens=args.max_tokens, **kw)
            reqs = [dict(prompt_ids=prompt, max_tokens=args.max_tokens, **kw)]
            reqs += [dict(prompt_ids=o, max_tokens=args.max_tokens, **kw) for o in others]
            busy = srv.complete_many(reqs)[0]
            same_tok = alone.token_ids == busy.token_ids
            n_eq = sum(a == b for a, b in zip(alone.logprobs, busy.logprobs))
            rows.append((label, alone, busy, same_tok, n_eq))
            ok &= same_tok and n_eq == len(alone.logprobs)
    stock_row = None
    if args.compare_stock:
        print("[+] the same greedy request on stock vLLM (VLLM_BATCH_INVARIANT=0: the plugin is inactive)", flush=True)
        from vllm_bi.launcher import cpu_env

        with VllmServer(model, batch_invariant=False, env=cpu_env(False), args=server_args + ["--enforce-eager"]) as srv:
            alone = srv.complete(prompt, max_tokens=args.max_tokens)
            reqs = [dict(prompt_ids=prompt, max_tokens=args.max_tokens)]
            reqs += [dict(prompt_ids=o, max_tokens=args.max_tokens) for o in others]
            busy = srv.complete_many(reqs)[0]
            stock_row = ("stock vLLM, greedy", alone, busy, alone.token_ids == busy.token_ids,
                         sum(a == b for a, b in zip(alone.logprobs, busy.logprobs)))
    print("[4/4] results")
    for label, alone, busy, same_tok, n_eq in rows + ([stock_row] if stock_row else []):
        print(f"  {label}")
        print(f"    alone : tokens {_fmt(alone.token_ids)} logprobs {_fmt(alone.logprobs)}")
        print(f"    busy  : tokens {_fmt(busy.token_ids)} logprobs {_fmt(busy.logprobs)}")
        print(f"    token ids identical: {same_tok}; logprobs bitwise equal: {n_eq}/{len(alone.logprobs)}")
    print("PASS: batch-invariant with vllm_bi" if ok else "FAIL: the request changed with the batch under vllm_bi")
    return 0 if ok else 1


def _cmd_parity(args) -> int:
    from vllm_bi.client import ServerError, ServerUnreachable
    from vllm_bi.parity import SettingsMismatch, load_prompts, run_parity
    from vllm_bi.launcher import ServerStartError

    log = (lambda *a, **k: print(*a, file=sys.stderr, **k)) if args.json else print
    try:
        report = run_parity(
            model=args.model,
            server_url=args.server,
            prompts=load_prompts(args.prompts),
            n=args.n,
            max_tokens=args.max_tokens,
            seed=args.seed,
            temperature=args.temperature,
            trainer=args.trainer,
            trainer_model=args.trainer_model,
            max_num_batched_tokens=args.max_num_batched_tokens,
            trainer_device=args.trainer_device,
            server_args=shlex.split(args.server_args),
            stock_server=args.stock_server,
            log=log,
        )
    except SettingsMismatch as e:
        print(f"vllm-bi parity: settings differ: {e}", file=sys.stderr)
        return PARITY_MISMATCH
    except (ServerError, ServerUnreachable, ServerStartError) as e:
        print(f"vllm-bi parity: server error: {_one_line(e)}", file=sys.stderr)
        return PARITY_SERVER_ERROR
    print(report.to_json() if args.json else report.table())
    return PARITY_EQUAL if report.ok else PARITY_DIFFER


# `vllm-bi parity`'s exit statuses (its --help lists them)
PARITY_EQUAL, PARITY_DIFFER, PARITY_USAGE, PARITY_SERVER_ERROR, PARITY_MISMATCH = 0, 1, 2, 3, 4


def _one_line(e: BaseException, width: int = 400) -> str:
    """An error's message on one line: its first line, the last error line quoted below it (a server log's
    excerpt) and the log's path, cut to ``width`` characters each."""
    import re

    from vllm_bi.launcher import _ERROR_LINE

    lines = [x.strip() for x in str(e).strip().splitlines() if x.strip()] or [type(e).__name__]
    text = lines[0]
    errors = [x for x in lines[1:] if _ERROR_LINE.match(x)]  # the excerpt's cause ends at such a line
    if errors:
        text = f"{text} {errors[-1]}"
    where = re.search(r"\((whole log|server log): [^)]*\)", str(e))
    text = text if len(text) <= width else text[: width - 3] + "..."
    return f"{text} {where.group(0)}" if where and where.group(0) not in text else text


def _cmd_diag(args) -> int:
    import json

    from vllm_bi.diag import first_difference, format_rows, layer_diff

    rows = layer_diff(args.model, args.trainer_model, args.prompt_len, args.seed)
    print(json.dumps(rows) if args.json else format_rows(rows))
    return 0 if first_difference(rows) is None else 1


def _cmd_plot(args) -> int:
    from vllm_bi.trainer.plot import plot_run

    for path in plot_run(args.run_dir):
        print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-bi", description="vllm_bi: batch-invariant vLLM for GDN hybrids")
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("demo", help="serve a small GDN model with batch invariance and show a request is unchanged by batching")
    d.add_argument("--model", default=None, help="model directory (default: build the built-in small model)")
    d.add_argument("--family", default="qwen3-next", choices=["qwen3-next", "qwen3.5", "qwen3.5-moe"],
                   help="built-in model family when --model is not given (default: qwen3-next)")
    d.add_argument("--workdir", default=os.path.join(os.getcwd(), ".vllm_bi_demo"),
                   help="where the built-in model is written (default: ./.vllm_bi_demo)")
    d.add_argument("--prompt-len", type=int, default=120, help="prompt length in tokens (default 120)")
    d.add_argument("--max-tokens", type=int, default=16, help="tokens to generate (default 16)")
    d.add_argument("--busy", type=int, default=9, help="other requests in flight for the busy run (default 9)")
    d.add_argument("--max-num-batched-tokens", type=int, default=32,
                   help="engine token budget per step; small values split prompts (default 32)")
    d.add_argument("--seed", type=int, default=0, help="seed for the random prompts (default 0)")
    d.add_argument("--no-compare-stock", dest="compare_stock", action="store_false",
                   help="skip the same greedy request on stock vLLM (plugin inactive) for contrast")
    d.set_defaults(fn=_cmd_demo)

    pa = sub.add_parser(
        "parity",
        help="sample from a batch-invariant server and check the trainer's logprobs equal the server's bit for bit",
        description="Sample completions from a VLLM_BATCH_INVARIANT=1 server (started here unless --server is "
        "given), recompute every sampled token's logprob with the trainer model, print a table. "
        "Exit status: 0 every token bitwise equal; 1 some differ; 2 usage error (bad arguments, missing files); "
        "3 server or environment error (the server did not start, did not answer, or failed a request, e.g. "
        "a non-finite logprob); 4 the server's vllm_bi settings differ from this trainer's (GDN mode, GEMM, "
        "CUDA ops, attention, MoE path), so equality is impossible: checked before sampling.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    pa.add_argument("--model", required=True, help="local HF checkpoint directory (served and loaded by the trainer)")
    pa.add_argument("--server", default=None, help="URL of a running BI server serving --model (default: start one)")
    pa.add_argument("--prompts", default=None, help='JSONL file, one {"prompt": "..."} per line (default: 8 built-in)')
    pa.add_argument("--n", type=int, default=4, help="samples per prompt (default 4)")
    pa.add_argument("--max-tokens", type=int, default=32, help="tokens per sample (default 32)")
    pa.add_argument("--seed", type=int, default=0, help="base sampling seed (default 0)")
    pa.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    pa.add_argument("--trainer", default="vllm_bi", choices=["vllm_bi", "hf"],
                    help="recompute with vllm_bi's trainer model (default) or HF transformers bf16 (the usual stack)")
    pa.add_argument("--trainer-model", default=None, help="checkpoint the trainer loads (default: --model)")
    pa.add_argument("--max-num-batched-tokens", type=int, default=64,
                    help="token budget of the server this command starts (default 64: prompts get split)")
    pa.add_argument("--trainer-device", default=None, choices=["cpu", "cuda"],
                    help="where the trainer recomputes (default: cuda when available, else cpu; it must be the "
                    "server's device: CPU and GPU math libraries round exp/log differently)")
    pa.add_argument("--server-args", default="",
                    help='extra `vllm serve` arguments for the server this command starts, e.g. '
                    '"--tensor-parallel-size 2" (default: none)')
    pa.add_argument("--stock-server", action="store_true",
                    help="start the server with VLLM_BATCH_INVARIANT=0 (stock vLLM kernels): a control that shows "
                    "the gap vllm_bi closes; expected to FAIL")
    pa.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    pa.set_defaults(fn=_cmd_parity)

    from vllm_bi.tiny_models import FAMILIES, SPECS

    dg = sub.add_parser("diag", help="where server and trainer part: per decoder sub-module, exact comparison",
                        description="Runs vLLM in this process (VLLM_BATCH_INVARIANT=1) with hooks on every decoder "
                        "layer and sub-module, prefills one prompt, runs the trainer model on the same ids and "
                        "prints each module's rows that differ and max |diff|. Exit 0 when all are bitwise equal, "
                        "1 otherwise (the first differing module is named).")
    dg.add_argument("--model", required=True, help="local HF checkpoint directory")
    dg.add_argument("--trainer-model", default=None, help="checkpoint the trainer loads (default: --model)")
    dg.add_argument("--prompt-len", type=int, default=24, help="prompt length in tokens (default 24)")
    dg.add_argument("--seed", type=int, default=0, help="seed of the random prompt (default 0)")
    dg.add_argument("--json", action="store_true", help="print the rows as JSON")
    dg.set_defaults(fn=_cmd_diag)

    m = sub.add_parser("make-model", help="write a small random-weight GDN hybrid and tokenizer")
    m.add_argument("family", choices=FAMILIES)
    m.add_argument("out", help="output directory")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--spec", default="default", choices=list(SPECS),
                   help="layer dimensions (default: ~10 M parameters; 9b-dims: Qwen3.5-9B layers, 4 of them, "
                   "~0.9 B parameters; moe-router: 256 experts, top-8)")
    m.add_argument("--overwrite", action="store_true")
    m.set_defaults(fn=_cmd_make_model)

    mc = sub.add_parser("make-checkpoint", help="write a full-size random-weight checkpoint with a published config",
                        description="Writes config.json, bf16 safetensors shards and a full-vocabulary tokenizer, each "
                        "tensor drawn from a generator seeded by --seed and its name (the same bytes on any machine); "
                        "the LM head scaled for a mean next-token entropy of --entropy nats.")
    mc.add_argument("name", choices=["qwen3.5-9b", "qwen3.5-35b-a3b"])
    mc.add_argument("out", help="output directory")
    mc.add_argument("--seed", type=int, default=0)
    mc.add_argument("--layers", type=int, default=0, help="fewer layers at full width (default: the published count)")
    mc.add_argument("--device", default="cpu", help="where tensors are drawn (cuda is much faster; the bytes are "
                    "the same per device type)")
    mc.add_argument("--entropy", type=float, default=3.0, help="target mean next-token entropy in nats (default 3)")
    mc.add_argument("--overwrite", action="store_true")
    mc.set_defaults(fn=_cmd_make_checkpoint)

    pl = sub.add_parser("plot", help="PNG curves (reward, logprob diff, throughput) of a trainer run",
                        description="Reads RUN_DIR/metrics.jsonl (written by python -m vllm_bi.trainer) and writes "
                        "RUN_DIR/plots/reward.png, logprob_diff.png and throughput.png.")
    pl.add_argument("run_dir", help="a trainer run directory (--run-dir of python -m vllm_bi.trainer)")
    pl.set_defaults(fn=_cmd_plot)

    i = sub.add_parser("info", help="versions and plugin registration")
    i.set_defaults(fn=_cmd_info)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, FileNotFoundError, FileExistsError, RuntimeError) as e:
        print(f"vllm-bi {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
