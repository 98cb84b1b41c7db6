"""TRL's GRPOTrainer on vllm_bi's digits task, sampling from a batch-invariant vLLM server, on CPU.

    python examples/trl_grpo/train.py --steps 10          # builds a tiny random-weight Qwen3.5, starts its server

Prints, per optimizer step, the largest |trainer - server| logprob over the step's completion tokens (0.0: the
trainer's logprobs are the server's, bit for bit), how many tokens differ in any bit, and the mean reward.
"""

from __future__ import annotations

import argparse
import os

DEFAULTS = dict(steps=10, prompts_per_step=4, group_size=4, max_tokens=12, temperature=1.0, lr=5e-3, seed=0)
SERVER_ARGS = ["--logprobs-mode", "processed_logprobs", "--max-num-batched-tokens", "128", "--max-num-seqs", "16"]


def digits_reward(prompts, completions, **kwargs) -> list[float]:
    """vllm_bi's digits reward in TRL's form: the share of each completion's non-space characters that are digits."""
    from vllm_bi.trainer.rewards import digits

    return [digits(p, c, {}) for p, c in zip(prompts, completions)]


def dataset(n: int, seed: int):
    """``n`` prompts of vllm_bi's procedural digits task ("<words> <number word> in digits:")."""
    from datasets import Dataset

    from vllm_bi.trainer.data import DigitsTask

    task = DigitsTask(seed)
    return Dataset.from_list([{"prompt": ex["prompt"], "answer": ex["answer"]} for ex in task.batch(0, n)])


def train(model_dir: str, server, output_dir: str, trainer_cls=None, **overrides):
    """Run ``BIGRPOTrainer`` (or ``trainer_cls``, a subclass) for ``steps`` optimizer steps against ``server`` (a
    :class:`vllm_bi.launcher.VllmServer` of ``model_dir`` started with :data:`SERVER_ARGS`); returns the trainer
    (``trainer.parity``, ``trainer.weight_pushes``, ``trainer.state.log_history``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from vllm_bi.integrations.trl import BIGRPOTrainer

    o = dict(DEFAULTS, **overrides)
    torch.manual_seed(o["seed"])
    args = GRPOConfig(
        output_dir=output_dir, max_steps=o["steps"], learning_rate=o["lr"], seed=o["seed"],
        per_device_train_batch_size=o["prompts_per_step"] * o["group_size"], num_generations=o["group_size"],
        max_completion_length=o["max_tokens"], temperature=o["temperature"], beta=0.0, num_iterations=1,
        use_cpu=True, bf16=False, gradient_checkpointing=False,
        use_vllm=True, vllm_mode="server", vllm_server_base_url=server.url, vllm_server_timeout=60,
        vllm_importance_sampling_correction=True,
        router_aux_loss_coef=0.0,  # MoE families: the adapted model does not compute the load-balancing loss
        logging_steps=1, report_to="none", save_strategy="no", dataloader_num_workers=0, disable_tqdm=True,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    trainer = (trainer_cls or BIGRPOTrainer)(
        model=model, reward_funcs=digits_reward, args=args, processing_class=AutoTokenizer.from_pretrained(model_dir),
        train_dataset=dataset(o["steps"] * o["prompts_per_step"], o["seed"]), api_key=server.api_key,
        base_model=model_dir)
    trainer.train()
    return trainer


def steps_table(trainer) -> list[dict]:
    """One row per optimizer step: TRL's logprob difference, the bitwise count, the reward and the loss."""
    rows = []
    for row in trainer.state.log_history:
        if "sampling/sampling_logp_difference/max" in row:
            rows.append({"step": row["step"], "logprob_diff_max": row["sampling/sampling_logp_difference/max"],
                         "mismatched_tokens": row.get("bit_wise/logprob_mismatches"), "reward": row["reward"],
                         "loss": row["loss"]})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    p.add_argument("--lr", type=float, default=DEFAULTS["lr"])
    p.add_argument("--prompts-per-step", type=int, default=DEFAULTS["prompts_per_step"])
    p.add_argument("--group-size", type=int, default=DEFAULTS["group_size"], help="samples per prompt")
    p.add_argument("--seed", type=int, default=DEFAULTS["seed"])
    p.add_argument("--family", default="qwen3.5", choices=("qwen3.5", "qwen3.5-moe", "qwen3-next"))
    p.add_argument("--run-dir", default="runs/trl_grpo")
    a = p.parse_args()
    for name in ("steps", "prompts_per_step", "group_size"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(a, name)}")
    if a.group_size < 2:
        p.error("--group-size must be at least 2: GRPO's advantage is a sample's reward against its group's")
    if not a.lr > 0:
        p.error(f"--lr must be > 0, got {a.lr}")
    os.environ.setdefault("VLLM_BATCH_INVARIANT", "1")  # this process's arithmetic settings: the server's
    from vllm_bi.launcher import VllmServer, cpu_env
    from vllm_bi.tiny_models import build_tiny_model

    model_dir = build_tiny_model(a.family, os.path.join(a.run_dir, f"model-{a.family}"))
    env = cpu_env(True, {"VLLM_SERVER_DEV_MODE": "1"})
    with VllmServer(model_dir, env=env, args=SERVER_ARGS, log_path=os.path.join(a.run_dir, "server.log")) as srv:
        trainer = train(model_dir, srv, a.run_dir, steps=a.steps, lr=a.lr, prompts_per_step=a.prompts_per_step,
                        group_size=a.group_size, seed=a.seed)
        print(f"{'step':>4} {'max |trainer - server| logprob':>31} {'tokens differing':>17} {'reward':>7}")
        for r in steps_table(trainer):
            print(f"{r['step']:>4} {r['logprob_diff_max']:>31} {int(r['mismatched_tokens']):>17} {r['reward']:>7.3f}")
        print(f"server weight version {srv.weight_version()} (digest verified after every push)")
    return 0


if __name__ == "__main__":
    import sys

    from vllm_bi.errors import run_command

    sys.exit(run_command("train.py", main))  # a vllm_bi error: one line and its exit status, no traceback
