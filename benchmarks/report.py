"""Results of a benchmark: the environment record, JSON/CSV writers, markdown tables and plots.

A results file holds ``{"meta": {...card, date, versions, command...}, "validation": [...], "rows": [...]}``;
the CSV beside it repeats card, date and command on every row. Files are rewritten after every row,
so an interrupted run keeps what it measured.

Merge several results files into one table and plot::

    python -m benchmarks.report benchmarks/results/a.json benchmarks/results/b.json --stem attention_h200
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

__all__ = ["environment", "ResultWriter", "load_results", "markdown_table", "detail_table", "plot_results", "PROVIDER_ORDER"]

PROVIDER_ORDER = [
    "dualkv-auto", "dualkv-triton", "dualkv-triton-no-ws", "dualkv-triton-tl-fwd", "dualkv-triton-tl-bwd", "dualkv-triton-gluon-dkdv", "dualkv-triton-fused-dq", "dualkv-pair", "dualkv-pair-cuda-triton", "dualkv-cuda", "dualkv-cuda-mma", "dualkv-cuda-mma-bwd", "dualkv-cuda-ws", "dualkv-cuda-tma-fwd", "dualkv-cuda-tma-bwd", "dualkv-cuda-cp-async-bwd", "dualkv-cuda-in-turn-fwd",
    "dualkv-cuda-wgmma-bwd",
    "dualkv-cuda-wgmma-bwd-overlap", "dualkv-cuda-fused-dq", "dualkv-pair-fused-dq",
    "dualkv-cuda-ws-bwd", "dualkv-cuda-ws-both-bwd", "dualkv-pair-ws-bwd", "dualkv-pair-ws-both-bwd", "dualkv-pair-in-turn-bwd",
    "dualkv-cuda-ws-fused-dq", "dualkv-pair-ws-fused-dq", "dualkv-cuda-ws-split-bwd", "dualkv-pair-ws-split-bwd",
    "cudnn-cascade", "flex-packed", "fa2-cascade", "cudnn-replicated",
    "fa2-replicated", "sdpa-efficient-replicated", "reference",
]
CSV_COLUMNS = [
    "config", "label", "N", "P", "R", "H", "H_kv", "d", "dtype", "T", "T_rep", "rho", "pairs", "computed_pairs",
    "provider", "status", "fwd_ms", "bwd_ms", "fwdbwd_ms", "fwd_tflops", "bwd_tflops", "fwdbwd_tflops",
    "fwd_reps", "bwd_reps", "fwdbwd_reps", "peak_extra_gib", "input_gib", "bytes_fwd", "bytes_bwd", "warmup_s",
]


def _git_commit() -> str | None:
    if os.environ.get("DUALKV_GIT_COMMIT"):
        return os.environ["DUALKV_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parents[1])
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


ENV_PREFIX = "DUALKV_"  # the package's own switches: a run is reproduced only with the same settings


def run_settings() -> dict[str, str]:
    """The ``DUALKV_*`` environment variables set for this run (kernel choices, schedules), sorted."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIX)}


def shown_command(meta: dict) -> str:
    """The command as a shell line, the run's ``DUALKV_*`` settings (``meta["env"]``) in front."""
    env = meta.get("env") or {}
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), str(meta.get("command"))])


