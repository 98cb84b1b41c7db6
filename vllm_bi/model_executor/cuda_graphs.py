"""CUDA graphs for decode steps under batch invariance (``VLLM_BI_CUDA_GRAPHS=decode``; experimental, CUDA).

By default vllm_bi forces eager mode on CUDA: its glue plans each step on the host. Eager mode cost stock vLLM
2.5x its generation throughput on the H200 (``docs/results/2026-11-30-h200-gdn-cost.md``). A step of one-token
decodes needs no host plan: the GDN glue (recurrent mode) reads its state slots from the metadata's device tensor
and the Triton attention builds its tiles on the device (``gdn._decode_plan``, ``attention._tiles``). With this
setting vLLM captures such steps whole (``cudagraph_mode=FULL_DECODE_ONLY``, no torch.compile) and replays them;
prefills and mixed steps stay eager. A captured step runs the same kernels on the same rows as an eager one, so
its bits are the same; padded rows read and write vLLM's null slot and block.

The hybrid GDN mode captures its decode steps too (the recurrence from each slot's full state); a step in which a
request is still before its prompt's last block boundary (a one-token prompt chunk, which vLLM counts as a decode)
is never replayed from a graph but runs eagerly (``patches.prompt_chunk_scheduled``). Not yet run on a GPU.

Refused where a decode step still reads the host: the chunk GDN mode (its partial blocks), the torch attention
op (``VLLM_BI_ATTENTION=torch``: rows grouped on the host), MoE layers on the default loop path (experts grouped on
the host; ``VLLM_BI_MOE=exact`` or ``triton`` groups them on the device), and vLLM's
own kernels (``VLLM_BI_CUDA_OPS=vllm``). On the H200 the trainer reproduced such a server's every token (768/768
on qwen3.5, 512/512 at 9b-dims, after the RoPE table's per-call host copy was removed); ``vllm-bi
parity`` names the server's CUDA-graph mode.
"""

from __future__ import annotations

from vllm_bi.settings import current

__all__ = ["cuda_graphs_requested", "graph_blockers"]


def cuda_graphs_requested() -> bool:
    """``VLLM_BI_CUDA_GRAPHS``: ``decode`` captures decode steps; unset, ``0`` or ``off``: eager (default)."""
    return current().cuda_graphs == "decode"


def graph_blockers(has_moe: bool) -> list[str]:
    """What in this process's settings (and the model) keeps a decode step from being captured; empty if none."""
    return current().graph_blockers(has_moe)
