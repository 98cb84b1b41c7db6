#!/usr/bin/env python3
"""Randomized-schedule fuzzing of a batch-invariant ``vllm serve``: a request in a busy, randomly scheduled batch must
give the tokens and logprobs it gives alone, bit for bit.

A **case** is one target request (prompt + sampling parameters) in one batch, compared with the same request run
alone on the same server: every choice's token ids and logprobs with ``==`` (the floats as the server returns them,
no tolerance). A batch holds 12 targets (each other's batch mates) and, drawn per batch, up to 6 further batch mates
of random lengths, up to 3 aborted neighbours (streaming clients that disconnect after 1-4 chunks, requests with a
client timeout of 20-500 ms), prompts that share a prefix with the prefix cache warmed first, random start delays
(a request joins while others run) and a random order. Each request is greedy, seeded sampling at temperature 1 (a
``seed`` of its own), or ``n`` = 2-3 seeded samples. A batch's targets are drawn from a pool of 32 requests that
serves 16 batches, so one alone run serves about six cases; an alone run has a ``cache_salt`` of its own (never a
prefix-cache hit) and nothing else in flight.

Server settings that need their own server are **profiles** (``--list-profiles``): ``max_num_batched_tokens`` 32,
64 and 2048 with prefix caching, and two forced-preemption profiles, with and without prefix caching: a KV cache of
14-18 blocks (``--num-gpu-blocks-override``; with ``--block-size 32`` the default model's hybrid blocks are 64
tokens) and ``--no-scheduler-reserve-full-isl`` (a request is admitted when its first chunk fits), so running
requests are preempted and recomputed. A forced-preemption profile whose batches saw no preemption
(``vllm:num_preemptions_total``) is an error. One server runs at a time, one per profile.

Every case is a function of the master seed, the profile and the case index: case ``i`` is slot ``i % 12`` of
batch ``i // 12``; its id is ``bi|stock/PROFILE/SEED/INDEX``. ``--replay ID`` runs that case alone and sends its
batch again (the same requests, order and delays; the engine's step boundaries depend on timing, so ``--repeat``
sends it several times) and prints the differing positions.

``--shard i/n`` takes the batches ``b`` with ``b % n == i``; ``--cases N`` is this shard's number of cases, split
over the profiles. Results are appended to a JSONL file (``--out``), one line per case: id, seed, profile, server
settings, the request (lengths, mode, seed, n), its batch (mates, aborted neighbours, and the server's counts of
preemptions, prefix-cache hit tokens and aborted requests during the batch), equal, the first difference. A rerun
skips the ids recorded there for the same model, so cases accumulate over several runs.

``--stock`` is the negative control: the same prompts on stock vLLM (``VLLM_BATCH_INVARIANT=0``, plugin inactive,
``--enforce-eager``), greedy only (a seeded request with a chunked prompt stops vLLM 0.32's CPU engine: "CPU
Generator does not use offset"). It is expected to find mismatches.

Exit status: 0 every selected case equal; 1 some case differs; 2 usage error; 3 server or environment error (a
server that does not start or fails a request, or a forced-preemption profile without a preemption).

    python scripts/fuzz_schedules.py --cases 2000 --out fuzz.jsonl            # every profile, 400 cases each
    python scripts/fuzz_schedules.py --cases 2000 --shard 1/4 --out fuzz.jsonl
    python scripts/fuzz_schedules.py --stock --profiles preempt --cases 48 --out stock.jsonl
    python scripts/fuzz_schedules.py --replay bi/preempt/0/1234 --repeat 5
    python scripts/fuzz_schedules.py --server http://127.0.0.1:8000 --profile mnbt64 --cases 400
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import os
import random
import shlex
import signal
import socket
import sys
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The generator's constants are part of every case id's meaning: changing one changes what a recorded id means,
# so GENERATOR is bumped with them (and recorded in every line).
GENERATOR = 1
TARGETS_PER_BATCH = 12
POOL_SIZE = 32
POOL_BATCHES = 16  # batches that draw their targets from one pool
MAX_MATES = 6
MAX_ABORTED = 3
MAX_PROMPT = 300

EXIT_OK, EXIT_MISMATCH, EXIT_USAGE, EXIT_ENV = 0, 1, 2, 3


class UsageError(Exception):
    pass


class EnvError(Exception):
    pass


# --------------------------------------------------------------------------------------------------- profiles
MAX_SEQS = 16  # --max-num-seqs of every profile (fewer when the KV cache has fewer blocks)
@dataclass(frozen=True)
class Profile:
    """Server settings: ``max_num_batched_tokens``, prefix caching, and for a forced-preemption profile the KV
    cache's size in blocks (``--num-gpu-blocks-override``)."""

    name: str
    mnbt: int
    prefix_caching: bool
    max_model_len: int
    kv_blocks: int | None = None  # None: the KV cache vLLM sizes itself (no preemption)
    min_max_tokens: int = 1
    max_max_tokens: int = 24
    extra: tuple[str, ...] = ()  # further `vllm serve` arguments

    @property
    def forces_preemption(self) -> bool:
        return self.kv_blocks is not None

    def server_args(self, kv_blocks: int | None = None, stock: bool = False) -> list[str]:
        blocks = (kv_blocks or self.kv_blocks) if self.kv_blocks is not None else None
        # a decode step captured in a CUDA graph needs one state block per sequence: at most `blocks` sequences
        seqs = min(MAX_SEQS, blocks) if blocks else MAX_SEQS
        args = ["--max-num-batched-tokens", str(self.mnbt), "--max-num-seqs", str(seqs), "--block-size", "32",
                "--max-model-len", str(self.max_model_len),
                "--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching"]
        if self.kv_blocks is not None:
            args += ["--num-gpu-blocks-override", str(blocks)]
        args += list(self.extra)
        if stock:
            args.append("--enforce-eager")
        return args


