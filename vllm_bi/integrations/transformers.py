"""The server's bits for a Hugging Face ``transformers`` GDN hybrid: ``apply(model)``, in place.

``apply`` takes a loaded ``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM`` or ``Qwen3NextForCausalLM`` (bf16) and
replaces the ``forward`` of its modules (the causal LM, its decoder, every decoder layer, norm, token mixer, MLP or
MoE block, the embedding and the LM head) with the trainer model's functions of their weights
(:mod:`vllm_bi.models.qwen_gdn`: ``gdn_block``, ``attention_block``, ``moe_block``, ...), which compose the op
library (:mod:`vllm_bi.ops`, :mod:`vllm_bi.gdn`) as the server does. The module tree, the parameters, their names
and dtypes stay as they are: ``state_dict``, optimizers and FSDP wrapping see the same model, and every module is
still entered through its ``__call__`` (hooks fire, an FSDP unit unshards its weights first).

The adapted model is called as before, ``model(input_ids, attention_mask=..., position_ids=...)``, with one of three
batch forms: right padding or left padding (``attention_mask [B, L]``, each row's tokens contiguous) or packed
sequences (``input_ids [1, T]``, ``position_ids`` restarting at 0 for each sequence). It unpads them to the packed
form (:func:`unpad`: ``cu_seqlens``, every sequence from position 0), so the three give every token the same bits,
the server's. ``logits`` come back in the input's padded shape ``[B, L, vocab]``, zero at padding.
:func:`token_logprobs` gives the logprob of each next token through the server's logprob op, shaped like HF's
shifted labels ``[B, L - 1]``.

Refused with a one-line :class:`~vllm_bi.errors.UsageError` naming the fix: another architecture or layer type,
parameters other than bf16 (``A_log`` may be fp32), gradient checkpointing, unmerged LoRA / peft adapters, what the
trainer model does not build (rope scaling, multimodal rotary, Qwen3-Next's dense layers, attention biases), a
KV cache; settings other than the server's with :class:`~vllm_bi.errors.SettingsMismatch` (status 4).
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch

from vllm_bi.errors import SettingsMismatch, UsageError
from vllm_bi.model_dir import QWEN_ARCHITECTURES
from vllm_bi.models.qwen_gdn import (
    HybridConfig,
    attention_block,
    decoder_layer,
    decoder_stack,
    gdn_block,
    gemma_rms_norm,
    mlp_block,
    moe_block,
    next_token_logprobs,
)
from vllm_bi.ops.linear import bi_linear

__all__ = ["Unpadded", "apply", "is_adapted", "token_logprobs", "unpad"]

_WHERE = "vllm_bi.integrations.transformers.apply"
_TEMPERATURE = "_vllm_bi_temperature"  # the causal LM's private keyword: return next-token logprobs, not logits
_ENTROPY = "_vllm_bi_entropy"  # with it: (logprobs, entropies)


@dataclass(frozen=True)
class Unpadded:
    """A ``[B, L]`` batch as packed sequences: ``input_ids [T]``, ``cu_seqlens [n + 1]`` (sequence ``i`` owns
    packed rows ``cu[i]:cu[i+1]``, from position 0) and ``index [T]``, each packed row's place in the flattened
    ``[B * L]`` batch."""

    input_ids: torch.Tensor
    cu_seqlens: list[int]
    index: torch.Tensor
    shape: tuple[int, int]

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """Packed rows ``[T, ...]`` -> ``[B, L, ...]``, zero at padding (differentiable)."""
        B, L = self.shape
        out = x.new_zeros((B, L, *x.shape[1:]))  # written through a view: the result is no view (FSDP2 hooks it)
        out.view(B * L, *x.shape[1:]).index_copy_(0, self.index, x)
        return out


def unpad(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
          position_ids: torch.Tensor | None = None) -> Unpadded:
    """Read a trainer's batch as packed sequences. ``input_ids [B, L]``; ``attention_mask [B, L]`` (1: a token):
    each row's tokens one contiguous run (left or right padding; an all-padding row holds no sequence);
    ``position_ids [B, L]`` or ``[1, L]``: a 0 starts a new sequence within a row (packing), and each sequence
    counts 0, 1, 2, ... from its first token, as the server numbers it. Without either, each row is one sequence."""
    if not torch.is_tensor(input_ids) or input_ids.dim() != 2:
        raise UsageError(f"input_ids: give a [batch, length] tensor of token ids (got "
                         f"{tuple(input_ids.shape) if torch.is_tensor(input_ids) else type(input_ids).__name__})")
    B, L = input_ids.shape
    dev = input_ids.device
    if attention_mask is None:
        mask = torch.ones((B, L), dtype=torch.bool, device=dev)
    else:
        if tuple(attention_mask.shape) != (B, L):
            raise UsageError(f"attention_mask: shape {tuple(attention_mask.shape)}, not input_ids' {(B, L)}; give the "
                             "tokenizer's [batch, length] 0/1 mask (not a 4-D attention bias)")
        mask = attention_mask.to(device=dev) != 0
    prev = torch.cat([torch.zeros((B, 1), dtype=torch.bool, device=dev), mask[:, :-1]], dim=1)
    run_starts = mask & ~prev
    holes = (run_starts.sum(dim=1) > 1).nonzero()
    if holes.numel():
        b = int(holes[0, 0])
        raise UsageError(f"attention_mask row {b}: padding between tokens; give left or right padding (each row's "
                         "tokens contiguous) or pack sequences into one row with position_ids restarting at 0")
    seq_starts = run_starts
    if position_ids is not None:
        pos = position_ids.to(device=dev)
        if pos.dim() != 2 or pos.shape[1] != L or pos.shape[0] not in (1, B):
            raise UsageError(f"position_ids: shape {tuple(pos.shape)}; give [batch, length] (or [1, length]) text "
                             "positions, 0 at each sequence's first token")
        pos = pos.expand(B, L)
        bad = (run_starts & (pos != 0)).nonzero()
        if bad.numel():
            b, j = (int(x) for x in bad[0])
            raise UsageError(f"position_ids row {b}: the first token (column {j}) has position {int(pos[b, j])}; each "
                             "sequence counts from 0, as the server numbers it: pass attention_mask.cumsum(-1) - 1 "
                             "(clamped at 0) or no position_ids")
        prev_pos = torch.cat([torch.full((B, 1), -1, dtype=pos.dtype, device=dev), pos[:, :-1]], dim=1)
        seq_starts = mask & (pos == 0)
        bad = (mask & ~seq_starts & (pos != prev_pos + 1)).nonzero()
        if bad.numel():
            b, j = (int(x) for x in bad[0])
            raise UsageError(f"position_ids row {b}, column {j}: {int(prev_pos[b, j])} then {int(pos[b, j])}; a "
                             "sequence's positions count up by 1 (a 0 starts the next packed sequence)")
    flat = mask.reshape(-1)
    index = flat.nonzero().squeeze(1)
    if index.numel() == 0:
        raise UsageError("attention_mask: no tokens in the batch")
    starts = seq_starts.reshape(-1)[index].nonzero().squeeze(1).tolist()
    cu = starts + [int(index.numel())]
    return Unpadded(input_ids.reshape(-1)[index], cu, index, (B, L))


def is_adapted(model) -> bool:
    """Whether :func:`apply` has adapted ``model``."""
    return getattr(model, "_vllm_bi_hybrid", None) is not None


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   position_ids: torch.Tensor | None = None, temperature: float = 1.0,
                   entropy: bool = False):
    """``[B, L - 1]`` fp32, differentiable: at ``[b, t]`` the adapted ``model``'s logprob of ``input_ids[b, t + 1]``
    given its sequence's tokens up to ``t``, through the server's logprob op (what the server reports for that
    token); 0.0 where ``t + 1`` is padding or starts another packed sequence. Batch forms as for the model's call
    (:func:`unpad`).

    ``temperature``: the server's default ``--logprobs-mode raw_logprobs`` reports logprobs before temperature,
    whatever a request's temperature: keep 1.0 for it. A server started with ``--logprobs-mode processed_logprobs``
    reports them after vLLM's division of the fp32 logits by the request's temperature: pass that temperature (top-k,
    top-p and penalties are not applied here).

    ``entropy``: also return, from the same forward, ``[B, L - 1]`` fp32 without gradient: at ``[b, t]`` the entropy
    of the next-token distribution at ``t`` (after ``temperature``; 0.0 where the logprob is), for logging and
    entropy masks (not a quantity the server reports: no parity claim). Returns ``(logprobs, entropies)``."""
    if not is_adapted(model):
        raise UsageError("token_logprobs: the model is not adapted; call "
                         "vllm_bi.integrations.transformers.apply(model) first")
    return model(input_ids, attention_mask=attention_mask, position_ids=position_ids,
                 **{_TEMPERATURE: float(temperature), _ENTROPY: bool(entropy)})


# ---- apply: checks -------------------------------------------------------------------------------------------------


def _architecture(model) -> str:
    for cls in type(model).__mro__:  # FSDP2 and others subclass the model's class
        if cls.__name__ in QWEN_ARCHITECTURES:
            return cls.__name__
    if any(cls.__module__.split(".")[0] == "peft" for cls in type(model).__mro__):
        raise UsageError(f"{_WHERE}: the model is a peft wrapper ({type(model).__name__}) with unmerged adapters; "
                         "call model.merge_and_unload() and adapt the merged model (the server serves merged weights)")
    hint = ""
    if type(model).__name__.endswith("ForConditionalGeneration"):
        hint = " (a multimodal model: load the text-only class, e.g. Qwen3_5ForCausalLM, from the checkpoint)"
    raise UsageError(f"{_WHERE}: {type(model).__name__} is not a GDN hybrid vllm_bi supports{hint}; give a "
                     f"{', '.join(QWEN_ARCHITECTURES)}")


def _expected_parameters(c: HybridConfig) -> set[str]:
    """The parameter names of a transformers model of ``c``'s network (a tied LM head counts once)."""
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not c.tie_word_embeddings:
        names.add("lm_head.weight")
    gdn = ["in_proj_qkvz", "in_proj_ba"] if c.interleaved_gdn else ["in_proj_qkv", "in_proj_z", "in_proj_b",
                                                                     "in_proj_a"]
    gdn = [f"{n}.weight" for n in gdn + ["conv1d", "norm", "out_proj"]] + ["A_log", "dt_bias"]
    attn = [f"{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
    if c.moe:
        mlp = ["gate.weight", "experts.gate_up_proj", "experts.down_proj", "shared_expert.gate_proj.weight",
               "shared_expert.up_proj.weight", "shared_expert.down_proj.weight", "shared_expert_gate.weight"]
    else:
        mlp = ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]
    for i, t in enumerate(c.layer_types):
        p = f"model.layers.{i}."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        names |= {p + ("linear_attn." + n if t == "linear_attention" else "self_attn." + n)
                  for n in (gdn if t == "linear_attention" else attn)}
        names |= {p + "mlp." + n for n in mlp}
    return names


