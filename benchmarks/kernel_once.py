"""Run one DualKV attention config a few times and exit: a target for kernel profilers.

    ncu -k regex:dkv_fwd_sm90 --launch-skip 2 --launch-count 1 --section SpeedOfLight \\
        python -m benchmarks.kernel_once --config 8,16K,512 --backend cuda
    nsys profile python -m benchmarks.kernel_once --config 28,4K,2K --backend triton --backward

Inputs are the benchmark harness's (random, seeded, bf16 unless the config says otherwise); the
launches are synchronised at the end, nothing is timed or written.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.harness import AttnConfig, _random_qkv
from dualkv.core import dualkv_attention
from dualkv.core.backends import BACKEND_CHOICES


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="8,16K,512", help="'N,P,R' or 'N=..,P=..,R=..,H=..,H_kv=..,d=..'")
    ap.add_argument("--backend", default="auto", choices=BACKEND_CHOICES)
    ap.add_argument("--calls", type=int, default=3, help="forward calls (each followed by its backward with --backward)")
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.calls < 1:
        ap.error(f"--calls: expected a positive count, got {args.calls}")

    cfg = AttnConfig.parse(args.config)
    device = torch.device(args.device)
    layout = cfg.layout(device)
    q, k, v = _random_qkv(cfg, device, args.seed)
    for t in (q, k, v):
        t.requires_grad_(args.backward)
    for _ in range(args.calls):
        out = dualkv_attention(q, k, v, layout, backend=args.backend)
        if args.backward:
            out.backward(torch.ones_like(out))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    print(f"{cfg.label} d={cfg.d} H={cfg.H}/{cfg.H_kv} {cfg.dtype}: {args.calls} call(s) on {args.backend}")


if __name__ == "__main__":
    main()
