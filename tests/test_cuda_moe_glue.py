"""CUDA MoE glue (``patch/cuda_moe.py``) on CPU tensors: vLLM's own CUDA-path classes (the fused top-k
router, ``TritonExperts`` behind the no-DP/EP modular kernel, ``UnquantizedFusedMoEMethod.forward_native``,
``GateLinear.forward``) with the patches applied through ``monkeypatch`` (undone after each test), compared by
exact equality with the trainer's ``SparseMoE`` / ``vllm_bi.ops.moe``; plus the refusals."""

from types import SimpleNamespace

import pytest
import torch

from vllm_bi.patch import cuda_moe
from vllm_bi.patch.ledger import LEDGER, apply_row, resolve
from vllm_bi.ops.linear import bi_linear
from vllm_bi.ops.moe import moe_experts, sigmoid_topk, softmax_topk

E, H, INTER, K = 8, 48, 32, 3


@pytest.fixture
def patched(monkeypatch):
    done = []

    def patch(owner, name, new):
        monkeypatch.setattr(owner, name, new)
        done.append((owner.__name__, name))

    for row in LEDGER:  # the ledger's CUDA MoE rows
        if row.new.startswith("vllm_bi.patch.cuda_moe:"):
            apply_row(row, patch)
    return done


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    gate = (torch.randn(E, H, generator=g) * 0.3).bfloat16()
    w13 = (torch.randn(E, 2 * INTER, H, generator=g) * 0.1).bfloat16()
    w2 = (torch.randn(E, H, INTER, generator=g) * 0.1).bfloat16()
    return gate, w13, w2


def _moe_config():
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FusedMoEConfig,
        FusedMoEParallelConfig,
        RoutingMethodType,
    )

    return FusedMoEConfig(
        num_experts=E, experts_per_token=K, hidden_dim=H, intermediate_size=INTER, num_local_experts=E,
        num_logical_experts=E, activation=MoEActivation.SILU, device="cpu",
        routing_method=RoutingMethodType.Renormalize, moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(),
        in_dtype=torch.bfloat16)


def _server_moe(renormalize=True):
    """vLLM's CUDA objects for one unquantized MoE layer: FusedTopKRouter + FusedMoEKernel(NoDPEP, TritonExperts)."""
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import MoEPrepareAndFinalizeNoDPEPModular
    from vllm.model_executor.layers.fused_moe.router.fused_topk_router import FusedTopKRouter

    cfg = _moe_config()
    experts = TritonExperts(moe_config=cfg, quant_config=FusedMoEQuantConfig.make())
    kernel = mk.FusedMoEKernel(MoEPrepareAndFinalizeNoDPEPModular(), experts)
    method = SimpleNamespace(moe_kernel=kernel, unquantized_backend=UnquantizedMoeBackend.TRITON)
    router = FusedTopKRouter(top_k=K, global_num_experts=E, scoring_func="softmax", renormalize=renormalize)
    return cfg, router, method


def _layer(cfg, w13, w2):
    return SimpleNamespace(w13_weight=w13, w2_weight=w2, activation=cfg.activation, apply_router_weight_on_input=False,
                           global_num_experts=E, expert_map=None, moe_config=cfg, routed_scaling_factor=1.0,
                           layer_name="model.layers.0.mlp.experts")


