"""The Gated DeltaNet family: one folder for every way vllm_bi computes a GDN layer.

- :mod:`~vllm_bi.gdn.naive` — the float64-friendly per-token reference the kernels are tested against;
- :mod:`~vllm_bi.gdn.recurrent` — the recurrent mode: token by token, fp32 state (torch on CPU, fla-core's
  fused recurrent kernel on CUDA);
- :mod:`~vllm_bi.gdn.chunk` — the chunk-aligned mode (64-token blocks at absolute positions);
- :mod:`~vllm_bi.gdn.slots`, :mod:`~vllm_bi.gdn.chunk_decode` — the server's CUDA steps that read and write
  states in vLLM's cache slots (recurrent and chunk mode);
- :mod:`~vllm_bi.gdn.layer` — the layer's core around them (causal conv, q/k/v split, gating) and the one public
  entry, :func:`gdn_varlen`, which takes the mode.

Nothing here imports vLLM: the server's glue (``vllm_bi.model_executor.gdn``) and the trainer's model
(``vllm_bi.trainer.model``) both call :func:`gdn_varlen`.
"""

from vllm_bi.gdn.chunk import CHUNK
from vllm_bi.gdn.layer import MODES, gdn_sequence, gdn_varlen
from vllm_bi.gdn.naive import naive_gdn

__all__ = ["CHUNK", "MODES", "gdn_sequence", "gdn_varlen", "naive_gdn"]
