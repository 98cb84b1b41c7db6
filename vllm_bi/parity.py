"""``vllm-bi parity``: exonerate the infrastructure — do the trainer's logprobs equal the server's?

Samples completions from a batch-invariant vLLM server (one it starts, or one
already running), sends them all at once so they share busy batches,
recomputes every sampled token's logprob with the trainer-side model
(:func:`vllm_bi.models.from_pretrained`: the Qwen GDN hybrids' or Kimi Linear's), and
reports how many are bitwise equal. Exit status 0 only when all are.
:func:`check_inputs` refuses bad input (the model directory and its architecture, counts, settings) before a
server starts.

``--trainer hf`` recomputes with HF transformers instead (bf16, fp32
log-softmax): the usual stack, for comparison.
"""

from __future__ import annotations

import json
import math
import os
from contextlib import contextmanager
from dataclasses import asdict, dataclass

from vllm_bi.errors import EnvironmentProblem, SettingsMismatch, UsageError

__all__ = ["ParityReport", "run_parity", "check_inputs", "trainer_logprobs", "DEFAULT_PROMPTS", "load_prompts",
           "SettingsMismatch", "serving"]

DEFAULT_PROMPTS = [
    "the quick red fox ran over the river and",
    "one two three four five six",
    "if the sun is up then the moon",
    "read the book page by page because",
    "12 + 7 = 19 and 30 + 4 =",
    "the cat sat near the door while the dog",
    "first think step by step, then answer the question:",
    "build a small house with a blue window and a",
]


def load_prompts(path: str | None) -> list[str | dict]:
    """The prompts of the JSONL file at ``path`` (:func:`vllm_bi.prompts.read_jsonl`), or the built-in ones; a
    missing or bad file raises :class:`~vllm_bi.errors.UsageError` naming it. A line with ``"tools"`` (a list of
    strings: the tool's output after each model turn) is a multi-turn prompt, returned as ``{"prompt", "tools"}``;
    the others as their prompt string."""
    if path is None:
        return list(DEFAULT_PROMPTS)
    from vllm_bi.prompts import read_jsonl

    if not os.path.isfile(path):
        raise UsageError(f"--prompts {path}: no such file; give a JSONL file with one {{\"prompt\": ...}} per line")
    out = []
    for i, row in enumerate(read_jsonl(path), 1):
        tools = row.get("tools")
        if tools is None:
            out.append(row["prompt"])
            continue
        if not isinstance(tools, list) or not tools or not all(isinstance(t, str) and t for t in tools):
            raise UsageError(f"--prompts {path}: example {i}: \"tools\" must be a non-empty list of non-empty "
                             "strings (the tool's output after each model turn)")
        out.append({"prompt": row["prompt"], "tools": list(tools)})
    return out


def _fixed_tools(example: dict, turns: list[dict]):
    """The environment of a multi-turn prompt file: the example's ``tools`` in order, then the end."""
    k = sum(t["role"] == "model" for t in turns) - 1
    return example["tools"][k] if k < len(example["tools"]) else None


def _sample_multiturn(srv, model: str, prompts: list, reqs: list[dict], n: int) -> list:
    """Every request of ``reqs`` (``n`` per prompt) as a trajectory: a model turn, then each of its prompt's
    ``tools`` outputs followed by another model turn (:mod:`vllm_bi.trajectories`: token ids in, each turn a new
    request on the conversation). A plain prompt is a one-turn trajectory."""
    from transformers import AutoTokenizer

    from vllm_bi.trajectories import rollout_trajectories

    tok = AutoTokenizer.from_pretrained(model)
    examples = [p if isinstance(p, dict) else {"prompt": p, "tools": []} for p in prompts for _ in range(n)]
    for r, ex in zip(reqs, examples):
        r["prompt_ids"] = tok(ex["prompt"], add_special_tokens=False)["input_ids"]
    turns = 1 + max(len(ex["tools"]) for ex in examples)
    return rollout_trajectories(srv, tok, reqs, examples, _fixed_tools, turns)


