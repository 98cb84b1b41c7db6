"""The trainer's models: the same network as the server's, built from the same checkpoint, every op from
:mod:`vllm_bi.ops` and :mod:`vllm_bi.gdn` with autograd backwards (no vLLM code runs here). :func:`from_pretrained`
builds the one a checkpoint's ``config.json`` names."""

from vllm_bi.model_dir import read_model_config
from vllm_bi.models.kimi_linear import KimiLinearForCausalLM
from vllm_bi.models.qwen_gdn import QwenGDNForCausalLM

__all__ = ["KimiLinearForCausalLM", "QwenGDNForCausalLM", "from_pretrained", "model_class"]


def model_class(path: str):
    """The trainer model class for the checkpoint directory ``path``: Kimi Linear's, else the Qwen GDN hybrids' (which
    refuses another architecture by name when it reads the config). A missing or unreadable ``config.json`` is
    refused in one line (:func:`vllm_bi.model_dir.read_model_config`)."""
    archs = read_model_config(path, supported=False).get("architectures") or [None]
    return KimiLinearForCausalLM if archs[0] == "KimiLinearForCausalLM" else QwenGDNForCausalLM


def from_pretrained(path: str):
    """The trainer model of the checkpoint directory ``path`` (:func:`model_class`), its weights loaded."""
    return model_class(path).from_pretrained(path)