# The KV-cache sizes fit the default model (qwen3-next, spec small-blocks: 64-token hybrid blocks, four KV-cache
# groups): one request of max_model_len tokens fits (vLLM refuses to start otherwise), so a request alone is never
# preempted; in a batch, requests admitted on their first chunk are preempted as they grow. Another model may need
# --kv-blocks.
PROFILES = {p.name: p for p in (
    Profile("mnbt32", 32, True, 1024),
    Profile("mnbt64", 64, True, 1024),
    Profile("mnbt2048", 2048, True, 1024),
    Profile("preempt", 64, False, 192, kv_blocks=18, min_max_tokens=4, max_max_tokens=16,
            extra=("--no-scheduler-reserve-full-isl",)),
    Profile("preempt-prefix", 64, True, 256, kv_blocks=14, min_max_tokens=16, max_max_tokens=48,
            extra=("--no-scheduler-reserve-full-isl",)),
)}


# --------------------------------------------------------------------------------------------------- requests
@dataclass(frozen=True)
class Req:
    prompt: tuple[int, ...]
    max_tokens: int
    mode: str  # greedy | seeded | n
    seed: int | None = None
    n: int = 1
    prefix: int = 0  # length of the shared prefix the prompt starts with (0: none)

    def body(self, model: str) -> dict:
        b = {"model": model, "prompt": list(self.prompt), "max_tokens": self.max_tokens, "logprobs": 0,
             "temperature": 0.0 if self.mode == "greedy" else 1.0, "top_p": 1.0, "n": self.n,
             "return_token_ids": True, "return_tokens_as_token_ids": True, "ignore_eos": True,
             "skip_special_tokens": False}
        if self.seed is not None:
            b["seed"] = self.seed
        return b

    def key(self) -> str:
        return hashlib.sha1(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]

    def summary(self) -> dict:
        return {"prompt_len": len(self.prompt), "prefix_len": self.prefix, "max_tokens": self.max_tokens,
                "mode": self.mode, "seed": self.seed, "n": self.n, "key": self.key()}


@dataclass
class Sent:
    """One request of a batch: its role (target / mate / abort-stream / abort-timeout), start delay (s), and for an
    aborted neighbour how many stream chunks it reads or its client timeout (s)."""

    role: str
    req: Req
    delay: float
    slot: int = -1  # a target's slot
    chunks: int = 0
    timeout: float = 0.0


@dataclass
class Batch:
    profile: str
    seed: int
    index: int
    sent: list[Sent]
    warm: list[Req]  # prefix-cache warm-up requests sent (one at a time) before the batch

    def targets(self) -> list[Sent]:
        return sorted((s for s in self.sent if s.role == "target"), key=lambda s: s.slot)


def _rng(*parts) -> random.Random:
    return random.Random(":".join(str(p) for p in ("vllm_bi-fuzz", GENERATOR) + parts))


def _ids(rng: random.Random, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.randrange(3, vocab) for _ in range(n))


def _mode(rng: random.Random, stock: bool, allow_n: bool = True) -> tuple[str, int | None, int]:
    r = rng.random()
    seed = rng.randrange(2**31)  # drawn in every branch: stock and BI cases share their prompts
    n = rng.randint(2, 3)
    if stock:  # greedy only (see the module doc)
        return "greedy", None, 1
    if r < 0.4:
        return "greedy", None, 1
    if r < 0.8 or not allow_n:
        return "seeded", seed, 1
    return "n", seed, n


def _length(rng: random.Random, cap: int) -> int:
    r = rng.random()
    if r < 0.4:
        n = rng.randint(1, 16)
    elif r < 0.8:
        n = rng.randint(17, 96)
    else:
        n = rng.randint(97, MAX_PROMPT)
    return max(1, min(n, cap))


def _max_tokens(rng: random.Random, prof: Profile) -> int:
    return rng.randint(prof.min_max_tokens, prof.max_max_tokens)


def make_pool(seed: int, prof: Profile, generation: int, vocab: int, stock: bool) -> tuple[list[Req], list[tuple]]:
    """The targets of batches ``generation * POOL_BATCHES ...``: POOL_SIZE requests, 40% of them starting with one
    of three shared prefixes of 64-200 tokens; and those prefixes."""
    rng = _rng(seed, prof.name, "pool", generation)
    cap = prof.max_model_len - prof.max_max_tokens - 1
    prefixes = [_ids(rng, rng.randint(64, min(200, cap - 8)), vocab) for _ in range(3)]
    pool = []
    for _ in range(POOL_SIZE):
        mt = _max_tokens(rng, prof)
        mode, s, n = _mode(rng, stock)
        if rng.random() < (0.4 if prof.prefix_caching else 0.1):
            pre = prefixes[rng.randrange(3)]
            prompt = pre + _ids(rng, rng.randint(1, min(60, cap - len(pre))), vocab)
            pool.append(Req(prompt, mt, mode, s, n, prefix=len(pre)))
        else:
            pool.append(Req(_ids(rng, _length(rng, cap), vocab), mt, mode, s, n))
    return pool, prefixes


