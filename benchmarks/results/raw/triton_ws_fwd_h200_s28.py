"""Triton forward candidates (the warp-specialised loop and the multi-loop kernel) at the benchmark
shapes: kernel time by do_bench, and the largest difference from the multi-loop default's output."""
import math, sys, torch
from triton.testing import do_bench
from dualkv.core import PackedLayout
from dualkv_core.reference import AttnMeta
from dualkv_core.backends.triton import launcher
from dualkv_core.backends.triton.configs import KernelConfig
torch.manual_seed(0)
C = KernelConfig
cases = [
    ((28, 4096, 2048), 32, 8, 128), ((28, 16384, 2048), 32, 8, 128), ((16, 32768, 2048), 32, 8, 128),
    ((32, 8192, 2048), 32, 8, 128), ((8, 16384, 512), 32, 8, 128), ((8, 16384, 2048), 32, 8, 64),
    ((16, 16384, 2048), 16, 8, 256),
]
cands = {64: [C(128, 128, 8, 3), C(128, 128, 4, 2, True), C(128, 128, 4, 3, True), C(128, 64, 4, 3, True)],
         128: [C(128, 128, 8, 3), C(128, 128, 4, 2, True), C(128, 64, 4, 2, True), C(128, 64, 4, 3, True)],
         256: [C(128, 64, 8, 2), C(128, 64, 4, 2, True), C(128, 32, 4, 3, True)]}
for (N, P, R), H, Hkv, d in cases:
    lay = PackedLayout.from_lengths([P], [[R] * N], device="cuda")
    meta = AttnMeta.from_layout(lay)
    T = lay.total_tokens
    q = torch.randn(T, H, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(T, Hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(T, Hkv, d, device="cuda", dtype=torch.bfloat16)
    pairs = P * (P + 1) / 2 + N * (R * P + R * (R + 1) / 2)
    flops = 4 * d * H * pairs
    ref = None
    for cfg in cands[d]:
        try:
            fn = lambda: launcher.forward(q, k, v, None, None, meta, 1 / math.sqrt(d), None, None, config=cfg)
            out, lse = fn()
            if ref is None:
                ref = (out, lse)
            err = (out.float() - ref[0].float()).abs().max().item()
            lerr = (lse - ref[1]).abs().max().item()
            ms = do_bench(fn, warmup=5, rep=200, return_mode="median")
            print(f"N={N} P={P} R={R} H={H}/{Hkv} d={d} {cfg}: {ms:8.3f} ms {flops / ms / 1e9:5.0f} TFLOP/s  out diff {err:.3g} lse diff {lerr:.3g}", flush=True)
        except Exception as e:
            print(f"N={N} P={P} R={R} d={d} {cfg}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