def _check_model(model, c: HybridConfig) -> None:
    params = dict(model.named_parameters())
    lora = [n for n in params if "lora_" in n or ".base_layer." in n]
    if lora or getattr(model, "peft_config", None):
        raise UsageError(f"{_WHERE}: unmerged LoRA / peft adapters ({lora[0] if lora else 'peft_config'}); call "
                         "merge_and_unload() and adapt the merged model (the server serves merged weights)")
    if model.is_gradient_checkpointing:
        raise UsageError(f"{_WHERE}: gradient checkpointing is on; call model.gradient_checkpointing_disable() (the "
                         "adapter's forward is not re-entrant under transformers' checkpointing)")
    bad = [t for t in c.layer_types if t not in ("linear_attention", "full_attention")]
    if bad:
        raise UsageError(f"{_WHERE}: layer type {bad[0]!r} is not one vllm_bi builds (linear_attention, "
                         "full_attention)")
    raw = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for key, ok, want in (("hidden_act", "silu", "silu"), ("attention_bias", False, "false"),
                          ("attention_dropout", 0.0, "0.0")):
        if getattr(raw, key, ok) != ok:
            raise UsageError(f"{_WHERE}: config.{key} = {getattr(raw, key)!r}; the server's network (and vllm_bi's) "
                             f"has {key} {want}")
    want = _expected_parameters(c)
    extra, missing = sorted(set(params) - want), sorted(want - set(params))
    if extra or missing:
        what = f"parameter {extra[0]} is not one of the network's" if extra else f"no parameter {missing[0]}"
        raise UsageError(f"{_WHERE}: {what}; adapt an unmodified {c.arch} (before wrapping it, e.g. in FSDP)")
    for name, p in params.items():
        ok = (torch.bfloat16, torch.float32) if name.endswith("A_log") else (torch.bfloat16,)
        if p.dtype not in ok:
            raise UsageError(f"{_WHERE}: {name} is {p.dtype}, the server's weights are bf16; load the model with "
                             "dtype=torch.bfloat16 or call model.to(torch.bfloat16) first")