def make_batch(seed: int, prof: Profile, index: int, vocab: int, stock: bool) -> Batch:
    """Batch ``index`` of ``prof`` under master ``seed``: a pure function of its arguments."""
    pool, _ = make_pool(seed, prof, index // POOL_BATCHES, vocab, stock)
    rng = _rng(seed, prof.name, "batch", index)
    cap = prof.max_model_len - prof.max_max_tokens - 1

    def delay():
        return 0.0 if rng.random() < 0.5 else round(rng.uniform(0.0, 0.4), 3)

    sent = [Sent("target", pool[rng.randrange(POOL_SIZE)], delay(), slot=k) for k in range(TARGETS_PER_BATCH)]
    for _ in range(rng.randint(0, MAX_MATES)):
        mode, s, n = _mode(rng, stock)
        sent.append(Sent("mate", Req(_ids(rng, _length(rng, cap), vocab), _max_tokens(rng, prof), mode, s, n),
                         delay()))
    for _ in range(rng.randint(0, MAX_ABORTED)):
        mode, s, _n = _mode(rng, stock, allow_n=False)
        mt = rng.randint(16, 48)  # long enough to be running when its client hangs up
        req = Req(_ids(rng, _length(rng, prof.max_model_len - mt - 1), vocab), mt, mode, s)
        if rng.random() < 0.5:
            sent.append(Sent("abort-stream", req, delay(), chunks=rng.randint(1, 4)))
        else:
            sent.append(Sent("abort-timeout", req, delay(), timeout=round(rng.uniform(0.02, 0.5), 3)))
    rng.shuffle(sent)
    warm = []
    if prof.prefix_caching and rng.random() < 0.8:
        seen = set()
        for t in sorted((s for s in sent if s.role == "target"), key=lambda s: s.slot):
            if t.req.prefix and t.req.prompt[: t.req.prefix] not in seen:
                seen.add(t.req.prompt[: t.req.prefix])
                warm.append(Req(t.req.prompt[: t.req.prefix] + _ids(rng, 3, vocab), 1, "greedy"))
    return Batch(prof.name, seed, index, sent, warm)


# --------------------------------------------------------------------------------------------------- the server
class Target:
    """The server the cases run on: a :class:`vllm_bi.client.VllmClient` plus the raw HTTP that aborting
    clients need."""

    def __init__(self, client, timeout: float = 300.0):
        self.client = client
        self.timeout = timeout
        u = urllib.parse.urlparse(client.url)
        self.host, self.port = u.hostname, u.port or 80
        self.sent_requests = 0

    def complete(self, req: Req, cache_salt: str | None = None) -> list[tuple[list[int], list[float]]]:
        """Every choice's (token ids, logprobs), in choice order."""
        from vllm_bi.client import ServerError

        body = req.body(self.client.model)
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        out = self.client._post("/v1/completions", body, timeout=self.timeout)
        choices = sorted(out["choices"], key=lambda c: c["index"])
        if len(choices) != req.n:
            raise ServerError(f"asked for n={req.n} choices, got {len(choices)}")
        res = []
        for ch in choices:
            toks = list(ch["token_ids"])
            lps = [float(x) for x in ch["logprobs"]["token_logprobs"]]
            if len(toks) != req.max_tokens or len(lps) != len(toks):
                raise ServerError(f"choice {ch['index']}: {len(toks)} tokens, {len(lps)} logprobs for max_tokens "
                                  f"{req.max_tokens} with ignore_eos")
            res.append((toks, lps))
        return res

    def abort_stream(self, req: Req, chunks: int) -> bool:
        """Stream ``req`` and close the connection after ``chunks`` chunks; True if it hung up before the end."""
        body = dict(req.body(self.client.model), stream=True)
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            conn.request("POST", "/v1/completions", json.dumps(body),
                         self.client._headers({"Content-Type": "application/json"}))
            resp = conn.getresponse()
            if resp.status != 200:
                raise EnvError(f"streaming request -> HTTP {resp.status}: {resp.read()[:300]!r}")
            seen = 0
            while seen < chunks:
                line = resp.readline()
                if not line or line.strip() == b"data: [DONE]":
                    return False
                seen += line.startswith(b"data:")
            return True
        finally:
            conn.close()

    def abort_timeout(self, req: Req, timeout: float) -> bool:
        """Send ``req`` and give up after ``timeout`` s; True if it gave up."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            conn.request("POST", "/v1/completions", json.dumps(req.body(self.client.model)),
                         self.client._headers({"Content-Type": "application/json"}))
            resp = conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                raise EnvError(f"request -> HTTP {resp.status}: {body[:300]!r}")
            return False
        except (socket.timeout, TimeoutError):
            return True
        finally:
            conn.close()

    def counters(self) -> dict[str, float]:
        m = self.client.metrics()

        def total(name, label=None):
            return sum(v for k, v in m.items() if k.split("{")[0] == name and (label is None or label in k))

        return {"preemptions": total("vllm:num_preemptions_total"),
                "prefix_hits": total("vllm:prefix_cache_hits_total"),
                "finished": total("vllm:request_success_total"),
                "busy": total("vllm:num_requests_running") + total("vllm:num_requests_waiting")}

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until the server reports no running or waiting request (an aborted neighbour may still be in flight)."""
        deadline = time.time() + timeout
        while self.counters()["busy"] > 0 and time.time() < deadline:
            time.sleep(0.05)


# --------------------------------------------------------------------------------------------------- running
def first_diff(alone, busy) -> dict | None:
    """The first (choice, position) where token id or logprob differ, with both values; None if all equal."""
    for c, ((ta, la), (tb, lb)) in enumerate(zip(alone, busy)):
        for p in range(max(len(ta), len(tb))):
            if p >= len(ta) or p >= len(tb) or ta[p] != tb[p] or la[p] != lb[p]:
                return {"choice": c, "pos": p,
                        "what": "token" if p < len(ta) and p < len(tb) and ta[p] != tb[p] else "logprob",
                        "alone": [ta[p], la[p]] if p < len(ta) else None,
                        "busy": [tb[p], lb[p]] if p < len(tb) else None}
    if len(alone) != len(busy):
        return {"choice": min(len(alone), len(busy)), "pos": 0, "what": "choices", "alone": None, "busy": None}
    return None


def run_batch(tgt: Target, batch: Batch) -> dict:
    """Send ``batch``'s warm-up requests one by one, then all its requests at once (each after its delay).
    Returns the targets' choices by slot and the batch's counter deltas."""
    tgt.wait_idle()
    for w in batch.warm:
        tgt.complete(w)
    c0 = tgt.counters()
    gate = threading.Barrier(len(batch.sent))
    hung_up = []

    def send(s: Sent):
        try:
            gate.wait(timeout=30)
        except threading.BrokenBarrierError:
            pass
        if s.delay:
            time.sleep(s.delay)
        if s.role == "abort-stream":
            hung_up.append(tgt.abort_stream(s.req, s.chunks))
            return None
        if s.role == "abort-timeout":
            hung_up.append(tgt.abort_timeout(s.req, s.timeout))
            return None
        return tgt.complete(s.req)

    with ThreadPoolExecutor(max_workers=len(batch.sent)) as ex:
        results = list(ex.map(send, batch.sent))
    tgt.wait_idle()
    c1 = tgt.counters()
    # vLLM counts a finished sequence (each of a request's n) in vllm:request_success_total, an aborted one not:
    # the aborting clients' requests the server aborted are those missing from that count
    completed = [s.req.n for s in batch.sent if not s.role.startswith("abort")]
    aborters = sum(s.role.startswith("abort") for s in batch.sent)
    finished = int(c1["finished"] - c0["finished"])
    return {"targets": {s.slot: r for s, r in zip(batch.sent, results) if s.role == "target"},
            "preemptions": int(c1["preemptions"] - c0["preemptions"]),
            "prefix_hits": int(c1["prefix_hits"] - c0["prefix_hits"]),
            "aborted": aborters - (finished - sum(completed)), "hung_up": sum(hung_up),
            "finished": finished, "completed": sum(completed)}


COUNTERS = ("preemptions", "prefix_hits", "aborted", "hung_up", "finished", "completed")


class AloneCache:
    """Alone references per request, for one server (settings): each run once, with nothing else in flight and a
    cache salt of its own (no prefix-cache hit)."""

    def __init__(self, tgt: Target):
        self.tgt, self.refs, self.runs = tgt, {}, 0

    def get(self, req: Req):
        k = req.key()
        if k not in self.refs:
            self.tgt.wait_idle()
            self.refs[k] = self.tgt.complete(req, cache_salt=f"alone-{k}")
            self.runs += 1
        return self.refs[k]


@dataclass
class Tally:
    cases: int = 0
    mismatches: int = 0
    preemptions: int = 0
    aborted: int = 0
    prefix_hits: int = 0
    batches: int = 0
    alone_runs: int = 0
    wall: float = 0.0
    first_mismatches: list = field(default_factory=list)


def case_id(stock: bool, profile: str, seed: int, index: int) -> str:
    return f"{'stock' if stock else 'bi'}/{profile}/{seed}/{index}"


def parse_case_id(text: str) -> tuple[bool, str, int, int]:
    parts = text.split("/")
    if len(parts) != 4 or parts[0] not in ("bi", "stock") or parts[1] not in PROFILES:
        raise UsageError(f"case id {text!r}: expected bi|stock/PROFILE/SEED/INDEX with PROFILE one of "
                         f"{', '.join(PROFILES)} (the id column of the results file)")
    try:
        return parts[0] == "stock", parts[1], int(parts[2]), int(parts[3])
    except ValueError:
        raise UsageError(f"case id {text!r}: SEED and INDEX must be integers") from None


def plan(prof_names: list[str], cases: int, shard: tuple[int, int]) -> dict[str, dict[int, list[int]]]:
    """This shard's cases: profile -> batch index -> slots. ``cases`` split over the profiles (the first ones get
    the remainder); a profile's cases are the slots of its batches ``b % n == i`` in order."""
    i, n = shard
    out = {}
    for j, name in enumerate(prof_names):
        want = cases // len(prof_names) + (j < cases % len(prof_names))
        batches, k = {}, 0
        while want > 0:
            b = i + k * n
            take = min(TARGETS_PER_BATCH, want)
            batches[b] = list(range(take))
            want -= take
            k += 1
        out[name] = batches
    return out


def load_done(path: str, model_tag: str) -> dict[str, dict]:
    done = {}
    if not os.path.exists(path):
        return done
    with open(path) as f:
        for ln, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                # a line cut short by a killed run: its case runs again
                print(f"note: {path}:{ln} is not a JSON line; ignored", file=sys.stderr)
                continue
            if rec.get("model") == model_tag and rec.get("generator") == GENERATOR:
                done[rec["id"]] = rec
    return done


def model_tag(model: str) -> str:
    """The model's name and a digest of its config and tiny-model stamp (a rebuilt model gets another tag)."""
    h = hashlib.sha1()
    for name in ("config.json", "vllm_bi_tiny.json"):
        p = os.path.join(model, name)
        if os.path.exists(p):
            with open(p, "rb") as f:
                h.update(f.read())
    return f"{os.path.basename(os.path.normpath(model))}@{h.hexdigest()[:10]}"


class Progress:
    def __init__(self, total: int, quiet: bool = False):
        self.total, self.done, self.t0, self.quiet = total, 0, time.time(), quiet
        self.tty = sys.stderr.isatty()

    def update(self, n: int, prof: str, tally: Tally, mism: int, pre: int) -> None:
        self.done += n
        if self.quiet:
            return
        el = time.time() - self.t0
        rate = self.done / el if el > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        width = 24
        fill = int(width * self.done / max(self.total, 1))
        line = (f"[{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} cases  {prof}  "
                f"mismatches {mism}  preemptions {pre}  {rate:.2f} cases/s  eta {eta:.0f} s")
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tty and not self.quiet:
            print(file=sys.stderr)


def serve_args(args, prof: Profile, stock: bool) -> list[str]:
    """The `vllm serve` arguments of ``prof``'s server: the profile's, then ``--server-args``."""
    return prof.server_args(args.kv_blocks, stock) + shlex.split(args.server_args or "")


def start_server(model: str, prof: Profile, stock: bool, argv: list[str], log_dir: str):
    from vllm_bi.launcher import ServerStartError, VllmServer, cpu_env

    log = os.path.join(log_dir, f"fuzz-{'stock' if stock else 'bi'}-{prof.name}-{os.getpid()}.log")
    srv = VllmServer(model, batch_invariant=not stock, args=argv, env=cpu_env(not stock), log_path=log)
    try:
        srv.start()
    except BaseException as e:
        srv.stop()  # a server still starting when this process is interrupted goes too
        if not isinstance(e, ServerStartError):
            raise
        raise EnvError(f"vllm serve for profile {prof.name} did not start (log: {log}); its settings: "
                       f"{' '.join(argv)}") from None
    return srv


def served_model(url: str) -> tuple[str, int | None]:
    """The model id and max_model_len a running server reports at /v1/models."""
    from vllm_bi.client import ServerError, ServerUnreachable, VllmClient

    try:
        data = VllmClient(url, "")._get("/v1/models")["data"][0]
    except (ServerUnreachable, ServerError, KeyError, IndexError) as e:
        raise EnvError(f"no model list from {url}/v1/models ({e}); is it a running vllm serve?") from None
    return data["id"], data.get("max_model_len")


def vocab_of(model: str) -> int:
    try:
        with open(os.path.join(model, "config.json")) as f:
            cfg = json.load(f)
        return int(cfg.get("vocab_size") or cfg["text_config"]["vocab_size"])
    except (OSError, KeyError, ValueError, TypeError):
        return 1024


def default_model() -> str:
    from vllm_bi.tiny_models import SPECS, build_tiny_model

    root = os.environ.get("VLLM_BI_TEST_MODELS", os.path.join(REPO, ".test_models"))
    return build_tiny_model("qwen3-next", os.path.abspath(os.path.join(root, "qwen3-next-small-blocks-s0")), seed=0,
                            spec=SPECS["small-blocks"])


def run_profile(tgt: Target, prof: Profile, seed: int, batches: dict[int, list[int]], done: dict, stock: bool,
                vocab: int, settings: dict, tag: str, out, progress: Progress, tally: Tally,
                deadline: float | None) -> None:
    alone = AloneCache(tgt)
    t0 = time.time()
    for b, slots in batches.items():
        if deadline is not None and time.time() > deadline:
            break
        ids = {s: case_id(stock, prof.name, seed, b * TARGETS_PER_BATCH + s) for s in slots}
        pending = [s for s in slots if ids[s] not in done]
        if not pending:
            continue
        batch = make_batch(seed, prof, b, vocab, stock)
        targets = {t.slot: t for t in batch.targets()}
        refs = {s: alone.get(targets[s].req) for s in pending}
        got = run_batch(tgt, batch)
        mates = sum(s.role == "mate" for s in batch.sent)
        n_abort = sum(s.role.startswith("abort") for s in batch.sent)
        for s in pending:
            diff = first_diff(refs[s], got["targets"][s])
            rec = {"id": ids[s], "generator": GENERATOR, "model": tag, "bi": not stock, "seed": seed,
                   "profile": prof.name, "settings": settings, "batch": b, "slot": s,
                   "spec": targets[s].req.summary(), "delay": targets[s].delay,
                   "batch_requests": {"targets": TARGETS_PER_BATCH, "mates": mates, "aborted": n_abort,
                                      "warm": len(batch.warm)},
                   "batch_counters": {k: got[k] for k in COUNTERS},
                   "equal": diff is None, "first_diff": diff, "time": round(time.time(), 3)}
            out.write(json.dumps(rec) + "\n")
            tally.cases += 1
            if diff is not None:
                tally.mismatches += 1
                if len(tally.first_mismatches) < 10:
                    tally.first_mismatches.append(rec)
        out.flush()
        tally.batches += 1
        tally.preemptions += got["preemptions"]
        tally.aborted += got["aborted"]
        tally.prefix_hits += got["prefix_hits"]
        progress.update(len(pending), prof.name, tally, tally.mismatches, tally.preemptions)
    tally.alone_runs = alone.runs
    tally.wall = time.time() - t0


def replay(args, model: str | None) -> int:
    stock, pname, seed, index = parse_case_id(args.replay)
    prof = PROFILES[pname]
    if args.stock and not stock:
        raise UsageError(f"--stock with the BI case {args.replay}; drop --stock or give a stock/... id")
    srv, tgt = open_target(args, model, prof, stock)
    try:
        vocab = args.vocab or vocab_of(tgt.client.model)
        b, slot = divmod(index, TARGETS_PER_BATCH)
        batch = make_batch(seed, prof, b, vocab, stock)
        target = {t.slot: t for t in batch.targets()}[slot]
        print(f"case {args.replay}: batch {b} slot {slot} of profile {pname} ({len(batch.sent)} requests, "
              f"{len(batch.warm)} warm-up); target {json.dumps(target.req.summary())}, delay {target.delay} s")
        tgt.wait_idle()
        ref = tgt.complete(target.req, cache_salt=f"alone-replay-{time.time()}")
        worst = 0
        for r in range(args.repeat):
            got = run_batch(tgt, batch)
            busy = got["targets"][slot]
            diff = first_diff(ref, busy)
            print(f"run {r + 1}/{args.repeat}: {'EQUAL' if diff is None else 'DIFFERS'}  (preemptions "
                  f"{got['preemptions']}, aborted {got['aborted']}, prefix-hit tokens {got['prefix_hits']})")
            if diff is not None:
                worst = 1
                print_diff(ref, busy)
        return EXIT_MISMATCH if worst else EXIT_OK
    finally:
        if srv is not None:
            srv.stop()


def print_diff(alone, busy, limit: int = 12) -> None:
    print(f"  {'choice':>6} {'pos':>4}  {'alone token':>11} {'busy token':>10}  {'alone logprob':>22} "
          f"{'busy logprob':>22}")
    shown = 0
    for c, ((ta, la), (tb, lb)) in enumerate(zip(alone, busy)):
        for p in range(max(len(ta), len(tb))):
            a = (ta[p], la[p]) if p < len(ta) else (None, None)
            b = (tb[p], lb[p]) if p < len(tb) else (None, None)
            if a != b and shown < limit:
                mark = "token" if a[0] != b[0] else "logprob"
                print(f"  {c:>6} {p:>4}  {a[0]!s:>11} {b[0]!s:>10}  {a[1]!r:>22} {b[1]!r:>22}  {mark}")
                shown += 1
        n_diff = sum(1 for p in range(min(len(ta), len(tb))) if (ta[p], la[p]) != (tb[p], lb[p]))
        print(f"  choice {c}: {n_diff}/{min(len(ta), len(tb))} positions differ")


def open_target(args, model: str | None, prof: Profile, stock: bool):
    """(the server started here or None, a Target) for ``prof``."""
    from vllm_bi.client import VllmClient

    if args.server:
        name, max_len = served_model(args.server)
        if max_len is not None and max_len < prof.max_model_len:
            raise EnvError(f"the server at {args.server} has max_model_len {max_len}, profile {prof.name} needs "
                           f"{prof.max_model_len}; start it with the profile's arguments (--list-profiles)")
        return None, Target(VllmClient(args.server, name))
    srv = start_server(model, prof, stock, serve_args(args, prof, stock), args.log_dir)
    return srv, Target(srv)


def summary_table(rows: list[tuple[str, Tally, int, int]], wall: float) -> str:
    head = (f"{'profile':<16} {'cases':>7} {'mismatch':>8} {'preempt':>8} {'aborted':>8} {'prefix hits':>11} "
            f"{'alone runs':>10} {'wall s':>8} {'cases/s':>8}   recorded (mismatch)")
    lines = [head, "-" * len(head)]
    tot = Tally()
    rec_tot = rec_mis = 0
    for name, t, rec, rec_mism in rows:
        rate = t.cases / t.wall if t.wall > 0 else 0.0
        lines.append(f"{name:<16} {t.cases:>7} {t.mismatches:>8} {t.preemptions:>8} {t.aborted:>8} "
                     f"{t.prefix_hits:>11} {t.alone_runs:>10} {t.wall:>8.1f} {rate:>8.2f}   {rec} ({rec_mism})")
        for k in ("cases", "mismatches", "preemptions", "aborted", "prefix_hits", "alone_runs"):
            setattr(tot, k, getattr(tot, k) + getattr(t, k))
        rec_tot += rec
        rec_mis += rec_mism
    lines.append("-" * len(head))
    rate = tot.cases / wall if wall > 0 else 0.0
    lines.append(f"{'total':<16} {tot.cases:>7} {tot.mismatches:>8} {tot.preemptions:>8} {tot.aborted:>8} "
                 f"{tot.prefix_hits:>11} {tot.alone_runs:>10} {wall:>8.1f} {rate:>8.2f}   {rec_tot} ({rec_mis})")
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="fuzz_schedules.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--cases", type=int, default=400, help="this shard's cases, split over the profiles (400)")
    p.add_argument("--seed", type=int, default=0, help="master seed (0)")
    p.add_argument("--profiles", default=",".join(PROFILES),
                   help=f"comma-separated profiles (default: all: {','.join(PROFILES)})")
    p.add_argument("--profile", help="with --server: the profile the running server was started with")
    p.add_argument("--shard", default="0/1", help="i/n: batches b with b %% n == i (0/1)")
    p.add_argument("--out", default="fuzz_schedules.jsonl", help="JSONL results, appended (fuzz_schedules.jsonl)")
    p.add_argument("--stock", action="store_true", help="negative control: stock vLLM (VLLM_BATCH_INVARIANT=0)")
    p.add_argument("--model", help="a model directory (default: the tiny qwen3-next small-blocks model, built "
                                   "under .test_models/)")
    p.add_argument("--server", help="URL of a running vllm serve to use instead of starting one (one --profile)")
    p.add_argument("--kv-blocks", type=int, help="KV-cache blocks of the forced-preemption profiles (default: the "
                                                 "profile's, sized for the default model)")
    p.add_argument("--server-args", help="further `vllm serve` arguments for every server started here, e.g. "
                                         "\"--gdn-prefill-backend triton\" where FlashInfer is missing")
    p.add_argument("--replay", metavar="CASE_ID", help="send one case's batch again and print the diff")
    p.add_argument("--repeat", type=int, default=1, help="with --replay: how many times to send the batch (1)")
    p.add_argument("--time-limit", type=float, help="stop starting batches after this many seconds (resume later)")
    p.add_argument("--vocab", type=int, help="token ids are drawn from [3, VOCAB) (default: the model's)")
    p.add_argument("--log-dir", help="where server logs go (default: beside --out)")
    p.add_argument("--list-profiles", action="store_true", help="print the profiles' server arguments and exit")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p.parse_args(argv)


