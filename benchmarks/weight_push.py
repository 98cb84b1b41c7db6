"""Benchmark: pushing a checkpoint's weights into a running ``VLLM_BATCH_INVARIANT=1`` server, through files (an HF
checkpoint written, then reloaded by the server) and through vLLM's weight-transfer engine (CUDA IPC, nothing
written), each push verified by the weight digest.

    python benchmarks/weight_push.py --model DIR [--pushes 3] [--transfers files,ipc] [--out weight_push.md]

The pushing side holds the checkpoint's tensors on the GPU (bf16, under the checkpoint's names, as a trainer's
gathered state), the server runs beside it on the same GPU with ``--weight-transfer-config '{"backend": "ipc"}'``,
and every push goes through :class:`vllm_bi.weight_push.WeightPush`, the class the trainer's and outside trainers'
pushes use: pause, label, load, reset the prefix cache, label, resume, digest check. Each push changes one element
of every tensor it sends, so the digest check fails unless the new weights arrived. The MTP drafter's tensors
(``mtp.*``) are left out: the served model does not load them. Median seconds per part over ``--pushes`` pushes after
one untimed push per transfer (the IPC engine's set-up, the first write's page cache).
"""

from __future__ import annotations

import argparse
import glob
import os
import shlex
import statistics
import sys
import tempfile
import time

import torch

SERVER_ARGS = "--gpu-memory-utilization 0.45 --max-model-len 4096 --max-num-seqs 256"  # vLLM's default 1024
# sequences need more GDN state slots than 0.45 of an 80 GB GPU leaves beside a 9B model
PARTS = (("gather + write", "time/sync_save_s"), ("swap (pause .. resume)", "time/sync_swap_s"),
         ("digest check", "time/sync_verify_s"))


def load_state(model: str, device: str) -> dict:
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(model, "*.safetensors")))
    if not files:
        raise SystemExit(f"weight_push.py: no *.safetensors in {model}: give a checkpoint directory "
                         "(vllm-bi make-checkpoint ...)")
    state = {}
    for f in files:
        state.update((k, v) for k, v in load_file(f, device=device).items() if not k.startswith("mtp."))
    return state


def make_push(client, run_dir: str, model: str, transfer: str):
    from vllm_bi.model_dir import write_checkpoint
    from vllm_bi.weight_push import WeightPush

    class StatePush(WeightPush):
        def state_dict(self, m):
            return m

        def write(self, m, path, state):
            write_checkpoint(path, state, like=model)

    return StatePush(client, run_dir, base_model=model, keep=1, transfer=transfer)


def bump(state: dict) -> None:
    """Change one element of every tensor (its first, to the next representable value: its bits as an integer plus
    one), so that each push carries new bits."""
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    for t in state.values():
        t.view(-1)[:1].view(ints[t.element_size()]).add_(1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a checkpoint directory (vllm-bi make-checkpoint ...)")
    ap.add_argument("--pushes", type=int, default=3, help="timed pushes per transfer (after one untimed push)")
    ap.add_argument("--transfers", default="files,ipc", help="comma-separated subset of files,ipc")
    ap.add_argument("--server-args", default=SERVER_ARGS, help="`vllm serve` arguments")
    ap.add_argument("--run-dir", default=None, help="where the files transfer writes its versions (default: a "
                    "temporary folder)")
    ap.add_argument("--out", default="weight_push.md")
    args = ap.parse_args()
    transfers = [t for t in args.transfers.split(",") if t]
    if not transfers or any(t not in ("files", "ipc") for t in transfers):
        ap.error(f"--transfers: a comma-separated subset of files,ipc, got {args.transfers!r}")
    if args.pushes < 1:
        ap.error("--pushes must be >= 1")
    if not torch.cuda.is_available():
        print("weight_push.py: needs a CUDA GPU (the IPC transfer moves CUDA tensors)", file=sys.stderr)
        return 3

    from vllm_bi.launcher import VllmServer, cpu_env

    t0 = time.perf_counter()
    state = load_state(args.model, "cuda")
    gib = sum(t.numel() * t.element_size() for t in state.values()) / 2**30
    print(f"[weight-push] {len(state)} tensors, {gib:.2f} GiB on the GPU in {time.perf_counter() - t0:.0f} s",
          flush=True)
    run_dir = args.run_dir or tempfile.mkdtemp(prefix="vllm_bi_push_")
    env = cpu_env(True, {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})
    srv_args = shlex.split(args.server_args) + ["--weight-transfer-config", '{"backend": "ipc"}']
    log = os.path.join(os.environ.get("OUT", run_dir), "server-weight-push.log")
    rows = {}
    version = 0
    with VllmServer(args.model, env=env, args=srv_args, startup_timeout=480, log_path=log) as srv:
        print(f"[weight-push] server up in {time.perf_counter() - t0:.0f} s", flush=True)
        for transfer in transfers:
            push = make_push(srv, os.path.join(run_dir, transfer), args.model, transfer)
            timings = []
            for i in range(args.pushes + 1):
                version += 1
                bump(state)
                torch.cuda.synchronize()
                t = push.push(state, version, state)
                t["total"] = sum(t.values())
                print(f"[weight-push] {transfer} v{version}{' (untimed)' if i == 0 else ''}: "
                      + ", ".join(f"{k.split('/')[-1]} {v:.2f}" for k, v in t.items()), flush=True)
                if i:
                    timings.append(t)
            rows[transfer] = {label: statistics.median(t[key] for t in timings) for label, key in PARTS}
            rows[transfer]["whole push"] = statistics.median(t["total"] for t in timings)
    labels = [label for label, _ in PARTS] + ["whole push"]
    lines = [f"# Weight push, {args.model} ({len(state)} tensors, {gib:.2f} GiB bf16), digest-verified", "",
             "command: " + shlex.join([sys.executable, *sys.argv]), "",
             f"| part (median s over {args.pushes} pushes) | " + " | ".join(transfers) + " |",
             "| --- |" + " ---: |" * len(transfers)]
    lines += [f"| {label} | " + " | ".join(f"{rows[t][label]:.2f}" for t in transfers) + " |" for label in labels]
    lines.append(f"| GiB/s, whole push | " + " | ".join(f"{gib / rows[t]['whole push']:.1f}" for t in transfers) + " |")
    from common import emit

    emit("\n".join(lines) + "\n", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
