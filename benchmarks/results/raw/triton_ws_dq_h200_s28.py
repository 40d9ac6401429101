"""Triton dQ kernel candidates (the warp-specialised single loop and the multi-loop kernel): kernel
time by do_bench at the benchmark shapes, and the largest difference from the multi-loop output."""
import math, torch
from triton.testing import do_bench
from dualkv.core import PackedLayout
from dualkv_core.reference import AttnMeta
from dualkv_core.backends.triton import launcher
from dualkv_core.backends.triton.configs import KernelConfig as C
torch.manual_seed(0)
cases = [((28, 4096, 2048), 32, 8, 128), ((28, 16384, 2048), 32, 8, 128), ((16, 32768, 2048), 32, 8, 128),
         ((32, 8192, 2048), 32, 8, 128), ((8, 16384, 512), 32, 8, 128), ((8, 16384, 2048), 32, 8, 64),
         ((16, 16384, 2048), 16, 8, 256)]
cands = {64: [C(128, 64, 8, 3), C(128, 64, 4, 2, True), C(128, 128, 4, 2, True)],
         128: [C(128, 64, 8, 3), C(128, 64, 4, 2, True), C(128, 128, 4, 2, True)],
         256: [C(128, 32, 8, 2), C(128, 32, 4, 2, True), C(128, 64, 4, 2, True)]}
for (N, P, R), H, Hkv, d in cases:
    lay = PackedLayout.from_lengths([P], [[R - 3 * i % 7 for i in range(N)]], device="cuda")  # ragged segment starts
    meta = AttnMeta.from_layout(lay)
    T = lay.total_tokens
    q, do = (torch.randn(T, H, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(T, Hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    scale = 1 / math.sqrt(d)
    out, lse = launcher.forward(q, k, v, None, None, meta, scale, None, None)
    bwd = launcher.Backward(do, q, k, v, None, None, out, lse, meta, scale, None, None, False)
    bwd.preprocess()
    ref = None
    for cfg in cands[d]:
        try:
            bwd.dq_kernel(cfg)
            got = bwd.dq.clone()
            ref = got if ref is None else ref
            err = (got.float() - ref.float()).abs().max().item()
            ms = do_bench(lambda: bwd.dq_kernel(cfg), warmup=5, rep=200, return_mode="median")
            print(f"N={N} P={P} R~{R} H={H}/{Hkv} d={d} dQ {cfg}: {ms:8.3f} ms  diff {err:.3g} (|dq| max {ref.float().abs().max().item():.3g})", flush=True)
        except Exception as e:
            print(f"N={N} P={P} d={d} {cfg}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
