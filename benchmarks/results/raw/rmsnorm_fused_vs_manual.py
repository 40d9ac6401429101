# Manual fp32 RMSNorm (the previous model code) vs F.rms_norm, bf16 in/out, forward + backward.
import torch, torch.nn.functional as F
from triton.testing import do_bench
T, D, eps = 17408, 4096, 1e-6
x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
g = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
def manual():
    h = x.float(); h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps); return w * h.to(x.dtype)
def fused():
    return w * F.rms_norm(x.float(), (D,), eps=eps).to(x.dtype)
for name, fn in (("manual", manual), ("F.rms_norm", fused)):
    ms = do_bench(lambda: torch.autograd.grad(fn(), (x, w), g))
    print(f"{name:12s} fwd+bwd {ms:.3f} ms  T={T} D={D} bf16")
a, b = manual(), fused()
ga, gb = torch.autograd.grad(a, (x, w), g), torch.autograd.grad(b, (x, w), g)
print("max |out diff|", (a.float() - b.float()).abs().max().item(), " max |dx diff|", (ga[0].float() - gb[0].float()).abs().max().item(),
      " rel dw diff", ((ga[1].float() - gb[1].float()).norm() / ga[1].float().norm()).item())
