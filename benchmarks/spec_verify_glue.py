"""Benchmark: the GDN glue of a verify step (``model_executor.gdn.spec_step`` -> ``verify_rows``) against a plain
decode step's (``_decode_plan`` + ``_recurrent_step``), on CPU with synthetic inputs, one GDN layer.

    python benchmarks/spec_verify_glue.py [--k 3] [--reqs 1,64] [--heads 16,32] [--dim 128] [--repeats 5]

For each request count N it runs, on one layer with the given head shape (default Qwen3.5-9B's: 16 key / 32 value
heads of 128, conv width 4):
- ``decode N``: N one-token decodes (the path a step without drafts takes on CPU),
- ``decode N*(k+1)``: as many one-token decodes as a verify step has rows (same GDN arithmetic, batched),
- ``verify N x (k+1)``: N speculative requests of k + 1 rows each through ``spec_step``.
and reports per call: median wall ms, torch ops dispatched (each is at least one kernel launch on CUDA; view and
metadata ops not counted), and the host reads / blocking copies it makes, which on CUDA each synchronise the
stream: ``.tolist()`` / ``.item()`` / ``bool()`` of a tensor, and ``torch.tensor(..., device=...)`` from a Python
list (a pageable host-to-device copy). On CPU none of these waits; the counts are what a CUDA step pays.
Nothing here changes a bit of the served arithmetic: it calls the glue as the server does.
"""

from __future__ import annotations

import argparse
import types

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from common import host_ms

from vllm_bi.model_executor import gdn as glue

VIEW_OPS = {"view", "_unsafe_view", "slice", "select", "t", "transpose", "unsqueeze", "squeeze", "expand", "reshape",
            "as_strided", "split", "split_with_sizes", "unbind", "detach", "alias", "permute", "lift_fresh",
            "_reshape_alias", "unflatten", "flatten", "narrow", "sym_size", "sym_stride", "sym_numel",
            "is_same_size", "_local_scalar_dense", "empty", "empty_like", "empty_strided", "new_empty"}


