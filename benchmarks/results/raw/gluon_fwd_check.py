"""The Gluon forward (dualkv_core/backends/triton/gluon_fwd.py) against the ``tl`` forward: agreement and
time, over launch variants (device script).

    PYTHONPATH=. python3 benchmarks/results/raw/gluon_fwd_check.py
"""
import math
import os
import traceback

import torch
from triton.testing import do_bench

from benchmarks.tune_triton import make_case
from dualkv.core.backends.triton import gluon_fwd, launcher
from dualkv.core.backends.triton.common import LOG2E

VARIANTS = [dict(block_n=128, stages=2, consumer_regs=232), dict(block_n=64, stages=4, consumer_regs=232),
            dict(block_n=128, stages=2, consumer_regs=240)]
CASES = [(3, 200, 77, 8, 2, 128, False), (2, 129, 63, 4, 4, 64, False), (5, 1000, 333, 8, 1, 128, False),
         (28, 4096, 2048, 32, 8, 128, True), (16, 32768, 2048, 32, 8, 128, True), (8, 16384, 512, 32, 8, 128, True),
         (16, 8192, 2048, 32, 8, 64, True)]


def gluon(q, k, v, meta, scale, **var):
    out = torch.empty_like(q)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    gluon_fwd.run(q, k, v, out, lse, meta, scale * LOG2E, **var)
    return out, lse


def main():
    os.environ["DUALKV_TRITON_GLUON_FWD"] = "0"  # launcher.forward: the tl forward
    launcher._ensure_allocator()
    for N, P, R, H, Hkv, d, timed in CASES:
        meta, q, k, v, _ = make_case(N, P, R, H, Hkv, d)
        scale = 1 / math.sqrt(d)
        tl_fwd = lambda: launcher.forward(q, k, v, None, None, meta, scale, None, None)  # noqa: E731
        ro, rl = tl_fwd()
        base = do_bench(tl_fwd, rep=300) if timed else None
        for var in VARIANTS:
            try:
                go, gl_ = gluon(q, k, v, meta, scale, **var)
                torch.cuda.synchronize()
                line = (f"N={N} P={P} R={R} d={d} {var}: max|dO| {(ro.float() - go.float()).abs().max().item():.3g} "
                        f"max|dLSE| {(rl - gl_).abs().max().item():.3g}")
                if timed:
                    ms = do_bench(lambda: gluon(q, k, v, meta, scale, **var), rep=300)
                    line += f"; triton {base:.2f} ms, gluon-ws {ms:.2f} ms ({base / ms:.3f}x)"
                print(line, flush=True)
            except Exception:  # noqa: BLE001 - a variant that fails is reported
                print(N, P, R, d, var, "failed")
                traceback.print_exc(limit=2)


if __name__ == "__main__":
    main()
