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
