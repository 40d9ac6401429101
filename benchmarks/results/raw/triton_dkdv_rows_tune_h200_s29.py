import math, torch, sys
from triton.testing import do_bench
from benchmarks.tune_triton import make_case
from dualkv.core.backends.triton import launcher
from dualkv.core.backends.triton.configs import KernelConfig as K
# (run at an intermediate tree whose row kernel had a warp_specialize switch, here set off: the form committed)
C128 = [(64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 8, 2), (32, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (32, 64, 4, 3), (128, 64, 8, 2)]
SHAPES = [((28, 4096, 2048, 32, 8, 128), (32, 64, 4, 3), C128), ((8, 16384, 512, 32, 8, 128), (32, 64, 4, 3), C128[:6]),
          ((16, 32768, 2048, 32, 8, 128), (32, 64, 4, 3), C128[:4]),
          ((16, 8192, 2048, 32, 8, 64), (32, 128, 8, 2), [(64, 128, 8, 2), (128, 128, 8, 2), (64, 128, 4, 3), (32, 128, 8, 2), (64, 64, 4, 3)]),
          ((16, 16384, 2048, 16, 8, 256), (32, 32, 4, 2), [(32, 64, 8, 2), (64, 64, 8, 2), (32, 32, 4, 2), (64, 32, 4, 2)])]
for (N, P, R, H, Hkv, d), base_cfg, cands in SHAPES:
    meta, q, k, v, do = make_case(N, P, R, H, Hkv, d)
    scale = 1 / math.sqrt(d)
    out, lse = launcher.forward(q, k, v, None, None, meta, scale, None, None)
    bwd = launcher.Backward(do, q, k, v, None, None, out, lse, meta, scale, None, None, False)
    bwd.preprocess()
    bwd.dkdv(K(*base_cfg)); ref = (bwd.dk.clone(), bwd.dv.clone())
    t0 = do_bench(lambda: bwd.dkdv(K(*base_cfg)), rep=200)
    print(f"{N},{P},{R} d={d} base multi-loop {base_cfg} {t0:.2f} ms", flush=True)
    for c in cands:
        try:
            bwd.dkdv(K(*c, True)); torch.cuda.synchronize()
            err = max((bwd.dk.float() - ref[0].float()).abs().max().item(), (bwd.dv.float() - ref[1].float()).abs().max().item())
            t = do_bench(lambda: bwd.dkdv(K(*c, True)), rep=200)
            print(f"{N},{P},{R} d={d} rows {c} {t:.2f} ms ({t0 / t:.3f}x) maxdiff {err:.2e}", flush=True)
        except Exception as e:
            print(f"{N},{P},{R} d={d} rows {c} failed {type(e).__name__}", flush=True)
