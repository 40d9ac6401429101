"""Kernel benchmark of shared-prompt attention (the Triton issue's table): DualKV vs its peers.

Forward, backward and forward+backward ms, useful TFLOP/s (``harness`` docstring), peak extra memory,
for every (config, provider); results, a markdown table and plots in ``benchmarks/results/``.

    python -m benchmarks.bench_attention --preset issue3 --validate        # the d=128 table
    python -m benchmarks.bench_attention --preset all --validate           # + d=192, 256 and 512 rows
    python -m benchmarks.bench_attention --configs "28,4K,2K;N=16,P=16K,R=2K,H=16,H_kv=8,d=256"
    python -m benchmarks.bench_attention --preset tiny --device cpu --providers reference   # smoke test

``--validate`` first checks every provider's output and gradients against
``dualkv.core.reference_attention`` at a small shape of each head dim (N=4, P=777, R=129 unless
``--validation-shape``); a provider
that fails is not timed. ``--max-est-s`` skips (and records as skipped) a run whose planned
forward+backward would take longer than that, ``--deadline-s`` stops starting new runs after that
many seconds (the rest is recorded as not run).
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "benchmarks"

import torch

from benchmarks import peers  # noqa: F401  (registers the peer providers)
from benchmarks.gpu_monitor import GpuMonitor
from benchmarks.harness import (MODES, PROVIDERS, AttnConfig, Timer, add_timing_argument, base_row, run_case,
                                validate_provider)
from benchmarks.report import PROVIDER_ORDER, ResultWriter, environment

MODULE = "benchmarks.bench_attention"

D128 = dict(H=32, H_kv=8, d=128)
D192 = dict(H=16, H_kv=8, d=192)
D256 = dict(H=16, H_kv=8, d=256)
D512 = dict(H=16, H_kv=2, d=512)
PRESETS = {
    "issue3": [AttnConfig.parse(s, **D128) for s in
               ("28,4K,2K", "28,16K,2K", "16,32K,2K", "16,64K,2K", "32,8K,2K", "8,16K,512", "16,128K,2K")],
    "d192": [AttnConfig.parse(s, **D192) for s in ("16,16K,2K", "16,32K,2K")],
    "d256": [AttnConfig.parse(s, **D256) for s in ("16,16K,2K", "16,32K,2K")],
    "d512": [AttnConfig.parse(s, **D512) for s in ("16,8K,2K", "16,16K,2K")],
    "quick": [AttnConfig.parse(s, **D128) for s in ("28,4K,2K", "16,32K,2K")],
    "tiny": [AttnConfig.parse("2,64,32", H=4, H_kv=2, d=32)],
}
PRESETS["all"] = PRESETS["issue3"] + PRESETS["d192"] + PRESETS["d256"] + PRESETS["d512"]

# Peers each head dim has (the rest answer "unsupported" and are left out of "auto").
AUTO_PROVIDERS = {
    "small": ["dualkv-triton", "dualkv-cuda", "cudnn-cascade", "flex-packed", "fa2-cascade", "cudnn-replicated", "fa2-replicated"],
    "d512": ["dualkv-triton", "dualkv-cuda", "flex-packed", "cudnn-replicated", "sdpa-efficient-replicated"],
}
VALIDATION_SHAPE = "4,777,129"


def providers_for(cfg: AttnConfig, requested: list[str] | None) -> list[str]:
    """The head dim's providers (``AUTO_PROVIDERS``), or the requested ones among them, in the
    requested order; a provider outside every auto list (e.g. ``reference``) is kept as asked."""
    auto = AUTO_PROVIDERS["d512" if cfg.d > 256 else "small"]
    if not requested:
        return auto
    known = {p for ps in AUTO_PROVIDERS.values() for p in ps}
    return [p for p in requested if p in auto or p not in known]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None, help="named config list (default: issue3)")
    ap.add_argument("--configs", default=None,
                    help="';'-separated configs, 'N,P,R' (H=32, H_kv=8, d=128) or 'N=..,P=..,R=..,H=..,H_kv=..,d=..'")
    ap.add_argument("--providers", default="auto", help=f"comma-separated, or 'auto'; known: {', '.join(PROVIDER_ORDER)}")
    ap.add_argument("--modes", default="fwd,bwd,fwdbwd", help="comma-separated subset of fwd,bwd,fwdbwd")
    ap.add_argument("--validate", action="store_true", help="check providers against the reference first")
    ap.add_argument("--validate-only", action="store_true")
    ap.add_argument("--validation-shape", default=VALIDATION_SHAPE, help="N,P,R of the validation runs")
    ap.add_argument("--validate-providers", default="", help="validate only these (comma-separated; default all)")
    ap.add_argument("--validate-configs", default="",
                    help="';'-separated extra configs whose head dims are validated (not timed)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--stem", default=None, help="output file name (default attention_<card>_<date>)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--budget-ms", type=float, default=400.0, help="time budget of the repeats of one measurement")
    ap.add_argument("--max-reps", type=int, default=30)
    ap.add_argument("--max-est-s", type=float, default=10.0, help="skip a run planned to take longer per fwd+bwd call")
    ap.add_argument("--deadline-s", type=float, default=None, help="start no new run after this many seconds")
    add_timing_argument(ap, "device")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--order", choices=("config", "provider"), default="config",
                    help="run config by config, or provider by provider (--providers order) under a deadline")
    ap.add_argument("--no-plots", action="store_true")
    return ap.parse_args(argv)


def select_configs(args) -> list[AttnConfig]:
    configs = []
    if args.preset or not args.configs:
        configs += PRESETS[args.preset or "issue3"]
    if args.configs:
        configs += [AttnConfig.parse(s, **D128) for s in args.configs.split(";") if s.strip()]
    return configs


def _requested(args) -> list[str] | None:
    if args.providers == "auto":
        return None
    names = [p.strip() for p in args.providers.split(",") if p.strip()]
    unknown = [p for p in names if p not in PROVIDERS]
    if unknown:
        raise SystemExit(f"--providers: unknown {unknown}; expected some of {sorted(PROVIDERS)}")
    return names


def _progress(total: int):
    try:
        from tqdm import tqdm

        return tqdm(total=total, dynamic_ncols=True, file=sys.stdout, mininterval=5.0, ascii=True)
    except ImportError:
        return None


def _say(bar, text: str) -> None:
    (bar.write if bar is not None else print)(text)


def validate(configs, requested, device, writer, bar=None, shape: str = VALIDATION_SHAPE, only=None) -> dict[tuple, str]:
    """Validate every provider at a small shape of each (H, H_kv, d); returns {(provider, d, H, H_kv):
    the status to record instead of timing} for those that failed."""
    failed = {}
    seen = set()
    for cfg in configs:
        small = AttnConfig.parse(shape, H=cfg.H, H_kv=cfg.H_kv, d=cfg.d, dtype=cfg.dtype)
        for p in providers_for(cfg, requested):
            if (p, small) in seen or (only and p not in only):
                continue
            seen.add((p, small))
            rep = validate_provider(p, small, device)
            writer.add_validation(rep)
            _say(bar, f"validate {p:28s} {small.name}: {rep['status']}")
            if rep["ok"] is False:
                status = rep["status"]
                failed[(p, cfg.d, cfg.H, cfg.H_kv)] = (
                    f"{status} (at validation)" if status == "OOM" or status.startswith("error")
                    else f"skipped: failed validation ({status})")
    return failed


def main(argv=None) -> Path:
    args = parse_args(argv)
    device = torch.device(args.device)
    configs = select_configs(args)
    requested = _requested(args)
    modes = tuple(m for m in args.modes.split(",") if m)
    if not set(modes) <= set(MODES):
        raise SystemExit(f"--modes: expected a subset of {MODES}, got {modes}")
    meta = environment(device, MODULE, sys.argv[1:] if argv is None else list(argv))
    card = meta["card"]["name"].replace("NVIDIA ", "").replace(" ", "-").lower()
    stem = args.stem or f"attention_{card.split('(')[0].strip('-')}_{datetime.now(timezone.utc):%Y%m%d-%H%M}"
    writer = ResultWriter(args.out, stem, meta)
    start = time.monotonic()
    cases = [(cfg, p) for cfg in configs for p in providers_for(cfg, requested)]
    if args.order == "provider":  # every config of the first provider, then the next provider, ...
        rank = {p: i for i, p in enumerate(requested or PROVIDER_ORDER)}
        cases.sort(key=lambda c: rank.get(c[1], len(rank)))
    bar = _progress(len(cases))
    extra = [AttnConfig.parse(s, **D128) for s in args.validate_configs.split(";") if s.strip()]
    only = {p.strip() for p in args.validate_providers.split(",") if p.strip()}
    failed = validate(configs + extra, requested, device, writer, bar, args.validation_shape, only) if (args.validate or args.validate_only) else {}
    timer = Timer(device, budget_ms=args.budget_ms, max_reps=args.max_reps, hide_host=args.timing == "device")
    # the SM clock and power while each mode is timed (a long run at the power cap clocks lower); a mode
    # times for tens of ms, so sample every 50 ms
    gpu = None if device.type != "cuda" else device.index if device.index is not None else torch.cuda.current_device()
    with GpuMonitor(gpu, interval_ms=50) as monitor:
        for cfg, p in ([] if args.validate_only else cases):
            if (p, cfg.d, cfg.H, cfg.H_kv) in failed:
                row = dict(base_row(cfg, p), status=failed[(p, cfg.d, cfg.H, cfg.H_kv)])
            elif args.deadline_s is not None and time.monotonic() - start > args.deadline_s:
                row = dict(base_row(cfg, p), status="not run: --deadline-s reached")
            else:
                if bar is not None:
                    bar.set_description(f"{cfg.label} d={cfg.d} {p}")
                row = run_case(cfg, p, device, timer, modes=modes, max_est_s=args.max_est_s, seed=args.seed,
                               monitor=monitor)
            writer.add(row)
            _say(bar, _summary(row))
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    for path in writer.finish(plots=not args.no_plots):
        print(path)
    return writer.json_path


def _summary(row: dict) -> str:
    if row["status"] != "ok":
        return f"{row['label']:>14s} d={row['d']:<3d} {row['provider']:26s} {row['status']}"
    parts = [f"{m} {row[m + '_ms']:8.2f} ms {row[m + '_tflops']:5.0f} TF" for m in MODES if m + "_ms" in row]
    mem = f" peak+{row['peak_extra_gib']:.2f} GiB" if "peak_extra_gib" in row else ""
    clock = f" @{row['fwdbwd_clock_mhz']:.0f} MHz" if row.get("fwdbwd_clock_mhz") is not None else ""
    return f"{row['label']:>14s} d={row['d']:<3d} {row['provider']:26s} " + " | ".join(parts) + mem + clock


if __name__ == "__main__":
    main()
