"""Run one DualKV attention config a few times and exit: a target for kernel profilers.

    ncu -k regex:dkv_fwd_sm90 --launch-skip 2 --launch-count 1 --section SpeedOfLight \\
        python -m benchmarks.kernel_once --config 8,16K,512 --backend cuda
    nsys profile python -m benchmarks.kernel_once --config 28,4K,2K --backend triton --backward

or, with ``--profile``, its own per-kernel table (torch.profiler: each kernel's time per call, the
mean over --calls after one warm-up call; on a CPU run, the operators' own CPU time):

    DUALKV_CUDA_WGMMA_BWD=3 python -m benchmarks.kernel_once --config 16,32K,2K --backend cuda --backward --profile

Inputs are the benchmark harness's (random, seeded, bf16 unless the config says otherwise); the
launches are synchronised at the end; nothing is written.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.harness import AttnConfig, _random_qkv
from dualkv.core import dualkv_attention
from dualkv.core.backends import BACKEND_CHOICES


def kernel_times(prof, calls: int, device_type: str) -> list[tuple[str, float]]:
    """(name, ms per call) of the kernels a torch.profiler run recorded (of the operators, by their own
    CPU time, on a CPU run), longest first."""
    per_name: dict[str, float] = {}
    for e in prof.events():
        if device_type == "cuda":
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = e.device_time
        else:
            us = e.self_cpu_time_total
        per_name[e.name] = per_name.get(e.name, 0.0) + us / 1000 / calls
    return sorted(per_name.items(), key=lambda item: -item[1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="8,16K,512", help="'N,P,R' or 'N=..,P=..,R=..,H=..,H_kv=..,d=..'")
    ap.add_argument("--backend", default="auto", choices=BACKEND_CHOICES)
    ap.add_argument("--calls", type=int, default=3, help="forward calls (each followed by its backward with --backward)")
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true", help="print each kernel's time per call (torch.profiler)")
    ap.add_argument("--top", type=int, default=10, help="with --profile: how many kernels to list")
    args = ap.parse_args(argv)
    if args.calls < 1:
        ap.error(f"--calls: expected a positive count, got {args.calls}")
    if args.top < 1:
        ap.error(f"--top: expected a positive count, got {args.top}")

    cfg = AttnConfig.parse(args.config)
    device = torch.device(args.device)
    layout = cfg.layout(device)
    q, k, v = _random_qkv(cfg, device, args.seed)
    for t in (q, k, v):
        t.requires_grad_(args.backward)
    # A random dout, as the benchmark harness's: the kernels' power draw (and so the clock) depends on
    # the data. autograd.grad, so no gradient accumulates into .grad between calls.
    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    dout = torch.randn(q.shape, generator=gen, device=device).to(q.dtype) if args.backward else None

    def calls(n: int) -> None:
        for _ in range(n):
            out = dualkv_attention(q, k, v, layout, backend=args.backend)
            if args.backward:
                torch.autograd.grad(out, (q, k, v), dout)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    if not args.profile:
        calls(args.calls)
    else:
        calls(1)  # warm-up: autotuning, JIT, caches
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            calls(args.calls)
    print(f"{cfg.label} d={cfg.d} H={cfg.H}/{cfg.H_kv} {cfg.dtype}: {args.calls} call(s) on {args.backend}")
    if args.profile:
        what = "kernel" if device.type == "cuda" else "operator (own CPU time)"
        print(f"ms per call  {what}")
        for name, ms in kernel_times(prof, args.calls, device.type)[: args.top]:
            print(f"{ms:11.3f}  {name[:110]}")


if __name__ == "__main__":
    main()
