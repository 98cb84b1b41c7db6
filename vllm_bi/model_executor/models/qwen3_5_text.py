"""Text-only Qwen3.5 (dense and MoE) for vLLM 0.32, built from vLLM's Qwen3-Next layers.

Why: vLLM 0.32's ``qwen3_5.py`` imports its vision tower at module level
(``qwen3_vl`` -> transformers' Qwen2-VL image processor -> torchvision). On
the CPU build, PyPI's torchvision is a CUDA build that cannot load against
torch 2.13+cpu, so the stock text model cannot even be imported there. Under
``VLLM_BATCH_INVARIANT=1`` vllm_bi registers these classes for
``Qwen3_5ForCausalLM`` and ``Qwen3_5MoeForCausalLM`` instead; they import
nothing multimodal.

What differs from Qwen3-Next (and only that): the GDN input projections are
stored split (``in_proj_qkv``/``in_proj_z``, ``in_proj_b``/``in_proj_a``) in a
flat [q, k, v] / [z] layout rather than interleaved per key-head group; dense
Qwen3.5 uses a plain gated MLP in every layer, Qwen3.5-MoE a sparse MoE block
in every layer; checkpoints may carry a ``model.language_model.`` prefix and
MTP weights (dropped). Multimodal rotary (``mrope_section``) is not handled:
the model audit refuses the rotary class vllm_bi did not patch.
"""

from __future__ import annotations

from torch import nn

from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_pp_group
from vllm.model_executor.layers.fused_moe.utils import is_model_fused_shared_expert_compatible
from vllm.model_executor.layers.layernorm import GemmaRMSNorm
from vllm.model_executor.layers.linear import ColumnParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid, SupportsPP
from vllm.model_executor.models.qwen2_moe import Qwen2MoeMLP
from vllm.model_executor.models.qwen3_next_mtp import Qwen3NextMTP, Qwen3NextMultiTokenPredictor
from vllm.model_executor.models.qwen3_next import (
    Qwen3NextAttention,
    Qwen3NextDecoderLayer,
    Qwen3NextForCausalLM,
    Qwen3NextModel,
    Qwen3NextSparseMoeBlock,
    QwenNextMixtureOfExperts,
)
from vllm.model_executor.models.utils import (
    AutoWeightsLoader,
    PPMissingLayer,
    WeightsMapper,
    extract_layer_index,
    make_empty_intermediate_tensors_factory,
    make_layers,
    maybe_prefix,
)

__all__ = ["Qwen3_5TextForCausalLM", "Qwen3_5MoeTextForCausalLM", "Qwen3_5TextMTP", "Qwen3_5MoeTextMTP"]

_MOE_TYPE = "qwen3_5_moe_text"


def _is_moe(config) -> bool:
    # a drafter's config says qwen3_5_mtp for both families; its architecture names the MoE one
    return getattr(config, "model_type", "") == _MOE_TYPE or "Qwen3_5MoeMTP" in (getattr(config, "architectures",
                                                                                          None) or ())


class Qwen3_5TextDecoderLayer(Qwen3NextDecoderLayer):
    """Qwen3-Next's decoder layer (and its forward) with Qwen3.5's GDN layout and MLP choice."""

    def __init__(self, vllm_config: VllmConfig, layer_type: str, prefix: str = "") -> None:
        nn.Module.__init__(self)
        config = vllm_config.model_config.hf_text_config
        self.layer_type = layer_type
        self.layer_idx = extract_layer_index(prefix)
        self.use_attn_reduce_scatter_for_moe = False
        if layer_type == "linear_attention":
            self.linear_attn = QwenGatedDeltaNetAttention(
                config, vllm_config=vllm_config, prefix=f"{prefix}.linear_attn", gqa_interleaved_layout=False
            )
        elif layer_type == "full_attention":
            self.self_attn = Qwen3NextAttention(
                config,
                model_config=vllm_config.model_config,
                cache_config=vllm_config.cache_config,
                quant_config=vllm_config.quant_config,
                prefix=f"{prefix}.self_attn",
            )
        else:
            raise ValueError(f"unknown Qwen3.5 layer type {layer_type!r}")
        if _is_moe(config):
            self.mlp = Qwen3NextSparseMoeBlock(vllm_config=vllm_config, prefix=f"{prefix}.mlp")
        else:
            self.mlp = Qwen2MoeMLP(
                hidden_size=config.hidden_size,
                intermediate_size=config.intermediate_size,
                hidden_act=config.hidden_act,
                quant_config=vllm_config.quant_config,
                prefix=f"{prefix}.mlp",
            )
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layer_scale = False