def environment(device: torch.device, module: str, argv: list[str] | None = None) -> dict:
    """Card, date, library versions, the exact command (``python -m <module> <args>``) and the
    ``DUALKV_*`` environment variables it ran under (``env``)."""
    argv = sys.argv[1:] if argv is None else argv
    versions = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        versions["triton"] = None
    from importlib.metadata import PackageNotFoundError, version

    for package in ("dualkv", "liger-kernel"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = None
    if device.type == "cuda":
        versions["cudnn"] = torch.backends.cudnn.version()
        props = torch.cuda.get_device_properties(device)
        card = dict(name=props.name, memory_gib=round(props.total_memory / 2**30, 1), sms=props.multi_processor_count,
                    capability=f"{props.major}.{props.minor}")
    else:
        card = dict(name=f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)")
    return dict(
        card=card, date=datetime.now(timezone.utc).isoformat(timespec="seconds"), versions=versions,
        git_commit=_git_commit(), command=shlex.join(["python", "-m", module, *argv]), env=run_settings(),
        host=platform.node(),
    )


class ResultWriter:
    """Writes ``<stem>.json`` and ``<stem>.csv`` after every row; ``finish`` adds the table and plots."""

    def __init__(self, out_dir: str | Path, stem: str, meta: dict, columns: list[str] | None = None):
        self.columns = CSV_COLUMNS if columns is None else columns
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.stem, self.meta = stem, meta
        self.rows: list[dict] = []
        self.validation: list[dict] = []

    @property
    def json_path(self) -> Path:
        return self.dir / f"{self.stem}.json"

    def add(self, row: dict) -> None:
        self.rows.append(row)
        self.flush()

    def add_validation(self, report: dict) -> None:
        self.validation.append(report)
        self.flush()

    def flush(self) -> None:
        payload = dict(meta=self.meta, validation=self.validation, rows=self.rows)
        tmp = self.json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(payload, indent=1, default=str))
        tmp.replace(self.json_path)
        write_csv(self.dir / f"{self.stem}.csv", self.rows, self.meta, self.columns)

    def finish(self, plots: bool = True) -> list[Path]:
        self.flush()
        results = dict(meta=self.meta, validation=self.validation, rows=self.rows)
        paths = [self.json_path, self.dir / f"{self.stem}.csv", write_markdown(self.dir / f"{self.stem}.md", [results])]
        if plots and self.rows:
            paths += plot_results(self.rows, self.dir / self.stem, title=_card_name(self.meta))
        return paths


def write_csv(path: Path, rows: list[dict], meta: dict, columns: list[str] = CSV_COLUMNS) -> None:
    extra = sorted({k for r in rows for k in r} - set(columns))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns) + extra + ["card", "date", "command"])
        writer.writeheader()
        for r in rows:
            writer.writerow({**r, "card": _card_name(meta), "date": meta.get("date"), "command": meta.get("command")})


def _card_name(meta: dict) -> str:
    card = meta.get("card", {})
    return card.get("name", "?") if isinstance(card, dict) else str(card)


def load_results(paths) -> list[dict]:
    return [json.loads(Path(p).read_text()) for p in paths]


def merged_rows(results: list[dict], key_fields: tuple[str, ...] = ("config", "provider")) -> list[dict]:
    """Rows of several results, a later file replacing an earlier one's row with the same ``key_fields``
    unless the later row was not measured (skipped/not run) and the earlier one was. Each row keeps
    its own file's date and command (``_date``, ``_command``)."""
    table: dict[tuple, dict] = {}
    for res in results:
        for r in res["rows"]:
            key = tuple(r[f] for f in key_fields)
            old = table.get(key)
            if old is None or _rank(r) >= _rank(old):
                table[key] = {**r, "_date": res["meta"].get("date"), "_command": res["meta"].get("command")}
    return list(table.values())


def merge_runs(paths, key_fields: tuple[str, ...], settings: tuple[str, ...],
               defaults: dict | None = None) -> tuple[dict, list[dict]]:
    """(meta, rows) of several result files of one setting, for a single report: the files must agree
    on ``settings`` (meta keys; a setting missing from a file written before it existed counts as its
    value in ``defaults``, else as off); rows as ``merged_rows``; ``meta["command"]`` lists every
    file's command."""
    results = load_results(paths)
    meta = dict(results[0]["meta"])
    defaults = defaults or {}

    def setting(m: dict, key: str):
        value = m.get(key)
        return defaults.get(key, False) if value is None else value

    for path, res in zip(paths[1:], results[1:]):
        differ = [k for k in settings if setting(res["meta"], k) != setting(meta, k)]
        if differ:
            raise ValueError(f"merge: {path} differs from {paths[0]} in {differ}; merge runs of one setting only")
    meta["command"] = " ; ".join(dict.fromkeys(res["meta"]["command"] for res in results))
    meta["merged_from"] = [Path(p).name for p in paths]
    return meta, merged_rows(results, key_fields)


def _rank(row: dict) -> int:
    s = row["status"]
    return 2 if s in ("ok", "OOM") else 1 if s.startswith(("error", "unsupported")) else 0


def _cell(row: dict | None, mode: str = "fwdbwd") -> str:
    if row is None:
        return "—"
    s = row["status"]
    if s == "ok":  # a run of other modes (--modes) did not measure this one
        return f"{row[f'{mode}_ms']:.1f} ({row[f'{mode}_tflops']:.0f})" if row.get(f"{mode}_ms") is not None else "—"
    if s == "OOM":
        return "OOM"
    return s.split(":")[0]


def _groups(rows: list[dict]) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["d"], r["H"], r["H_kv"], r["dtype"]), []).append(r)
    return groups


