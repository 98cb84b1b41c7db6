"""Shared checks of the serving parity contract P1-P3 (imported by the per-model test modules)."""

from __future__ import annotations

from scenarios import describe_diff, p3_pairs, same


def check_p1(res, label: str) -> int:
    """Every busy result equals the same request alone. Returns the number of comparisons."""
    n = 0
    for (name, mode, bi), c in res.busy.items():
        alone = res.alone[(name, mode)]
        assert same(alone, c), f"{label}: P1 broken for {name}/{mode} batch {bi}: {describe_diff(alone, c)}"
        n += 1
    return n


def check_p2(a, b, label: str) -> int:
    n = 0
    for key, ca in a.alone.items():
        cb = b.alone[key]
        assert same(ca, cb), f"{label}: P2 broken for {key}: {describe_diff(ca, cb)}"
        n += 1
    for mode, ca in a.prefix_b.items():
        cb = b.prefix_b[mode]
        assert same(ca, cb), f"{label}: P2 (prefix cache hit vs none) broken for {mode}: {describe_diff(ca, cb)}"
        n += 1
    return n


def check_p3(res, label: str) -> int:
    n = 0
    for key, dec, pre in p3_pairs(res):
        assert dec == pre, f"{label}: P3 broken for {key}: decode {dec[:4]} vs prompt_logprobs {pre[:4]}"
        n += len(dec)
    return n


def hf_reference_check(model_path: str, res, label: str) -> None:
    """Served prompt logprobs vs HF transformers in float32 on the same weights (correctness, not parity).

    Tolerance for a bf16 model against an fp32 reference: median |diff| < 0.01 and
    >= 90% of positions within 0.05 (MoE routing can flip on near-ties between bf16
    and fp32 router logits, which moves a few positions further).
    """
    import torch
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(model_path)
    model = getattr(transformers, cfg.architectures[0]).from_pretrained(model_path, dtype=torch.float32)
    diffs = []
    for key, r in list(res.rescored.items())[:3]:
        ids = r.prompt_ids
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
        for i in range(1, len(ids)):
            diffs.append(abs(lp[i - 1, ids[i]].item() - r.prompt_logprobs[i]))
    diffs.sort()
    median = diffs[len(diffs) // 2]
    within = sum(d < 0.05 for d in diffs) / len(diffs)
    assert median < 0.01 and within >= 0.9, (
        f"{label}: served logprobs disagree with HF transformers fp32: median {median:.4f}, "
        f"{within:.0%} within 0.05, max {diffs[-1]:.4f}"
    )


def _unique_completions(*results):
    seen, out = set(), []
    for res in results:
        for c in list(res.alone.values()) + list(res.busy.values()) + list(res.prefix_b.values()):
            key = (tuple(c.prompt_ids), tuple(c.token_ids))
            if key not in seen:
                seen.add(key)
                out.append(c)
    return out


def check_p4(model_path: str, label: str, *results) -> int:
    """Trainer (vllm_bi's own model, same op library) == server logprobs for every sampled token.

    Also: the trainer's result for a sequence is identical packed with 15 others or alone.
    """
    from vllm_bi.models import from_pretrained
    from vllm_bi.parity import trainer_logprobs

    model = from_pretrained(model_path)
    comps = _unique_completions(*results)
    got = trainer_logprobs(model, comps, pack=16)
    n = _count_equal(comps, got, f"{label}: P4 broken", "trainer")
    alone = trainer_logprobs(model, comps[:1], pack=1)[0]
    assert alone == got[0], f"{label}: trainer result changed between packing 1 and 16 sequences"
    return n


def _count_equal(comps, got, what: str, who: str) -> int:
    """Assert every completion's logprobs in ``got`` equal the server's, bitwise; the number of tokens compared."""
    n = 0
    for c, mine in zip(comps, got):
        bad = [i for i, (a, b) in enumerate(zip(mine, c.logprobs)) if a != b]
        assert not bad, (f"{what}: {len(bad)}/{len(mine)} tokens differ, first at {bad[0]}: {who} {mine[bad[0]]!r} "
                         f"vs server {c.logprobs[bad[0]]!r}")
        n += len(mine)
    return n


def check_p4_hf(model_path: str, label: str, *results) -> int:
    """transformers' own model class adapted by ``vllm_bi.integrations.transformers.apply`` == server logprobs for
    every sampled token (all unique completions in one right-padded batch, through ``token_logprobs``:
    ``vllm_bi.parity.adapted_logprobs``, what ``vllm-bi parity --trainer transformers`` runs).

    Negative control: the same model unadapted (transformers' forward, fp32 log-softmax) differs on the first
    completions. Returns the number of tokens compared."""
    from vllm_bi.parity import _recompute_hf, adapted_logprobs, adapted_transformers_model

    comps = _unique_completions(*results)
    got = adapted_logprobs(adapted_transformers_model(model_path), comps, pack=len(comps))
    n = _count_equal(comps, got, f"{label}: adapted transformers model vs server", "adapted")
    few = comps[:4]
    stock_got = _recompute_hf(model_path, few, 4, lambda it: it)
    assert any(a != b for c, s in zip(few, stock_got) for a, b in zip(s, c.logprobs)), (
        f"{label}: the unadapted transformers model matched the server on every token: the adapter's parity test "
        "cannot fail here"
    )
    return n


def check_multiturn(model_path: str, label: str, run) -> int:
    """A multi-turn trajectory (``scenarios.run_multiturn``): every turn after the first hit the prefix cache, and
    the trainer's one forward over the whole trajectory gives every model token the server's logprob, bit for bit
    (``policy.completion_logprobs``: tool tokens masked out). Negative control: transformers' own model (the
    trainer's ``--arithmetic stock``) on the same trajectory differs. Returns the number of model tokens compared."""
    import torch

    from vllm_bi.models.qwen_gdn import QwenGDNForCausalLM
    from vllm_bi.trainer.policy import completion_logprobs
    from vllm_bi.trainer.rollout import Sample
    from vllm_bi.trainer.stock import StockModel

    t = run.trajectory
    assert t.model_turns == len(run.hits) >= 3 and len(t.logprobs) == sum(t.mask) == 16 * t.model_turns, label
    assert all(h > 0 for h in run.hits[1:]), f"{label}: a later turn did not hit the prefix cache: {run.hits}"
    s = Sample(0, "", t.prompt_ids, t.token_ids, t.logprobs, t.text, mask=t.mask, turns=t.model_turns)
    with torch.no_grad():
        (got,), _ = completion_logprobs(QwenGDNForCausalLM.from_pretrained(model_path), [s])
        (stock,), _ = completion_logprobs(StockModel.from_pretrained(model_path), [s])
    n = _count_equal([s], [got.tolist()], f"{label}: multi-turn trainer vs server", "trainer")
    assert stock.tolist() != t.logprobs, f"{label}: transformers' own model matched the server: the check cannot fail"
    return n
