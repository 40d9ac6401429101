"""Same-process A/B of a kernel-choice environment variable: backward (or forward) time per value.

The CUDA binding reads its variables (``DUALKV_CUDA_BWD_CHUNK_ROWS``, ``DUALKV_CUDA_WGMMA_BWD``, ...)
on every call, as do the Triton backend's (``DUALKV_TRITON_BWD_HEAD_MAJOR``, ``DUALKV_TRITON_ATOMIC_DQ``,
with ``--backend triton``), so one process can time several values on the same inputs. Per layout the values
take turns for ``--rounds`` rounds (the order reversed every other round, so that clock or thermal
drift does not favour one value); each sample is the mean of ``--calls`` calls. Printed per value:
the median ms, the minimum, the median relative to the first value and, in brackets, the range of
the per-round ratios (each round's sample over the first value's of the same round): where that range
straddles 1, the rounds do not agree on which value is faster. The value ``unset`` removes the
variable (the package's own default). ``--out DIR`` also writes ``<stem>.json`` (card, date, versions,
command, every sample) and a bar plot of the ratios, ``<stem>.png``.

    python -m benchmarks.env_ab --var DUALKV_CUDA_BWD_CHUNK_ROWS --values 0,4096,8192,16384 \\
        --layouts 'dec:5K,32;dec:8K,16;dec:16K,8;8,16K,512;28,4K,2K;16,32K,2K'

A layout is ``N,P,R`` (N responses of R tokens after a prompt of P) or ``dec:P,mb`` (the decoder-layer
benchmark's point: mb responses of R_i ~ U(131, 2048) tokens, seeded). bf16, H=32, H_kv=8, d=128
unless ``--heads`` / ``--head-dim`` say otherwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from benchmarks.harness import parse_size, restored_env, set_env
from dualkv.core import PackedLayout, dualkv_attention
from dualkv.core.backends import BACKEND_CHOICES


def parse_layout(text: str, seed: int) -> tuple[str, int, list[int]]:
    """(name, P, response lengths) of ``N,P,R`` or ``dec:P,mb``."""
    text = text.strip()
    if text.startswith("dec:"):
        from benchmarks.bench_decoder_layer import make_point

        point = make_point(text[4:], seed)
        return text, point.P, point.rs
    parts = text.split(",")
    if len(parts) != 3:
        raise ValueError(f"layout: expected 'N,P,R' or 'dec:P,mb', got {text!r}")
    n, p, r = (parse_size(x) for x in parts)
    return f"({text})", p, [r] * n


UNSET = "unset"  # a value that removes the variable


def set_value(var: str, value: str) -> None:
    """``var`` = ``value``, or removed for ``UNSET``."""
    set_env(var, None if value == UNSET else value)


def time_calls(fn, calls: int) -> float:
    """ms per call of ``fn``, the mean over ``calls`` calls between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def time_values(fn, var: str, values: list[str], rounds: int, calls: int) -> dict[str, list[float]]:
    """ms per call of ``fn`` under each value of ``var`` (``UNSET``: removed), ``rounds`` samples each,
    taking turns."""
    times: dict[str, list[float]] = {v: [] for v in values}
    with restored_env(var):
        for v in values:  # one warm-up call each
            set_value(var, v)
            fn()
        for rnd in range(rounds):
            for v in values if rnd % 2 == 0 else values[::-1]:
                set_value(var, v)
                times[v].append(time_calls(fn, calls))
    return times


def round_ratios(times: dict[str, list[float]], values: list[str]) -> dict[str, list[float]]:
    """Each value's sample of a round over the first value's sample of the same round. The two ran back
    to back, so clock and power drift between rounds cancel in the ratio, and the spread of these ratios
    says how firmly the values differ, which the medians alone do not."""
    base = times[values[0]]
    return {v: [t / b for t, b in zip(times[v], base)] for v in values}


def ratio_row(name: str, times: dict[str, list[float]], values: list[str]) -> dict:
    """A layout's row: each value's samples, median ms, median over the first value's, and the range of
    its per-round ratios (``round_ratios``)."""
    base = statistics.median(times[values[0]])
    per_round = round_ratios(times, values)
    row = {"layout": name}
    for v in values:
        row[v] = statistics.median(times[v])
        row[f"{v}_ratio"] = row[v] / base
        row[f"{v}_samples"] = times[v]
        row[f"{v}_round_ratio_range"] = [min(per_round[v]), max(per_round[v])]
    return row


