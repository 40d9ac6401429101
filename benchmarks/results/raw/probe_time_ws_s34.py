"""Time variants of the default sm_90 d = 128 backward (the warp-specialised Gluon dK/dV with dQ fused),
one process, on a GPU: ws_var's constexprs, the item order, split_rows. Prints ms, ratio to the
default, and the largest dQ / dK / dV differences from the default's (relative to their largest value).

    python -m probes.time_ws [--variants a,b] [--shapes 28,4096,2048;...]

(from the repository root, with this file as probes/time_ws.py in a ``probes`` package on PYTHONPATH,
beside probes/ws_var.py: dualkv_core/backends/triton/gluon_dkdv_ws.py of commit 7de4338 with
probe_ws_var_s34.diff applied. The logs it wrote: triton_ws_variants_h200_s34.log,
triton_balanced_splits_h200_s34.log.)
"""

from __future__ import annotations

import argparse
import math
import os
import time

SHAPES = "28,4096,2048;32,8192,2048;28,16384,2048;16,32768,2048;16,65536,2048;8,16384,512"


def resp_major(items):
    """Prompt items first in their heavy-first order, then each response's key blocks together
    (response by response, longest block first), then the padding: a response's blocks add into the
    same dQ rows at about the same time."""
    import torch
    from dualkv.core.backends.triton import schedule

    t = items.table
    unit, blk, reg = t[schedule.UNIT].long(), t[schedule.BLOCK].long(), t[schedule.REGION].long()
    pos = torch.arange(t.shape[1], device=t.device)
    group = torch.where(unit < 0, 2, torch.where(reg >= 0, 0, 1))
    second = torch.where(group == 1, unit * (1 << 24) + blk, pos)
    order = torch.argsort(second, stable=True)
    order = order[torch.argsort(group[order], stable=True)]
    return items._replace(table=t[:, order].contiguous())


def main(argv=None):
    import torch
    from triton.testing import do_bench

    from dualkv.core.backends.triton import gluon_dkdv_ws, launcher, schedule
    from benchmarks.tune_triton import make_case

    from . import ws_var

    variants = {
        "default": (None, {}, None),
        "resp-major": (None, {}, None, resp_major),
        "old4K-resp-major": (None, {}, 4096, resp_major),
        "var-base": (ws_var.run, {}, None),
        "early": (ws_var.run, dict(early=True), None),
        "rot-head": (ws_var.run, dict(rot=1), None),
        "rot-read": (ws_var.run, dict(rot=2), None),
        "early-rot-head": (ws_var.run, dict(early=True, rot=1), None),
        "no-dq": (ws_var.run, dict(no_dq=True), None),
        "old4K": (None, {}, 4096),
        "split8K": (None, {}, 8192),
        "split16K": (None, {}, 16384),
        "nosplit": (None, {}, 1 << 30),
    }
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default=",".join(variants))
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--rep-ms", type=int, default=400)
    args = ap.parse_args(argv)
    base_run = gluon_dkdv_ws.run
    for shape in args.shapes.split(";"):
        N, P, R = (int(x) for x in shape.split(","))
        meta, q, k, v, do = make_case(N, P, R, 32, 8, 128)
        scale = 1 / math.sqrt(128)
        out, lse = launcher.forward(q, k, v, None, None, meta, scale, None, None)
        ref = None
        t0 = None
        for name in args.variants.split(","):
            impl, kw, split_rows, *transform = variants[name]
            real_items = schedule.key_items
            if transform:
                schedule.key_items = lambda *a, _f=transform[0], **k2: _f(real_items(*a, **k2))
            gluon_dkdv_ws.run = (lambda *a, _i=impl, _k=kw, **k2: _i(*a, **{**k2, **_k})) if impl else base_run

            def run():
                return launcher.backward(do, q, k, v, None, None, out, lse, meta, scale, None, None, False,
                                         split_rows=split_rows)
            try:
                t_start = time.perf_counter()
                got = run()
                torch.cuda.synchronize()
                first = time.perf_counter() - t_start
                if ref is None:
                    ref = [g.float() for g in got[:3]]
                err = [((a.float() - b).abs().max() / b.abs().max()).item() for a, b in zip(got[:3], ref)]
                t = do_bench(run, rep=args.rep_ms)
                t0 = t0 or t
                flag = " WRONG" if max(err) > 2e-2 else ""
                print(f"{N},{P},{R} {name:15s} {t:8.2f} ms ({t0 / t:.3f}x) first {first:.1f} s; dq/dk/dv rel diff "
                      + " ".join(f"{e:.1e}" for e in err) + flag, flush=True)
            except Exception as err:  # noqa: BLE001
                print(f"{N},{P},{R} {name} failed {type(err).__name__}: {str(err)[:300]}", flush=True)
            finally:
                gluon_dkdv_ws.run = base_run
                schedule.key_items = real_items
        del meta, q, k, v, do, out, lse, ref
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