def check_args(args) -> tuple[list[str], tuple[int, int]]:
    names = [s.strip() for s in (args.profile or args.profiles).split(",") if s.strip()]
    bad = [s for s in names if s not in PROFILES]
    if bad or not names:
        raise UsageError(f"unknown profile {', '.join(bad) or '(none)'}; choose from {', '.join(PROFILES)} "
                         "(--list-profiles shows their settings)")
    try:
        i, n = (int(x) for x in args.shard.split("/"))
    except ValueError:
        raise UsageError(f"--shard {args.shard!r}: give i/n with integers, e.g. --shard 0/4") from None
    if not (n >= 1 and 0 <= i < n):
        raise UsageError(f"--shard {args.shard}: need 0 <= i < n, e.g. --shard 0/4 ... 3/4")
    if args.cases < 0:
        raise UsageError(f"--cases {args.cases}: give a number of cases >= 0")
    if args.repeat < 1:
        raise UsageError(f"--repeat {args.repeat}: give 1 or more")
    if args.kv_blocks is not None and args.kv_blocks < 2:
        raise UsageError(f"--kv-blocks {args.kv_blocks}: give 2 or more blocks")
    if args.server:
        if not args.profile and not args.replay:
            raise UsageError("--server needs --profile NAME: the profile that server was started with "
                             "(--list-profiles shows each profile's arguments)")
        if args.model:
            raise UsageError("--server and --model: the server's model is used; drop --model")
        if args.kv_blocks is not None or args.server_args:
            raise UsageError("--kv-blocks and --server-args set up a server started here; drop them with --server")
    elif args.profile:
        raise UsageError("--profile names a running server's settings; use --profiles without --server")
    if args.replay:
        parse_case_id(args.replay)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        raise UsageError(f"--out {args.out}: no folder {out_dir}; create it or give another path")
    if args.model and not os.path.isfile(os.path.join(args.model, "config.json")):
        raise UsageError(f"--model {args.model}: no config.json there; give a model directory "
                         "(e.g. one written by `vllm-bi make-model`)")
    return names, (i, n)


