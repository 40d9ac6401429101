import math, torch
from triton.testing import do_bench
from benchmarks.tune_triton import make_case
from dualkv.core.backends.triton import launcher
from dualkv.core.backends.triton.configs import KernelConfig as K
SHAPES = [((16, 8192, 2048, 32, 8, 64), [(64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 4), (32, 64, 4, 3), (64, 32, 4, 3), (128, 64, 8, 2), (128, 128, 8, 2)]),
          ((28, 4096, 2048, 32, 8, 128), [(64, 128, 8, 3), (64, 128, 8, 4), (64, 64, 4, 4), (64, 64, 4, 3)]),
          ((16, 16384, 2048, 16, 8, 256), [(64, 64, 8, 2), (32, 64, 8, 2)])]
for (N, P, R, H, Hkv, d), cands in SHAPES:
    meta, q, k, v, do = make_case(N, P, R, H, Hkv, d)
    scale = 1 / math.sqrt(d)
    out, lse = launcher.forward(q, k, v, None, None, meta, scale, None, None)
    bwd = launcher.Backward(do, q, k, v, None, None, out, lse, meta, scale, None, None, False)
    bwd.preprocess()
    for c in cands:
        try:
            t = do_bench(lambda: bwd.dkdv(K(*c)), rep=200)
            print(f"{N},{P},{R} d={d} rows {c} {t:.2f} ms", flush=True)
        except Exception as e:
            print(f"{N},{P},{R} d={d} rows {c} failed {type(e).__name__}", flush=True)
