"""TRL's GRPOTrainer through ``vllm_bi.integrations.trl.BIGRPOTrainer`` against a real batch-invariant ``vllm serve``
on CPU: the example's loop (``examples/trl_grpo/train.py``) for two optimizer steps on the tiny dense Qwen3.5.

- Every step: TRL's own ``sampling/sampling_logp_difference/max`` is 0.0 and no completion token's trainer logprob
  differs from the server's in any bit (the importance-sampling ratio is exactly 1).
- The weights changed and the server holds them: versions 0 (the base, checking the layout), 1 and 2 pushed and
  digest-verified, the server's digest is the trained model's and not the base checkpoint's.
- Negative controls on the same batches: TRL's stock logprob path (its fused LM head) differs from the server's
  logprobs; the base weights' logprobs equal them while the server holds the base (step 1) and differ once it holds
  the pushed weights (step 2).
- Without the server: a config the trainer cannot keep parity under is refused in one line; the helper's tensors
  carry the checkpoint's names (a MoE model's stacked experts become its per-expert tensors).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from vllm_bi.errors import UsageError
from vllm_bi.integrations.weight_sync import checkpoint_state_dict
from vllm_bi.weights import weight_digest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 2

trl = pytest.importorskip("trl")


def _example():
    spec = importlib.util.spec_from_file_location("trl_grpo_example", os.path.join(ROOT, "examples", "trl_grpo",
                                                                                   "train.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def run(tiny_model_path, tmp_path_factory):
    """The example's loop for STEPS steps with the controls' shadows; yields (trainer, server, model_dir, shadows)."""
    from trl import GRPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    from vllm_bi.integrations.transformers import apply, token_logprobs
    from vllm_bi.integrations.trl import BIGRPOTrainer
    from vllm_bi.launcher import VllmServer, cpu_env

    ex = _example()
    model_dir = tiny_model_path("qwen3.5")
    base = apply(_hf(model_dir))
    stock = _hf(model_dir)  # TRL's stock path: the transformers forward and TRL's fused LM head
    add_fused_lm_head(stock, temperature=ex.DEFAULTS["temperature"], outputs=("log_probs", "entropy"))
    shadows = []

    class WithControls(BIGRPOTrainer):
        """Also scores every batch with TRL's stock path (the trainer's current weights) and with the base weights
        (no effect on training)."""

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
            mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
            K = out["completion_ids"].size(1)
            scored = out["completion_mask"].bool()
            server = out["sampling_per_token_logps"]
            with torch.no_grad():
                stock.load_state_dict(self.model.state_dict())
                stocks = GRPOTrainer._get_per_token_logps_and_entropies(self, stock, ids, mask, K)[0]
                based = token_logprobs(base, ids, mask, temperature=self.temperature)[:, -K:]
            shadows.append({"stock": (stocks - server).abs()[scored].max().item(),
                            "base": (based - server).abs()[scored].max().item()})
            return out

    out = str(tmp_path_factory.mktemp("trl"))
    env = cpu_env(True, {"VLLM_SERVER_DEV_MODE": "1"})
    with VllmServer(model_dir, env=env, args=ex.SERVER_ARGS, log_path=os.path.join(out, "server.log")) as srv:
        trainer = ex.train(model_dir, srv, out, trainer_cls=WithControls, steps=STEPS, prompts_per_step=2,
                           max_tokens=8)
        yield trainer, srv, model_dir, shadows, ex


@pytest.mark.server
def test_every_step_the_trainer_logprobs_are_the_server_bits(run):
    trainer, _, _, _, ex = run
    rows = ex.steps_table(trainer)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["logprob_diff_max"] for r in rows] == [0.0] * STEPS, rows
    assert [r["mismatched_tokens"] for r in rows] == [0.0] * STEPS, rows
    logged = [r for r in trainer.state.log_history if "sampling/importance_sampling_ratio/min" in r]
    assert all(r["sampling/importance_sampling_ratio/min"] == r["sampling/importance_sampling_ratio/max"] == 1.0
               for r in logged), logged
    assert len(trainer.parity) == STEPS and all(p["tokens"] > 0 and p["mismatched_tokens"] == 0
                                                and p["logprob_diff_max"] == 0.0 for p in trainer.parity)
    assert [p["weight_version"] for p in trainer.parity] == list(range(STEPS))  # sampled under the pushed version


@pytest.mark.server
def test_the_trained_weights_are_pushed_and_verified_on_the_server(run):
    trainer, srv, model_dir, _, _ = run
    assert [p["version"] for p in trainer.weight_pushes] == list(range(STEPS + 1))
    assert srv.weight_version() == str(STEPS)
    served = srv.weight_digest()
    trained = weight_digest(checkpoint_state_dict(trainer.model).items())
    base = weight_digest(checkpoint_state_dict(_hf(model_dir)).items())
    assert served == trained
    assert all(served[k] != base[k] for k in served)  # every layer changed
    newest = os.path.join(trainer.args.output_dir, "weights", f"v{STEPS:06d}")
    assert sorted(os.listdir(os.path.dirname(newest)))[-1] == os.path.basename(newest)


@pytest.mark.server
def test_negative_controls_stock_logprobs_and_unpushed_weights_differ(run):
    _, _, _, shadows, _ = run
    assert len(shadows) == STEPS
    assert all(s["stock"] > 0 for s in shadows), shadows  # TRL's fused LM head: other bits
    assert shadows[0]["base"] == 0.0, shadows  # step 1 samples the base weights (version 0)
    assert all(s["base"] > 0 for s in shadows[1:]), shadows  # later steps: the server holds the pushed weights


def test_a_config_without_parity_is_refused_in_one_line(tmp_path):
    from trl import GRPOConfig

    from vllm_bi.integrations.trl import BIGRPOTrainer

    common = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none")
    cases = [(dict(use_vllm=True, vllm_mode="colocate"), "vllm_mode='server'"),
             (dict(use_vllm=True, vllm_mode="server", vllm_server_base_url="http://127.0.0.1:9",
                   vllm_importance_sampling_correction=False), "vllm_importance_sampling_correction=True"),
             (dict(use_vllm=True, vllm_mode="server", vllm_server_base_url="http://127.0.0.1:9",
                   gradient_checkpointing=True), "gradient_checkpointing=False")]
    for kw, why in cases:
        with pytest.raises(UsageError, match=why) as e:
            BIGRPOTrainer(model="unused", reward_funcs=[], args=GRPOConfig(**common, **kw))
        assert "\n" not in str(e.value)


def test_the_pushed_tensors_carry_the_checkpoint_names(tiny_model_path):
    from safetensors import safe_open

    path = tiny_model_path("qwen3.5-moe")
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        ckpt = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    model = _hf(path)
    assert any(n.endswith("experts.gate_up_proj") for n, _ in model.named_parameters())  # fused in transformers
    state = checkpoint_state_dict(model)
    assert {k: tuple(v.shape) for k, v in state.items()} == ckpt
