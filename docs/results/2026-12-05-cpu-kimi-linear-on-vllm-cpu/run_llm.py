import sys
from vllm import LLM, SamplingParams


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else '/tmp/kimi_probe/model'
    extra = {}
    for a in sys.argv[2:]:
        k, v = a.split('=', 1)
        extra[k] = {'True': True, 'False': False}.get(v, int(v) if v.isdigit() else v)
    print('extra LLM kwargs:', extra, flush=True)
    llm = LLM(path, enforce_eager=True, max_model_len=512,
              max_num_batched_tokens=512, dtype='bfloat16', **extra)
    print(llm.generate(['hello world'], SamplingParams(max_tokens=8, temperature=0)))


if __name__ == '__main__':
    main()
