"""TRL's ``GRPOTrainer`` against a ``VLLM_BATCH_INVARIANT=1 vllm serve``, with the server's logprobs bit for bit.

.. code-block:: python

    from trl import GRPOConfig
    from vllm_bi.integrations.trl import BIGRPOTrainer

    args = GRPOConfig(output_dir="runs/x", use_vllm=True, vllm_mode="server", vllm_server_base_url=url,
                      vllm_importance_sampling_correction=True, gradient_checkpointing=False, ...)
    trainer = BIGRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok)
    trainer.train()   # trainer.parity: per generation batch, the max |trainer - server| logprob and the count

:class:`BIGRPOTrainer` is ``GRPOTrainer`` with four changes (``docs/own-trainer.md``, "Use vllm_bi with TRL"):

- the model is adapted (:func:`vllm_bi.integrations.transformers.apply`, checked against the server's settings),
  and ``_get_per_token_logps_and_entropies`` returns :func:`~vllm_bi.integrations.transformers.token_logprobs` of
  the completion tokens: TRL's own path goes through its fused LM head (another logprob op: other bits);
- TRL's client (``VLLMClient``) sends the server's API key and opens no NCCL group (vLLM's CPU build has no weight
  transfer engine; every route of a batch-invariant server with a key needs the key);
- the weights go to the server through :class:`vllm_bi.integrations.weight_sync.HFWeightSync` where TRL would
  broadcast them (before each generation after an optimizer step, and once before the first, which checks the
  model's layout, and after the last step): checkpoint, keyed atomic swap, version ``global_step``, digest check; a
  failure raises :class:`~vllm_bi.weight_push.PushFailed`;
- every generation batch logs ``bit_wise/logprob_mismatches`` (completion tokens whose trainer logprob differs from
  the server's in any bit) beside TRL's ``sampling/sampling_logp_difference/max``, and appends both to
  ``trainer.parity``.

Importing this module does not import TRL; the first use of :class:`BIGRPOTrainer` does (``pip install
vllm_bi[trl]``, TRL 1.16.0).
"""

from __future__ import annotations

import os

from vllm_bi.errors import UsageError

__all__ = ["BIGRPOTrainer"]

_TRL_VERSION = "1.16.0"
_CLASSES: dict = {}


