"""A/B of several builds of the CUDA extension: processes that take turns, each loading one build.

A kernel change that cannot sit behind an environment variable (one that moves registers or the order
of instructions in a hot loop, where a template flag would itself change the code) is timed as two
builds. Keep each build's library file, then let this script start one process per build in turn
(``DUALKV_CUDA_LIBRARY`` names the file; the order reversed every other round, so that clock or thermal
drift does not favour one build). Each process times every layout ``--rounds`` times (each sample the
mean of ``--calls`` calls, after one warm-up call); a build's time for a layout is the median over its
processes of each process's median. Printed per layout: each build's median ms and its ratio to the
first build's. ``--out`` writes ``<stem>.json`` (card, date, versions, command, every sample) and a plot
of the ratios, ``<stem>.png``.

    TORCH_CUDA_ARCH_LIST=9.0a pip install --no-build-isolation --no-deps -e .   # tree A
    cp dualkv_core/_C*.so /tmp/a.so
    # ... change csrc/, build again ...
    cp dualkv_core/_C*.so /tmp/b.so
    python -m benchmarks.build_ab --libs base=/tmp/a.so,new=/tmp/b.so --forward \\
        --layouts '28,4K,2K;16,32K,2K;dec:8K,16' --out benchmarks/results/raw --stem my_change_h200

Layouts as in ``benchmarks.env_ab``: ``N,P,R`` or ``dec:P,mb``; bf16, H=32, H_kv=8, d=128 unless
``--heads`` / ``--head-dim`` say otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

LIBRARY_VAR = "DUALKV_CUDA_LIBRARY"  # dualkv.core.backends.cuda.LIBRARY_VAR (not imported: no torch here)


def parse_libs(text: str) -> dict[str, str]:
    """``name=path,name=path`` -> {name: path}, in order; every file must exist, names unique."""
    libs: dict[str, str] = {}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        name, sep, path = item.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise SystemExit(f"--libs: expected 'name=path' items separated by ',', got {item!r}")
        if name in libs:
            raise SystemExit(f"--libs: the name {name!r} is given twice")
        if not Path(path).is_file():
            raise SystemExit(f"--libs: {name}={path}: no such file (expected a built _C library)")
        libs[name] = str(Path(path).resolve())
    if len(libs) < 2:
        raise SystemExit(f"--libs: expected at least two builds to compare, got {len(libs)}")
    return libs


def process_order(names: list[str], processes: int) -> list[str]:
    """The builds in the order their processes run: ``processes`` rounds, reversed every other one."""
    return [n for rnd in range(processes) for n in (names if rnd % 2 == 0 else names[::-1])]


def summarise(samples: dict[str, dict[str, list[list[float]]]], names: list[str]) -> list[dict]:
    """One row per layout: each build's median over its processes of the process medians, and the
    ratio to the first build's. ``samples[build][layout]`` holds one list of ms per process."""
    rows = []
    for layout in samples[names[0]]:
        row = {"layout": layout}
        for name in names:
            per_process = [statistics.median(s) for s in samples[name][layout]]
            row[name] = statistics.median(per_process)
            row[f"{name}_processes"] = per_process
        for name in names:
            row[f"{name}_ratio"] = row[name] / row[names[0]]
        rows.append(row)
    return rows


def table(rows: list[dict], names: list[str]) -> str:
    lines = [f"{'layout':18s} | " + " | ".join(f"{n}: ms (/ {names[0]})" for n in names)]
    for row in rows:
        lines.append(f"{row['layout']:18s} | " + " | ".join(f"{row[n]:9.3f} ({row[f'{n}_ratio']:.3f})" for n in names))
    return "\n".join(lines)


