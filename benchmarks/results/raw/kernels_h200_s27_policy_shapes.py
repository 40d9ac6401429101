"""Per-kernel times of the CUDA backend at policy-step shapes, under several env settings."""
import os, sys, torch
from dualkv.core import dualkv_attention, PackedLayout
from benchmarks.harness import attended_pairs

def lens(seed, n, lo=131, hi=2048):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi + 1, (n,), generator=g).tolist()

def run(P, R, H, Hkv, d=128, calls=4, backward=True):
    dev = torch.device("cuda")
    layout = PackedLayout.from_lengths([P], [R], device=dev)
    T = P + sum(R)
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(T, H, d, generator=g, device=dev, dtype=torch.bfloat16).requires_grad_(backward)
    k = torch.randn(T, Hkv, d, generator=g, device=dev, dtype=torch.bfloat16).requires_grad_(backward)
    v = torch.randn(T, Hkv, d, generator=g, device=dev, dtype=torch.bfloat16).requires_grad_(backward)
    do = torch.randn(T, H, d, generator=g, device=dev, dtype=torch.bfloat16)
    def step():
        out = dualkv_attention(q, k, v, layout, backend="cuda")
        if backward:
            torch.autograd.grad(out, (q, k, v), do)
    step(); torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    per = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name] = per.get(e.name, 0.0) + e.device_time / 1000 / calls
    pairs = attended_pairs([P], [R])
    F = 4 * d * H * pairs
    fwd = sum(v for k_, v in per.items() if "fwd" in k_)
    bwd = sum(v for k_, v in per.items() if "fwd" not in k_)
    print(f"  T={T} H={H}/{Hkv} pairs={pairs/1e6:.1f}M fwd {fwd:.3f} ms ({F/fwd/1e9:.0f} TF/s) bwd {bwd:.3f} ms ({2.5*F/bwd/1e9:.0f} TF/s)")
    for name, ms in sorted(per.items(), key=lambda x: -x[1])[:6]:
        print(f"    {ms:8.3f}  {name[:110]}")

CASES = {
    "policy8": lambda: run(8192, lens(0, 8), 16, 8),
    "policy8_h32": lambda: run(8192, lens(0, 8), 32, 8),
    "policy16": lambda: run(8192, lens(0, 16), 16, 8),
    "fixed1k": lambda: run(8192, [1024] * 8, 16, 8),
    "ref_8_16K_512": lambda: run(16384, [512] * 8, 32, 8),
}
ENVS = [e for e in os.environ.get("ENVS", "-").split(";")]
for case in sys.argv[1:]:
    for env in ENVS:
        saved = {}
        if env != "-":
            for kv in env.split(","):
                k_, v_ = kv.split("=")
                saved[k_] = os.environ.get(k_)
                os.environ[k_] = v_
        print(f"{case} [{env}]", flush=True)
        CASES[case]()
        for k_, v_ in saved.items():
            if v_ is None: os.environ.pop(k_)
            else: os.environ[k_] = v_