@dataclass
class ParityReport:
    model: str
    trainer: str
    sequences: int
    tokens: int
    bitwise_equal: int
    max_abs_diff: float
    mean_abs_diff: float
    first_mismatch: dict | None
    settings: str = ""  # the trainer's vllm_bi settings the comparison ran with (the server was checked to match)
    server: str = ""  # how the server ran what the trainer cannot mirror (its CUDA-graph mode), from vllm_bi_info

    @property
    def ok(self) -> bool:
        return self.tokens > 0 and self.bitwise_equal == self.tokens

    def to_json(self) -> str:
        d = asdict(self)
        d["fraction_bitwise_equal"] = self.bitwise_equal / self.tokens if self.tokens else 0.0
        d["pass"] = self.ok
        return json.dumps(d)

    def table(self) -> str:
        pct = 100.0 * self.bitwise_equal / self.tokens if self.tokens else 0.0
        fm = "none"
        if self.first_mismatch:
            m = self.first_mismatch
            fm = (f"sequence {m['sequence']} (prompt {m['prompt']}, sample {m['sample']}), token {m['position']}: "
                  f"server {m['server']!r} vs trainer {m['trainer']!r}")
        rows = [
            ("model", self.model),
            ("trainer", self.trainer),
            ("sequences", str(self.sequences)),
            ("tokens compared", str(self.tokens)),
            ("bitwise equal", f"{self.bitwise_equal} ({pct:.2f}%)"),
            ("max |diff|", f"{self.max_abs_diff:.6g}"),
            ("mean |diff|", f"{self.mean_abs_diff:.6g}"),
            ("first mismatch", fm),
            *([("settings", self.settings)] if self.settings else []),
            *([("server", self.server)] if self.server else []),
            ("result", "PASS: trainer == server, bit for bit" if self.ok else "FAIL"),
        ]
        w = max(len(k) for k, _ in rows)
        return "\n".join(f"{k.ljust(w)}  {v}" for k, v in rows)


# who recomputes: vllm_bi's trainer model, transformers' own model adapted to the op library, or transformers' own
# model as it is (the usual stack: the control)
TRAINERS = ("vllm_bi", "transformers", "hf")


def trainer_logprobs(model, completions, pack: int = 8, progress=lambda it: it) -> list[list[float]]:
    """The trainer model's logprob of every sampled token of ``completions``, ``pack`` sequences per forward
    (on the device the model's parameters are on)."""
    import torch

    out = []
    for i in progress(range(0, len(completions), pack)):
        group = completions[i : i + pack]
        with torch.no_grad():
            lps, _ = model.completion_logprobs([(c.prompt_ids, c.token_ids) for c in group])
        out.extend(lp.cpu().tolist() for lp in lps)
    return out


