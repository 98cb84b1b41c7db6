"""DIAGNOSTIC ONLY (not a fix): bypass the hybrid block-size check in-process to
see what fails next on the forward path. Nothing on disk under vLLM is changed;
the patch is a runtime monkeypatch of CpuPlatform._check_aligned_block_size.
Run with VLLM_ENABLE_V1_MULTIPROCESSING=0 so the engine core and the worker
(distributed_executor_backend='uni') live in this process.
"""
import sys
import traceback

from vllm.platforms import cpu as cpu_platform


def _no_check(cls, vllm_config, backend_classes, pre_block_size):
    print(f"[diag] skipping _check_aligned_block_size: block_size="
          f"{vllm_config.cache_config.block_size} backends="
          f"{[b.get_name() for b in backend_classes]}", flush=True)


cpu_platform.CpuPlatform._check_aligned_block_size = classmethod(_no_check)

if "--torch-gather" in sys.argv:
    # DIAGNOSTIC: torch stand-in for the Triton gather_initial_states so the
    # KDA prefill proceeds to its next kernel (chunk_kda_with_fused_gate).
    import torch
    from vllm.model_executor.layers.mamba.gdn import kimi_gdn_linear_attn as _k

    def _gather(state, indices, has_initial_state):
        out = state.index_select(0, indices.long()).clone()
        out[~has_initial_state] = 0
        return out

    _k.gather_initial_states = _gather
    print("[diag] patched gather_initial_states with torch version", flush=True)

from vllm import LLM, SamplingParams  # noqa: E402


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else "/tmp/kimi_probe/model"
    llm = LLM(path, enforce_eager=True, max_model_len=512,
              max_num_batched_tokens=512, dtype="bfloat16",
              enable_prefix_caching=False, distributed_executor_backend="uni")
    try:
        print(llm.generate(["hello world"],
                           SamplingParams(max_tokens=8, temperature=0)))
    except Exception:
        traceback.print_exc()
        raise


if __name__ == "__main__":
    main()
