"""Where a decoder layer's time goes: bench_decoder_layer's layer, forward+backward, under torch.profiler.

Per (point, mode, variant): the median of 5 calls timed by the harness's Timer after two warm-up
calls, then (eager mode, or every mode with ``--profile-all``) one more call under torch.profiler and
its costliest kernels, each with its total time. ``--gaps N`` adds where the GPU sat idle in that
call (its longest N gaps, each with the kernel after it and the host operator running then; the
idle time by host operator) and the host synchronisations of one more call
(``torch.cuda.set_sync_debug_mode``), read by ``benchmarks.timeline``.

    python -m benchmarks.profile_decoder_layer --points '5K,32;8K,16' --modes eager,compile \\
        --variants dualkv,flex-packed [--gaps 10]

Prints only; nothing is written.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks import bench_decoder_layer as dl
from benchmarks.harness import Timer
from benchmarks.kernel_once import kernel_times
from benchmarks.timeline import host_syncs, idle_report

MODES = ("eager", "compile")


def kernel_table(fn, top: int, gaps: int = 0) -> list[str]:
    """Lines 'ms  name' of the ``top`` costliest kernels of one call of ``fn``, and their total; with
    ``gaps`` > 0, the GPU's idle time in that call, its ``gaps`` longest idle stretches (each with the
    host operator running then) and that idle time by host operator."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if gaps else [])
    with profile(activities=activities) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = kernel_times(prof, 1, "cuda")
    lines = [f"   kernel total {sum(ms for _, ms in kernels):.2f} ms"]
    lines += [f"   {ms:8.2f} ms  {name[:110]}" for name, ms in kernels[:top]]
    return lines + (idle_report(prof, gaps) if gaps else [])


def profile_one(point: dl.Point, mode: str, variant: str, preset: str, backend: str, seed: int, table: bool,
                top: int, gaps: int = 0) -> list[str]:
    device = torch.device("cuda")
    block, var, x, fwdbwd = dl.prepare_layer(point, variant, preset, device, backend, seed, mode == "compile")
    try:
        t0 = time.perf_counter()
        fwdbwd()
        fwdbwd()
        torch.cuda.synchronize()
        warmup = time.perf_counter() - t0
        t = Timer(device, budget_ms=float("inf"), max_reps=6).measure(fwdbwd)
        lines = [f"== {point.P},{point.mb} {mode} {variant}: median {t.median_ms:.2f} ms (min {min(t.times_ms):.2f}, "
                 f"max {max(t.times_ms):.2f}, {t.reps} calls) warmup {warmup:.1f}s T={x.shape[0]}"]
        if table:
            lines += kernel_table(fwdbwd, top, gaps)
        if gaps:
            lines += host_syncs(fwdbwd, skip=(__file__,))
        return lines
    finally:
        var.close()
        del block, var, x, fwdbwd
        torch._dynamo.reset()
        torch.cuda.empty_cache()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--points", default="5K,32;8K,16", help="';'-separated 'P,mb' points")
    ap.add_argument("--modes", default="eager,compile", help=f"','-separated, of {MODES}")
    ap.add_argument("--variants", default="dualkv,flex-packed", help=f"','-separated, of {dl.VARIANTS}")
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--backend", default="auto", help="dualkv backend of the 'dualkv' variant")
    ap.add_argument("--profile-all", action="store_true", help="the kernel table in every mode, not only eager")
    ap.add_argument("--top", type=int, default=28, help="kernels listed per table")
    ap.add_argument("--gaps", type=int, default=0, help="also list the GPU's N longest idle stretches and the host syncs")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.gaps < 0:
        ap.error(f"--gaps: expected a count >= 0, got {args.gaps}")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if set(modes) - set(MODES):
        raise SystemExit(f"--modes: expected some of {MODES}, got {modes}")
    if set(variants) - set(dl.VARIANTS):
        raise SystemExit(f"--variants: expected some of {dl.VARIANTS}, got {variants}")
    if not torch.cuda.is_available():
        raise SystemExit("profile_decoder_layer: needs a CUDA device")
    for text in args.points.split(";"):
        if not text.strip():
            continue
        point = dl.make_point(text, args.seed)
        for mode in modes:
            for variant in variants:
                table = mode == "eager" or args.profile_all
                for line in profile_one(point, mode, variant, args.preset, args.backend, args.seed, table, args.top,
                                        args.gaps):
                    print(line, flush=True)


if __name__ == "__main__":
    main()