def default_trainer_device() -> str:
    """The server's device: a GPU server's transcendental functions (exp, log, ...) differ from the CPU's."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _recompute_vllm_bi(model_dir: str, completions, pack: int, progress, device: str):
    from vllm_bi.models import from_pretrained

    return trainer_logprobs(from_pretrained(model_dir).to(device), completions, pack, progress)


def _recompute_hf(model_dir: str, completions, pack: int, progress, device: str = "cpu"):
    import torch
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(model_dir)
    model = getattr(transformers, cfg.architectures[0]).from_pretrained(model_dir, dtype=torch.bfloat16).to(device)
    out = []
    for c in progress(completions):
        ids = torch.tensor([c.prompt_ids + c.token_ids], device=device)
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits[0].float(), -1)
        n = len(c.prompt_ids)
        out.append([lp[n - 1 + k, t].item() for k, t in enumerate(c.token_ids)])
    return out


def adapted_logprobs(model, completions, pack: int = 8, progress=lambda it: it) -> list[list[float]]:
    """A transformers model adapted by :func:`vllm_bi.integrations.transformers.apply`: every sampled token's logprob
    of ``completions``, ``pack`` right-padded sequences per forward, through ``token_logprobs``."""
    import torch

    from vllm_bi.integrations.transformers import token_logprobs

    dev = next(model.parameters()).device
    out = []
    for i in progress(range(0, len(completions), pack)):
        group = completions[i : i + pack]
        seqs = [c.prompt_ids + c.token_ids for c in group]
        ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, seq in enumerate(seqs):
            ids[j, : len(seq)], mask[j, : len(seq)] = torch.tensor(seq), 1
        with torch.no_grad():
            lp = token_logprobs(model, ids.to(dev), mask.to(dev))
        out.extend(lp[j, len(c.prompt_ids) - 1 : len(c.prompt_ids) - 1 + len(c.token_ids)].tolist()
                   for j, c in enumerate(group))
    return out


def adapted_transformers_model(model_dir: str, device: str = "cpu"):
    """The checkpoint's transformers class (bf16) with vllm_bi's op library applied
    (:func:`vllm_bi.integrations.transformers.apply`)."""
    import torch
    import transformers

    from vllm_bi.integrations.transformers import apply

    cls = getattr(transformers, transformers.AutoConfig.from_pretrained(model_dir).architectures[0])
    return apply(cls.from_pretrained(model_dir, dtype=torch.bfloat16).to(device))


def _recompute_adapted(model_dir: str, completions, pack: int, progress, device: str):
    return adapted_logprobs(adapted_transformers_model(model_dir, device), completions, pack, progress)


def settings_mismatch(info: dict) -> str | None:
    """Why a trainer in this process cannot reproduce a server whose ``vllm_bi_info`` is ``info``; None if it can
    (:func:`vllm_bi.settings.describe_diff` of the two arithmetic dicts)."""
    from vllm_bi.settings import current, describe_diff

    return describe_diff(info, current().arithmetic(info.get("device", "cpu")))


def adopt_server_tiles(info: dict, folder: str) -> str | None:
    """Under ``VLLM_BI_GEMM_CONFIGS=tune`` with the Triton GEMM, make the server's tuned tile table (the text
    ``vllm_bi_info`` carries) this process's, from a copy written to ``folder`` (a trainer never tunes). Returns the
    copy's path, or None when there is nothing to take (another setting, the float64 GEMM, no table sent). A copy
    that is not a table or whose digest is not the one the server names raises :class:`SettingsMismatch`."""
    from vllm_bi.ops.gemm_tune import adopt_table
    from vllm_bi.settings import current

    text = info.get("gemm_table")
    if not isinstance(text, str) or not current().tunes_gemm(info.get("device", "cpu")):
        return None
    try:
        path, digest = adopt_table(text, folder)
    except ValueError as e:
        raise SettingsMismatch(f"the server's tuned GEMM tile table is unusable here ({e})") from None
    if digest != info.get("gemm_configs"):
        raise SettingsMismatch(f"the server's tuned GEMM tile table arrived with digest {digest}, the server names "
                               f"{info.get('gemm_configs')!r}; restart the server and retry")
    return path


def check_server_settings(client, log) -> dict | None:
    """Compare the server's vllm_bi settings (``vllm_bi_info`` over ``/collective_rpc``) with this process's and
    return them (under ``VLLM_BI_GEMM_CONFIGS=tune`` after taking the server's table: :func:`adopt_server_tiles`).
    A mismatch raises :class:`SettingsMismatch`; a server without the admin routes only gets a note (and None)."""
    try:
        info = client.server_info()
    except RuntimeError as e:
        log(f"note: could not read the server's vllm_bi settings ({str(e).splitlines()[0][:160]}); start it with "
            "VLLM_SERVER_DEV_MODE=1 to let this command check them")
        return None
    from vllm_bi.settings import current

    adopt_server_tiles(info, os.path.join(current().cache_root(), "gemm_tiles", "from-server"))
    why = settings_mismatch(info)
    if why:
        raise SettingsMismatch(f"the server and this trainer cannot agree bit for bit: {why}")
    return info


def server_execution(info: dict | None) -> str:
    """The report's ``server`` line: the server's CUDA-graph mode (``NONE``: eager), when it reported one."""
    if not info or info.get("cuda_graphs") in (None, "None"):
        return ""
    mode = info["cuda_graphs"]
    return "eager (no CUDA graphs)" if mode == "NONE" else f"CUDA graphs {mode}"


def check_inputs(model: str, trainer: str = "vllm_bi", trainer_model: str | None = None, n: int = 1,
                 max_tokens: int = 1, trainer_device: str | None = None) -> None:
    """What :func:`run_parity` refuses before it starts a server, each as a one-line
    :class:`~vllm_bi.errors.UsageError` (or, for a device this machine lacks, an
    :class:`~vllm_bi.errors.EnvironmentProblem`): an unknown trainer, counts below 1, a model directory that is
    missing, has no valid ``config.json`` or (for the vllm_bi trainer) an architecture it does not support, and bad
    ``VLLM_BI_*`` values."""
    from vllm_bi.model_dir import read_model_config
    from vllm_bi.settings import current

    if trainer not in TRAINERS:
        raise UsageError(f"--trainer {trainer!r}: choose {', '.join(TRAINERS)}")
    for flag, value in (("--n", n), ("--max-tokens", max_tokens)):
        if value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}: there would be no token to compare")
    mine = trainer != "hf"  # vllm_bi's model, or transformers' adapted to vllm_bi's ops: a supported architecture
    cfg = read_model_config(model, "--model", supported=mine and trainer_model is None)
    if trainer_model is not None:
        cfg = read_model_config(trainer_model, "--trainer-model", supported=mine)
    arch = (cfg.get("architectures") or [None])[0]
    if trainer != "vllm_bi" and arch == "KimiLinearForCausalLM":
        raise UsageError(f"--trainer {trainer}: transformers has no {arch} class (Kimi's modelling code is remote "
                         "code, which vllm_bi does not run); use --trainer vllm_bi")
    current()  # a bad VLLM_BI_* value: refused here rather than by the server it would start
    if trainer_device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise EnvironmentProblem("--trainer-device cuda: torch finds no CUDA device on this machine; use cpu "
                                     "(with a CPU server) or run on a GPU")


@contextmanager
def serving(server):
    """``with serving(VllmServer(...)) as srv``: started, and stopped on the way out also when the start itself is
    interrupted (Ctrl-C while the server loads leaves no server behind)."""
    try:
        yield server.start()
    finally:
        server.stop()


def run_parity(
    model: str,
    server_url: str | None = None,
    prompts: list[str] | None = None,
    n: int = 4,
    max_tokens: int = 32,
    seed: int = 0,
    temperature: float = 1.0,
    trainer: str = "vllm_bi",
    trainer_model: str | None = None,
    max_num_batched_tokens: int = 64,
    trainer_device: str | None = None,
    server_args: list[str] | None = None,
    stock_server: bool = False,
    show_progress: bool = True,
    api_key: str | None = None,
    log=print,
) -> ParityReport:
    from tqdm import tqdm

    from vllm_bi.client import ServerError, ServerUnreachable, VllmClient
    from vllm_bi.launcher import VllmServer, cpu_env

    check_inputs(model, trainer, trainer_model, n, max_tokens, trainer_device)
    prompts = prompts or list(DEFAULT_PROMPTS)
    multi = any(isinstance(p, dict) for p in prompts)
    reqs = [
        dict(prompt_ids=p, max_tokens=max_tokens, temperature=temperature, seed=seed + 1000 * pi + k)
        for pi, p in enumerate(prompts)
        for k in range(n)
    ]

    def sample(srv):
        log(f"sampling {len(reqs)} completions ({len(prompts)} prompts x n={n}, {max_tokens} tokens, "
            f"T={temperature}) from {srv.url}, all in flight at once"
            + (" per turn (multi-turn: each turn a new request on the conversation's token ids)" if multi else ""))
        return _sample_multiturn(srv, model, prompts, reqs, n) if multi else srv.complete_many(reqs)

    info = None
    if server_url:
        client = VllmClient(server_url, model, api_key=api_key)
        if not stock_server:
            info = check_server_settings(client, log)
        completions = sample(client)
    else:
        log(f"starting VLLM_BATCH_INVARIANT={0 if stock_server else 1} vllm serve (about a minute on 2 CPU cores)")
        args = ["--max-num-batched-tokens", str(max_num_batched_tokens), "--max-num-seqs", "16"] + list(server_args or [])
        env = cpu_env(not stock_server, {"VLLM_SERVER_DEV_MODE": "1"})
        with serving(VllmServer(model, batch_invariant=not stock_server, env=env, args=args, api_key=api_key)) as srv:
            try:
                if not stock_server:
                    info = check_server_settings(srv, log)
                completions = sample(srv)
            except (ServerError, ServerUnreachable) as e:  # name the log that holds the server's side of it
                e.args = (f"{e.args[0] if e.args else e} (server log: {srv.log_path})", *e.args[1:])
                raise

    if not any(c.token_ids for c in completions):
        raise EnvironmentProblem(f"nothing to compare: the server returned no tokens for any of the "
                                 f"{len(completions)} completions (--max-tokens {max_tokens}); see its log")

    def progress(it):
        return tqdm(it, desc=f"recomputing with the {trainer} trainer", disable=not show_progress)

    recompute = {"vllm_bi": _recompute_vllm_bi, "transformers": _recompute_adapted, "hf": _recompute_hf}[trainer]
    mine = recompute(trainer_model or model, completions, 8, progress, trainer_device or default_trainer_device())
    tokens = equal = 0
    max_d = sum_d = 0.0
    first = None
    for si, (c, got) in enumerate(zip(completions, mine)):
        if getattr(c, "mask", None) is not None:  # a trajectory: the model's tokens only (tool tokens have none)
            got = [g for g, m in zip(got, c.mask) if m]
        for pos, (a, b) in enumerate(zip(c.logprobs, got)):
            tokens += 1
            d = abs(a - b) if math.isfinite(a) and math.isfinite(b) else math.inf
            equal += a == b
            max_d, sum_d = max(max_d, d), sum_d + d
            if a != b and first is None:
                first = {"sequence": si, "prompt": si // n, "sample": si % n, "position": pos, "server": a, "trainer": b}
    return ParityReport(model, trainer, len(completions), tokens, equal, max_d, sum_d / max(tokens, 1), first,
                        trainer_settings(trainer_device or default_trainer_device()) if trainer != "hf" else "",
                        server_execution(info))


def trainer_settings(device: str) -> str:
    """The settings that decide the trainer's bits, as one line (``vllm-bi parity``'s report)."""
    from vllm_bi.settings import current

    a = current().arithmetic(device)
    tiles = f" (tiles {a['gemm_configs']})" if a["gemm"] == "triton" else ""
    return (f"GDN {current().gdn_summary(device)}, GEMM {a['gemm']}{tiles}, attention {a['attention']}, "
            f"MoE experts {a['moe']}, trainer on {device}")
