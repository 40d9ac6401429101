"""A/B of DUALKV_CUDA_TILE_ORDER (1: a context's readers first, the default; 0: the layout's order):
forward and forward+backward ms of the CUDA backend, the two orders interleaved in one process."""
import os, sys, random, statistics
import torch
from dualkv.core import PackedLayout, dualkv_attention

def lengths(spec, seed):
    rng = random.Random(seed)
    P, N, R = spec
    return [P], [[R if R else rng.randint(131, 2048) for _ in range(N)]]

CONFIGS = [  # (label, (P, N, R or 0 = U(131, 2048)), H, Hkv)
    ("policy mb 8: P=8K, N=8, R~U, H=16/8", (8192, 8, 0), 16, 8),
    ("decoder 5K,32: P=5K, N=32, R~U, H=32/8", (5120, 32, 0), 32, 8),
    ("28,4K,2K H=32/8", (4096, 28, 2048), 32, 8),
    ("8,16K,512 H=32/8", (16384, 8, 512), 32, 8),
    ("16,32K,2K H=32/8", (32768, 16, 2048), 32, 8),
]

def timed(fn, reps):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / reps

for label, spec, H, Hkv in CONFIGS:
    prompts, responses = lengths(spec, 0)
    layout = PackedLayout.from_lengths(prompts, responses, device="cuda")
    T = layout.total_tokens
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(T, h, 128, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_() for h in (H, Hkv, Hkv))
    dout = torch.randn(T, H, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    fwd = lambda: dualkv_attention(q, k, v, layout, backend="cuda")
    both = lambda: torch.autograd.grad(fwd(), (q, k, v), dout)
    res = {"1": ([], []), "0": ([], [])}
    for order in ("1", "0"):
        os.environ["DUALKV_CUDA_TILE_ORDER"] = order
        both(); torch.cuda.synchronize()
    reps = max(3, int(300 / max(1.0, timed(both, 1))))
    for _ in range(4):
        for order in ("1", "0"):
            os.environ["DUALKV_CUDA_TILE_ORDER"] = order
            res[order][0].append(timed(fwd, reps * 3))
            res[order][1].append(timed(both, reps))
    f1, f0 = (statistics.median(res[o][0]) for o in ("1", "0"))
    b1, b0 = (statistics.median(res[o][1]) for o in ("1", "0"))
    print(f"{label} (T={T}): forward {f1:.3f} (readers first) vs {f0:.3f} ms (layout order): {100 * (f0 - f1) / f0:+.1f}% ; "
          f"fwd+bwd {b1:.3f} vs {b0:.3f} ms: {100 * (b0 - b1) / b0:+.1f}%", flush=True)
    del q, k, v, dout
os.environ.pop("DUALKV_CUDA_TILE_ORDER")
