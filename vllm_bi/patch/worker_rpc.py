"""Worker methods a trainer calls over ``/collective_rpc``: the weight digest and the settings that decide the bits."""

from __future__ import annotations

from vllm_bi.settings import current as current_settings
from vllm_bi.settings import tuned_table

__all__ = ["vllm_bi_weight_digest", "vllm_bi_info", "vllm_bi_model_layout"]


# parameters vLLM derives from the checkpoint's at load and the batch-invariant forwards never read: MLA's
# weight-absorbed copies of kv_b_proj (its decode arithmetic, which bi_mla_forward replaces)
DERIVED = (".W_UK_T", ".W_UV")


def vllm_bi_weight_digest(self) -> dict[str, str]:
    from vllm_bi.weights import weight_digest

    params = self.model_runner.get_model().named_parameters()
    return weight_digest((n, p) for n, p in params if not n.endswith(DERIVED))


def vllm_bi_info(self) -> dict:
    """What a trainer must agree with to reproduce this server's bits (``/collective_rpc vllm_bi_info``); under
    ``VLLM_BI_GEMM_CONFIGS=tune`` also the tuned table's text (``gemm_table``), whose digest ``gemm_configs`` is."""
    from vllm_bi import __version__
    from vllm_bi.gdn import CHUNK

    from vllm.platforms import current_platform

    device = "cuda" if current_platform.is_cuda() else "cpu"
    graphs = "NONE"  # CPU: no CUDA graphs, whatever the config says
    if device == "cuda":
        graphs = getattr(getattr(getattr(self, "vllm_config", None), "compilation_config", None), "cudagraph_mode", None)
    # the settings' arithmetic dict (vllm_bi.settings), and what else a trainer checks
    settings = current_settings()
    info = {"vllm_bi": __version__, **settings.arithmetic(device), "chunk": CHUNK, "device": device,
            "cuda_graphs": str(getattr(graphs, "name", graphs))}
    tuned = tuned_table()
    if settings.tunes_gemm(device) and tuned is not None:  # the tuned table itself: a trainer installs a copy
        with open(tuned[0], newline="") as f:
            info["gemm_table"] = f.read()
    return info


def vllm_bi_model_layout(self) -> dict:
    """The served checkpoint's architecture and every tensor's HF name and shape, read from its safetensors headers
    (no weights loaded): what a trainer checks its model against before its first weight push."""
    import glob
    import json
    import os

    from safetensors import safe_open

    path = self.model_config.model
    if not os.path.isdir(path):
        return {"architectures": None, "tensors": None, "path": path}
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    tensors = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(file, "pt") as st:
            for name in st.keys():
                tensors[name] = list(st.get_slice(name).get_shape())
    return {"architectures": cfg.get("architectures"), "tensors": tensors, "path": path}