def _check_settings(settings, device: str) -> None:
    from vllm_bi.settings import Settings, current, describe_diff

    if isinstance(settings, Settings):
        settings = settings.arithmetic(device)
    if not isinstance(settings, dict):
        raise UsageError(f"{_WHERE}: settings must be the server's vllm_bi_info dict "
                         f"(vllm_bi.client.VllmClient(url).server_info()), not a {type(settings).__name__}")
    theirs = settings.get("device", device)
    if theirs != device:
        raise SettingsMismatch(f"{_WHERE}: the server computes on {theirs}, the model is on {device}, and their "
                               f"math libraries round differently; move the model to {theirs} before apply")
    why = describe_diff(settings, current().arithmetic(device), ours="this process")
    if why:
        raise SettingsMismatch(f"{_WHERE}: {why}")


# ---- apply: the modules' forwards ----------------------------------------------------------------------------------


def _norm_forward(c):
    def forward(self, x, residual=None):
        return gemma_rms_norm(x, residual, self.weight, c.rms_norm_eps)
    return forward


def _embedding_forward(self, ids):
    # indexing, not nn.Embedding's padding_idx path: the pad token's row gets its gradient, as in the trainer model
    return self.weight[ids]


def _linear_forward(self, x):
    return bi_linear(x, self.weight)


