"""Scores a tiled forward computes per useful one: the masked share of the CUDA forward's tile walk.

Each query tile of ``--block-m`` rows of a segment walks the key tiles of ``make_walk``
(``csrc/dkv_fwd.cuh``; no window): its context keys (the shared prompt; none for the prompt's own
rows) in tiles of ``--block-n``, the last one partial, then its own keys up to its last row, in
tiles of ``--block-n`` again. Every tile it visits costs block_m x block_n scores, masked or not; the
useful ones are the pairs the layout attends (``harness.attended_pairs``), the count behind every
useful TFLOP/s figure. A walk that lets the prompt's last partial tile run on into the response's
first keys (one key range in logical positions, so one partial tile where the walk has two) is
counted as ``merged``: the 176-key CUDA forward walks that way with ``DUALKV_CUDA_FWD_MERGE=1``
(opt-in, docs/cuda.md), starting up to 15 keys early (masked) so that the prompt ends on a 16-row
boundary of its tile, as counted here.

    python -m benchmarks.tile_waste                                  # the d = 128 benchmark configs
    python -m benchmarks.tile_waste --configs '28,4048,2048;28,4096,2048' --block-n 176

A count from the layout alone, not a measurement: no GPU, nothing written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "benchmarks"

from benchmarks.harness import AttnConfig, attended_pairs

DEFAULT_CONFIGS = "28,4096,2048;28,16384,2048;16,32768,2048;16,65536,2048;32,8192,2048;8,16384,512;16,131072,2048"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


MERGE_ALIGN = 16  # rows: the merged walk's context ends a multiple of this into its tile


def walk_tiles(ctx_len: int, own_hi: int, block_n: int, merged: bool = False) -> int:
    """Key tiles a query tile visits: ctx_len context keys, then own keys 0 .. own_hi - 1 (merged: one
    range, from up to MERGE_ALIGN - 1 masked keys before the context's first)."""
    if merged and ctx_len > 0:
        lead = -ctx_len % MERGE_ALIGN
        return _cdiv(lead + ctx_len + own_hi, block_n)
    return _cdiv(ctx_len, block_n) + _cdiv(own_hi, block_n)


def computed_scores(prompt_lens, response_lens, block_m: int, block_n: int, merged: bool = False) -> int:
    """Scores the forward computes over the packed layout: per segment (a prompt, which sees its own
    keys only, and each response, which sees its prompt and its own keys) and per query tile of it."""
    if block_m < 1 or block_n < 1:
        raise ValueError(f"block_m, block_n: expected positive tile sizes, got {block_m}, {block_n}")
    total = 0
    for p, rs in zip(prompt_lens, response_lens):
        for ctx_len, rows in ((0, p), *((p, r) for r in rs)):
            for q0 in range(0, rows, block_m):
                own_hi = min(rows, q0 + block_m)
                total += walk_tiles(ctx_len, own_hi, block_n, merged) * block_m * block_n
    return total


def waste_rows(configs: list[AttnConfig], block_m: int, block_ns: list[int]) -> list[dict]:
    rows = []
    for cfg in configs:
        useful = attended_pairs(cfg.prompt_lens, cfg.response_lens)
        row = dict(config=cfg.label, useful_pairs=useful)
        for n in block_ns:
            for merged in (False, True):
                key = f"n{n}{'_merged' if merged else ''}"
                row[key] = computed_scores(cfg.prompt_lens, cfg.response_lens, block_m, n, merged) / useful
        rows.append(row)
    return rows


def table(rows: list[dict], block_ns: list[int]) -> str:
    head = ["N, P, R", "useful pairs"] + [f"{n}-key tiles{' merged' if m else ''}" for n in block_ns for m in (False, True)]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        cells = [r["config"], f"{r['useful_pairs']:,}"] + [f"{r[f'n{n}' + ('_merged' if m else '')]:.4f}"
                                                          for n in block_ns for m in (False, True)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="';'-separated 'N,P,R' (as bench_attention)")
    ap.add_argument("--block-m", type=int, default=128, help="query rows a block computes (the d = 128 forward's 128)")
    ap.add_argument("--block-n", default="128,176", help="comma-separated key tile widths")
    args = ap.parse_args(argv)
    try:
        args.configs = [AttnConfig.parse(c) for c in args.configs.split(";") if c.strip()]
    except ValueError as e:
        ap.error(f"--configs: {e}")
    try:
        args.block_n = [int(n) for n in args.block_n.split(",") if n.strip()]
    except ValueError:
        ap.error(f"--block-n: expected comma-separated whole numbers, got {args.block_n!r}")
    if args.block_m < 1 or not args.block_n or min(args.block_n) < 1:
        ap.error(f"--block-m / --block-n: expected positive tile sizes, got {args.block_m} / {args.block_n}")
    return args


def main(argv=None) -> str:
    args = parse_args(argv)
    out = ("Scores computed per useful (query, key) pair, forward, query tiles of "
           f"{args.block_m} rows:\n\n" + table(waste_rows(args.configs, args.block_m, args.block_n), args.block_n))
    print(out)
    return out


if __name__ == "__main__":
    main()