def worker(args) -> None:
    """One process: time every layout with the library DUALKV_CUDA_LIBRARY names; JSON to --worker-json."""
    import torch

    from benchmarks.env_ab import make_case, parse_heads, time_calls
    from dualkv.core.backends import cuda

    how = cuda.load_extension()
    if LIBRARY_VAR not in how:  # never time the installed build by mistake
        raise SystemExit(f"build_ab worker: the extension came from {how!r}, not from {LIBRARY_VAR}")
    heads, out = parse_heads(args.heads), {}
    for spec in (s for s in args.layouts.split(";") if s.strip()):
        name, fn, tensors = make_case(spec, heads, args.head_dim, args.seed, args.backend, args.forward)
        fn()  # warm-up
        out[name] = [time_calls(fn, args.calls) for _ in range(args.rounds)]
        del fn, tensors
        torch.cuda.empty_cache()
    Path(args.worker_json).write_text(json.dumps(out))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--libs", required=True, help="','-separated name=path of built _C libraries; the first is the baseline")
    ap.add_argument("--layouts", required=True, help="';'-separated 'N,P,R' or 'dec:P,mb'")
    ap.add_argument("--backend", default="cuda", help="cuda, or a pair with a cuda half (e.g. cuda+triton)")
    ap.add_argument("--forward", action="store_true", help="time the forward instead of the backward")
    ap.add_argument("--heads", default="32,8", help="H,H_kv")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--processes", type=int, default=4, help="processes per build")
    ap.add_argument("--rounds", type=int, default=3, help="samples per layout in a process")
    ap.add_argument("--calls", type=int, default=2, help="calls per sample")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="folder for <stem>.json and <stem>.png")
    ap.add_argument("--stem", default="build_ab")
    ap.add_argument("--worker-json", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker_json:
        return worker(args)
    libs = parse_libs(args.libs)
    if "cuda" not in args.backend.split("+"):
        raise SystemExit(f"--backend: the builds are of the CUDA extension, so 'cuda' or a pair with it; got {args.backend!r}")
    for flag in ("processes", "rounds", "calls"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag}: expected a whole number >= 1, got {getattr(args, flag)}")
    if not [s for s in args.layouts.split(";") if s.strip()]:
        raise SystemExit("--layouts: expected at least one layout")
    from benchmarks.env_ab import parse_heads

    parse_heads(args.heads)  # a bad --heads is named here, not in every process

    import torch
    from tqdm import tqdm

    from benchmarks.report import _card_name, environment, plot_ratios

    if not torch.cuda.is_available():
        raise SystemExit("build_ab: needs a CUDA device")
    meta = environment(torch.device("cuda"), "benchmarks.build_ab", sys.argv[1:] if argv is None else argv)
    meta["libs"] = libs
    names = list(libs)
    samples: dict[str, dict[str, list[list[float]]]] = {n: {} for n in names}
    passthrough = ["--layouts", args.layouts, "--backend", args.backend, "--heads", args.heads, "--head-dim",
                   str(args.head_dim), "--rounds", str(args.rounds), "--calls", str(args.calls), "--seed", str(args.seed)]
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(tqdm(process_order(names, args.processes), desc="processes", unit="proc")):
            result = Path(tmp) / f"{i}.json"
            cmd = [sys.executable, "-m", "benchmarks.build_ab", "--libs", args.libs, *passthrough,
                   *(["--forward"] if args.forward else []), "--worker-json", str(result)]
            proc = subprocess.run(cmd, env={**os.environ, LIBRARY_VAR: libs[name]}, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"build_ab: the process of build {name} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
            for layout, times in json.loads(result.read_text()).items():
                samples[name].setdefault(layout, []).append(times)
    rows = summarise(samples, names)
    mode = "forward" if args.forward else "backward"
    print(f"{_card_name(meta)}: {mode}, {args.backend}, {args.processes} processes per build; median ms and the ratio to {names[0]}'s")
    print(table(rows, names))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{args.stem}.json").write_text(json.dumps(dict(meta=meta, mode=mode, rows=rows, samples=samples), indent=1))
        plot_ratios(rows, names, out / f"{args.stem}.png", f"{_card_name(meta)}: {mode}, time relative to {names[0]}")
        print(f"wrote {out / args.stem}.json and .png")


if __name__ == "__main__":
    main()
