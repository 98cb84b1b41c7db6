"""A model directory as vllm_bi's commands take it: a local Hugging Face checkpoint of a GDN hybrid.

:data:`ARCHITECTURES` lists the ``config.json`` architectures vllm_bi supports (the trainer model builds them and the
server glue serves them batch-invariantly). :func:`read_model_config` reads a directory's ``config.json`` without
importing torch, so a command refuses a missing directory, a missing or corrupt ``config.json`` or another
architecture in one line (:class:`~vllm_bi.errors.UsageError`) before it starts a server or loads a model.
:func:`write_checkpoint` writes a checkpoint of new weights beside another's config and tokenizer (a weight push).
"""

from __future__ import annotations

import json
import os

from vllm_bi.errors import UsageError

__all__ = ["ARCHITECTURES", "QWEN_ARCHITECTURES", "copy_checkpoint_files", "read_model_config", "read_tensors",
           "write_checkpoint"]

# config.json architecture -> (vllm_bi's family name, GDN projections packed per key-head group as Qwen3-Next does)
QWEN_ARCHITECTURES = {
    "Qwen3NextForCausalLM": ("qwen3-next", True),
    "Qwen3_5ForCausalLM": ("qwen3.5", False),
    "Qwen3_5MoeForCausalLM": ("qwen3.5-moe", False),
}
# config.json architecture -> vllm_bi's family name: every architecture the trainer builds and the server serves
ARCHITECTURES = {**{arch: family for arch, (family, _) in QWEN_ARCHITECTURES.items()},
                 "KimiLinearForCausalLM": "kimi-linear"}


def read_model_config(path: str, flag: str = "--model", supported: bool = True, qwen_only: str = "") -> dict:
    """``path``'s ``config.json`` as a dict. Raises :class:`UsageError` naming ``flag``, the problem and the fix
    when ``path`` is not a directory, has no readable ``config.json``, the file is not a JSON object, or (with
    ``supported``) its first architecture is not one of :data:`ARCHITECTURES`; with ``qwen_only`` (the command's
    name), also when it is not one of :data:`QWEN_ARCHITECTURES` (for the commands that build transformers' model or
    hook the Qwen trainer model's modules: Kimi Linear has neither)."""
    where = f"{flag} {path}"
    if not os.path.isdir(path):
        raise UsageError(f"{where}: no such directory; give a local Hugging Face checkpoint directory "
                         "(`vllm-bi make-model` writes a small one)")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise UsageError(f"{where}: no config.json in it; give the directory of a Hugging Face checkpoint")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except json.JSONDecodeError as e:
        raise UsageError(f"{cfg_path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); restore the "
                         "checkpoint's config.json") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"{cfg_path}: not UTF-8 text ({e.reason}); restore the checkpoint's config.json") from None
    except OSError as e:
        raise UsageError(f"{cfg_path}: cannot read it ({e.strerror}); check its permissions") from None
    if not isinstance(cfg, dict):
        raise UsageError(f"{cfg_path}: a JSON {type(cfg).__name__}, not an object; restore the checkpoint's "
                         "config.json")
    if supported:
        archs = cfg.get("architectures")
        arch = archs[0] if isinstance(archs, list) and archs else None
        if arch is None:
            raise UsageError(f"{cfg_path}: names no architecture (an \"architectures\" list); vllm_bi supports "
                             f"{', '.join(ARCHITECTURES)}")
        if arch not in ARCHITECTURES:
            raise UsageError(f"{where}: architecture {arch} is not a GDN hybrid vllm_bi supports; give a checkpoint "
                             f"of {', '.join(ARCHITECTURES)}")
        if qwen_only and arch not in QWEN_ARCHITECTURES:
            raise UsageError(f"{where}: {qwen_only} does not run {arch} yet (`vllm serve`, `vllm-bi parity` and the "
                             f"RL trainer do); give a checkpoint of {', '.join(QWEN_ARCHITECTURES)}")
    return cfg


def read_tensors(path: str) -> dict:
    """Every tensor of a checkpoint directory's ``*.safetensors`` files, by name (the files in sorted order)."""
    from safetensors.torch import load_file

    tensors = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(path, name)))
    return tensors


def copy_checkpoint_files(like: str, path: str) -> None:
    """Copy every file of the checkpoint directory ``like`` but its weights (config, generation config, tokenizer)
    into ``path`` (made if missing), over what is there."""
    import shutil

    os.makedirs(path, exist_ok=True)
    for name in os.listdir(like):
        src = os.path.join(like, name)
        if os.path.isfile(src) and not name.endswith((".safetensors", ".safetensors.index.json", ".bin")):
            shutil.copy(src, os.path.join(path, name))


def write_checkpoint(path: str, state: dict, like: str) -> str:
    """Write ``state`` (tensor name -> tensor, the checkpoint's names) as ``path/model.safetensors``, with every other
    file of the checkpoint directory ``like`` (config, generation config, tokenizer) copied as it is; returns
    ``path``."""
    from safetensors.torch import save_file

    copy_checkpoint_files(like, path)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    return path
