"""Separate vs concatenated projections (q/k/v, gate/up): forward + backward time, eager and compiled.

Run: python benchmarks/results/raw/fused_projections_ab.py (a CUDA GPU). The concatenated form is
one linear over torch.cat of the weights, split after; its backward so takes one product for dX.
"""
import sys, torch, torch.nn.functional as F
torch.manual_seed(0)
dev, dt = "cuda", torch.bfloat16
print(torch.cuda.get_device_name(), torch.__version__, flush=True)

def timeit(fn, reps=30):
    for _ in range(5): fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    ts = []
    for _ in range(reps):
        s.record(); fn(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e))
    ts.sort(); return ts[len(ts) // 2]

def qkv_sep(x, wq, wk, wv):
    return F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)
def qkv_cat(x, wq, wk, wv):
    y = F.linear(x, torch.cat([wq, wk, wv]))
    return y.split([wq.shape[0], wk.shape[0], wv.shape[0]], dim=-1)
def mlp_sep(x, wg, wu, wd):
    return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)
def mlp_cat(x, wg, wu, wd):
    g, u = F.linear(x, torch.cat([wg, wu])).chunk(2, dim=-1)
    return F.linear(F.silu(g) * u, wd)

for name, D, H, K, I in (("qwen3-1.7b", 2048, 16, 8, 6144), ("qwen3-4b", 2560, 32, 8, 9728)):
    for T in (16768, 8192 + 4 * 1090):
        x = torch.randn(T, D, device=dev, dtype=dt, requires_grad=True)
        ws = [torch.randn(n, D, device=dev, dtype=dt, requires_grad=True) * 0.02 for n in (H * 128, K * 128, K * 128)]
        ws = [w.detach().requires_grad_() for w in ws]
        mw = [torch.randn(n, m, device=dev, dtype=dt) * 0.02 for n, m in ((I, D), (I, D), (D, I))]
        mw = [w.detach().requires_grad_() for w in mw]
        res = {}
        for mode in ("eager", "compiled"):
            for label, f, params in (("qkv_sep", qkv_sep, ws), ("qkv_cat", qkv_cat, ws), ("mlp_sep", mlp_sep, mw), ("mlp_cat", mlp_cat, mw)):
                g = torch.compile(f) if mode == "compiled" else f
                outs = g(x, *params)
                outs = outs if isinstance(outs, tuple) else (outs,)
                grads = [torch.randn_like(o) for o in outs]
                def step():
                    o = g(x, *params)
                    o = o if isinstance(o, tuple) else (o,)
                    torch.autograd.backward(o, grads)
                res[(mode, label)] = timeit(step)
        flops_qkv = 3 * 2 * T * D * (H + 2 * K) * 128
        flops_mlp = 3 * 2 * T * D * I * 3
        for mode in ("eager", "compiled"):
            a, b = res[(mode, "qkv_sep")], res[(mode, "qkv_cat")]
            c, d = res[(mode, "mlp_sep")], res[(mode, "mlp_cat")]
            print(f"{name} T={T} {mode}: qkv sep {a:.3f} ms ({flops_qkv / a / 1e9:.0f} TF/s) cat {b:.3f} ({flops_qkv / b / 1e9:.0f}) ratio {b / a:.3f} | "
                  f"mlp sep {c:.3f} ({flops_mlp / c / 1e9:.0f}) cat {d:.3f} ({flops_mlp / d / 1e9:.0f}) ratio {d / c:.3f}", flush=True)