class OpCount(TorchDispatchMode):
    """Torch ops dispatched, the GDN recurrence and the causal conv counted as one launch each (CUDA runs each as
    one kernel; the CPU torch paths loop over sequences, tokens and taps)."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.names: dict[str, int] = {}
        self.paused = False

    def one_launch(self, fn, name):
        def wrapped(*a, **k):
            if self.paused:
                return fn(*a, **k)
            self.ops += 1
            self.names[name] = self.names.get(name, 0) + 1
            self.paused = True
            try:
                return fn(*a, **k)
            finally:
                self.paused = False
        return wrapped

    def __enter__(self):
        from vllm_bi.gdn import layer as L

        self._saved = (L.gdn_recurrent_varlen, L._conv_torch)
        L.gdn_recurrent_varlen = self.one_launch(L.gdn_recurrent_varlen, "GDN core")
        L._conv_torch = self.one_launch(L._conv_torch, "conv")
        return super().__enter__()

    def __exit__(self, *exc):
        from vllm_bi.gdn import layer as L

        L.gdn_recurrent_varlen, L._conv_torch = self._saved
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEW_OPS and not self.paused:
            self.ops += 1
            self.names[name] = self.names.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


class HostReads:
    """Counts the calls that would read the device on the host (``tolist``, ``item``, ``bool``) or copy a Python
    list to the device from pageable memory (``torch.tensor(list, device=...)``)."""

    def __enter__(self):
        self.reads = self.copies = 0
        self._orig = (torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.tensor)
        outer = self

        def tolist(t, *a, **k):
            outer.reads += 1
            return outer._orig[0](t, *a, **k)

        def item(t, *a, **k):
            outer.reads += 1
            return outer._orig[1](t, *a, **k)

        def as_bool(t):
            outer.reads += 1
            return outer._orig[2](t)

        def tensor(data, *a, **k):
            if k.get("device") is not None and not isinstance(data, torch.Tensor):
                outer.copies += 1
            return outer._orig[3](data, *a, **k)

        torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.tensor = tolist, item, as_bool, tensor
        return self

    def __exit__(self, *exc):
        torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.tensor = self._orig


def make_layer(hk: int, hv: int, dim: int, k: int):
    g = torch.Generator().manual_seed(0)
    return types.SimpleNamespace(num_k_heads=hk, num_v_heads=hv, head_k_dim=dim, head_v_dim=dim, tp_size=1,
                                 activation="silu", num_spec=k, prefix="layers.0.linear_attn",
                                 A_log=torch.randn(hv, generator=g) * 0.1, dt_bias=torch.randn(hv, generator=g) * 0.1)


def inputs(T: int, layer, W: int, dtype):
    g = torch.Generator().manual_seed(1)
    D = 2 * layer.num_k_heads * layer.head_k_dim + layer.num_v_heads * layer.head_v_dim
    x = (torch.randn(T, D, generator=g) * 0.5).to(dtype)
    b = torch.randn(T, layer.num_v_heads, generator=g).to(dtype)
    a = torch.randn(T, layer.num_v_heads, generator=g).to(dtype)
    weight = (torch.randn(D, W, generator=g) * 0.3).to(dtype)
    return x, b, a, weight, D


def plain_decode(layer, N: int, W: int, dtype):
    x, b, a, weight, D = inputs(N, layer, W, dtype)
    S = N + 1
    conv_cache = torch.randn(S, W - 1, D).to(dtype)
    ssm = torch.randn(S, layer.num_v_heads, layer.head_v_dim, layer.head_k_dim) * 0.01
    md = types.SimpleNamespace(non_spec_state_indices_tensor=torch.arange(1, N + 1, dtype=torch.int32))
    out = torch.zeros(N, layer.num_v_heads, layer.head_v_dim, dtype=dtype)

    def step():
        plan = glue._decode_plan(md, N, torch.device("cpu"))  # once per step (shared by the layers)
        conv = glue.gather_slots(conv_cache, plan.slot_t, plan.fresh)
        new = glue._recurrent_step(layer, x, b, a, out, plan, conv[:, -(W - 1):], ssm, weight, False)
        conv_cache[plan.slot_t] = new.to(conv_cache.dtype)

    return step


def verify(layer, N: int, k: int, W: int, dtype):
    T = N * (k + 1)
    x, b, a, weight, D = inputs(T, layer, W, dtype)
    S = N * (k + 1) + 1
    conv_cache = torch.randn(S, W - 1 + k, D).to(dtype)
    ssm = torch.randn(S, layer.num_v_heads, layer.head_v_dim, layer.head_k_dim) * 0.01
    slots = torch.arange(1, S, dtype=torch.int32).reshape(N, k + 1)
    out = torch.zeros(T, layer.num_v_heads, layer.head_v_dim, dtype=dtype)
    md = types.SimpleNamespace(spec_sequence_masks=torch.ones(N, dtype=torch.bool), num_prefills=0, num_decodes=0,
                               num_spec_decodes=N, spec_query_start_loc=torch.arange(0, T + 1, k + 1, dtype=torch.int32),
                               spec_state_indices_tensor=slots,
                               num_accepted_tokens=torch.full((N,), 2, dtype=torch.int32),
                               non_spec_token_indx=None, spec_token_indx=None,
                               vllm_bi_num_computed=torch.full((N,), 64, dtype=torch.int32))

    def step():
        glue.spec_step(layer, x, b, a, out, md, conv_cache, ssm, weight, False, False)

    return step


def measure(step, repeats: int) -> dict:
    step()  # warm the index caches
    with OpCount() as oc, HostReads() as hr:
        step()
    top = sorted(oc.names.items(), key=lambda kv: -kv[1])[:7]
    return dict(ms=host_ms(step, reps=repeats, warmup=0), ops=oc.ops, reads=hr.reads, copies=hr.copies, top=top)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--reqs", default="1,64")
    ap.add_argument("--heads", default="16,32", help="key heads, value heads")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        hk, hv = (int(x) for x in args.heads.split(","))
        if hk < 1 or hv % hk:
            raise ValueError
    except ValueError:
        ap.error(f"--heads takes KEY_HEADS,VALUE_HEADS (value heads a multiple of key heads), got {args.heads!r}")
    dtype = getattr(torch, args.dtype)
    W, k = 4, args.k
    layer = make_layer(hk, hv, args.dim, k)
    print(f"one GDN layer, {hk}/{hv} heads of {args.dim}, conv width {W}, k = {k}, {args.dtype}, "
          f"{torch.get_num_threads()} threads; per call: median of {args.repeats}")
    print("| call | rows | wall ms | launches (core, conv = 1) | host reads | list->device copies | top ops |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    plain_off = types.SimpleNamespace(num_spec=0)
    for N in (int(x) for x in args.reqs.split(",")):
        for label, rows, step in (
                (f"decode {N}", N, plain_decode(layer, N, W, dtype)),
                (f"decode {N * (k + 1)}", N * (k + 1), plain_decode(layer, N * (k + 1), W, dtype)),
                (f"verify {N} x {k + 1}", N * (k + 1), verify(layer, N, k, W, dtype))):
            r = measure(step, args.repeats)
            top = ", ".join(f"{n} {c}" for n, c in r["top"])
            print(f"| {label} | {rows} | {r['ms']:.2f} | {r['ops']} | {r['reads']} | {r['copies']} | {top} |",
                  flush=True)
    del plain_off


if __name__ == "__main__":
    main()