def _attention_forward(c):
    def forward(self, x, positions, cu):
        return attention_block(c, x, positions, cu, self.q_proj.weight, self.k_proj.weight, self.v_proj.weight,
                               self.o_proj.weight, self.q_norm.weight, self.k_norm.weight)
    return forward


def _gdn_forward(c):
    names = ("in_proj_qkvz", "in_proj_ba") if c.interleaved_gdn else ("in_proj_qkv", "in_proj_z", "in_proj_b",
                                                                       "in_proj_a")

    def forward(self, x, cu):
        projections = tuple(getattr(self, n).weight for n in names)
        return gdn_block(c, x, cu, projections, self.conv1d.weight, self.A_log, self.dt_bias, self.norm.weight,
                         self.out_proj.weight)
    return forward


def _mlp_forward(self, x):
    return mlp_block(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)


def _moe_forward(c):
    def forward(self, x):
        s = self.shared_expert
        return moe_block(c, x, self.gate.weight, self.experts.gate_up_proj, self.experts.down_proj,
                         (s.gate_proj.weight, s.up_proj.weight, s.down_proj.weight), self.shared_expert_gate.weight)
    return forward


def _layer_forward(self, h, residual, positions, cu):
    if hasattr(self, "linear_attn"):
        def mixer(x):
            return self.linear_attn(x, cu)
    else:
        def mixer(x):
            return self.self_attn(x, positions, cu)
    return decoder_layer(h, residual, self.input_layernorm, mixer, self.post_attention_layernorm, self.mlp)


def _refuse_call(model, past_key_values, inputs_embeds, kwargs) -> None:
    if model.is_gradient_checkpointing:
        raise UsageError("the vllm_bi-adapted model has gradient checkpointing on; call "
                         "model.gradient_checkpointing_disable()")
    if past_key_values is not None:
        raise UsageError("the vllm_bi-adapted model scores whole sequences and keeps no KV cache: sample with the "
                         "server, pass past_key_values=None")
    if inputs_embeds is not None:
        raise UsageError("the vllm_bi-adapted model takes input_ids, not inputs_embeds")
    for key in ("output_attentions", "output_hidden_states"):
        if kwargs.get(key):
            raise UsageError(f"the vllm_bi-adapted model returns no attentions or hidden states; drop {key}=True")


def _model_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                   inputs_embeds=None, use_cache=None, _vllm_bi_batch=None, **kwargs):
    from transformers.modeling_outputs import BaseModelOutputWithPast

    _refuse_call(self, past_key_values, inputs_embeds, kwargs)
    batch = _vllm_bi_batch or unpad(input_ids, attention_mask, position_ids)
    h = decoder_stack(self.embed_tokens(batch.input_ids), self.layers, self.norm, batch.cu_seqlens)
    return BaseModelOutputWithPast(last_hidden_state=batch.pad(h))


def _kept_columns(logits_to_keep, L: int, device) -> torch.Tensor:
    if isinstance(logits_to_keep, int):
        return torch.arange(L, device=device)[-logits_to_keep:] if logits_to_keep else torch.arange(L, device=device)
    cols = torch.as_tensor(logits_to_keep, device=device)
    if cols.dim() != 1:
        raise UsageError("logits_to_keep: give a number of last positions or a 1-D tensor of positions")
    return cols


