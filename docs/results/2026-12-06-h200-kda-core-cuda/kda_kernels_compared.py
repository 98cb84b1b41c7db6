import torch, inspect
from fla.ops.kda import fused_recurrent_kda
import fla.ops.kda as kmod
from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
from vllm_bi.gdn.recurrent import kda_gating
print(inspect.getsource(fused_recurrent_kda)[:3000])
H, K, T = 4, 128, 50
g0 = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, T, H, K, generator=g0).bfloat16().cuda() for _ in range(3))
a = (torch.randn(T, H, K, generator=g0) * 2).bfloat16().cuda(); b = torch.randn(T, H, generator=g0).bfloat16().cuda()
g, beta = kda_gating(torch.log(torch.linspace(1, 16, H)).cuda(), a, b, torch.linspace(-0.5, 0.5, H * K).cuda(), -5.0)
h0 = torch.zeros(1, H, K, K, device="cuda")
cu = torch.tensor([0, T], device="cuda")
o1, h1 = fused_recurrent_kda(q, k, v, g[None].float().contiguous(), beta[None].contiguous(), scale=K**-0.5, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
o2, h2 = fused_recurrent_gated_delta_rule(q=q, k=k, v=v, g=None, gk=g[None].float().contiguous(), beta=beta[None].contiguous(), scale=K**-0.5, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
print("equal o", torch.equal(o1, o2), "h", torch.equal(h1, h2), "maxdiff", float((o1.float()-o2.float()).abs().max()), float((h1-h2).abs().max()))
print("dtypes", g.dtype, beta.dtype, o1.dtype, o2.dtype)
