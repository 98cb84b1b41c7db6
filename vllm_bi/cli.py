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

A mistake is one line on stderr naming the problem and the fix, and every command's exit status has one meaning
(:mod:`vllm_bi.errors`: 0 passed or done, 1 a difference found, 2 usage, 3 server or environment, 4 settings
differ, 130 Ctrl-C); each ``--help`` lists its own.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shlex
import sys
import time

from vllm_bi.errors import DIFFER, OK, EnvironmentProblem, OneLineParser, UserError, exit_status_help, run_command

__all__ = ["main", "build_parser"]


def _cmd_make_model(args) -> int:
    from vllm_bi.tiny_models import SPECS, build_tiny_model

    path = build_tiny_model(args.family, args.out, seed=args.seed, spec=SPECS[args.spec], overwrite=args.overwrite)
    print(f"wrote {args.family} (spec {args.spec}, seed {args.seed}) to {path}")
    return 0


def _cmd_make_checkpoint(args) -> int:
    from vllm_bi.checkpoints import write_checkpoint

    if args.device.startswith("cuda"):
        _require_cuda("--device cuda")
    overrides = {"num_hidden_layers": args.layers} if args.layers else None
    path = write_checkpoint(args.name, args.out, seed=args.seed, overrides=overrides, device=args.device,
                            entropy=args.entropy, overwrite=args.overwrite, lm_head_rows=args.lm_head_rows)
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
    if not eps:
        raise EnvironmentProblem("vLLM does not find the vllm_bi plugin (no vllm.general_plugins entry point named "
                                 "vllm_bi): reinstall vllm_bi into this Python environment (pip install .)")
    return OK


def _fmt(xs, n=6):
    return "[" + ", ".join(f"{x:.6f}" if isinstance(x, float) else str(x) for x in xs[:n]) + (", ...]" if len(xs) > n else "]")


def _cmd_demo(args) -> int:
    from vllm_bi.launcher import VllmServer
    from vllm_bi.parity import serving
    from vllm_bi.tiny_models import build_tiny_model

    model = args.model
    if model is not None:
        from vllm_bi.model_dir import read_model_config

        read_model_config(model, "--model", qwen_only="vllm-bi demo")  # before the server starts: one line
    _check_settings()
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
    with serving(VllmServer(model, batch_invariant=True, args=server_args)) as srv:
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

        stock = VllmServer(model, batch_invariant=False, env=cpu_env(False), args=server_args + ["--enforce-eager"])
        with serving(stock) as srv:
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
    from vllm_bi.parity import load_prompts, run_parity

    log = (lambda *a, **k: print(*a, file=sys.stderr, **k)) if args.json else print
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
        server_args=args.server_args,
        stock_server=args.stock_server,
        api_key=args.api_key,
        log=log,
    )
    print(report.to_json() if args.json else report.table())
    return OK if report.ok else DIFFER


def _cmd_diag(args) -> int:
    import json

    from vllm_bi.diag import first_difference, format_rows, layer_diff

    rows = layer_diff(args.model, args.trainer_model, args.prompt_len, args.seed)
    print(json.dumps(rows) if args.json else format_rows(rows))
    return OK if first_difference(rows) is None else DIFFER


def _cmd_plot(args) -> int:
    from vllm_bi.trainer.plot import plot_run

    for path in plot_run(args.run_dir):
        print(path)
    return OK


# --------------------------------------------------------------------------- argument checks and the error path


def _int(lo: int, hi: int | None = None):
    """An argparse type: an integer in ``[lo, hi]``."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"must be {f'between {lo} and {hi}' if hi is not None else f'>= {lo}'}, "
                                             f"got {v}")
        return v

    return parse


def _float(lo: float, lo_open: bool = False):
    """An argparse type: a finite float ``>= lo`` (``> lo`` when ``lo_open``)."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(v) or v < lo or (lo_open and v == lo):
            raise argparse.ArgumentTypeError(f"must be a finite number {'>' if lo_open else '>='} {lo:g}, got {text}")
        return v

    return parse


def _url(text: str) -> str:
    if not text.startswith(("http://", "https://")) or len(text.split("://", 1)[1].strip("/")) == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a server URL; give one like http://127.0.0.1:8000")
    return text


def _args_list(text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} cannot be split like a shell line ({e})") from None


def _require_cuda(what: str) -> None:
    import torch

    if not torch.cuda.is_available():
        raise EnvironmentProblem(f"{what}: torch finds no CUDA device on this machine; use cpu or run it on a GPU")


def _check_settings() -> None:
    """This process's VLLM_BI_* settings, read now: a bad value is refused before a server starts."""
    from vllm_bi.settings import current

    current()


