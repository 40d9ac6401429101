"""Gluon dK/dV vs the row kernel: agreement and time (device script)."""
import math
import os
import traceback

import torch
from triton.testing import do_bench
from dualkv.core.backends.triton import launcher, gluon_dkdv
from dualkv.core.backends.triton.configs import KernelConfig
from benchmarks.tune_triton import make_case

LOG2E = 1.4426950408889634
STAGES = int(os.environ.get("STAGES", 2))
CFG = KernelConfig(64, 128, 8, 3)
info = {}


def gluon_rows(self, cfg, table, wsk, wsv):
    q, k, v, _, _, dout, _, lse, meta = self.args
    T, H = q.shape[:2]
    t4 = -(-T // 4) * 4
    lse2 = lse.new_zeros((H, t4)); torch.mul(lse, LOG2E, out=lse2[:, :T])
    delta = lse.new_zeros((H, t4)); delta[:, :T] = self.delta
    kern = gluon_dkdv.run(q, k, v, dout, lse2, delta, self.dk, self.dv, wsk, wsv, table, meta.cu_seqlens,
                          k.shape[1], H // k.shape[1], self.o.qk_scale, self.o.scale, stages=STAGES)
    info["regs"] = (getattr(kern, "n_regs", None), getattr(kern, "n_spills", None))


def case(N, P, R, H, Hkv, d, time_it):
    meta, q, k, v, do = make_case(N, P, R, H, Hkv, d)
    scale = 1 / math.sqrt(d)
    out, lse = launcher.forward(q, k, v, None, None, meta, scale, None, None)
    res = {}
    for name in ("rows", "gluon"):
        bwd = launcher.Backward(do, q, k, v, None, None, out, lse, meta, scale, None, None, False)
        assert bwd.rows_dkdv
        if name == "gluon":
            bwd._dkdv_rows = gluon_rows.__get__(bwd)
        bwd.preprocess()
        bwd.dkdv(CFG)
        torch.cuda.synchronize()
        res[name] = (bwd.dk.float().clone(), bwd.dv.float().clone())
        if time_it:
            res[name + "_ms"] = do_bench(lambda: bwd.dkdv(CFG), rep=300)
    errs = [((a - b).abs().max().item(), a.abs().max().item()) for a, b in zip(res["rows"], res["gluon"])]
    bad = [int(((a - b).abs().amax(dim=(1, 2)) > 2e-2 * max(1.0, a.abs().max().item())).sum()) for a, b in zip(res["rows"], res["gluon"])]
    line = f"N={N} P={P} R={R} H={H}/{Hkv} d={d}: max|diff| dK {errs[0][0]:.3g} (of {errs[0][1]:.3g}) dV {errs[1][0]:.3g} (of {errs[1][1]:.3g}); bad rows {bad}"
    if time_it:
        line += f"; rows {res['rows_ms']:.2f} ms, gluon {res['gluon_ms']:.2f} ms ({res['rows_ms']/res['gluon_ms']:.3f}x)"
    print(line, info, flush=True)


launcher._ensure_allocator()
for c in [(3, 200, 77, 8, 2, 128, False), (2, 129, 63, 4, 4, 64, False), (5, 1000, 333, 8, 1, 128, False),
          (28, 4096, 2048, 32, 8, 128, True), (16, 32768, 2048, 32, 8, 128, True), (16, 8192, 2048, 32, 8, 64, True)]:
    try:
        case(*c)
    except Exception:
        print("case", c, "failed:"); traceback.print_exc(limit=3)
