"""Build a tiny random-weight Kimi Linear (KimiLinearForCausalLM) checkpoint.

Parameter names/shapes follow the HF Kimi-Linear checkpoint layout that
vLLM 0.32's KimiLinearModel.load_weights expects
(vllm/models/kimi_k3/nvidia/model.py:1420-1576, stacked_params_mapping at
1431-1442; KDA params in vllm/model_executor/layers/mamba/gdn/kimi_gdn_linear_attn.py;
MLA params in vllm/models/kimi_k3/nvidia/mla.py:253-297).

Usage: python build_tiny_kimi_linear.py OUT_DIR [--mla-first]
"""

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/kimi_probe/model")
mla_first = "--mla-first" in sys.argv
out.mkdir(parents=True, exist_ok=True)

H = 256  # hidden
V = 1024  # vocab
L = 4  # layers
NH = 4  # attention heads (MLA)
I = 512  # dense MLP intermediate
# KDA
KDA_NH, KDA_HD, CONV_K = 4, 64, 4
P = KDA_NH * KDA_HD
# MLA (Kimi-Linear style: q_lora_rank=None, NoPE)
KV_LORA, NOPE, ROPE, VHD = 512, 64, 64, 64  # CPU_MLA needs kv_lora+rope == 576
# MoE
E, TOPK, MI, NSHARED = 8, 2, 128, 1

if mla_first:
    full_attn_layers, kda_layers = [1, 3], [2, 4]
else:
    full_attn_layers, kda_layers = [2, 4], [1, 3]

config = {
    "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear",
    "vocab_size": V,
    "hidden_size": H,
    "head_dim": H // NH,
    "intermediate_size": I,
    "num_hidden_layers": L,
    "num_attention_heads": NH,
    "num_key_value_heads": NH,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 0,
    "dtype": "bfloat16",
    # MLA
    "q_lora_rank": None,
    "kv_lora_rank": KV_LORA,
    "qk_nope_head_dim": NOPE,
    "qk_rope_head_dim": ROPE,
    "v_head_dim": VHD,
    "mla_use_nope": True,
    "mla_use_output_gate": False,
    # MoE
    "num_experts": E,
    "num_experts_per_token": TOPK,
    "num_shared_experts": NSHARED,
    "moe_intermediate_size": MI,
    "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid",
    "routed_scaling_factor": 2.446,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    # KDA
    "linear_attn_config": {
        "full_attn_layers": full_attn_layers,
        "kda_layers": kda_layers,
        "head_dim": KDA_HD,
        "num_heads": KDA_NH,
        "short_conv_kernel_size": CONV_K,
    },
    "num_nextn_predict_layers": 0,
}

g = torch.Generator().manual_seed(0)


def rnd(*shape, std=0.02, dtype=torch.bfloat16):
    return (torch.randn(*shape, generator=g) * std).to(dtype)


w = {
    "model.embed_tokens.weight": rnd(V, H),
    "model.norm.weight": torch.ones(H, dtype=torch.bfloat16),
    "lm_head.weight": rnd(V, H),
}
for i in range(L):
    p = f"model.layers.{i}"
    w[f"{p}.input_layernorm.weight"] = torch.ones(H, dtype=torch.bfloat16)
    w[f"{p}.post_attention_layernorm.weight"] = torch.ones(H, dtype=torch.bfloat16)
    a = f"{p}.self_attn"
    if (i + 1) in kda_layers:
        for n in ("q", "k", "v"):
            w[f"{a}.{n}_proj.weight"] = rnd(P, H)
            w[f"{a}.{n}_conv1d.weight"] = rnd(P, 1, CONV_K, std=0.2)
        w[f"{a}.b_proj.weight"] = rnd(KDA_NH, H)
        w[f"{a}.f_a_proj.weight"] = rnd(KDA_HD, H)
        w[f"{a}.f_b_proj.weight"] = rnd(P, KDA_HD)
        w[f"{a}.g_a_proj.weight"] = rnd(KDA_HD, H)
        w[f"{a}.g_b_proj.weight"] = rnd(P, KDA_HD)
        w[f"{a}.A_log"] = torch.log(
            torch.empty(1, 1, KDA_NH, 1).uniform_(1, 16, generator=g)
        ).float()
        w[f"{a}.dt_bias"] = rnd(P, std=0.1, dtype=torch.float32)
        w[f"{a}.o_norm.weight"] = torch.ones(KDA_HD, dtype=torch.bfloat16)
        w[f"{a}.o_proj.weight"] = rnd(H, P)
    else:
        w[f"{a}.q_proj.weight"] = rnd(NH * (NOPE + ROPE), H)
        w[f"{a}.kv_a_proj_with_mqa.weight"] = rnd(KV_LORA + ROPE, H)
        w[f"{a}.kv_a_layernorm.weight"] = torch.ones(KV_LORA, dtype=torch.bfloat16)
        w[f"{a}.kv_b_proj.weight"] = rnd(NH * (NOPE + VHD), KV_LORA)
        w[f"{a}.o_proj.weight"] = rnd(H, NH * VHD)
    if i < config["first_k_dense_replace"]:
        m = f"{p}.mlp"
        w[f"{m}.gate_proj.weight"] = rnd(I, H)
        w[f"{m}.up_proj.weight"] = rnd(I, H)
        w[f"{m}.down_proj.weight"] = rnd(H, I)
    else:
        m = f"{p}.block_sparse_moe"
        w[f"{m}.gate.weight"] = rnd(E, H)
        w[f"{m}.gate.e_score_correction_bias"] = torch.zeros(E, dtype=torch.float32)
        for e in range(E):
            w[f"{m}.experts.{e}.w1.weight"] = rnd(MI, H)
            w[f"{m}.experts.{e}.w3.weight"] = rnd(MI, H)
            w[f"{m}.experts.{e}.w2.weight"] = rnd(H, MI)
        s = f"{m}.shared_experts"
        w[f"{s}.gate_proj.weight"] = rnd(MI * NSHARED, H)
        w[f"{s}.up_proj.weight"] = rnd(MI * NSHARED, H)
        w[f"{s}.down_proj.weight"] = rnd(H, MI * NSHARED)

save_file({k: v.contiguous() for k, v in w.items()}, str(out / "model.safetensors"),
          metadata={"format": "pt"})
(out / "config.json").write_text(json.dumps(config, indent=2))
(out / "generation_config.json").write_text(
    json.dumps({"eos_token_id": 0, "pad_token_id": 0}))

src = Path("/tmp/kimi_probe/qwen_tiny")
for f in src.iterdir():
    if f.name.startswith("tokenizer") or f.name.startswith("special_tokens") \
            or f.name == "chat_template.jinja":
        shutil.copy(f, out / f.name)

print(out, len(w), "tensors",
      sum(v.numel() for v in w.values()) / 1e6, "M params")
