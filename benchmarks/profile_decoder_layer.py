"""Where a decoder layer's time goes: bench_decoder_layer's layer, forward+backward, under torch.profiler.

Per (point, mode, variant): the median of 5 event-timed calls after two warm-up calls, then (eager
mode, or every mode with ``--profile-all``) one more call under torch.profiler and its costliest
kernels, each with its total time and number of launches.

    python -m benchmarks.profile_decoder_layer --points '5K,32;8K,16' --modes eager,compile \\
        --variants dualkv,flex-packed

Prints only; nothing is written.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks import bench_decoder_layer as dl

MODES = ("eager", "compile")


def kernel_table(fn, top: int) -> list[str]:
    """Lines 'ms  calls x  name' of the ``top`` costliest kernels of one call of ``fn``, and their total."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in events) / 1e3
    lines = [f"   kernel total {total:.2f} ms"]
    lines += [f"   {e.self_device_time_total / 1e3:8.2f} ms {e.count:4d}x  {e.key[:110]}" for e in events[:top]]
    return lines


def profile_one(point: dl.Point, mode: str, variant: str, preset: str, backend: str, seed: int, table: bool,
                top: int) -> list[str]:
    device = torch.device("cuda")
    block, attn_cfg = dl.build_block(preset, device, torch.bfloat16, seed)
    var = dl.Variant(variant, point, attn_cfg, device, backend)
    try:
        if mode == "compile":
            block.compile(dynamic=False)
        T = var.packed.total_tokens
        D = block.input_layernorm.weight.shape[0]
        gen = torch.Generator(device=device).manual_seed(seed)
        probe = torch.randn(T, D, generator=gen, device=device, dtype=torch.bfloat16)
        x = var.tokens(torch.randn(T, D, generator=gen, device=device, dtype=torch.bfloat16)).requires_grad_()
        wrt = [x] + list(block.parameters())

        def fn():
            torch.autograd.grad(dl.layer_loss(block, attn_cfg, var, x, probe), wrt)

        t0 = time.perf_counter()
        fn()
        fn()
        torch.cuda.synchronize()
        warmup = time.perf_counter() - t0
        times = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        times.sort()
        lines = [f"== {point.P},{point.mb} {mode} {variant}: median {times[2]:.2f} ms (min {times[0]:.2f}, "
                 f"max {times[-1]:.2f}) warmup {warmup:.1f}s T={T}"]
        if table:
            lines += kernel_table(fn, top)
        return lines
    finally:
        var.close()
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
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
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
                for line in profile_one(point, mode, variant, args.preset, args.backend, args.seed, table, args.top):
                    print(line, flush=True)


if __name__ == "__main__":
    main()
