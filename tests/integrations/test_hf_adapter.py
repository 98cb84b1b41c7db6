"""The transformers adapter (``vllm_bi.integrations.transformers``) on small random-weight models of the three
families, CPU, no server.

- Parity: the adapted transformers model's logits and next-token logprobs equal the trainer model's
  (``QwenGDNForCausalLM``, the server's bits: ``tests/e2e`` P4) on the same checkpoint, ``torch.equal``, for a
  right-padded, a left-padded and a packed batch of the same sequences; the unadapted model (negative control)
  computes the same network but other bits.
- Gradients: equal to the trainer model's, bit for bit (three families), and within a stated tolerance of
  transformers' own forward on float64 weights (dense Qwen3.5; the tolerance is in the test's docstring).
- The module tree and the parameters (names, objects, dtypes) are unchanged; every refused case raises one line.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from vllm_bi.errors import SettingsMismatch, UsageError
from vllm_bi.integrations.transformers import apply, is_adapted, token_logprobs, unpad
from vllm_bi.models.qwen_gdn import QwenGDNForCausalLM

FAMILIES = ["qwen3-next", "qwen3.5", "qwen3.5-moe"]
LENS = [13, 29, 7, 21]  # a batch of four sequences of other lengths


def _hf(path, dtype=torch.bfloat16, **kw):
    cfg = transformers.AutoConfig.from_pretrained(path)
    return getattr(transformers, cfg.architectures[0]).from_pretrained(path, dtype=dtype, **kw)


def _sequences(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (n,), generator=g) for n in LENS]


def _forms(seqs):
    """The same sequences as a right-padded, a left-padded and a packed batch: (kwargs, [(row, columns)] per
    sequence)."""
    L = max(len(s) for s in seqs)
    right, left = torch.zeros(len(seqs), L, dtype=torch.long), torch.full((len(seqs), L), 7, dtype=torch.long)
    rmask, lmask = torch.zeros_like(right), torch.zeros_like(left)
    r_at, l_at, p_at, start = [], [], [], 0
    for i, s in enumerate(seqs):
        n = len(s)
        right[i, :n], rmask[i, :n] = s, 1
        left[i, L - n :], lmask[i, L - n :] = s, 1
        r_at.append((i, slice(0, n)))
        l_at.append((i, slice(L - n, L)))
        p_at.append((0, slice(start, start + n)))
        start += n
    packed = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    return {
        "right": (dict(input_ids=right, attention_mask=rmask), r_at),
        "left": (dict(input_ids=left, attention_mask=lmask), l_at),
        "packed": (dict(input_ids=packed, position_ids=pos), p_at),
        "packed+mask": (dict(input_ids=packed, attention_mask=torch.ones_like(packed), position_ids=pos), p_at),
    }


def _trainer_reference(path, seqs):
    model = QwenGDNForCausalLM.from_pretrained(path)
    cu = [0]
    for s in seqs:
        cu.append(cu[-1] + len(s))
    ids = torch.cat(seqs)
    with torch.no_grad():
        return model(ids, cu), model.token_logprobs(ids, cu), cu


@pytest.mark.parametrize("family", FAMILIES)
def test_adapted_model_gives_the_trainer_models_bits_in_every_batch_form(family, tiny_model_path):
    path = tiny_model_path(family)
    seqs = _sequences()
    ref_logits, ref_lp, cu = _trainer_reference(path, seqs)
    model = apply(_hf(path))
    assert is_adapted(model)
    checked = 0
    for form, (kw, at) in _forms(seqs).items():
        with torch.no_grad():
            logits = model(**kw).logits
            lp = token_logprobs(model, **kw)
        assert logits.shape == (*kw["input_ids"].shape, ref_logits.shape[-1])
        assert lp.shape == (kw["input_ids"].shape[0], kw["input_ids"].shape[1] - 1)
        for i, (row, cols) in enumerate(at):
            mine = logits[row, cols]
            assert torch.equal(mine, ref_logits[cu[i] : cu[i + 1]]), f"{family} {form}: logits of sequence {i}"
            lp_cols = slice(cols.start, cols.stop - 1)
            assert torch.equal(lp[row, lp_cols], ref_lp[cu[i] : cu[i + 1] - 1]), f"{family} {form}: logprobs {i}"
            checked += 1
        if "mask" in kw and form != "packed+mask":  # padding positions hold zeros
            assert not logits[kw["attention_mask"] == 0].any()
    assert checked == 4 * len(LENS)

    # negative control: transformers' own forward on the same weights, the right-padded batch
    stock = _hf(path)
    (kw, at) = _forms(seqs)["right"]
    with torch.no_grad():
        slp = torch.log_softmax(stock(**kw).logits.float(), -1)[:, :-1].gather(-1, kw["input_ids"][:, 1:, None])[..., 0]
    diffs = [(slp[row, cols.start : cols.stop - 1] - ref_lp[cu[i] : cu[i + 1] - 1]).abs()
             for i, (row, cols) in enumerate(at)]
    diff = torch.cat(diffs)
    assert (diff > 0).any(), f"{family}: the unadapted model gave the server's bits: the parity test cannot fail here"
    assert diff.median() < 0.02, f"{family}: the unadapted model computes another network (median |diff| " \
                                 f"{diff.median():.3g})"


def test_module_tree_and_parameters_unchanged(tiny_model_path):
    model = _hf(tiny_model_path("qwen3.5-moe"))
    before = {n: (p, p.dtype, tuple(p.shape)) for n, p in model.named_parameters()}
    keys = list(model.state_dict())
    modules = [n for n, _ in model.named_modules()]
    apply(model)
    after = {n: (p, p.dtype, tuple(p.shape)) for n, p in model.named_parameters()}
    assert list(model.state_dict()) == keys
    assert [n for n, _ in model.named_modules()] == modules
    assert before.keys() == after.keys()
    assert all(before[n][0] is after[n][0] and before[n][1:] == after[n][1:] for n in before)
    assert apply(model) is model  # adapting again changes nothing


def test_hooks_fire_on_every_module_the_forward_uses(tiny_model_path):
    """Modules are entered through ``__call__`` (what FSDP's unshard hooks and user hooks rely on)."""
    model = apply(_hf(tiny_model_path("qwen3-next")))
    entered = set()
    for name, m in model.named_modules():
        m.register_forward_pre_hook(lambda mod, args, name=name: entered.add(name))
    kw, _ = _forms(_sequences())["right"]
    with torch.no_grad():
        model(**kw)
    layer0 = {"model.layers.0", "model.layers.0.input_layernorm", "model.layers.0.linear_attn",
              "model.layers.0.post_attention_layernorm", "model.layers.0.mlp", "model.layers.3.self_attn"}
    assert {"", "model", "model.embed_tokens", "model.norm", "lm_head"} | layer0 <= entered


def test_fsdp2_units_unshard_for_the_adapted_forwards(tiny_model_path, tmp_path):
    """FSDP2 (one gloo process): per-layer units and the root unshard their DTensor parameters in the pre-forward
    hooks the adapted forwards go through; logits and gradients keep the unsharded model's bits."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    path = tiny_model_path("qwen3.5-moe")
    kw, _ = _forms(_sequences())["right"]
    plain = apply(_hf(path))
    want = plain(**kw).logits
    want.float().square().mean().backward()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        model = apply(_hf(path))
        for unit in [*model.model.layers, model]:
            fully_shard(unit)
        assert type(model.lm_head.weight).__name__ == "DTensor"
        got = model(**kw).logits
        assert torch.equal(got, want)
        got.float().square().mean().backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        assert all(torch.equal(grads[n], p.grad) for n, p in plain.named_parameters())
    finally:
        dist.destroy_process_group()


def test_labels_and_logits_to_keep(tiny_model_path):
    model = apply(_hf(tiny_model_path("qwen3.5")))
    kw, _ = _forms(_sequences())["right"]
    with torch.no_grad():
        full = model(**kw).logits
        assert torch.equal(model(**kw, logits_to_keep=5).logits, full[:, -5:])
        labels = kw["input_ids"].masked_fill(kw["attention_mask"] == 0, -100)
        loss = model(**kw, labels=labels).loss
    want = torch.nn.functional.cross_entropy(full[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten())
    assert torch.allclose(loss, want)  # transformers' own loss function over the adapted logits


def _adapted_loss_and_grads(path, seqs):
    """Mean NLL of every next token of ``seqs`` (a left-padded batch) through the adapted model; its gradients."""
    kw, at = _forms(seqs)["left"]
    model = apply(_hf(path))
    lp = token_logprobs(model, **kw)
    n_tok = sum(len(s) - 1 for s in seqs)
    loss = -torch.cat([lp[row, cols.start : cols.stop - 1] for row, cols in at]).sum() / n_tok
    loss.backward()
    return loss, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_equal_the_trainer_models(family, tiny_model_path):
    path = tiny_model_path(family)
    seqs = _sequences(1)
    loss, grads = _adapted_loss_and_grads(path, seqs)

    trainer = QwenGDNForCausalLM.from_pretrained(path)
    cu = [0]
    for s in seqs:
        cu.append(cu[-1] + len(s))
    tlp = trainer.token_logprobs(torch.cat(seqs), cu)
    tloss = -torch.cat([tlp[cu[i] : cu[i + 1] - 1] for i in range(len(seqs))]).sum() / (cu[-1] - len(seqs))
    tloss.backward()
    assert torch.equal(loss, tloss)
    theirs = {}
    for name, p in trainer.named_parameters():
        if name.endswith("mlp.w13") or name.endswith("mlp.w2"):  # transformers keeps the experts fused the same way
            hf = "gate_up_proj" if name.endswith("w13") else "down_proj"
            theirs[f"model.{name.rsplit('.', 1)[0]}.experts.{hf}"] = p.grad
        else:
            for cand in ("model." + name, "model." + name + ".weight", name + ".weight"):
                theirs[cand] = p.grad
    for name, g in grads.items():
        assert g is not None, f"{family} {name}: no gradient"
        # A_log: transformers' is bf16, the trainer's fp32; both sides use it in fp32, so the bf16 gradient is the
        # trainer's rounded
        assert torch.equal(g, theirs[name].to(g.dtype)), f"{family} {name}: gradient differs from the trainer model's"


def test_gradients_near_a_float64_reference(tiny_model_path):
    """Dense Qwen3.5 (in the MoE families a top-k choice flips between bf16 and float64 on a near-tie; measured on
    this batch: one flipped token moves whole-tensor gradients by 5-19%). Tolerance: every parameter tensor's
    gradient has cosine similarity >= 0.999 and relative L2 error <= 4% to transformers' forward on float64 weights
    (its GDN core computes in fp32), the per-head vectors A_log and dt_bias (< 16 elements) <= 10%; measured worst
    2.3% (in_proj_a) and 4.7% (A_log)."""
    path = tiny_model_path("qwen3.5")
    seqs = _sequences(1)
    loss, grads = _adapted_loss_and_grads(path, seqs)
    ref = _hf(path, torch.float64)
    n_tok = sum(len(s) - 1 for s in seqs)
    ref_loss = 0.0
    for s in seqs:
        ref_lp = torch.log_softmax(ref(s[None]).logits[0], -1)[:-1].gather(1, s[1:, None]).squeeze(1)
        ref_loss = ref_loss - ref_lp.sum() / n_tok
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 2e-3
    checked = 0
    for name, p in ref.named_parameters():
        h, g = p.grad, grads[name].double()
        cos = torch.nn.functional.cosine_similarity(g.flatten(), h.flatten(), dim=0).item()
        rel = ((g - h).norm() / h.norm()).item()
        max_rel = 0.04 if h.numel() >= 16 else 0.10
        assert cos >= 0.999 and rel <= max_rel, f"{name}: cos {cos:.5f}, rel {rel:.4f} vs float64"
        checked += 1
    assert checked == len(grads)


def test_temperature_divides_the_fp32_logits_as_vllms_sampler(tiny_model_path):
    """``temperature``: vLLM's ``processed_logprobs`` (its sampler's ``apply_temperature``, then the server's
    logprob op); a temperature below 1e-5 (greedy) counts as 1, and 0.7 gives other bits than 1.0."""
    from vllm.v1.sample.sampler import Sampler

    from vllm_bi.ops.softmax import log_softmax

    path = tiny_model_path("qwen3.5")
    model = apply(_hf(path))
    seqs = _sequences()
    kw, at = _forms(seqs)["packed"]
    with torch.no_grad():
        logits = model(**kw).logits[0]
        t07 = token_logprobs(model, **kw, temperature=0.7)[0]
        t1 = token_logprobs(model, **kw)[0]
        t0 = token_logprobs(model, **kw, temperature=0.0)[0]
    scaled = Sampler.apply_temperature(logits.float(), torch.full((logits.shape[0],), 0.7), all_random=True)
    want = log_softmax(scaled, dim=-1, dtype=torch.float32)[:-1].gather(1, kw["input_ids"][0, 1:, None]).squeeze(1)
    inside = torch.ones(logits.shape[0] - 1, dtype=torch.bool)
    for _, cols in at[:-1]:
        inside[cols.stop - 1] = False  # the next token starts another sequence
    assert torch.equal(t07[inside], want[inside])
    assert not torch.equal(t07[inside], t1[inside])
    assert torch.equal(t0, t1)


# ---- unpad --------------------------------------------------------------------------------------------------------


def test_unpad_reads_each_batch_form_as_the_same_packed_sequences():
    seqs = _sequences()
    forms = _forms(seqs)
    want_ids, want_cu = torch.cat(seqs), [0, 13, 42, 49, 70]
    for form, (kw, _) in forms.items():
        u = unpad(kw["input_ids"], kw.get("attention_mask"), kw.get("position_ids"))
        assert torch.equal(u.input_ids, want_ids) and u.cu_seqlens == want_cu, form
    # HF-style positions for left padding (cumsum - 1, clamped) are read as from 0
    kw, _ = forms["left"]
    pos = (kw["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    assert unpad(kw["input_ids"], kw["attention_mask"], pos).cu_seqlens == want_cu
    # an all-padding row holds no sequence
    ids = torch.ones(2, 5, dtype=torch.long)
    u = unpad(ids, torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0]]))
    assert u.cu_seqlens == [0, 3] and u.pad(torch.ones(3, 2)).sum() == 6


@pytest.mark.parametrize("mask, pos, match", [
    ([[1, 0, 1, 1]], None, "padding between tokens"),
    ([[1, 1, 1, 1]], [[1, 2, 3, 4]], "counts from 0"),
    ([[0, 1, 1, 1]], [[0, 1, 2, 3]], "counts from 0"),  # left padding with plain arange positions
    ([[1, 1, 1, 1]], [[0, 1, 3, 4]], "count up by 1"),
])
def test_unpad_refuses_what_it_cannot_read(mask, pos, match):
    ids = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(UsageError, match=match) as e:
        unpad(ids, torch.tensor(mask), None if pos is None else torch.tensor(pos))
    assert "\n" not in str(e.value)


# ---- refusals -----------------------------------------------------------------------------------------------------


def _refused(model, match, exc=UsageError, **kw):
    with pytest.raises(exc, match=match) as e:
        apply(model, **kw)
    assert "\n" not in str(e.value), str(e.value)
    assert not is_adapted(model)


def test_refuses_another_architecture():
    cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=16, intermediate_size=64)
    _refused(transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16), "Qwen3ForCausalLM is not a GDN hybrid")


def test_refuses_weights_other_than_bf16(tiny_model_path):
    _refused(_hf(tiny_model_path("qwen3.5"), torch.float32), r"float32, the server's weights are bf16.*bfloat16")


def test_refuses_gradient_checkpointing(tiny_model_path):
    model = _hf(tiny_model_path("qwen3.5"))
    model.gradient_checkpointing_enable()
    _refused(model, "gradient_checkpointing_disable")
    model.gradient_checkpointing_disable()
    apply(model)
    model.gradient_checkpointing_enable()  # switched on after apply: the call refuses it
    kw, _ = _forms(_sequences())["right"]
    with pytest.raises(UsageError, match="gradient_checkpointing_disable"):
        model(**kw)


def test_refuses_unmerged_lora(tiny_model_path):
    """peft's LoRA layers add ``lora_A``/``lora_B`` (and ``base_layer``) parameters next to the weights."""
    model = _hf(tiny_model_path("qwen3.5"))
    q = model.model.layers[3].self_attn.q_proj
    q.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(q.in_features, 4, bias=False)}).to(torch.bfloat16)
    _refused(model, "merge_and_unload")