def _server_forward(x, gate, w13, w2, renormalize=True):
    """Router logits (GateLinear's ReplicatedLinear tier = bi_linear) -> router -> quant method -> modular kernel."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    cfg, router, method = _server_moe(renormalize)
    logits = bi_linear(x, gate)
    tw, ti = router.select_experts(hidden_states=x, router_logits=logits,
                                   topk_indices_dtype=method.moe_kernel.prepare_finalize.topk_indices_dtype())
    return UnquantizedFusedMoEMethod.forward_native(method, _layer(cfg, w13, w2), x, tw, ti, None, None), (tw, ti)


def _trainer_moe(gate, w13, w2, renormalize=True):
    from vllm_bi.models.qwen_gdn import SparseMoE

    c = SimpleNamespace(hidden_size=H, num_experts=E, num_experts_per_tok=K, norm_topk_prob=renormalize)
    m = SparseMoE(c, INTER, 0)
    with torch.no_grad():
        m.gate.copy_(gate)
        m.w13.copy_(w13)
        m.w2.copy_(w2)
    return m


def test_patch_set(patched):
    want = {("FusedTopKRouter", "_compute_routing"), ("GroupedTopKRouter", "_compute_routing"),
            ("GateLinear", "forward"), ("TritonExperts", "apply"),
            ("MoERunner", "_maybe_fuse_gate_weights"), ("UnquantizedFusedMoEMethod", "process_weights_after_loading")}
    assert want <= set(patched)
    assert [resolve(row.new) for row in LEDGER if row.target.endswith("GroupedTopKRouter._compute_routing")] == [
        cuda_moe.grouped_topk_compute_routing]
    for name in ("CustomRoutingRouter", "FusedTopKBiasRouter", "RoutingSimulatorRouter",
                 "ZeroExpertRouter", "AiterSharedRoutedFusedMoERouter"):
        assert (name, "_compute_routing") in patched


@pytest.mark.parametrize("renormalize", [True, False])
def test_router_is_softmax_topk(patched, renormalize):
    _, router, _ = _server_moe(renormalize)
    logits = torch.randn(37, E).bfloat16()
    tw, ti = router.select_experts(hidden_states=torch.zeros(37, H).bfloat16(), router_logits=logits)
    want_w, want_i = softmax_topk(logits, K, renormalize)
    assert tw.dtype == torch.float32 and ti.dtype == torch.int32
    assert torch.equal(tw, want_w) and torch.equal(ti, want_i)
    other_w, _ = softmax_topk(logits, K, not renormalize)
    assert not torch.equal(tw, other_w)  # the comparison sees the renormalisation


def test_modular_kernel_path_equals_trainer(patched):
    gate, w13, w2 = _weights()
    x = torch.randn(41, H).bfloat16()
    out, (tw, ti) = _server_forward(x, gate, w13, w2)
    trainer = _trainer_moe(gate, w13, w2)
    with torch.no_grad():
        want = trainer(x)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert torch.equal(out, want)
    assert torch.equal(out, moe_experts(x, w13, w2, tw, ti))
    # rows do not depend on the batch they ran in
    small, _ = _server_forward(x[:3].clone(), gate, w13, w2)
    assert torch.equal(small, out[:3])
    # in fp32 (no bf16 rounding at the end to hide it) the top-k slot order of the sum is visible: the glue keeps
    # the router's order, as the trainer does
    x32, g32, w13_32, w2_32 = x.float(), gate.float(), w13.float(), w2.float()
    out32, (tw32, ti32) = _server_forward(x32, g32, w13_32, w2_32)
    assert out32.dtype == torch.float32
    assert torch.equal(out32, moe_experts(x32, w13_32, w2_32, tw32, ti32))
    assert not torch.equal(out32, moe_experts(x32, w13_32, w2_32, tw32.flip(-1), ti32.flip(-1)))
    # negative control: one changed expert weight changes the result the test compares
    w2b = w2.clone()
    w2b[int(ti[0, 0])] *= 1.5
    out_b, _ = _server_forward(x, gate, w13, w2b)
    assert not torch.equal(out_b, want)


def test_gate_linear_forward_is_the_replicated_linear_tier(patched):
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    gate, _, _ = _weights()
    calls = []

    def apply(layer, x, bias=None):
        calls.append(x.shape[0])
        return bi_linear(x, layer.weight, bias)

    g = GateLinear.__new__(GateLinear)
    torch.nn.Module.__init__(g)
    g.weight = torch.nn.Parameter(gate, requires_grad=False)
    g.bias, g.skip_bias_add, g.return_bias, g.out_dtype, g.is_unquantized = None, False, True, None, True
    g.quant_method = SimpleNamespace(apply=apply)
    # every specialised tier switched on: the patched forward must still take the quant method (bi_linear)
    for flag in ("allow_ll_bf16_gemm", "allow_rocm_bf16x3_router_gemm", "allow_fp32_router_gemm",
                 "allow_bf16x3_router_gemm", "allow_cublas_router_gemm"):
        setattr(g, flag, True)
    x = torch.randn(5, H).bfloat16()
    out, bias = g(x)
    assert bias is None and calls == [5] and torch.equal(out, bi_linear(x, gate))
    # Kimi Linear's gate: fp32 router logits are bi_linear's bf16 product cast to fp32 (the trainer's
    # bi_linear(x, w).float()), not an fp32 GEMM
    g.out_dtype = torch.float32
    out32, bias = g(x)
    assert bias is None and out32.dtype == torch.float32 and torch.equal(out32, bi_linear(x, gate).float())
    assert not torch.equal(out32, (x.float() @ gate.float().T))  # control: an fp32 GEMM has other bits
    g.out_dtype = torch.float16
    with pytest.raises(NotImplementedError, match="out_dtype"):
        g(x)


def test_gate_linear_stock_forward_would_bypass_bi_linear(monkeypatch):
    """Negative control for the test above: vLLM's own GateLinear.forward skips the quant method on its GEMM tiers."""
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    gate, _, _ = _weights()
    g = GateLinear.__new__(GateLinear)
    torch.nn.Module.__init__(g)
    g.weight = torch.nn.Parameter(gate, requires_grad=False)
    g.quant_method = SimpleNamespace(apply=lambda *a, **k: pytest.fail("quant method reached"))
    g.return_bias, g.out_dtype = True, torch.float32
    for flag in ("allow_ll_bf16_gemm", "allow_rocm_bf16x3_router_gemm", "allow_fp32_router_gemm",
                 "allow_bf16x3_router_gemm"):
        setattr(g, flag, False)
    g.allow_cublas_router_gemm = True
    try:  # tier 5: torch.mm(x, W.T, out_dtype=float32) -- no CPU bf16 kernel in some torch builds
        out, _ = g(torch.randn(5, H).bfloat16())
        assert out.dtype == torch.float32
    except NotImplementedError:
        pass  # raised by torch.mm, before (and instead of) the quant method, which would have failed the test