@support_torch_compile(
    dynamic_arg_dims={"input_ids": 0, "positions": -1, "intermediate_tensors": 0, "inputs_embeds": 0}
)
class Qwen3_5TextModel(Qwen3NextModel):
    # Checkpoint names -> the fused parameters vLLM's GDN layer owns.
    hf_to_vllm_mapper = Qwen3NextModel.hf_to_vllm_mapper | WeightsMapper(
        orig_to_new_stacked={
            ".in_proj_qkv": (".in_proj_qkvz", (0, 1, 2)),
            ".in_proj_z": (".in_proj_qkvz", 3),
            ".in_proj_b": (".in_proj_ba", 0),
            ".in_proj_a": (".in_proj_ba", 1),
        }
    )

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        nn.Module.__init__(self)
        config = vllm_config.model_config.hf_text_config
        self.config = config
        self.num_redundant_experts = vllm_config.parallel_config.eplb_config.num_redundant_experts
        self.vocab_size = config.vocab_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: Qwen3_5TextDecoderLayer(
                vllm_config, config.layer_types[extract_layer_index(prefix)], prefix=prefix
            ),
            prefix=f"{prefix}.layers",
        )
        self.is_fused_shared_expert_enabled = is_model_fused_shared_expert_compatible(
            self.layers, Qwen3NextSparseMoeBlock, "mlp"
        )
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            ["hidden_states", "residual"], config.hidden_size
        )
        self.norm = (
            GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps) if get_pp_group().is_last_rank else PPMissingLayer()
        )
        self.aux_hidden_state_layers: tuple[int, ...] = ()


class _Qwen3_5TextBase(nn.Module, HasInnerState, IsHybrid, SupportsPP):
    hf_to_vllm_mapper = WeightsMapper(orig_to_new_prefix={"model.language_model.": "model.", "mtp.": None})
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
        "in_proj_qkvz": ["in_proj_qkv", "in_proj_z"],
        "in_proj_ba": ["in_proj_b", "in_proj_a"],
    }

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        self.config = config
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.quant_config = vllm_config.quant_config
        self.scheduler_config = vllm_config.scheduler_config
        self.model = Qwen3_5TextModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        if get_pp_group().is_last_rank:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "lm_head"))
            if getattr(config, "tie_word_embeddings", False):
                self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        else:
            self.lm_head = PPMissingLayer()
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

    # Identical to Qwen3-Next's (same state shapes and dtypes, same forward).
    embed_input_ids = Qwen3NextForCausalLM.embed_input_ids
    forward = Qwen3NextForCausalLM.forward
    compute_logits = Qwen3NextForCausalLM.compute_logits
    get_mamba_state_dtype_from_config = Qwen3NextForCausalLM.get_mamba_state_dtype_from_config
    get_mamba_state_shape_from_config = Qwen3NextForCausalLM.get_mamba_state_shape_from_config
    get_mamba_state_copy_func = Qwen3NextForCausalLM.get_mamba_state_copy_func

    def load_weights(self, weights) -> set[str]:
        return AutoWeightsLoader(self).load_weights(weights, mapper=self.hf_to_vllm_mapper)


class Qwen3_5TextForCausalLM(_Qwen3_5TextBase):
    """``Qwen3_5ForCausalLM`` (dense)."""


class Qwen3_5MoeTextForCausalLM(_Qwen3_5TextBase, QwenNextMixtureOfExperts):
    """``Qwen3_5MoeForCausalLM``."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.set_moe_parameters()


@support_torch_compile
class _Qwen3_5TextMTPPredictor(Qwen3NextMultiTokenPredictor):
    """Qwen3-Next's MTP predictor (and its forward) with Qwen3.5's decoder layer, norms and layer count."""

    hf_to_vllm_mapper = Qwen3_5TextModel.hf_to_vllm_mapper

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        nn.Module.__init__(self)
        config = vllm_config.model_config.hf_text_config
        self.config = config
        self.vocab_size = config.vocab_size
        self.mtp_start_layer_idx = config.num_hidden_layers
        self.num_mtp_layers = getattr(config, "mtp_num_hidden_layers", None) or 1
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.fc = ColumnParallelLinear(config.hidden_size * 2, config.hidden_size, gather_output=True, bias=False,
                                       return_bias=False, quant_config=vllm_config.quant_config, prefix=f"{prefix}.fc")
        self.layers = nn.ModuleList(Qwen3_5TextDecoderLayer(vllm_config, "full_attention", prefix=f"{prefix}.layers.{i}")
                                    for i in range(self.num_mtp_layers))
        self.is_fused_shared_expert_enabled = is_model_fused_shared_expert_compatible(
            self.layers, Qwen3NextSparseMoeBlock, "mlp")
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            ["hidden_states", "residual"], config.hidden_size)
        self.norm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.pre_fc_norm_embedding = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def load_weights(self, weights) -> set[str]:
        if self.is_fused_shared_expert_enabled:  # Qwen3-Next's loader fuses the shared expert (MoE configs only)
            return super().load_weights(weights)
        return AutoWeightsLoader(self).load_weights(weights, mapper=self.hf_to_vllm_mapper)


@support_torch_compile
class Qwen3_5TextMTP(Qwen3NextMTP):
    """``Qwen3_5MTP``, the checkpoint's multi-token-prediction drafter, without vLLM's multimodal imports."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        nn.Module.__init__(self)
        config = vllm_config.model_config.hf_text_config
        self.vllm_config, self.quant_config, self.config = vllm_config, vllm_config.quant_config, config
        self.model = _Qwen3_5TextMTPPredictor(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "mtp"))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "lm_head"))
        self.logits_processor = LogitsProcessor(config.vocab_size)
        if _is_moe(config):
            self.set_moe_parameters()

    def load_weights(self, weights) -> set[str]:
        # published checkpoints keep the text model under model.language_model.
        return super().load_weights((name.replace("model.language_model.", "model.", 1), w) for name, w in weights)


class Qwen3_5MoeTextMTP(Qwen3_5TextMTP):
    """``Qwen3_5MoeMTP``."""