def _explain(args):
    """The command's known errors from the layers below as one line (:func:`vllm_bi.known_errors.explain`)."""

    def explain(e: BaseException) -> UserError | None:
        from vllm_bi.known_errors import explain

        url = getattr(args, "server", None)
        fix = (f"check that a server runs at --server {url} (or leave --server out to let this command start one)"
               if url else "the server this command started stopped answering; its log says why")
        return explain(e, fix)

    return explain


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="vllm-bi", description="vllm_bi: batch-invariant vLLM for GDN hybrids",
                      epilog=exit_status_help("done", "the command's check found a difference (parity, diag, demo)",
                                              "the server's vllm_bi settings differ from the trainer's (parity)"))
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("demo", help="serve a small GDN model with batch invariance and show a request is unchanged "
                       "by batching", epilog=exit_status_help("the request is the same alone and in a busy batch",
                                               "it changed with the batch under vllm_bi"))
    d.add_argument("--model", default=None, help="model directory (default: build the built-in small model)")
    d.add_argument("--family", default="qwen3-next", choices=["qwen3-next", "qwen3.5", "qwen3.5-moe"],
                   help="built-in model family when --model is not given (default: qwen3-next)")
    d.add_argument("--workdir", default=os.path.join(os.getcwd(), ".vllm_bi_demo"),
                   help="where the built-in model is written (default: ./.vllm_bi_demo)")
    d.add_argument("--prompt-len", type=_int(1, 1024), default=120,
                   help="prompt length in tokens, 1-1024 (default 120)")
    d.add_argument("--max-tokens", type=_int(1, 512), default=16, help="tokens to generate, 1-512 (default 16)")
    d.add_argument("--busy", type=_int(1, 64), default=9,
                   help="other requests in flight for the busy run, 1-64 (default 9)")
    d.add_argument("--max-num-batched-tokens", type=_int(1), default=32,
                   help="engine token budget per step; small values split prompts (default 32)")
    d.add_argument("--seed", type=_int(0), default=0, help="seed for the random prompts (default 0)")
    d.add_argument("--no-compare-stock", dest="compare_stock", action="store_false",
                   help="skip the same greedy request on stock vLLM (plugin inactive) for contrast")
    d.set_defaults(fn=_cmd_demo)

    pa = sub.add_parser(
        "parity",
        help="sample from a batch-invariant server and check the trainer's logprobs equal the server's bit for bit",
        description="Sample completions from a VLLM_BATCH_INVARIANT=1 server (started here unless --server is "
        "given), recompute every sampled token's logprob with the trainer model, print a table. The model "
        "directory, its architecture, the prompts and the settings are checked before a server starts.",
        epilog=exit_status_help(
            "every token bitwise equal", "some differ (the table shows the first)",
            "the server's vllm_bi settings differ from this trainer's (GDN mode, GEMM, CUDA ops, attention, MoE "
            "path), so equality is impossible: checked before sampling",
            environment="server or environment error (the server did not start, did not answer, refused or failed "
            "a request, e.g. a non-finite logprob; a missing package or device)"),
    )
    pa.add_argument("--model", required=True, help="local HF checkpoint directory (served and loaded by the trainer)")
    pa.add_argument("--server", type=_url, default=None,
                    help="URL of a running BI server serving --model (default: start one)")
    pa.add_argument("--api-key", default=None,
                    help="the --server's API key (default: VLLM_API_KEY); a server this command starts gets a key "
                    "made for the run")
    pa.add_argument("--prompts", default=None, help='JSONL file, one {"prompt": "..."} per line (default: 8 built-in); '
                    'a line with "tools": ["...", ...] is a multi-turn prompt: after each model turn the next tool '
                    'output, each turn a new request on the conversation\'s token ids; its model tokens are compared')
    pa.add_argument("--n", type=_int(1), default=4, help="samples per prompt (default 4)")
    pa.add_argument("--max-tokens", type=_int(1), default=32, help="tokens per sample (default 32)")
    pa.add_argument("--seed", type=_int(0), default=0, help="base sampling seed (default 0)")
    pa.add_argument("--temperature", type=_float(0.0), default=1.0, help="sampling temperature, >= 0 (default 1.0)")
    pa.add_argument("--trainer", default="vllm_bi", choices=["vllm_bi", "transformers", "hf"],
                    help="recompute with vllm_bi's trainer model (default), transformers' own model class adapted "
                    "to vllm_bi's op library (vllm_bi.integrations.transformers.apply: what an outside trainer "
                    "runs), or HF transformers bf16 as it is (the usual stack: expected to FAIL)")
    pa.add_argument("--trainer-model", default=None, help="checkpoint the trainer loads (default: --model)")
    pa.add_argument("--max-num-batched-tokens", type=_int(1), default=64,
                    help="token budget of the server this command starts (default 64: prompts get split)")
    pa.add_argument("--trainer-device", default=None, choices=["cpu", "cuda"],
                    help="where the trainer recomputes (default: cuda when available, else cpu; it must be the "
                    "server's device: CPU and GPU math libraries round exp/log differently)")
    pa.add_argument("--server-args", type=_args_list, default=[],
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
                        "prints each module's rows that differ and max |diff|; the first differing module is named.",
                        epilog=exit_status_help("every module bitwise equal", "some module differs"))
    dg.add_argument("--model", required=True, help="local HF checkpoint directory")
    dg.add_argument("--trainer-model", default=None, help="checkpoint the trainer loads (default: --model)")
    dg.add_argument("--prompt-len", type=_int(1, 511), default=24, help="prompt length in tokens, 1-511 (default 24)")
    dg.add_argument("--seed", type=_int(0), default=0, help="seed of the random prompt (default 0)")
    dg.add_argument("--json", action="store_true", help="print the rows as JSON")
    dg.set_defaults(fn=_cmd_diag)

    m = sub.add_parser("make-model", help="write a small random-weight GDN hybrid and tokenizer",
                       epilog=exit_status_help("written (or the same model was already there)"))
    m.add_argument("family", choices=FAMILIES)
    m.add_argument("out", help="output directory")
    m.add_argument("--seed", type=_int(0), default=0)
    m.add_argument("--spec", default="default", choices=list(SPECS),
                   help="layer dimensions (default: ~10 M parameters; 9b-dims: Qwen3.5-9B layers, 4 of them, "
                   "~0.9 B parameters; moe-router: 256 experts, top-8)")
    m.add_argument("--overwrite", action="store_true", help="replace what the output directory holds")
    m.set_defaults(fn=_cmd_make_model)

    mc = sub.add_parser("make-checkpoint", help="write a full-size random-weight checkpoint with a published config",
                        description="Writes config.json, bf16 safetensors shards and a full-vocabulary tokenizer, each "
                        "tensor drawn from a generator seeded by --seed and its name (the same bytes on any machine); "
                        "the LM head scaled for a mean next-token entropy of --entropy nats.",
                        epilog=exit_status_help("written"))
    mc.add_argument("name", choices=["qwen3.5-9b", "qwen3.5-35b-a3b"])
    mc.add_argument("out", help="output directory")
    mc.add_argument("--seed", type=_int(0), default=0)
    mc.add_argument("--layers", type=_int(0), default=0,
                    help="fewer layers at full width (default: the published count; below 4 the last is full attention)")
    mc.add_argument("--device", default="cpu", help="where tensors are drawn (cuda is much faster; the bytes are "
                    "the same per device type)")
    mc.add_argument("--entropy", type=_float(0.0, lo_open=True), default=3.0,
                    help="target mean next-token entropy in nats, > 0 and < log(vocabulary) (default 3)")
    mc.add_argument("--lm-head-rows", type=_int(0), default=0,
                    help="keep only N rows of the LM head (token ids 10..10+N-1, in opposite pairs), the others zero: "
                    "decoding picks among N tokens and the random MTP drafter agrees with its target about 1/N of "
                    "the time (a knob for speculative decoding's acceptance); 0, the default: every row, scaled for "
                    "--entropy")
    mc.add_argument("--overwrite", action="store_true", help="replace what the output directory holds")
    mc.set_defaults(fn=_cmd_make_checkpoint)

    pl = sub.add_parser("plot", help="PNG curves (reward, logprob diff, throughput) of a trainer run",
                        description="Reads RUN_DIR/metrics.jsonl (written by python -m vllm_bi.trainer) and writes "
                        "RUN_DIR/plots/reward.png, logprob_diff.png and throughput.png.",
                        epilog=exit_status_help("written"))
    pl.add_argument("run_dir", help="a trainer run directory (--run-dir of python -m vllm_bi.trainer)")
    pl.set_defaults(fn=_cmd_plot)

    i = sub.add_parser("info", help="versions and plugin registration",
                       epilog=exit_status_help("printed, and vLLM finds the plugin",
                                               environment="vLLM does not find the vllm_bi plugin"))
    i.set_defaults(fn=_cmd_info)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(f"vllm-bi {args.cmd}", lambda: args.fn(args), _explain(args))


if __name__ == "__main__":
    sys.exit(main())
