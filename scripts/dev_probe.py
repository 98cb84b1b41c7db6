"""Dev probe: one request alone vs in a busy batch, and at two max_num_batched_tokens."""
import os, sys, time, random
def main():
    from vllm import LLM, SamplingParams
    model = sys.argv[1]
    mnbt = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    t0 = time.time()
    llm = LLM(model=model, dtype="bfloat16", max_model_len=1024, max_num_batched_tokens=mnbt,
              max_num_seqs=16, gpu_memory_utilization=0.2, enforce_eager=True, seed=0,
              enable_prefix_caching=False)
    print("startup", time.time() - t0, flush=True)
    rng = random.Random(0)
    tok = llm.get_tokenizer()
    words = "the cat sat on a red mat and the dog ran far away into the blue sea".split()
    prompt = " ".join(rng.choice(words) for _ in range(60))
    others = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 120))) for _ in range(9)]
    for sp in [SamplingParams(temperature=0, max_tokens=24, logprobs=0),
               SamplingParams(temperature=1.0, seed=1234, max_tokens=24, logprobs=0)]:
        a = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
        b = llm.generate([prompt] + others, sp, use_tqdm=False)[0].outputs[0]
        la = [list(d.values())[0].logprob for d in a.logprobs]
        lb = [list(d.values())[0].logprob for d in b.logprobs]
        same_tok = a.token_ids == b.token_ids
        n = min(len(la), len(lb))
        eq = sum(x == y for x, y in zip(la, lb))
        md = max(abs(x - y) for x, y in zip(la[:n], lb[:n]))
        print(f"T={sp.temperature} tokens_same={same_tok} logprobs_equal={eq}/{n} maxdiff={md:.3g}", flush=True)
    print("total", time.time() - t0)
if __name__ == "__main__":
    main()
