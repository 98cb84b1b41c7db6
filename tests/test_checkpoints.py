"""Full-size random-weight checkpoints (``vllm_bi/checkpoints.py``): the published configs, a written checkpoint's
names, shapes, determinism and tokenizer, and the next-token entropy its LM head was scaled for."""

import json
import math
import os

import pytest
import torch

from vllm_bi import checkpoints as C

# A checkpoint with the 9B's structure and full vocabulary on narrow layers (CPU-sized).
NARROW = {"hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 512, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 64, "linear_num_key_heads": 1, "linear_num_value_heads": 2}


def test_published_configs_are_the_published_numbers():
    _, nine = C._config("qwen3.5-9b", None, 0)
    assert (nine.hidden_size, nine.num_hidden_layers, nine.intermediate_size, nine.vocab_size) == (4096, 32, 12288,
                                                                                                   248320)
    assert (nine.num_attention_heads, nine.num_key_value_heads, nine.head_dim) == (16, 4, 256)
    assert (nine.linear_num_key_heads, nine.linear_num_value_heads, nine.linear_key_head_dim,
            nine.linear_value_head_dim, nine.linear_conv_kernel_dim) == (16, 32, 128, 128, 4)
    assert nine.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 8
    assert nine.tie_word_embeddings is False and nine.architectures == ["Qwen3_5ForCausalLM"]
    _, moe = C._config("qwen3.5-35b-a3b", None, 0)
    assert (moe.hidden_size, moe.num_hidden_layers, moe.num_experts, moe.num_experts_per_tok,
            moe.moe_intermediate_size, moe.shared_expert_intermediate_size) == (2048, 40, 256, 8, 512, 512)
    assert (moe.num_attention_heads, moe.num_key_value_heads) == (16, 2)
    # the 9B's text model, counted on the meta device (no memory): about 9 B parameters
    params = sum(math.prod(s) for _, s in C.checkpoint_tensors("qwen3.5", nine))
    assert 8.5e9 < params < 9.5e9, params
    # fewer layers at full width keep the pattern; a model cut below one period ends on a full-attention layer, so
    # the MTP layer (a full-attention layer) has its shapes
    assert C._config("qwen3.5-9b", {"num_hidden_layers": 6}, 0)[1].layer_types == nine.layer_types[:6]
    _, two = C._config("qwen3.5-9b", {"num_hidden_layers": 2}, 0)
    assert two.layer_types == ["linear_attention", "full_attention"]
    names = dict(C.checkpoint_tensors("qwen3.5", two))
    assert names["mtp.layers.0.self_attn.q_proj.weight"] == names["model.layers.1.self_attn.q_proj.weight"]
    with pytest.raises(ValueError, match="unknown checkpoint 'qwen9'; choose one of qwen3.5-9b, qwen3.5-35b-a3b"):
        C._config("qwen9", None, 0)


@pytest.mark.parametrize("target", [1.0, 3.0, 6.0])
def test_the_logit_scale_gives_the_entropy_asked_for(target):
    sigma = C.logit_sigma_for_entropy(248320, target, seed=0)
    z = torch.randn(64, 248320, generator=torch.Generator().manual_seed(1))  # fresh draws
    logp = torch.log_softmax(sigma * z, dim=-1)
    got = float(-(logp.exp() * logp).sum(-1).mean())
    assert abs(got - target) < 0.15 * target, (sigma, got)


@pytest.fixture(scope="module")
def narrow(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt") / "qwen3.5-9b-narrow")
    return C.write_checkpoint("qwen3.5-9b", path, seed=3, overrides=NARROW, shard_bytes=64 << 20, progress=False)


def test_a_written_checkpoint_has_the_models_tensors_a_full_tokenizer_and_is_deterministic(narrow, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    cfg = json.load(open(os.path.join(narrow, "config.json")))
    assert cfg["vocab_size"] == 248320 and cfg["hidden_size"] == 256 and cfg["architectures"] == ["Qwen3_5ForCausalLM"]
    index = json.load(open(os.path.join(narrow, "model.safetensors.index.json")))["weight_map"]
    assert len(set(index.values())) > 1  # sharded
    tensors = {}
    for f in sorted(set(index.values())):
        tensors.update(load_file(os.path.join(narrow, f)))
    _, config = C._config("qwen3.5-9b", NARROW, 0)
    want = dict(C.checkpoint_tensors("qwen3.5", config))
    assert {n: tuple(t.shape) for n, t in tensors.items()} == want and set(index) == set(want)
    # the MTP layer vLLM's drafter loads: [embedding; hidden] -> hidden, norms, one full-attention decoder layer
    assert cfg["mtp_num_hidden_layers"] == 1 and want["mtp.fc.weight"] == (256, 512)
    assert want["mtp.layers.0.self_attn.q_proj.weight"] == want["model.layers.3.self_attn.q_proj.weight"]
    assert all(t.dtype == torch.bfloat16 and torch.isfinite(t.float()).all() for t in tensors.values())
    tok = AutoTokenizer.from_pretrained(narrow)
    assert len(tok) == 248320 and tok.decode([200000]) == "<|v200000|>"
    assert tok.decode(tok("one two three")["input_ids"]) == "one two three"
    # the same seed, another shard size: the same bytes; another seed: other values (a small vocabulary: cheaper)
    small = dict(NARROW, vocab_size=4096)
    one = C.write_checkpoint("qwen3.5-9b", str(tmp_path / "one"), seed=3, overrides=small, progress=False)
    many = C.write_checkpoint("qwen3.5-9b", str(tmp_path / "many"), seed=3, overrides=small, shard_bytes=1 << 20,
                              progress=False)
    a = load_file(os.path.join(one, "model-00001-of-00001.safetensors"))
    shards = json.load(open(os.path.join(many, "model.safetensors.index.json")))["weight_map"]
    b = {}
    for f in sorted(set(shards.values())):
        b.update(load_file(os.path.join(many, f)))
    assert len(set(shards.values())) > 2 and set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)
    assert torch.equal(a["model.layers.0.linear_attn.A_log"], tensors["model.layers.0.linear_attn.A_log"])
    with pytest.raises(FileExistsError, match="not empty"):
        C.write_checkpoint("qwen3.5-9b", one, seed=4, overrides=small, progress=False)
    reseeded = C.write_checkpoint("qwen3.5-9b", one, seed=4, overrides=small, progress=False, overwrite=True)
    other = load_file(os.path.join(reseeded, "model-00001-of-00001.safetensors"))
    assert not torch.equal(other["lm_head.weight"], a["lm_head.weight"])


def test_the_trainer_model_loads_it_and_samples_neither_flat_nor_one_hot(narrow):
    """The LM head was scaled for a mean next-token entropy of 3 nats; the model's own forward gives 1-6 (flat
    over 248,320 tokens would be 12.4, one-hot 0)."""
    from vllm_bi.models import QwenGDNForCausalLM
    from transformers import AutoTokenizer

    model = QwenGDNForCausalLM.from_pretrained(narrow)
    tok = AutoTokenizer.from_pretrained(narrow)
    seqs = [tok(t)["input_ids"] for t in ("one two three four five six", "the quick cat sat near the river",
                                          "add 12 + 30 = 42 and then")]
    ids = torch.tensor([i for s in seqs for i in s])
    cu = [0]
    for s in seqs:
        cu.append(cu[-1] + len(s))
    h = C.mean_entropy(model, ids, cu)
    assert 1.0 <= h <= 6.0, h


def test_lm_head_rows_keeps_that_many_rows_of_the_head(tmp_path):
    """``lm_head_rows=N``: rows 10 .. 10 + N - 1 of the LM head drawn in opposite pairs (logit std 100), every other
    row zero, recorded in the checkpoint's stamp; the MTP layer is written as before. Control: the default head has
    no zero row."""
    from safetensors.torch import load_file

    small = dict(NARROW, vocab_size=4096)
    path = C.write_checkpoint("qwen3.5-9b", str(tmp_path / "rows"), seed=1, overrides=small, progress=False,
                              lm_head_rows=3)
    sd = load_file(os.path.join(path, "model-00001-of-00001.safetensors"))
    head = sd["lm_head.weight"].float()
    nonzero = (head != 0).any(dim=1).nonzero().flatten().tolist()
    assert nonzero == [10, 11, 12] and "mtp.fc.weight" in sd
    assert 0.3 < float(head[10:13].std()) * math.sqrt(256) / 100 < 3  # logits of std about 100 for a unit-RMS state
    assert torch.equal(head[11], -head[10]) and not torch.equal(head[12], -head[11])  # v, -v, u
    assert json.load(open(os.path.join(path, "vllm_bi_checkpoint.json")))["lm_head_rows"] == 3
    full = C.write_checkpoint("qwen3.5-9b", str(tmp_path / "full"), seed=1, overrides=small, progress=False)
    assert (load_file(os.path.join(full, "model-00001-of-00001.safetensors"))["lm_head.weight"] != 0).any(dim=1).all()
    with pytest.raises(ValueError, match="--lm-head-rows 5000"):
        C.write_checkpoint("qwen3.5-9b", str(tmp_path / "bad"), overrides=small, progress=False, lm_head_rows=5000)
