"""Full-size random-weight checkpoints with the published configs, written without a model hub.

``write_checkpoint("qwen3.5-9b", DIR)`` writes a Hugging Face checkpoint that vLLM and the trainer load like a
downloaded one: ``config.json`` (the published text config: Qwen3.5-9B is hidden 4096, 32 layers ``[GDN ×3,
attention] × 8``, attention 16/4 heads of 256, GDN 16 key / 32 value heads of 128, MLP 12288, vocabulary 248,320,
untied embeddings; Qwen3.5-35B-A3B is hidden 2048, 40 layers, 256 experts top-8 of 512), bf16 safetensors shards with
an index, and a tokenizer with the full vocabulary (a small BPE trained on a local corpus, its vocabulary filled up
with placeholder tokens that decode to ``<|vN|>``).

Each tensor is drawn from its own generator, seeded by the checkpoint's seed and the tensor's name, on the chosen
device (a GPU writes the 9B in seconds), one tensor at a time: memory holds one shard. Every value is a pure function
of (seed, name, shape), so the same call writes the same bytes on any machine and any shard size.

Initialisation: the 1-D parameters take the constant Hugging Face initialises them with (norm weights, with a little
noise as in the small test models), the GDN decays are spread over heads (``A_log = log U(1, 16)``, ``dt_bias =
U(-1, 1)``), other matrices ``N(0, 0.02)``, and the LM head's scale is chosen so that the next-token distribution is
neither flat nor one-hot: its logits are ``N(0, sigma^2)`` per token (the final norm makes the hidden state's RMS 1),
with ``sigma`` solved for a mean entropy of ``entropy`` nats (default 3; flat over 248,320 tokens would be 12.4).
``mean_entropy`` measures what a written model gives.

``lm_head_rows=N`` instead keeps N rows of the LM head (token ids ``10 .. 10 + N - 1``) and zeroes the others. The
rows come in opposite pairs (``v, -v, u, -u, ...``), so one row of each pair has a logit >= 0 and the largest kept
logit beats the zero rows; their logits have a standard deviation of 100, so even at temperature 1 the N tokens hold
almost all of the mass (a logit of 20 outweighs the 248K zero rows 2,000 to 1). Decoding then picks among N tokens,
and the checkpoint's random MTP drafter (it shares the LM head) agrees with its target about 1 / N of the time for
an even N (N = 2: half the drafts): the acceptance knob of a speculative-decoding benchmark
(``benchmarks/spec_decode.py``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import zlib

from vllm_bi.errors import OutputExists, UsageError

__all__ = ["PUBLISHED", "logit_sigma_for_entropy", "write_checkpoint", "checkpoint_tensors", "build_full_tokenizer",
           "mean_entropy"]

# name -> (model family, config overrides). Hugging Face's Qwen3_5TextConfig / Qwen3_5MoeTextConfig defaults are the
# published Qwen3.5-9B and Qwen3.5-35B-A3B text configs (checked by tests/test_checkpoints.py against the numbers above).
PUBLISHED = {
    "qwen3.5-9b": ("qwen3.5", {}),
    "qwen3.5-35b-a3b": ("qwen3.5-moe", {}),
}
INIT_STD = 0.02


def logit_sigma_for_entropy(vocab: int, entropy: float, seed: int = 0) -> float:
    """The ``sigma`` for which softmax over ``vocab`` logits drawn ``N(0, sigma^2)`` has mean entropy ``entropy`` nats
    (solved by bisection on 32 draws of ``vocab`` standard normals, their mean entropy, which falls monotonically
    with sigma; at low entropy one draw's is dominated by its few largest logits)."""
    import torch

    if not 0.0 < entropy < math.log(vocab):
        raise UsageError(f"entropy {entropy} nats: choose between 0 and log(vocab) = {math.log(vocab):.2f}")
    z = torch.randn(32, vocab, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)

    def h(sigma: float) -> float:
        logp = torch.log_softmax(sigma * z, dim=-1)
        return float(-(logp.exp() * logp).sum(-1).mean())

    lo, hi = 0.0, 1.0
    while h(hi) > entropy:
        hi *= 2.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if h(mid) > entropy else (lo, mid)
    return (lo + hi) / 2


def _config(name: str, overrides: dict | None, eos_id: int):
    from vllm_bi.tiny_models import _model_class

    if name not in PUBLISHED:
        raise UsageError(f"unknown checkpoint {name!r}; choose one of {', '.join(PUBLISHED)}")
    family, base = PUBLISHED[name]
    if family == "qwen3.5":
        from transformers import Qwen3_5TextConfig as Config
    else:
        from transformers import Qwen3_5MoeTextConfig as Config
    values = dict(base, **(overrides or {}))
    layers = int(values.get("num_hidden_layers", Config().num_hidden_layers))
    # [GDN x3, full] repeated; a model cut below one period ends on a full-attention layer, so that every layer
    # kind (and the MTP layer's shapes, a full-attention layer's) is in it
    values.setdefault("layer_types", ["full_attention" if (i + 1) % 4 == 0 or i + 1 == layers < 4
                                      else "linear_attention" for i in range(layers)])
    values.setdefault("mtp_num_hidden_layers", 1)  # the published checkpoints carry one MTP layer
    cfg = Config(eos_token_id=eos_id, pad_token_id=eos_id, bos_token_id=eos_id, tie_word_embeddings=False, **values)
    cfg.architectures = [_model_class(family).__name__]
    cfg.torch_dtype = "bfloat16"
    return family, cfg


def _constant_inits(family: str, cfg) -> dict[str, float]:
    """For each 1-D parameter kind (its name without the layer index), the constant Hugging Face initialises it
    with, read off a two-layer model of the same family (``A_log`` and ``dt_bias`` are drawn instead)."""
    import re

    import torch

    from vllm_bi.tiny_models import TinyModelSpec, _config as tiny_config, _model_class

    spec = TinyModelSpec(num_hidden_layers=4, vocab_size=64, num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    small = _model_class(family)(tiny_config(family, spec, 0))
    out = {}
    for n, p in small.named_parameters():
        p = p.detach()
        if p.ndim == 1 and not n.endswith(("A_log", "dt_bias")) and bool((p == p.flatten()[0]).all()):
            out[re.sub(r"\.\d+\.", ".N.", n)] = float(p.flatten()[0])
    return out


def checkpoint_tensors(family: str, cfg) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of every tensor of the Hugging Face model for ``cfg``, in its state-dict order (built on the
    meta device: no memory), then the multi-token-prediction layers vLLM's drafter loads (``mtp.*``: a projection
    of [embedding; hidden] to hidden, three norms, and ``mtp_num_hidden_layers`` full-attention decoder layers;
    vLLM's main model and the trainer skip them)."""
    import torch

    from vllm_bi.tiny_models import _model_class

    with torch.device("meta"):
        model = _model_class(family)(cfg)
    out = [(n, tuple(t.shape)) for n, t in model.state_dict().items()]
    full = cfg.layer_types.index("full_attention")
    layer = [(n.split(f"model.layers.{full}.", 1)[1], s) for n, s in out if n.startswith(f"model.layers.{full}.")]
    H = cfg.hidden_size
    for i in range(int(getattr(cfg, "mtp_num_hidden_layers", 0) or 0)):
        out += [(f"mtp.layers.{i}.{rest}", s) for rest, s in layer]
    if getattr(cfg, "mtp_num_hidden_layers", 0):
        out += [("mtp.fc.weight", (H, 2 * H))] + [(f"mtp.{n}.weight", (H,)) for n in
                                                   ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding")]
    return out


def _kind(name: str) -> str:
    """A tensor's initialisation kind: its name without the layer index; an MTP layer's tensors are initialised as
    the main model's layers, its norms as the final norm."""
    import re

    if name.startswith("mtp.layers."):
        name = "model.layers.N." + name.split(".", 3)[3]
    elif name.startswith("mtp.") and name.endswith("norm.weight"):
        name = "model.norm.weight"
    return re.sub(r"\.\d+\.", ".N.", name)


def _seed_for(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


HEAD_ROWS_FIRST, HEAD_ROWS_LOGIT_STD = 10, 100.0


def _draw(name: str, shape, seed: int, device, constants: dict[str, float], lm_std: float, lm_rows: int = 0):
    import torch

    g = torch.Generator(device=device).manual_seed(_seed_for(seed, name))
    kind = _kind(name)
    if name.endswith("A_log"):
        t = torch.log(torch.rand(shape, generator=g, device=device) * 15.0 + 1.0)
    elif name.endswith("dt_bias"):
        t = torch.rand(shape, generator=g, device=device) * 2.0 - 1.0
    elif kind in constants:
        t = constants[kind] + 0.1 * torch.randn(shape, generator=g, device=device)
    elif name == "lm_head.weight" and lm_rows:
        t = torch.zeros(shape, device=device)
        pairs = torch.randn(((lm_rows + 1) // 2, shape[1]), generator=g, device=device)
        rows = torch.stack([pairs, -pairs], dim=1).flatten(0, 1)[:lm_rows]  # v, -v, u, -u, ...
        t[HEAD_ROWS_FIRST : HEAD_ROWS_FIRST + lm_rows] = rows * (HEAD_ROWS_LOGIT_STD / math.sqrt(shape[1]))
    elif name == "lm_head.weight":
        t = torch.randn(shape, generator=g, device=device) * lm_std
    else:
        t = torch.randn(shape, generator=g, device=device) * INIT_STD
    return t.to(torch.bfloat16).cpu()


def build_full_tokenizer(path: str, vocab_size: int, seed: int = 0):
    """A tokenizer with ``vocab_size`` ids: the small test models' BPE (trained on the local corpus), its vocabulary
    filled up with placeholder tokens ``<|vN|>`` that no text encodes to but every id decodes to."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from vllm_bi.tiny_models import build_tokenizer

    small = build_tokenizer(path, vocab_size=1024, seed=seed)
    spec = json.loads(small.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    n = max(max(vocab.values()), max((t["id"] for t in spec.get("added_tokens", [])), default=0)) + 1
    for i in range(n, vocab_size):
        vocab[f"<|v{i}|>"] = i
    full = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                   eos_token=small.eos_token, pad_token=small.pad_token, bos_token=None, unk_token=None)
    full.chat_template = small.chat_template
    full.save_pretrained(path)
    return full


def write_checkpoint(name: str, path: str, seed: int = 0, overrides: dict | None = None, device: str = "cpu",
                     entropy: float = 3.0, shard_bytes: int = 4 << 30, progress: bool = True,
                     overwrite: bool = False, lm_head_rows: int = 0) -> str:
    """Write the random-weight checkpoint ``name`` (:data:`PUBLISHED`; ``overrides`` change config fields, e.g.
    ``{"num_hidden_layers": 8}`` for full width with fewer layers) to ``path``; returns ``path``. ``lm_head_rows``:
    keep that many rows of the LM head (module doc; 0: every row, scaled for ``entropy``)."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    if os.path.exists(path) and os.listdir(path) and not overwrite:
        raise OutputExists(path, "exists and is not empty")
    family, cfg = _config(name, overrides, 0)
    if not 0.0 < entropy < math.log(cfg.vocab_size):  # refused before anything is written
        raise UsageError(f"entropy {entropy} nats: choose between 0 and log(vocab) = {math.log(cfg.vocab_size):.2f}")
    if not 0 <= lm_head_rows <= cfg.vocab_size - HEAD_ROWS_FIRST:
        raise UsageError(f"--lm-head-rows {lm_head_rows}: choose 0 (every row) to "
                         f"{cfg.vocab_size - HEAD_ROWS_FIRST}")
    tmp = f"{path.rstrip(os.sep)}.writing-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    tok = build_full_tokenizer(tmp, vocab_size=cfg.vocab_size, seed=seed)
    cfg.eos_token_id = cfg.pad_token_id = cfg.bos_token_id = tok.eos_token_id
    if len(tok) != cfg.vocab_size:
        raise RuntimeError(f"tokenizer has {len(tok)} ids, the config's vocabulary {cfg.vocab_size}")
    lm_std = logit_sigma_for_entropy(cfg.vocab_size, entropy, seed) / math.sqrt(cfg.hidden_size)
    constants = _constant_inits(family, cfg)
    tensors = checkpoint_tensors(family, cfg)
    shards, size = [[]], 0
    for n, shape in tensors:
        nbytes = 2 * math.prod(shape)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((n, shape))
        size += nbytes
    total = sum(2 * math.prod(s) for _, s in tensors)
    weight_map = {}
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {name}", disable=not progress)
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        data = {}
        for n, shape in shard:
            data[n] = _draw(n, shape, seed, device, constants, lm_std, lm_head_rows)
            weight_map[n] = fname
            bar.update(2 * math.prod(shape))
        save_file(data, os.path.join(tmp, fname), metadata={"format": "pt"})
        del data
    bar.close()
    with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    cfg.save_pretrained(tmp)
    with open(os.path.join(tmp, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": tok.eos_token_id, "pad_token_id": tok.eos_token_id}, f)
    with open(os.path.join(tmp, "vllm_bi_checkpoint.json"), "w") as f:
        json.dump({"name": name, "seed": seed, "overrides": overrides or {}, "entropy": entropy,
                   "lm_head_std": lm_std, "lm_head_rows": lm_head_rows, "parameters": total // 2}, f, indent=1)
    if os.path.exists(path):
        shutil.rmtree(path)
    os.rename(tmp, path)
    return path


def mean_entropy(model, input_ids, cu_seqlens) -> float:
    """Mean next-token entropy (nats, temperature 1) of a trainer model (:class:`vllm_bi.models.QwenGDNForCausalLM`)
    over a packed batch."""
    import torch

    with torch.no_grad():
        logits = model(input_ids, cu_seqlens).float()
    logp = torch.log_softmax(logits, dim=-1)
    return float(-(logp.exp() * logp).sum(-1).mean())