def format_row(row: dict, values: list[str]) -> str:
    """The printed line of a layout: per value its median ms, minimum, median ratio and (after the
    first value) the range of its per-round ratios."""
    cells = []
    for i, v in enumerate(values):
        lo, hi = row[f"{v}_round_ratio_range"]
        spread = f" [{lo:5.3f}-{hi:5.3f}]" if i else ""
        cells.append(f"{v}: {row[v]:8.2f} (min {min(row[f'{v}_samples']):8.2f}) {row[f'{v}_ratio']:5.3f}{spread}")
    return f"{row['layout']:18s} | " + " | ".join(cells)


def make_case(spec: str, heads: tuple[int, int], d: int, seed: int, backend: str, forward: bool):
    """(name, fn, tensors) of one layout: ``fn`` runs the forward (``forward``) or the backward of bf16
    inputs of that layout; drop ``tensors`` to free them."""
    H, Hkv = heads
    name, P, rs = parse_layout(spec, seed)
    layout = PackedLayout.from_lengths([P], [rs], device="cuda")
    T = layout.total_tokens
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, dout = (torch.randn(T, h, d, device="cuda", dtype=torch.bfloat16, generator=gen) for h in (H, Hkv, Hkv, H))
    for t in (q, k, v):
        t.requires_grad_()
    if forward:
        def fn():
            with torch.no_grad():
                dualkv_attention(q, k, v, layout, backend=backend)
    else:
        out = dualkv_attention(q, k, v, layout, backend=backend)

        def fn():
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    return name, fn, [q, k, v, dout]


def parse_heads(text: str) -> tuple[int, int]:
    try:
        H, Hkv = (int(x) for x in text.split(","))
    except ValueError:
        raise SystemExit(f"--heads: expected 'H,H_kv' (two whole numbers), got {text!r}") from None
    return H, Hkv


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--var", required=True, help="the environment variable, e.g. DUALKV_CUDA_BWD_CHUNK_ROWS")
    ap.add_argument("--values", required=True, help="','-separated values; the first is the baseline; 'unset' removes the variable")
    ap.add_argument("--layouts", required=True, help="';'-separated 'N,P,R' or 'dec:P,mb'")
    ap.add_argument("--backend", default="cuda", choices=BACKEND_CHOICES)
    ap.add_argument("--forward", action="store_true", help="time the forward instead of the backward")
    ap.add_argument("--heads", default="32,8", help="H,H_kv")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="folder for <stem>.json and <stem>.png")
    ap.add_argument("--stem", default="env_ab")
    args = ap.parse_args(argv)
    values = [v.strip() for v in args.values.split(",") if v.strip()]
    H, Hkv = parse_heads(args.heads)
    if not values:
        raise SystemExit("--values: expected at least one value")
    if args.var == "DUALKV_CUDA_LIBRARY" and len(values) > 1:
        raise SystemExit("--var DUALKV_CUDA_LIBRARY: a process loads one library; time several builds with "
                         "python -m benchmarks.build_ab")
    if not torch.cuda.is_available():
        raise SystemExit("env_ab: needs a CUDA device")
    d = args.head_dim
    print(f"{args.var}: {', '.join(values)} ({'forward' if args.forward else 'backward'}, {args.backend}, "
          f"H={H}, H_kv={Hkv}, d={d}; median ms (min), median / the first value's and [the range of the "
          f"rounds' own ratios])", flush=True)
    rows = []
    for spec in args.layouts.split(";"):
        if not spec.strip():
            continue
        name, fn, tensors = make_case(spec, (H, Hkv), d, args.seed, args.backend, args.forward)
        times = time_values(fn, args.var, values, args.rounds, args.calls)
        rows.append(ratio_row(name, times, values))
        print(format_row(rows[-1], values), flush=True)
        del fn, tensors
        torch.cuda.empty_cache()
    if args.out and rows:
        from benchmarks.report import _card_name, environment, plot_ratios

        meta = environment(torch.device("cuda"), "benchmarks.env_ab", sys.argv[1:] if argv is None else argv)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        mode = "forward" if args.forward else "backward"
        (out / f"{args.stem}.json").write_text(json.dumps(dict(meta=meta, var=args.var, mode=mode, rows=rows), indent=1))
        plot_ratios(rows, values, out / f"{args.stem}.png",
                    f"{_card_name(meta)}: {mode}, {args.var}, time relative to {values[0]}")
        print(f"wrote {out / args.stem}.json and .png")


if __name__ == "__main__":
    main()
