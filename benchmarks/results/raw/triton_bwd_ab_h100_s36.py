"""Interleaved A/B timing of ws_var's backward variants: every round runs each variant once (cuda events,
enough calls to fill ~target ms), so clock and power drift hit all variants alike. Prints the median and
min per variant and the ratio of medians to the first variant.

    PYTHONPATH=.:.devrun python -m probes.ab_ws --variants var-base,fast-mask --shapes 16,32768,2048 --rounds 7
"""
from __future__ import annotations

import argparse
import math
import statistics


def main(argv=None):
    import torch

    from dualkv.core.backends.triton import gluon_dkdv_ws, launcher
    from benchmarks.tune_triton import make_case

    from . import ws_var

    variants = {
        "var-base": {},
        "fast-mask": dict(fast_mask=True),
        "few-bars": dict(few_bars=True),
        "fast-mask-few-bars": dict(fast_mask=True, few_bars=True),
        "pipe-s": dict(pipe_s=True),
        "all3": dict(fast_mask=True, few_bars=True, pipe_s=True),
        "no-dq": dict(no_dq=True),
        "rot-head": dict(rot=1),
        "rot-read": dict(rot=2),
        "fmfb-rot-head": dict(fast_mask=True, few_bars=True, rot=1),
        "fmfb-rot-read": dict(fast_mask=True, few_bars=True, rot=2),
        "read-first": dict(rot=3),
        "read-first-bo": dict(rot=4),
        "fmfb-read-first": dict(fast_mask=True, few_bars=True, rot=3),
        "fmfb-read-first-bo": dict(fast_mask=True, few_bars=True, rot=4),
        "wave": dict(rot=5),
        "fmfb-wave": dict(fast_mask=True, few_bars=True, rot=5),
        "head-major": dict(rot=6),
        "fmfb-head-major": dict(fast_mask=True, few_bars=True, rot=6),
        "split4K": dict(_split_rows=4096),
        "split16K": dict(_split_rows=16384),
        "nosplit": dict(_split_rows=1 << 30),
        "deterministic": dict(_atomic=False),
        "base-pad": dict(_pad=1),
        "var-base2": {},
    }
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default=",".join(variants))
    ap.add_argument("--shapes", default="16,65536,2048;16,32768,2048;8,16384,512;28,4096,2048")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--target-ms", type=float, default=150)
    args = ap.parse_args(argv)
    names = args.variants.split(",")
    base_run = gluon_dkdv_ws.run
    for shape in args.shapes.split(";"):
        N, P, R = (int(x) for x in shape.split(","))
        meta, q, k, v, do = make_case(N, P, R, 32, 8, 128)
        scale = 1 / math.sqrt(128)
        out, lse = launcher.forward(q, k, v, None, None, meta, scale, None, None)

        def runner(name):
            kw = {kk: x for kk, x in variants[name].items() if not kk.startswith("_")}
            lk = {kk[1:] + ("_dq" if kk == "_atomic" else ""): x for kk, x in variants[name].items() if kk.startswith("_")}

            pad_mb = lk.pop("pad", 0) * 37

            def run():
                pad = torch.empty(pad_mb << 20, dtype=torch.uint8, device="cuda") if pad_mb else None  # noqa: F841
                gluon_dkdv_ws.run = lambda *a, **k2: ws_var.run(*a, **{**k2, **kw})
                try:
                    return launcher.backward(do, q, k, v, None, None, out, lse, meta, scale, None, None, False, **lk)
                finally:
                    gluon_dkdv_ws.run = base_run
            return run

        ref, reps, times = None, {}, {n: [] for n in names}
        for name in names:
            got = runner(name)()
            torch.cuda.synchronize()
            if ref is None:
                ref = [g.float() for g in got[:3]]
            err = max(((a.float() - b).abs().max() / b.abs().max()).item() for a, b in zip(got[:3], ref))
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record(); runner(name)(); e1.record(); torch.cuda.synchronize()
            reps[name] = max(1, int(args.target_ms / e0.elapsed_time(e1)))
            print(f"{shape} {name}: max rel diff {err:.1e}{' WRONG' if err > 2e-2 else ''}, {reps[name]} calls/round",
                  flush=True)
        for _ in range(args.rounds):
            for name in names:
                run = runner(name)
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                for _ in range(reps[name]):
                    run()
                e1.record()
                torch.cuda.synchronize()
                times[name].append(e0.elapsed_time(e1) / reps[name])
        m0 = statistics.median(times[names[0]])
        for name in names:
            m = statistics.median(times[name])
            print(f"{shape} {name:20s} median {m:8.2f} ms min {min(times[name]):8.2f} max {max(times[name]):8.2f} "
                  f"({m0 / m:.3f}x)", flush=True)
        del meta, q, k, v, do, out, lse, ref
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
