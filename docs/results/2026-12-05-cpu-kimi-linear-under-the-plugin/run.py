import os, sys
os.environ.setdefault("VLLM_BATCH_INVARIANT", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_KIMI_K3_GEMM_AR", "0")
import vllm_bi.patch.model_families as MF
MF.refusal = lambda mc: None
from vllm import LLM, SamplingParams
llm = LLM("/tmp/kx/model", enforce_eager=True, max_model_len=512, max_num_batched_tokens=512, dtype="bfloat16",
          enable_prefix_caching=False, **dict(a.split("=", 1) for a in sys.argv[1:]))
print(llm.generate(["hello world"], SamplingParams(max_tokens=8, temperature=0)))
