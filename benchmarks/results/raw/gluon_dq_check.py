"""The Gluon dQ (dualkv_core/backends/triton/gluon_dq.py) against the tl dQ kernel: agreement and time,
over launch variants (device script).

    PYTHONPATH=. python3 benchmarks/results/raw/gluon_dq_check.py
"""
import math
import traceback

import torch
from triton.testing import do_bench

from benchmarks.tune_triton import make_case
from dualkv.core.backends.triton import configs, gluon_dq, launcher

VARIANTS = [dict(block_n=64, stages=4), dict(block_n=128, stages=2), dict(block_n=64, stages=4, consumer_regs=232),
            dict(block_n=64, stages=3)]
CASES = [(3, 200, 77, 8, 2, 128, False), (2, 129, 63, 4, 4, 64, False), (5, 1000, 333, 8, 1, 128, False),
         (28, 4096, 2048, 32, 8, 128, True), (16, 32768, 2048, 32, 8, 128, True), (8, 16384, 512, 32, 8, 128, True),
         (16, 8192, 2048, 32, 8, 64, True)]


def main():
    launcher._ensure_allocator()
    for N, P, R, H, Hkv, d, timed in CASES:
        meta, q, k, v, do = make_case(N, P, R, H, Hkv, d)
        T = q.shape[0]
        scale = 1 / math.sqrt(d)
        out, lse = launcher.forward(q, k, v, None, None, meta, scale, None, None)
        bwd = launcher.Backward(do, q, k, v, None, None, out, lse, meta, scale, None, None, False)
        bwd.preprocess()
        o = bwd.o

        def tl_dq():
            configs.launch("dq", o.key(meta, T, (False, False)), o.dim, o.elem, True, bwd.dq_kernel,
                           warp_specialize=bwd.ws_ok, smem_limit=o.smem_limit)

        tl_dq()
        ref = bwd.dq.float().clone()
        base = do_bench(tl_dq, rep=300) if timed else None
        for var in VARIANTS:
            try:
                dq = torch.full_like(q, float("nan"))
                run = lambda: gluon_dq.run(q, k, v, do, dq, lse, bwd.delta, meta, o.qk_scale, o.scale, **var)  # noqa: E731
                run()
                torch.cuda.synchronize()
                err = (dq.float() - ref).abs().max().item()
                line = f"N={N} P={P} R={R} d={d} {var}: max|d dQ| {err:.3g} (of {ref.abs().max().item():.3g})"
                if timed:
                    ms = do_bench(run, rep=300)
                    line += f"; tl dq {base:.2f} ms, gluon dq {ms:.2f} ms ({base / ms:.3f}x)"
                print(line, flush=True)
            except Exception:  # noqa: BLE001 - a variant that fails is reported
                print(N, P, R, d, var, "failed")
                traceback.print_exc(limit=2)


if __name__ == "__main__":
    main()