def __getattr__(name: str):
    if name == "BIGRPOTrainer":
        if "BIGRPOTrainer" not in _CLASSES:
            _CLASSES["BIGRPOTrainer"] = _build()
        return _CLASSES["BIGRPOTrainer"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _require_trl():
    try:
        import trl
        from trl import GRPOTrainer
        from trl.generation import vllm_client, vllm_generation
    except ImportError as e:
        raise UsageError(f"vllm_bi.integrations.trl needs TRL {_TRL_VERSION} ({e}): pip install vllm_bi[trl]") from None
    return trl, GRPOTrainer, vllm_client.VLLMClient, vllm_generation


def _client_class(VLLMClient, api_key: str | None):
    """TRL's ``VLLMClient`` that sends ``api_key`` on every request and opens no NCCL group."""
    import time

    import requests

    auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    class BIVLLMClient(VLLMClient):
        @property
        def session(self):
            return self._bi_session

        @session.setter
        def session(self, s):  # VLLMClient.__init__ makes its session and uses it at once: key it as it is set
            s.headers.update(auth)
            self._bi_session = s

        def check_server(self, total_timeout: float = 0.0, retry_interval: float = 2.0):
            deadline = time.monotonic() + total_timeout
            while True:
                try:
                    r = requests.get(f"{self.base_url}/health", headers=auth, timeout=10)
                    if r.status_code == 200:
                        return
                    if r.status_code == 401:
                        raise UsageError(f"the vLLM server at {self.base_url} refused the API key (HTTP 401): set "
                                         "VLLM_API_KEY or pass api_key= to the server's key")
                except requests.exceptions.RequestException:
                    pass
                if time.monotonic() >= deadline:
                    raise ConnectionError(f"the vLLM server at {self.base_url} did not answer /health within "
                                          f"{total_timeout} s")
                time.sleep(retry_interval)

        def init_communicator(self, device=0):
            """No NCCL group: :class:`BIGRPOTrainer` pushes weights over HTTP (HFWeightSync)."""

    return BIVLLMClient


def _build():
    trl, GRPOTrainer, VLLMClient, vllm_generation = _require_trl()
    if trl.__version__ != _TRL_VERSION:
        raise UsageError(f"vllm_bi.integrations.trl is made for TRL {_TRL_VERSION}, this is {trl.__version__}: "
                         "pip install vllm_bi[trl]")
    import torch

    from vllm_bi.client import VllmClient
    from vllm_bi.integrations.transformers import apply, is_adapted, token_logprobs
    from vllm_bi.integrations.weight_sync import HFWeightSync

    class BIGRPOTrainer(GRPOTrainer):
        """``GRPOTrainer(model, reward_funcs, args, ...)`` plus ``api_key`` (default ``VLLM_API_KEY``) and
        ``base_model`` (the served checkpoint's directory; default: the model's ``name_or_path``). See the module
        doc for what changes."""

        def __init__(self, *args, api_key: str | None = None, base_model: str | None = None, **kwargs):
            cfg = kwargs.get("args") if "args" in kwargs else (args[2] if len(args) > 2 else None)
            _check_config(cfg)
            key = api_key if api_key is not None else (os.environ.get("VLLM_API_KEY") or None)
            stock = vllm_generation.VLLMClient
            vllm_generation.VLLMClient = _client_class(VLLMClient, key)  # what GRPOTrainer.__init__ constructs
            try:
                super().__init__(*args, **kwargs)
            finally:
                vllm_generation.VLLMClient = stock
            if self.accelerator.num_processes != 1:
                raise UsageError("BIGRPOTrainer: one training process only (the weight push reads the whole model)")
            model = self.accelerator.unwrap_model(self.model)
            self.bi_base_model = base_model or model.name_or_path
            if not os.path.isfile(os.path.join(self.bi_base_model, "config.json")):
                raise UsageError(f"BIGRPOTrainer: base_model {self.bi_base_model!r} is not a local checkpoint "
                                 "directory; pass base_model= (the directory the server serves)")
            self.bi_server = VllmClient(cfg.vllm_server_base_url, model=self.bi_base_model, api_key=key)
            settings = self.bi_server.server_info()
            apply(model, settings=settings)
            if self.ref_model is not None:
                apply(self.accelerator.unwrap_model(self.ref_model), settings=settings)
            mode = self.vllm_generation.vllm_client.get_server_info()["model_config"]["logprobs_mode"]
            if mode != "processed_logprobs" and self.temperature != 1.0:
                raise UsageError(f"BIGRPOTrainer: the server reports {mode} (before temperature) but the sampling "
                                 f"temperature is {self.temperature}: start it with --logprobs-mode "
                                 "processed_logprobs, or sample at temperature 1.0")
            self.bi_sync = HFWeightSync(self.bi_server, cfg.output_dir, self.bi_base_model)
            self.vllm_generation.sync_weights = self._bi_push_weights  # where TRL broadcasts over NCCL
            self.weight_pushes: list[dict] = []
            self.parity: list[dict] = []

        def train(self, *args, **kwargs):
            """TRL's training loop, then the last optimizer step's weights pushed too (TRL pushes before a
            generation, and none follows the last step): the server ends on the trained weights, verified."""
            out = super().train(*args, **kwargs)
            if self.bi_sync.good is None or self.bi_sync.good[0] != self.state.global_step:
                self._bi_push_weights()
            return out

        def _bi_push_weights(self):
            """Push the model's weights as version ``global_step`` (TRL calls this before a generation whose step
            has not been pushed; no request is in flight)."""
            version = self.state.global_step
            timings = self.bi_sync.push(self.accelerator.unwrap_model(self.model), version)
            self.weight_pushes.append({"version": version, **timings})

        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                               batch_size=None, compute_entropy=False, compute_aux_loss=False,
                                               **multimodal):
            """TRL's contract (``[B, logits_to_keep]`` logprobs of the completion tokens, entropies, aux loss),
            through :func:`token_logprobs`: the server's bits."""
            if any(v is not None for v in multimodal.values()):
                raise UsageError("BIGRPOTrainer: text models only (got " +
                                 ", ".join(k for k, v in multimodal.items() if v is not None) + ")")
            if compute_aux_loss:
                raise UsageError("BIGRPOTrainer: the MoE load-balancing loss is not computed by the adapted model; "
                                 "pass GRPOConfig(router_aux_loss_coef=0.0) (TRL adds that loss for a MoE model "
                                 "whose config declares a coefficient)")
            model = self.accelerator.unwrap_model(model)
            if not is_adapted(model):
                raise UsageError("BIGRPOTrainer: the model was replaced after the trainer adapted it")
            batch_size = batch_size or input_ids.size(0)
            logps, entropies = [], []
            for s in range(0, input_ids.size(0), batch_size):  # rows scored alone or together: the same bits
                ids, mask = input_ids[s : s + batch_size], attention_mask[s : s + batch_size]
                lp, ent = token_logprobs(model, ids, mask, temperature=self.temperature, entropy=True)
                logps.append(lp[:, -logits_to_keep:])
                entropies.append(ent[:, -logits_to_keep:])
            return torch.cat(logps), (torch.cat(entropies) if compute_entropy else None), None

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            mine, server = out.get("old_per_token_logps"), out.get("sampling_per_token_logps")
            if mine is not None and server is not None:
                scored = out["completion_mask"].bool() & ~torch.isnan(server)
                differ = self.accelerator.gather(((mine != server) & scored).sum()).sum().item()
                tokens = self.accelerator.gather(scored.sum()).sum().item()
                diff = (mine - server).abs()[scored]
                mode = "train" if self.model.training else "eval"
                self._metrics[mode]["bit_wise/logprob_mismatches"].append(float(differ))
                self.parity.append({"step": self.state.global_step, "weight_version": self.bi_sync.good[0],
                                    "logprob_diff_max": diff.max().item() if diff.numel() else 0.0,
                                    "mismatched_tokens": int(differ), "tokens": int(tokens)})
            return out

    return BIGRPOTrainer


def _check_config(cfg) -> None:
    """Refuse, in one line each, a GRPOConfig under which the trainer's logprobs cannot be the server's."""
    if cfg is None:
        raise UsageError("BIGRPOTrainer: pass args=GRPOConfig(...) (use_vllm=True, vllm_mode='server', ...)")
    if not cfg.use_vllm or cfg.vllm_mode != "server" or not cfg.vllm_server_base_url:
        raise UsageError("BIGRPOTrainer: sample with the batch-invariant server: use_vllm=True, vllm_mode='server', "
                         "vllm_server_base_url=<its URL>")
    if not cfg.vllm_importance_sampling_correction:
        raise UsageError("BIGRPOTrainer: set vllm_importance_sampling_correction=True (TRL then scores the sampled "
                         "tokens with the trainer, which the parity record compares with the server's logprobs)")
    if cfg.gradient_checkpointing:
        raise UsageError("BIGRPOTrainer: set gradient_checkpointing=False (the adapted model refuses it)")