def _causal_lm_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                       inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
    from transformers.modeling_outputs import CausalLMOutputWithPast

    temperature = kwargs.pop(_TEMPERATURE, None)
    entropy = kwargs.pop(_ENTROPY, False)
    _refuse_call(self, past_key_values, inputs_embeds, kwargs)
    batch = unpad(input_ids, attention_mask, position_ids)
    hidden = self.model(input_ids, _vllm_bi_batch=batch).last_hidden_state
    B, L = batch.shape
    h_T = hidden.reshape(B * L, -1)[batch.index]
    if temperature is not None:  # token_logprobs: every row through the head, the server's logprob op
        logits_TV = self.lm_head(h_T)
        lp = next_token_logprobs(logits_TV, batch.input_ids, batch.cu_seqlens, temperature)
        scored = ~torch.isnan(lp)
        lp = torch.where(scored, lp, torch.zeros_like(lp))
        if not entropy:
            return batch.pad(lp)[:, :-1].contiguous()
        with torch.no_grad():
            lp_TV = torch.log_softmax(logits_TV.float() / (temperature if temperature >= 1e-5 else 1.0), dim=-1)
            ent = torch.where(scored, -(lp_TV.exp() * lp_TV).sum(-1), torch.zeros_like(lp))
        return batch.pad(lp)[:, :-1].contiguous(), batch.pad(ent)[:, :-1].contiguous()
    cols = _kept_columns(logits_to_keep, L, hidden.device)
    K = cols.numel()
    slot = torch.full((L,), -1, dtype=torch.long, device=hidden.device)
    slot[cols] = torch.arange(K, device=hidden.device)
    row_slot = slot[batch.index % L]
    keep = (row_slot >= 0).nonzero().squeeze(1)
    logits_T = self.lm_head(h_T[keep])
    out_index = (batch.index[keep] // L) * K + row_slot[keep]
    logits = logits_T.new_zeros((B, K, logits_T.shape[-1]))
    logits.view(B * K, -1).index_copy_(0, out_index, logits_T)
    loss = None
    if labels is not None:
        loss_kwargs = {k: kwargs[k] for k in ("num_items_in_batch", "ignore_index", "shift_labels") if k in kwargs}
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **loss_kwargs)
    out = CausalLMOutputWithPast(loss=loss, logits=logits)
    return out.to_tuple() if kwargs.get("return_dict") is False else out


def _set_forward(module, fn) -> None:
    module.forward = types.MethodType(fn, module)


def apply(model, settings=None):
    """Adapt a transformers ``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM`` or ``Qwen3NextForCausalLM`` in place
    (the module docstring says what changes) and return it. ``settings``: the server's ``vllm_bi_info`` dict
    (:meth:`vllm_bi.client.VllmClient.server_info`) or a :class:`~vllm_bi.settings.Settings`: refused with
    :class:`~vllm_bi.errors.SettingsMismatch` when this process's arithmetic settings, or the model's device kind,
    differ from it. Apply before wrapping the model (FSDP, DDP); adapting an adapted model only checks the
    settings."""
    arch = _architecture(model)
    device = next(model.parameters()).device.type
    if settings is not None:
        _check_settings(settings, device)
    if is_adapted(model):
        return model
    try:
        c = HybridConfig.from_dict(model.config.to_dict() | {"architectures": [arch]}, "the model's config")
    except (ValueError, NotImplementedError, KeyError) as e:
        raise UsageError(f"{_WHERE}: {e}".splitlines()[0]) from None
    _check_model(model, c)
    inner = model.model
    _set_forward(model, _causal_lm_forward)
    _set_forward(inner, _model_forward)
    _set_forward(inner.embed_tokens, _embedding_forward)
    _set_forward(inner.norm, _norm_forward(c))
    _set_forward(model.lm_head, _linear_forward)
    for layer in inner.layers:
        _set_forward(layer, _layer_forward)
        _set_forward(layer.input_layernorm, _norm_forward(c))
        _set_forward(layer.post_attention_layernorm, _norm_forward(c))
        if hasattr(layer, "linear_attn"):
            _set_forward(layer.linear_attn, _gdn_forward(c))
        else:
            _set_forward(layer.self_attn, _attention_forward(c))
        _set_forward(layer.mlp, _moe_forward(c) if c.moe else _mlp_forward)
    model._vllm_bi_hybrid = c
    return model
