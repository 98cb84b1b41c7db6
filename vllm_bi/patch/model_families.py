"""Refuse, when the engine is configured, a model whose recurrent-state layers vllm_bi does not make batch-invariant.

vLLM 0.32 serves many architectures with Mamba-type or linear-attention layers (Mamba, Mamba2 hybrids such as
Nemotron-H, Granite-4.0-H and Falcon-H1, LFM2's short convolutions, Bailing's and MiniMax's linear attention, Kimi's
delta attention, OLMo's hybrid GDN). Its own batch-invariant mode covers none of them; vllm_bi covers the Qwen
GDN layer (:data:`SUPPORTED_LAYERS`) and Kimi Linear (:data:`SUPPORTED_ARCHITECTURES`: CPU, and CUDA as the
``kimi-linear`` feature of :mod:`vllm_bi.settings`, refused there unless ``VLLM_BI_CUDA_PREVIEW`` names it until a
GPU gate shows it exact). Without this check such
a model would be refused later, when the loaded model is audited (``patch.audit``), after its weights are read; here
it is refused at configuration time with the layer type named.

Which layers a model has is read from vLLM's source without importing the model (a model module may need packages a
CPU install lacks, e.g. torchvision): every class under ``vllm/model_executor/layers/mamba`` and in the model's own
modules (its module and the vLLM model modules it imports) that derives from ``MambaBase``, the base vLLM gives every
layer with a recurrent state. The most derived of those the model's modules name are its state layers.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os

__all__ = ["SUPPORTED_ARCHITECTURES", "SUPPORTED_LAYERS", "local_architecture", "state_layers", "refusal"]

# state-layer class -> what makes it batch-invariant
SUPPORTED_LAYERS = {
    "QwenGatedDeltaNetAttention": "the GDN modes (model_executor/gdn.py; Qwen3-Next, Qwen3.5, their MTP drafters)",
}
# architecture -> (the platforms it is served on, what makes it batch-invariant): models whose vLLM module also holds
# state layers of other architectures (Kimi Linear shares its package with Kimi K3)
SUPPORTED_ARCHITECTURES = {
    "KimiLinearForCausalLM": (("cpu", "cuda"), "its KDA layers in the recurrent or chunk GDN mode (CUDA: recurrent) "
                              "(model_executor.gdn.bi_kda_forward) and its MLA layers in one formulation "
                              "(model_executor.attention.bi_mla_forward)"),
}
# architecture -> the vllm_bi.settings CUDA feature that serves it on CUDA (gated, or previewed for measuring)
CUDA_FEATURE = {"KimiLinearForCausalLM": "kimi-linear"}
_ROOT = "MambaBase"
_MODEL_PREFIXES = ("vllm.model_executor.models.", "vllm.models.")
_LAYER_PACKAGE = "vllm.model_executor.layers.mamba"


@functools.lru_cache(maxsize=1)
def _vllm_dir() -> str:
    spec = importlib.util.find_spec("vllm")  # the top package only: nothing of a model is imported
    return os.path.dirname(spec.origin)


def _origin(module: str) -> str | None:
    """The source file of a module: a ``vllm.`` one found on disk (finding it through the import system would run
    its packages' ``__init__``)."""
    parts = module.split(".")
    if parts[0] != "vllm":  # an out-of-tree model (vllm_bi's own text-only classes): its package is imported already
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            return None
        return spec.origin if spec is not None and spec.origin and spec.origin.endswith(".py") else None
    base = os.path.join(_vllm_dir(), *parts[1:])
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            return path
    return None


@functools.lru_cache(maxsize=None)
def _parse(path: str, package: str) -> tuple[dict[str, tuple[str, ...]], tuple[tuple[str, tuple[str, ...]], ...]]:
    """``({class: base names}, ((imported module, names), ...))`` of one source file of ``package``."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    classes: dict[str, tuple[str, ...]] = {}
    imports = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            classes[node.name] = tuple(_last_name(b) for b in node.bases)
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                mod = f"{base}.{mod}" if mod else base
            imports.append((mod, tuple(a.name for a in node.names)))
    return classes, tuple(imports)


def _last_name(expr: ast.expr) -> str:
    if isinstance(expr, ast.Attribute):
        return expr.attr
    return expr.id if isinstance(expr, ast.Name) else ""


def _package(module: str, path: str) -> str:
    """The package relative imports in ``module`` (whose file is ``path``) start from."""
    return module if os.path.basename(path) == "__init__.py" else module.rpartition(".")[0]


@functools.lru_cache(maxsize=1)
def _layer_files() -> tuple[tuple[str, str], ...]:
    """``(path, package)`` of every source file under :data:`_LAYER_PACKAGE`."""
    top = os.path.join(_vllm_dir(), *_LAYER_PACKAGE.split(".")[1:])
    out = []
    for d, _, fs in os.walk(top):
        package = "vllm." + os.path.relpath(d, _vllm_dir()).replace(os.sep, ".")
        out += [(os.path.join(d, f), package) for f in fs if f.endswith(".py")]
    return tuple(sorted(out))


def _model_closure(module: str) -> list[tuple[str, str]]:
    """``(path, package)`` of ``module`` and of every vLLM model module it imports, transitively."""
    seen, files, todo = set(), [], [module]
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        path = _origin(mod)
        if path is None:
            continue
        files.append((path, _package(mod, path)))
        for imported, names in _parse(*files[-1])[1]:
            if imported.startswith(_MODEL_PREFIXES):
                todo.append(imported)
                todo.extend(f"{imported}.{n}" for n in names)  # ``from pkg import submodule``
    return files


def state_layers(module: str) -> list[str]:
    """The recurrent-state layer classes (``MambaBase`` subclasses) that the model module ``module`` uses: the most
    derived such classes named (defined or imported) in it and in the vLLM model modules it imports."""
    model_files = _model_closure(module)
    bases: dict[str, tuple[str, ...]] = {}
    for path, package in (*_layer_files(), *model_files):
        bases.update(_parse(path, package)[0])
    state = {_ROOT}
    grew = True
    while grew:
        more = {c for c, bs in bases.items() if c not in state and any(b in state for b in bs)}
        state |= more
        grew = bool(more)
    state.discard(_ROOT)
    named = set()
    for path, package in model_files:
        classes, imports = _parse(path, package)
        named |= set(classes)
        for _, names in imports:
            named |= set(names)
    used = named & state
    return sorted(c for c in used if not any(c in bases.get(d, ()) for d in used))


def _module_of(architecture: str) -> str | None:
    from vllm.model_executor.models.registry import ModelRegistry

    entry = ModelRegistry.models.get(architecture)
    if entry is None:
        return None
    if getattr(entry, "module_name", None):
        return entry.module_name
    cls = getattr(entry, "model_cls", None)
    return cls.__module__ if cls is not None else None


def local_architecture(model: str) -> str | None:
    """The first architecture a local checkpoint directory's ``config.json`` names, or None (a hub name, no or an
    unreadable config: vLLM reports those itself)."""
    import json

    try:
        with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
            archs = json.load(f).get("architectures")
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    return archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None


def _platform() -> str:
    """``rocm``, ``cuda`` or ``cpu`` (any other platform: vllm_bi's ledger refuses it when it applies)."""
    from vllm.platforms import current_platform

    if current_platform.is_rocm():
        return "rocm"
    return "cuda" if current_platform.is_cuda_alike() else "cpu"


def refusal(model_config) -> str | None:
    """Why a model with recurrent-state layers other than :data:`SUPPORTED_LAYERS` is refused (module doc), or None
    when it is not. ``model_config`` is vLLM's ``ModelConfig`` (``architecture``, ``is_hybrid``,
    ``has_inner_state``, ``is_attention_free``)."""
    stateful = any(bool(getattr(model_config, flag, False))
                   for flag in ("is_hybrid", "has_inner_state", "is_attention_free"))
    if not stateful:
        return None  # attention-only: the layer audit after loading covers it
    arch = model_config.architecture
    if arch in SUPPORTED_ARCHITECTURES:
        platforms, platform = SUPPORTED_ARCHITECTURES[arch][0], _platform()
        if platform not in platforms:
            return (f"vllm_bi: {arch} is served batch-invariantly on {', '.join(platforms)} only so far (its KDA and "
                    f"MLA forwards have no {platform.upper()} path yet). Fix: serve it on a CPU build of vLLM, or "
                    "without VLLM_BATCH_INVARIANT=1.")
        feature = CUDA_FEATURE.get(arch) if platform == "cuda" else None
        if feature is None:
            return None
        from vllm_bi.settings import current

        if current().cuda_feature(feature):
            return None
        return (f"vllm_bi: {arch} on CUDA has not been shown exact by a GPU gate yet. Fix: serve it on a CPU build "
                f"of vLLM, or set VLLM_BI_CUDA_PREVIEW={feature} to run it unverified (for measuring), or serve "
                "without VLLM_BATCH_INVARIANT=1.")
    module = _module_of(arch)
    layers = state_layers(module) if module else []
    if layers and all(layer in SUPPORTED_LAYERS for layer in layers):
        return None
    other = [layer for layer in layers if layer not in SUPPORTED_LAYERS]
    what = (", ".join(other) + " layers" if other else
            "recurrent-state layers vllm_bi could not identify in its source")
    return (
        f"vllm_bi: {arch} has {what} (Mamba-type / linear attention), which vllm_bi does not yet make "
        f"batch-invariant; it supports the Qwen GDN layer (Qwen3-Next, Qwen3.5) and Kimi Linear. Fix: serve this "
        f"model without VLLM_BATCH_INVARIANT=1, or serve a supported model (docs/serving.md).")