def _terminated(signum, frame):
    raise KeyboardInterrupt  # so the server started here is stopped on the way out


def main(argv=None) -> int:
    args = parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminated)
    try:
        names, shard = check_args(args)
        if args.list_profiles:
            for name in names:
                prof = PROFILES[name]
                extra = f"  (forces preemption: {prof.kv_blocks} KV-cache blocks)" if prof.forces_preemption else ""
                print(f"{name:<16} vllm serve MODEL {' '.join(prof.server_args())}{extra}")
            return EXIT_OK
        args.log_dir = args.log_dir or os.path.dirname(os.path.abspath(args.out))
        os.makedirs(args.log_dir, exist_ok=True)
        model = None if args.server else (os.path.abspath(args.model) if args.model else default_model())
        if args.replay:
            return replay(args, model)
        return fuzz(args, names, shard, model)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except EnvError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ENV
    except KeyboardInterrupt:
        print("\ninterrupted; the cases recorded so far stay in the results file (rerun the command to resume)",
              file=sys.stderr)
        return EXIT_ENV
    except OSError as e:  # includes the client's ServerUnreachable (a ConnectionError)
        print(f"error: {e.__class__.__name__}: {e}", file=sys.stderr)
        return EXIT_ENV
    except RuntimeError as e:  # the client's ServerError: the server failed a request
        print(f"error: the server failed a request: {str(e)[:500]}", file=sys.stderr)
        return EXIT_ENV


