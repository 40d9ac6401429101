"""linear_logprobs (Triton reduction, bf16) forward+backward at qwen3-1.7b's head, chunk 441 (the old
default, 256 MiB of fp32 logits) vs 882 (the new one, 256 MiB of bf16 logits), interleaved."""
import statistics, torch
from dualkv.core.logprobs import linear_logprobs
g = torch.Generator(device="cuda").manual_seed(0)
n, D, V = 9700, 2048, 151936
h = torch.randn(n, D, device="cuda", generator=g).bfloat16().requires_grad_()
w = (torch.randn(V, D, device="cuda", generator=g) * D ** -0.5).bfloat16().requires_grad_()
t = torch.randint(0, V, (n,), device="cuda", generator=g)
def step(chunk):
    lp, _ = linear_logprobs(h, w, t, chunk_size=chunk, impl="triton")
    torch.autograd.grad(lp.sum(), (h, w))
res = {441: [], 882: [], None: []}
for c in res: step(c)
for _ in range(5):
    for c in res:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(); s.record()
        for _ in range(3): step(c)
        e.record(); torch.cuda.synchronize(); res[c].append(s.elapsed_time(e) / 3)
for c, v in res.items():
    print(f"chunk {c or 'default'}: forward+backward {statistics.median(v):.2f} ms (n={n}, D={D}, V={V})")
