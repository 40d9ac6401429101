"""The whole Triton backward with dQ added inside the one-loop dK/dV (atomic_dq=True) against the dQ
kernel. ``--register-atomics``: dQ added by fp32 atomics from registers instead of the copy engine's
reduce-add (the kernel launched with DQ_TMA off), on the shapes of that run.

    PYTHONPATH=. python3 benchmarks/results/raw/triton_dkdv_rows_atomic_h200_s29.py [--register-atomics]
"""
import math
import sys

import torch
from triton.testing import do_bench
from benchmarks.tune_triton import make_case
from dualkv.core.backends.triton import launcher
from dualkv.core.backends.triton.configs import KernelConfig as K

REGISTER_ATOMICS = "--register-atomics" in sys.argv
if REGISTER_ATOMICS:
    real = launcher.dkdv_rows_kernel

    class RegisterAtomics:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                if kw.get("ATOMIC_DQ"):
                    kw["DQ_TMA"] = False
                return real[grid](*args, **kw)
            return launch

    launcher.dkdv_rows_kernel = RegisterAtomics()
SHAPES = [((28, 4096, 2048, 32, 8, 128), [None, (32, 128, 8, 3), (64, 64, 4, 3)]),
          ((16, 32768, 2048, 32, 8, 128), [None, (32, 128, 8, 3)]),
          ((8, 16384, 512, 32, 8, 128), [None]),
          ((16, 8192, 2048, 32, 8, 64), [None, (128, 128, 8, 2)]),
          ((16, 16384, 2048, 16, 8, 256), [None])]
if REGISTER_ATOMICS:
    SHAPES = [((28, 4096, 2048, 32, 8, 128), [None, (64, 128, 8, 3)]),
              ((16, 32768, 2048, 32, 8, 128), [None, (64, 128, 8, 3)]),
              ((16, 8192, 2048, 32, 8, 64), [None])]
for (N, P, R, H, Hkv, d), cfgs in SHAPES:
    meta, q, k, v, do = make_case(N, P, R, H, Hkv, d)
    scale = 1 / math.sqrt(d)
    out, lse = launcher.forward(q, k, v, None, None, meta, scale, None, None)
    run = lambda atomic, cfg=None: launcher.backward(do, q, k, v, None, None, out, lse, meta, scale, None, None, False,
                                                     atomic_dq=atomic, dkdv_config=None if cfg is None else K(*cfg))
    ref = run(False)
    t0 = do_bench(lambda: run(False), rep=300)
    print(f"{N},{P},{R} d={d} bwd kernel-dQ {t0:.2f} ms", flush=True)
    for c in cfgs:
        try:
            g = run(True, c); torch.cuda.synchronize()
            err = [(a.float() - b.float()).abs().max().item() for a, b in zip(g[:3], ref[:3])]
            t = do_bench(lambda: run(True, c), rep=300)
            print(f"{N},{P},{R} d={d} bwd {'pointer-' if REGISTER_ATOMICS else ''}atomic-dQ {c or 'default'} {t:.2f} ms ({t0 / t:.3f}x) maxdiff dq/dk/dv "
                  + " ".join(f"{e:.1e}" for e in err) + f" (|dq| {ref[0].float().abs().max().item():.1e})", flush=True)
        except Exception as e:
            print(f"{N},{P},{R} d={d} atomic {c} failed {type(e).__name__}: {str(e)[:150]}", flush=True)
