"""Per-kernel CUDA times of one dualkv_attention forward+backward (backend="cuda", bf16), the mean of
3 steps after 2 warm-up steps, by torch.profiler. Arguments: N P R H H_kv d (one prompt of P tokens,
N responses of R tokens). The kernel-choice variables come from the environment."""
import os, sys, math, torch
from dualkv.core import PackedLayout, dualkv_attention
N, P, R, H, Hkv, d = (int(x) for x in sys.argv[1:7])
layout = PackedLayout.from_lengths([P], [[R] * N], device="cuda")
T = layout.total_tokens
q, k, v = (torch.randn(T, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (H, Hkv, Hkv))
dout = torch.randn(T, H, d, device="cuda", dtype=torch.bfloat16)
def step():
    out = dualkv_attention(q, k, v, layout, backend="cuda")
    out.backward(dout)
for _ in range(2): step()
torch.cuda.synchronize()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    for _ in range(3): step()
    torch.cuda.synchronize()
tot = {}
for e in prof.events():
    if e.device_type == torch.autograd.DeviceType.CUDA:
        tot[e.name] = tot.get(e.name, 0) + e.device_time / 1000 / 3
for name, ms in sorted(tot.items(), key=lambda x: -x[1])[:8]:
    print(f"  {ms:9.2f} ms  {name[:110]}")