@pytest.mark.parametrize("change, match", [
    (lambda c: setattr(c, "rope_parameters", {**c.rope_parameters, "rope_type": "yarn", "factor": 2.0}),
     "rope .* not supported"),
    (lambda c: setattr(c, "rope_parameters", {**c.rope_parameters, "mrope_section": [4, 2, 2]}),
     "rope .* not supported"),
    (lambda c: c.layer_types.__setitem__(0, "sliding_attention"), "layer type 'sliding_attention'"),
    (lambda c: setattr(c, "hidden_act", "gelu"), "hidden_act"),
])
def test_refuses_what_the_trainer_model_does_not_build(change, match, tiny_model_path):
    model = _hf(tiny_model_path("qwen3.5"))
    change(model.config)
    _refused(model, match)


def test_refuses_settings_other_than_the_servers(tiny_model_path):
    from vllm_bi.settings import current

    model = _hf(tiny_model_path("qwen3.5"))
    mine = current().arithmetic("cpu") | {"device": "cpu"}
    _refused(model, "VLLM_BI_GDN_MODE", SettingsMismatch, settings=mine | {"gdn_mode": "chunk"})
    _refused(model, "the server computes on cuda.*move the model to cuda", SettingsMismatch,
             settings=mine | {"device": "cuda"})
    assert SettingsMismatch.exit_code == 4
    assert is_adapted(apply(model, settings=mine))


def test_refuses_a_kv_cache_and_embeddings(tiny_model_path):
    model = apply(_hf(tiny_model_path("qwen3.5")))
    kw, _ = _forms(_sequences())["right"]
    with pytest.raises(UsageError, match="no KV cache"):
        model(**kw, past_key_values=transformers.DynamicCache())
    with pytest.raises(UsageError, match="inputs_embeds"):
        model(inputs_embeds=torch.zeros(1, 3, 256, dtype=torch.bfloat16))
    with pytest.raises(UsageError, match="not adapted"):
        token_logprobs(_hf(tiny_model_path("qwen3.5")), **kw)
