"""Which vLLM attributes differ from a pristine import: the independent observation the patch-ledger tests compare
the ledger with. Run as a script, in fresh processes:

    python tests/ledger_observer.py serve MODEL DEVICE OUT.json
        VLLM_BATCH_INVARIANT=1, vLLM's engine in this process (the plugin applies itself as in any server), one
        request served; then every loaded ``vllm`` module is described (``describe_loaded``). Written twice: as
        served, and "tampered" (one unlisted attribute replaced, one listed patch put back to vLLM's original),
        the negative controls.
    python tests/ledger_observer.py pristine IN.json OUT.json
        batch invariance off (the plugin changes nothing): the same modules imported and described.

A description maps ``module:Qualified.name`` (and registry entries ``module:REGISTRY[key]``) to where the value's
code lives, so a replacement shows up even when ``functools.wraps`` copied the original's name.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
import json
import os
import re
import sys

ADDRESS = re.compile(r" at 0x[0-9a-f]+|0x[0-9a-f]{6,}")


def describe(v, depth: int = 0) -> str | None:
    """Where ``v``'s code lives (functions, methods, properties, wrappers), or a stable repr for plain values and
    registry records; ``None`` for anything else (not observed)."""
    try:
        return _describe(v, depth)
    except Exception:  # lazy placeholder objects raise on any attribute
        return None


def _describe(v, depth: int) -> str | None:
    if depth > 3:
        return None
    if isinstance(v, (staticmethod, classmethod)):
        inner = describe(v.__func__, depth + 1)
        return inner and f"{type(v).__name__}:{inner}"
    if isinstance(v, property):
        inner = describe(v.fget, depth + 1)
        return inner and f"property:{inner}"
    code = getattr(v, "__code__", None)
    if code is not None:
        return f"{code.co_filename}:{code.co_firstlineno}:{code.co_name}"
    if getattr(v, "__wrapped__", None) is not None and callable(v):  # lru_cache and similar C wrappers
        return describe(v.__wrapped__, depth + 1)
    if inspect.isclass(v):
        return f"class:{v.__module__}.{v.__qualname__}"
    if isinstance(v, (str, int, float, bool, type(None))):
        return repr(v)
    if dataclasses.is_dataclass(v) and not inspect.isclass(v):
        return ADDRESS.sub("", repr(v))
    return None


def _key(k) -> str:
    return str(k) if isinstance(k, enum.Enum) else ADDRESS.sub("", repr(k) if not isinstance(k, str) else k)


def _dict_items(prefix: str, d: dict, out: dict) -> None:
    for k, v in list(d.items()):
        desc = describe(v)
        if desc is not None:
            out[f"{prefix}[{_key(k)}]"] = desc


def describe_module(name: str, mod) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in list(vars(mod).items()):
        if inspect.ismodule(v):
            continue
        if inspect.isclass(v):
            if v.__module__ != name:
                continue
            for ck, cv in list(vars(v).items()):
                desc = describe(cv)
                if desc is not None:
                    out[f"{name}:{v.__qualname__}.{ck}"] = desc
            continue
        if isinstance(v, dict):
            _dict_items(f"{name}:{k}", v, out)
            continue
        desc = None if dataclasses.is_dataclass(v) else describe(v)
        if desc is not None:
            out[f"{name}:{k}"] = desc
            continue
        try:  # registry objects (ModelRegistry); lazy placeholder modules raise on any attribute
            fields = vars(v) if type(v).__module__ == name else {}  # where its class is defined: listed once
        except Exception:
            continue
        if isinstance(fields, dict):
            for ak, av in list(fields.items()):
                if isinstance(av, dict):
                    _dict_items(f"{name}:{k}.{ak}", av, out)
    return out


def describe_loaded() -> dict[str, dict[str, str]]:
    return {name: describe_module(name, mod) for name, mod in sorted(sys.modules.items())
            if mod is not None and (name == "vllm" or name.startswith("vllm."))}


def _foreign(key: str, desc: str | None, vllm_dir: str) -> bool:
    """Whether a patched-side description points at code or a class outside vLLM, or is a registry entry (``key``
    ends in ``[...]``) naming vllm_bi: a change vLLM did not make to itself. (vLLM rebinds some kernels and fills
    caches and counters while it serves; those point into vLLM or are plain values, and are not patches. It also keeps
    the stack that first initialised its platform, which runs through the plugin, as a plain string.)"""
    if desc is None:
        return False
    if desc.startswith(("staticmethod:", "classmethod:", "property:")):
        desc = desc.split(":", 1)[1]
    if desc.startswith("class:"):
        return not desc.startswith(("class:vllm.", "class:builtins."))
    if ".py:" in desc:
        return not os.path.abspath(desc.split(".py:")[0] + ".py").startswith(vllm_dir + os.sep)
    return key.endswith("]") and "vllm_bi" in desc


def changed(pristine: dict, patched: dict, vllm_dir: str) -> set[str]:
    """Every ``module:name`` whose description differs between the two processes and now names code outside vLLM,
    in the modules both described."""
    out = set()
    for mod in set(pristine) & set(patched):
        a, b = pristine[mod], patched[mod]
        for k in set(a) | set(b):
            if a.get(k) == b.get(k):
                continue
            if _foreign(k, b.get(k), vllm_dir):
                out.add(k)
    return out


UNLISTED = "vllm.v1.sample.sampler:Sampler.apply_temperature"  # a deliberate extra patch in the tampered snapshot


def _serve(model: str, device: str, out_path: str) -> None:
    os.environ["VLLM_BATCH_INVARIANT"] = "1"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine and worker in this process: one set of modules
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import vllm.entrypoints.launchers.api_server.entry  # noqa: F401 - as in `vllm serve`: the API server's rows apply
    from vllm import LLM, SamplingParams

    llm = LLM(model, max_model_len=256, max_num_batched_tokens=256, gpu_memory_utilization=0.2, seed=0)
    out = llm.generate(["one two three"], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 4
    from vllm_bi.patch.ledger import active_rows, applied

    served = describe_loaded()
    # tampered: one attribute the ledger does not list, one listed patch undone
    from vllm.v1.sample.sampler import Sampler

    def apply_temperature(self, logits, temp, all_random):  # stands for a patch someone forgot to list
        return logits

    Sampler.apply_temperature = apply_temperature
    applied_rows = [p.target for p in applied()]
    # a listed patch put back: the last applied row that wraps a method, restored to vLLM's original
    row = [p for p in applied() if p.wraps and p.kind == "attr"][-1]
    module, _, path = row.target.partition(":")
    owner = importlib.import_module(module)
    for name in path.split(".")[:-1]:
        owner = getattr(owner, name)
    attr = path.split(".")[-1]
    setattr(owner, attr, inspect.getattr_static(owner, attr).__wrapped__)
    tampered = describe_loaded()
    import vllm

    json.dump({"served": served, "tampered": tampered, "applied": applied_rows, "reverted": row.target,
               "vllm_dir": os.path.dirname(os.path.abspath(vllm.__file__)),
               "active": [p.target for p in active_rows(device)]}, open(out_path, "w"))


def _pristine(in_path: str, out_path: str) -> None:
    os.environ["VLLM_BATCH_INVARIANT"] = "0"
    names = json.load(open(in_path))["served"]
    failed = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # a module that imports only inside a running engine: not compared
            failed.append(name)
    desc = describe_loaded()
    json.dump({"pristine": {n: d for n, d in desc.items() if n in names and n not in failed}, "failed": failed},
              open(out_path, "w"))


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        _serve(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        _pristine(sys.argv[2], sys.argv[3])


def compare(observed: set[str], listed: set[str]) -> tuple[list[str], list[str]]:
    """``(patched but not in the ledger, in the ledger but not patched)``."""
    return sorted(observed - listed), sorted(listed - observed)


def observe(model: str, device: str, tmp_path) -> tuple[set[str], set[str], dict]:
    """Serve ``model`` in a fresh process and describe vLLM there and in a pristine process; returns the changed
    attributes as served and as tampered, and the served run's record (``active``, ``applied``, ``reverted``)."""
    import subprocess

    served, pristine = tmp_path / "served.json", tmp_path / "pristine.json"
    env = dict(os.environ, VLLM_BATCH_INVARIANT="1")
    r = subprocess.run([sys.executable, __file__, "serve", model, device, str(served)], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    r = subprocess.run([sys.executable, __file__, "pristine", str(served), str(pristine)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    run, base = json.load(open(served)), json.load(open(pristine))["pristine"]
    assert len(base) > 100, "the pristine process described too few vLLM modules"
    return changed(base, run["served"], run["vllm_dir"]), changed(base, run["tampered"], run["vllm_dir"]), run


def check_ledger(model: str, device: str, tmp_path) -> None:
    """The ledger's active rows on ``device`` are exactly what serving ``model`` changed in vLLM; the negative
    controls (an unlisted patch, a listed one undone) are both named by the same comparison."""
    import vllm.entrypoints.launchers.api_server.entry  # noqa: F401 - the served process imported it too
    from vllm_bi.patch.ledger import active_rows

    observed, tampered, run = observe(model, device, tmp_path)
    active = active_rows(device)
    # a row applied when vLLM imports its module: pending where the served model never imports it
    pending = {p.target for p in active if p.kind == "on_import" and p.target.partition(":")[0] not in run["served"]}
    listed = {p.target for p in active} - pending
    assert set(run["active"]) == listed | pending and set(run["applied"]) == listed
    unlisted, missing = compare(observed, listed)
    assert not unlisted and not missing, (
        f"vLLM attributes changed but not in the ledger: {unlisted}; ledger rows not applied: {missing}")
    unlisted, missing = compare(tampered, listed)
    assert unlisted == [UNLISTED] and missing == [run["reverted"]], (unlisted, missing)