def fuzz(args, names: list[str], shard: tuple[int, int], model: str | None) -> int:
    stock = args.stock
    if args.server:
        served, _ = served_model(args.server)
        tag = model_tag(served) if os.path.isdir(served) else served
    else:
        tag = model_tag(model)
    done = load_done(args.out, tag)
    todo = plan(names, args.cases, shard)
    total = sum(1 for name, bs in todo.items() for b, ss in bs.items() for s in ss
                if case_id(stock, name, args.seed, b * TARGETS_PER_BATCH + s) not in done)
    print(f"fuzz: {'stock vLLM (negative control)' if stock else 'batch-invariant'} server, model {tag}, "
          f"seed {args.seed}, shard {shard[0]}/{shard[1]}, {args.cases} cases over {', '.join(names)}; "
          f"{args.cases - total} already in {args.out}, {total} to run", file=sys.stderr)
    progress = Progress(total, args.quiet)
    deadline = time.time() + args.time_limit if args.time_limit else None
    rows, t0 = [], time.time()
    no_preempt = []
    with open(args.out, "a") as out:
        for name in names:
            prof = PROFILES[name]
            pending = any(case_id(stock, name, args.seed, b * TARGETS_PER_BATCH + s) not in done
                          for b, ss in todo[name].items() for s in ss)
            tally = Tally()
            if pending and not (deadline is not None and time.time() > deadline):
                srv, tgt = open_target(args, model, prof, stock)
                try:
                    settings = ({"server": args.server, "profile": name} if args.server else
                                {"args": serve_args(args, prof, stock),
                                 "VLLM_BATCH_INVARIANT": "0" if stock else "1"})
                    vocab = args.vocab or vocab_of(tgt.client.model)
                    run_profile(tgt, prof, args.seed, todo[name], done, stock, vocab, settings, tag, out, progress,
                                tally, deadline)
                finally:
                    if srv is not None:
                        srv.stop()
                if prof.forces_preemption and tally.batches and tally.preemptions == 0:
                    no_preempt.append((name, tally.batches))
            ids = [case_id(stock, name, args.seed, b * TARGETS_PER_BATCH + s) for b, ss in todo[name].items()
                   for s in ss]
            recorded = load_done(args.out, tag)
            rows.append((name, tally, sum(i in recorded for i in ids),
                         sum(i in recorded and not recorded[i]["equal"] for i in ids)))
    progress.close()
    print(summary_table(rows, time.time() - t0))
    mism_rec = sum(m for *_, m in rows)
    for _, t, _, _ in rows:
        for rec in t.first_mismatches:
            d = rec["first_diff"]
            print(f"mismatch {rec['id']}: {d['what']} at choice {d['choice']} position {d['pos']} "
                  f"(alone {d['alone']}, busy {d['busy']}); replay: --replay {rec['id']}"
                  + (" --stock" if stock else ""))
    if stock:
        print(f"negative control: stock vLLM gave {mism_rec} mismatching case(s) of "
              f"{sum(r for _, _, r, _ in rows)} recorded"
              + ("" if mism_rec else " -- the comparison could not fail on these cases"))
    if mism_rec:
        return EXIT_MISMATCH
    if no_preempt:
        for name, nb in no_preempt:
            print(f"error: profile {name} forced no preemption in {nb} batches (vllm:num_preemptions_total "
                  f"stayed 0); give it a smaller KV cache with --kv-blocks", file=sys.stderr)
        return EXIT_ENV
    return EXIT_OK


if __name__ == "__main__":
    try:
        import vllm_bi  # noqa: F401  (installed, or on PYTHONPATH)
    except ImportError:
        sys.path.insert(1, REPO)  # a checkout without an install
    sys.exit(main())