def test_experts_refusals(patched):
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    gate, w13, w2 = _weights()
    cfg, router, method = _server_moe()
    experts = method.moe_kernel.fused_experts
    x = torch.randn(4, H).bfloat16()
    tw, ti = softmax_topk(bi_linear(x, gate), K, True)
    out = torch.empty_like(x)
    args = dict(output=out, hidden_states=x, w1=w13, w2=w2, topk_weights=tw, topk_ids=ti,
                activation=MoEActivation.SILU, global_num_experts=E, expert_map=None, a1q_scale=None, a2_scale=None,
                workspace13=None, workspace2=None, expert_tokens_meta=None, apply_router_weight_on_input=False)
    experts.apply(**args)
    assert torch.equal(out, moe_experts(x, w13, w2, tw, ti))
    for change, match in (({"expert_map": torch.arange(E)}, "expert parallelism"),
                          ({"activation": MoEActivation.GELU}, "activation"),
                          ({"apply_router_weight_on_input": True}, "apply_router_weight_on_input"),
                          ({"w1": w13[:, :INTER]}, "layout")):
        with pytest.raises(NotImplementedError, match=match):
            experts.apply(**{**args, **change})
    experts._lora_context = object()
    with pytest.raises(NotImplementedError, match="LoRA"):
        experts.apply(**args)


def test_check_moe_method(patched):
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

    _, w13, w2 = _weights()
    cfg, _, method = _server_moe()
    cuda_moe.check_moe_method(method, _layer(cfg, w13, w2))  # accepted
    bad_backend = SimpleNamespace(moe_kernel=method.moe_kernel,
                                  unquantized_backend=UnquantizedMoeBackend.FLASHINFER_TRTLLM)
    with pytest.raises(NotImplementedError, match="FlashInfer TRTLLM"):
        cuda_moe.check_moe_method(bad_backend, _layer(cfg, w13, w2))
    with pytest.raises(NotImplementedError, match="expert weights"):
        cuda_moe.check_moe_method(method, _layer(cfg, w13.transpose(1, 2), w2))
    padded = torch.zeros(E, 2 * (INTER + 8), H, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="expert weights"):
        cuda_moe.check_moe_method(method, _layer(cfg, padded, w2))
    layer = _layer(cfg, w13, w2)
    layer.routed_scaling_factor = 2.5
    with pytest.raises(NotImplementedError, match="routed_scaling_factor 2.5 without grouped"):
        cuda_moe.check_moe_method(method, layer)
    layer.use_grouped_topk = True  # Kimi Linear's layer: its grouped router scales the routing weights
    cuda_moe.check_moe_method(method, layer)


def test_check_moe_method_needs_the_patched_experts():
    """Without the patch (vLLM's Triton experts) the check refuses: it cannot pass by accident."""
    _, w13, w2 = _weights()
    cfg, _, method = _server_moe()
    with pytest.raises(NotImplementedError, match="experts kernel TritonExperts"):
        cuda_moe.check_moe_method(method, _layer(cfg, w13, w2))