def _providers(rows: list[dict]) -> list[str]:
    present = {r["provider"] for r in rows}
    return [p for p in PROVIDER_ORDER if p in present] + sorted(present - set(PROVIDER_ORDER))


def markdown_table(rows: list[dict], mode: str = "fwdbwd") -> str:
    """Configs x providers, cells ``ms (useful TFLOP/s)``, one table per (d, H, H_kv, dtype)."""
    out = []
    for (d, H, Hkv, dtype), grp in _groups(rows).items():
        provs = _providers(grp)
        configs = list(dict.fromkeys(r["config"] for r in grp))
        by = {(r["config"], r["provider"]): r for r in grp}
        out.append(f"{dtype}, H={H}, H_kv={Hkv}, d={d}; {_MODE_NAMES[mode]}, ms (useful TFLOP/s):\n")
        out.append("| N, P, R | rho | " + " | ".join(provs) + " |")
        out.append("| --- | --- | " + " | ".join("---" for _ in provs) + " |")
        for c in configs:
            first = next(r for r in grp if r["config"] == c)
            cells = [_cell(by.get((c, p)), mode) for p in provs]
            out.append(f"| {first['label']} | {first['rho']:.2f} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


_MODE_NAMES = {"fwd": "forward", "bwd": "backward", "fwdbwd": "forward+backward"}


def detail_table(rows: list[dict]) -> str:
    head = ("| config | provider | status | fwd ms | bwd ms | fwd+bwd ms | TFLOP/s fwd | bwd | fwd+bwd "
            "| peak extra GiB | inputs GiB | reps (fwd/bwd/both) | run |")
    out = [head, "|" + " --- |" * 13]

    def num(r, k, fmt):
        v = r.get(k)
        return format(v, fmt) if isinstance(v, (int, float)) else ""

    for r in rows:
        reps = "/".join(str(r.get(f"{m}_reps", "")) for m in ("fwd", "bwd", "fwdbwd"))
        status = r["status"].replace("|", "/")
        out.append(
            f"| {r['label']} d={r['d']} H={r['H']}/{r['H_kv']} | {r['provider']} | {status} | {num(r, 'fwd_ms', '.2f')} "
            f"| {num(r, 'bwd_ms', '.2f')} | {num(r, 'fwdbwd_ms', '.2f')} | {num(r, 'fwd_tflops', '.0f')} "
            f"| {num(r, 'bwd_tflops', '.0f')} | {num(r, 'fwdbwd_tflops', '.0f')} | {num(r, 'peak_extra_gib', '.2f')} "
            f"| {num(r, 'input_gib', '.2f')} | {reps} | {r.get('_date', '')} |"
        )
    return "\n".join(out)


def measured_modes(rows: list[dict]) -> list[str]:
    """The modes ("fwdbwd", "fwd", "bwd", in that order) some row has a time for (a ``--modes`` run)."""
    return [m for m in ("fwdbwd", "fwd", "bwd") if any(r.get(f"{m}_ms") is not None for r in rows)]


def spread_lines(rows: list[dict], wide: float = 1.10) -> list[str]:
    """The markdown's note on how far each row's forward+backward repeats spread (``fwdbwd_min_ms`` /
    ``fwdbwd_max_ms``), naming the rows whose slowest repeat took more than ``wide`` times their fastest:
    a kernel that runs in two modes (on an H100 the Triton backward's dQ adds once did) makes the median
    of a few repeats read either."""
    spans = [(r, r["fwdbwd_max_ms"] / r["fwdbwd_min_ms"]) for r in rows
             if r.get("status") == "ok" and r.get("fwdbwd_min_ms")]
    if not spans:
        return []
    worst = max(ratio for _, ratio in spans)
    line = (f"Forward+backward repeats: the slowest of a row took up to {worst:.2f}x its fastest "
            "(`<mode>_min_ms` / `<mode>_max_ms` in the CSV / JSON).")
    flagged = [f"{r['config']} {r['provider']} {r['fwdbwd_min_ms']:.2f}-{r['fwdbwd_max_ms']:.2f} ms"
               for r, ratio in spans if ratio > wide]
    if flagged:
        line += f" Wider than {wide:.2f}x, where the median may sit in either of two modes: {'; '.join(flagged)}."
    return [line, ""]


def timing_lines(rows: list[dict]) -> list[str]:
    """One line saying how the times were taken (``Timer.hide_host``) and how long the host took to
    enqueue a call; nothing for rows from before the harness recorded it."""
    modes = ("fwd", "bwd", "fwdbwd")
    hosts = [r[f"{m}_host_ms"] for r in rows for m in modes if r.get(f"{m}_host_ms") is not None]
    if not hosts:
        return []
    exposed = [r[f"{m}_host_exposed"] for r in rows for m in modes if r.get(f"{m}_host_exposed") is not None]
    span = f"{min(hosts):.2f}-{max(hosts):.2f} ms"
    if exposed:
        line = (f"Timing `device`: the GPU waited in a spin kernel after each L2 flush until the host had enqueued "
                f"the call ({span} a call, each mode's median), so the times are the device's; "
                f"{sum(exposed)} timed calls enqueued for longer than the wait.")
    else:
        line = (f"Timing `host-visible`: the start event follows the L2 flush directly, so the host's enqueue "
                f"time after the flush ({span} a call, each mode's median) is partly inside the times.")
    return [line, ""]


def write_markdown(path: Path, results: list[dict], rows: list[dict] | None = None) -> Path:
    rows = merged_rows(results) if rows is None else rows
    lines = [f"# {path.stem}", ""]
    for res in results:
        m = res["meta"]
        v = m.get("versions", {})
        lines.append(f"- {_card_name(m)}, {m.get('date')}: `{shown_command(m)}`  ")
        lines.append(f"  torch {v.get('torch')}, CUDA {v.get('cuda')}, cuDNN {v.get('cudnn')}, Triton {v.get('triton')}, "
                     f"dualkv {v.get('dualkv')} (commit {m.get('git_commit')})")
    lines += ["", "Useful TFLOP/s = 3.5 * 4*d*H*(attended pairs of the packed layout) / time for forward+backward "
              "(1x forward, 2.5x backward); the same FLOP count for every provider.", ""]
    lines += timing_lines(rows)
    measured = measured_modes(rows)  # a table per measured mode (all three when nothing was measured)
    for mode in ("fwdbwd", "fwd", "bwd"):
        if mode in measured or not measured:
            lines += [markdown_table(rows, mode), ""]
    lines += ["All rows:", "", detail_table(rows), ""]
    clocks = [r["fwdbwd_clock_mhz"] for r in rows if r.get("fwdbwd_clock_mhz") is not None]
    if clocks:
        lines += [f"SM clock while forward+backward was timed: {min(clocks):.0f}-{max(clocks):.0f} MHz over the rows "
                  "(each row's median of nvidia-smi samples every 50 ms, or the nearest sample; `<mode>_clock_mhz` and `<mode>_power_w` in "
                  "the CSV / JSON).", ""]
        busy = [r["fwdbwd_busy"] for r in rows if r.get("fwdbwd_busy") is not None]
        if busy:
            lines += [f"The timed calls filled {min(busy):.0%}-{max(busy):.0%} of each row's forward+backward stretch "
                      "(`<mode>_busy`); the rest is inputs' setup, L2 flushes and host time. nvidia-smi's board power is "
                      "an average over about the last second on Ampere and newer GPUs, so a mode timed for less than that "
                      "reads partly the stretch before it, and less the smaller its busy share: compare power only "
                      "between modes timed for seconds at like shares.", ""]
    lines += spread_lines(rows)
    for res in results:
        val = res.get("validation", [])
        failed = [r for r in val if r.get("ok") is False]
        passed = [f"{r['provider']} ({r['config'].split('_')[-2]})" for r in val if r.get("ok")]
        if val:
            lines.append(f"Validation against dualkv.core.reference_attention, run of {res['meta'].get('date')}: "
                         f"{len(passed)} passed ({', '.join(passed)}), {len(failed)} failed.")
            lines += [f"- {r['provider']} {r['config']}: {r['status']}" for r in failed]
            lines.append("")
    path.write_text("\n".join(lines) + "\n")
    return path


def _color(provider: str):
    import matplotlib

    order = PROVIDER_ORDER + sorted({provider} - set(PROVIDER_ORDER))
    return matplotlib.colormaps["tab20"](order.index(provider) % 20)  # one colour per known provider


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (benchmarks never open a window)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, rect=None) -> Path:
    """Lay out, write at 130 dpi and close a figure; returns the path."""
    fig.tight_layout(rect=rect)
    fig.savefig(path, dpi=130)
    pyplot().close(fig)
    return Path(path)


