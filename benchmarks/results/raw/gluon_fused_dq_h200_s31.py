"""The whole Triton backward with dQ inside the Gluon dK/dV (DUALKV_TRITON_GLUON_DKDV=1 and
atomic_dq=True) against the default backward, per number of dQ column slices.

    PYTHONPATH=. python3 benchmarks/results/raw/gluon_fused_dq_h200_s31.py
"""
import math
import os

import torch
from triton.testing import do_bench

from benchmarks.tune_triton import make_case
from dualkv.core.backends.triton import gluon_dkdv, launcher

SHAPES = [(28, 4096, 2048, 32, 8, 128), (16, 32768, 2048, 32, 8, 128), (8, 16384, 512, 32, 8, 128),
          (16, 8192, 2048, 32, 8, 64), (28, 4096, 2048, 32, 8, 64)]
real_run = gluon_dkdv.run
for N, P, R, H, Hkv, d in SHAPES:
    meta, q, k, v, do = make_case(N, P, R, H, Hkv, d)
    scale = 1 / math.sqrt(d)
    out, lse = launcher.forward(q, k, v, None, None, meta, scale, None, None)
    run = lambda atomic: launcher.backward(do, q, k, v, None, None, out, lse, meta, scale, None, None, False,
                                           atomic_dq=atomic)
    os.environ["DUALKV_TRITON_GLUON_DKDV"] = "0"
    ref = run(False)
    t0 = do_bench(lambda: run(False), rep=300)
    print(f"{N},{P},{R} d={d} bwd default {t0:.2f} ms", flush=True)
    os.environ["DUALKV_TRITON_GLUON_DKDV"] = "1"
    for parts in (1, 2):
        gluon_dkdv.run = lambda *a, parts=parts, **kw: real_run(*a, **{**kw, "dq_parts": parts})
        g = run(True)
        torch.cuda.synchronize()
        err = [(a.float() - b.float()).abs().max().item() for a, b in zip(g[:3], ref[:3])]
        t = do_bench(lambda: run(True), rep=300)
        print(f"{N},{P},{R} d={d} bwd fused parts={parts} {t:.2f} ms ({t0 / t:.3f}x) maxdiff dq/dk/dv "
              + " ".join(f"{e:.1e}" for e in err), flush=True)
    gluon_dkdv.run = real_run