@pytest.fixture
def kimi_feature(monkeypatch):
    """The kimi-linear CUDA feature on for one test (``VLLM_BI_CUDA_PREVIEW``; the suite's ``monkeypatch`` re-reads
    the settings)."""
    monkeypatch.setenv("VLLM_BI_CUDA_PREVIEW", "kimi-linear")


def test_grouped_router_refused_while_the_kimi_feature_is_off(patched, monkeypatch):
    monkeypatch.cuda_feature_off("kimi-linear")
    with pytest.raises(NotImplementedError, match="VLLM_BI_CUDA_PREVIEW=kimi-linear"):
        _grouped_router()._compute_routing(torch.zeros(5, H), torch.randn(5, E), None)


def test_other_routers_and_fused_gate_refused(patched, kimi_feature):
    from vllm.model_executor.layers.fused_moe.router.grouped_topk_router import GroupedTopKRouter
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    from vllm.model_executor.layers.fused_moe.router.custom_routing_router import CustomRoutingRouter

    with pytest.raises(NotImplementedError, match="CustomRoutingRouter"):
        CustomRoutingRouter._compute_routing(CustomRoutingRouter.__new__(CustomRoutingRouter), None, None, None)
    logits = torch.randn(5, E)
    for groups, topk_group, scoring in ((2, 1, "sigmoid"), (1, 2, "sigmoid"), (4, 2, "sigmoid"), (1, 1, "softmax")):
        router = _grouped_router(groups=groups, topk_group=topk_group, scoring=scoring)
        with pytest.raises(NotImplementedError, match="not batch-invariant yet"):
            router._compute_routing(torch.zeros(5, H), logits, None)
    with pytest.raises(NotImplementedError, match="fused shared experts"):
        _grouped_router(fused_shared=1)._compute_routing(torch.zeros(5, H), logits, None)
    with pytest.raises(NotImplementedError, match="fused router"):
        MoERunner._maybe_fuse_gate_weights(None)


def _grouped_router(groups=1, topk_group=1, scoring="sigmoid", bias=None, fused_shared=0, scale=2.446):
    """vLLM's grouped top-k router as Kimi Linear builds it on CUDA (one expert group, sigmoid scores, a score
    correction bias, renormalised, a routed scaling factor)."""
    from vllm.model_executor.layers.fused_moe.router.grouped_topk_router import GroupedTopKRouter

    return GroupedTopKRouter(top_k=K, global_num_experts=E, num_expert_group=groups, topk_group=topk_group,
                             renormalize=True, scoring_func=scoring, routed_scaling_factor=scale,
                             e_score_correction_bias=bias, num_fused_shared_experts=fused_shared)


def test_grouped_router_is_the_trainers_sigmoid_topk(patched, kimi_feature):
    """Kimi Linear's router on CUDA: ``GroupedTopKRouter`` -> ``cuda_moe.grouped_topk_compute_routing`` gives
    ``ops.moe.sigmoid_topk``'s weights and ids bit for bit (the trainer's ``kimi_moe_block``), through the router's
    public ``select_experts``. Control: the same scores without the correction bias choose other experts."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(53, E, generator=g)  # fp32, as Kimi Linear's gate gives them
    bias = torch.nn.Parameter(torch.randn(E, generator=g) * 0.3, requires_grad=False)
    router = _grouped_router(bias=bias)
    tw, ti = router.select_experts(hidden_states=torch.zeros(53, H).bfloat16(), router_logits=logits)
    want_w, want_i = sigmoid_topk(logits, K, True, bias, 2.446)
    assert tw.dtype == torch.float32 and ti.dtype == torch.int32
    assert torch.equal(tw, want_w) and torch.equal(ti, want_i)
    direct_w, direct_i = cuda_moe.grouped_topk_compute_routing(router, None, logits, None)
    assert torch.equal(direct_w, want_w) and torch.equal(direct_i, want_i)
    # negative control: dropping the bias changes the choice the comparison checks
    nob_w, nob_i = sigmoid_topk(logits, K, True, None, 2.446)
    assert not (torch.equal(nob_i, ti) and torch.equal(nob_w, tw))
    nob_router_w, nob_router_i = _grouped_router(bias=None).select_experts(
        hidden_states=torch.zeros(53, H).bfloat16(), router_logits=logits)
    assert torch.equal(nob_router_w, nob_w) and torch.equal(nob_router_i, nob_i)