def plot_ratios(rows: list[dict], names: list[str], path: Path, title: str) -> Path:
    """Bars of each name's time over the first name's per layout (``row["layout"]``, ``row[f"{name}_ratio"]``):
    the A/B scripts' plot (``benchmarks.env_ab``, ``benchmarks.build_ab``)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(rows)), 3.6))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(rows))]
        ax.bar(xs, [row[f"{name}_ratio"] for row in rows], width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)), [row["layout"] for row in rows], rotation=20, ha="right")
    ratios = [row[f"{n}_ratio"] for row in rows for n in names]
    ax.set_ylim(min(ratios) - 0.03, max(ratios) + 0.03)
    ax.set_ylabel(f"time / {names[0]}'s")
    ax.set_title(title)
    ax.legend()
    return save_figure(fig, path)


def plot_results(rows: list[dict], stem: Path, title: str = "") -> list[Path]:
    """``<stem>_tflops.png`` (useful TFLOP/s) and ``<stem>_ms.png`` (time, log scale) of forward+backward,
    or of the first mode the rows measured (a ``--modes fwd`` run plots the forward)."""
    plt = pyplot()

    groups = _groups(rows)
    paths = []
    mode = (measured_modes(rows) or ["fwdbwd"])[0]
    name = _MODE_NAMES[mode]
    for metric, ylabel, log in ((f"{mode}_tflops", f"useful TFLOP/s, {name}", False),
                                (f"{mode}_ms", f"{name} ms (log scale)", True)):
        n_configs = sum(len({r["config"] for r in g}) for g in groups.values())
        fig, axes = plt.subplots(1, len(groups), figsize=(min(18.0, 3.0 + 1.4 * n_configs), 5.0),
                                 squeeze=False, gridspec_kw=dict(width_ratios=[len({r["config"] for r in g}) for g in groups.values()]))
        for ax, ((d, H, Hkv, dtype), grp) in zip(axes[0], groups.items()):
            provs = [p for p in _providers(grp)  # providers that cannot run this head dim at all are left out
                     if not all(r["status"].startswith("unsupported") for r in grp if r["provider"] == p)]
            configs = list(dict.fromkeys(r["config"] for r in grp))
            by = {(r["config"], r["provider"]): r for r in grp}
            width = 0.8 / max(1, len(provs))
            for j, p in enumerate(provs):
                xs, ys, notes = [], [], []
                for i, c in enumerate(configs):
                    r = by.get((c, p))
                    x = i - 0.4 + width * (j + 0.5)
                    if r is not None and r["status"] == "ok" and r.get(metric) is not None:
                        xs.append(x)
                        ys.append(r[metric])
                    elif r is not None:
                        notes.append((x, "OOM" if r["status"] == "OOM" else r["status"].split(":")[0]))
                color = _color(p)
                ax.bar(xs, ys, width, label=p, color=color)
                for x, text in notes:
                    ax.text(x, 0.02, text, rotation=90, ha="center", va="bottom", fontsize=7, color=color,
                            transform=ax.get_xaxis_transform())
            ax.set_xlim(-0.5, len(configs) - 0.5)
            labels = [next(r["label"] for r in grp if r["config"] == c) for c in configs]
            ax.set_xticks(range(len(configs)), labels, rotation=30, fontsize=8)
            ax.set_xlabel("N, P, R")
            ax.set_title(f"{dtype} H={H} H_kv={Hkv} d={d}", fontsize=9)
            if log:
                ax.set_yscale("log")
            ax.grid(axis="y", alpha=0.3)
        axes[0][0].set_ylabel(ylabel)
        from matplotlib.patches import Patch

        shown = _providers([r for r in rows if not r["status"].startswith("unsupported")])
        fig.legend(handles=[Patch(color=_color(p), label=p) for p in shown], fontsize=8, loc="lower center",
                   ncol=min(len(shown), 8), frameon=False)
        fig.suptitle(f"Shared-prompt attention, {title}", fontsize=10)
        paths.append(save_figure(fig, Path(f"{stem}_{metric.split('_')[1]}.png"), rect=(0, 0.06, 1, 1)))
    return paths


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Merge benchmark results files into one markdown table and plots.")
    ap.add_argument("results", nargs="+", help="results .json files (later files win for the same config and provider)")
    ap.add_argument("--stem", required=True, help="output name, e.g. attention_h200")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    results = load_results(args.results)
    rows = merged_rows(results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(write_markdown(out / f"{args.stem}.md", results, rows))
    for p in plot_results(rows, out / args.stem, title=_card_name(results[-1]["meta"])):
        print(p)


if __name__ == "__main__":
    main()
