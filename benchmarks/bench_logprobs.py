"""Log-prob head benchmark: ``linear_logprobs`` forward and forward+backward, per implementation.

The memory-lean head (``dualkv.core.logprobs.linear_logprobs``) turns the final hidden states of the
response tokens into their log-probs and entropies without ever holding the (n, V) logits. Per chunk
of rows it runs the LM-head matmul, then either a chain of PyTorch ops on an fp32 copy of the logits
(``impl="torch"``) or one Triton kernel per direction over the logits as they are (``"triton"``).
Every point runs both on the same inputs (bf16, random, seeded), checks they agree, and reports:

- forward ms (log-probs and entropies: what the old / reference log-prob phases run) and
  forward+backward ms (what the update runs; backward recomputes each chunk's logits);
- the same with the LM-head matmuls alone (``matmul-only``: the floor both implementations share);
- peak extra memory of the forward+backward.

    python -m benchmarks.bench_logprobs                                  # qwen3 head (D 2048 / 4096, V 151936)
    python -m benchmarks.bench_logprobs --points 'n=8192,D=2048,V=151936' --impls torch,triton
    python -m benchmarks.bench_logprobs --points 'n=64,D=32,V=300' --device cpu   # smoke test (interpreter)
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timezone
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "benchmarks"

import torch

from benchmarks.harness import Timer, _free, _is_oom, _sync, add_timing_argument
from benchmarks.report import ResultWriter, environment, pyplot, save_figure, shown_command
from dualkv.core.logprobs import LOGPROB_IMPLS, linear_logprobs

MODULE = "benchmarks.bench_logprobs"
# Response tokens of one micro-batch at mb = 8 / 16 (R ~ U(131, 2048)); Qwen3-1.7B and -8B heads.
DEFAULT_POINTS = "n=8192,D=2048,V=151936;n=16384,D=2048,V=151936;n=8192,D=4096,V=151936"
COLUMNS = ["point", "n", "D", "V", "impl", "status", "fwd_ms", "fwdbwd_ms", "peak_extra_gib", "max_lp_diff",
           "max_grad_rel_diff"]


def parse_point(text: str) -> dict:
    """'n=..,D=..,V=..' -> {'n': .., 'D': .., 'V': ..} (all three required, positive)."""
    fields = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        if key.strip() not in ("n", "D", "V") or not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"--points: expected 'n=<rows>,D=<hidden>,V=<vocab>' with positive ints, got {text!r}")
        fields[key.strip()] = int(value)
    if set(fields) != {"n", "D", "V"}:
        raise ValueError(f"--points: expected n, D and V in every point, got {text!r}")
    return fields


def make_inputs(pt: dict, dtype, device, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    h = torch.randn(pt["n"], pt["D"], device=device, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(pt["V"], pt["D"], device=device, generator=g) * pt["D"] ** -0.5).to(dtype).requires_grad_()
    t = torch.randint(0, pt["V"], (pt["n"],), device=device, generator=g)
    coef = torch.randn(2, pt["n"], device=device, generator=g)
    return h, w, t, coef


def head(impl: str, h, w, t, coef):
    """One forward (log-probs and entropies) and the loss a GRPO update would differentiate."""
    if impl == "matmul-only":  # the LM-head matmuls of forward and backward, nothing else
        logits = torch.nn.functional.linear(h, w)
        return logits[:, 0].float(), (logits[:, 0].float() * coef[0]).sum()
    lp, ent = linear_logprobs(h, w, t, return_entropy=True, impl=impl)
    return lp, (coef[0] * lp).sum() + (coef[1] * ent).sum()


def measure(impl: str, pt: dict, dtype, device, timer: Timer, seed: int, ref=None) -> tuple[dict, tuple | None]:
    row = dict(point=f"n={pt['n']},D={pt['D']},V={pt['V']}", **pt, impl=impl)
    h, w, t, coef = make_inputs(pt, dtype, device, seed)
    try:
        torch.autograd.grad(head(impl, h, w, t, coef)[1], (h, w))  # warm-up: compilation, autotuning, cuBLAS
        _sync(device)
        with torch.no_grad():
            row["fwd_ms"] = timer.measure(lambda: head(impl, h, w, t, coef)).median_ms
        row["fwdbwd_ms"] = timer.measure(lambda: torch.autograd.grad(head(impl, h, w, t, coef)[1], (h, w))).median_ms
        _free(device)
        base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        lp, loss = head(impl, h, w, t, coef)
        grads = torch.autograd.grad(loss, (h, w))
        if device.type == "cuda":
            row["peak_extra_gib"] = round((torch.cuda.max_memory_allocated(device) - base) / 2**30, 3)
        if ref is not None and impl != "matmul-only":
            row["max_lp_diff"] = (lp - ref[0]).abs().max().item()
            row["max_grad_rel_diff"] = max(((a.float() - b.float()).norm() / b.float().norm()).item()
                                           for a, b in zip(grads, ref[1]))
        row["status"] = "ok"
        return row, (lp.detach(), [g.detach() for g in grads])
    except Exception as err:  # noqa: BLE001 - one failing point must not end the run
        if not _is_oom(err):
            raise
        _free(device)
        row["status"] = "OOM"
        return row, None


def write_report(writer: ResultWriter) -> Path:
    meta, rows = writer.meta, writer.rows
    writer.flush()
    v = meta["versions"]
    lines = [f"# {writer.stem}", "",
             f"- {meta['card']['name']}, {meta['date']}: `{shown_command(meta)}`  ",
             f"  torch {v.get('torch')}, Triton {v.get('triton')}, dualkv {v.get('dualkv')} (commit {meta.get('git_commit')})",
             f"- {meta['dtype']} hidden states and LM-head weight (random, seed {meta['seed']}); log-probs and entropies; "
             "forward+backward of sum(a * logprob) + sum(b * entropy); medians of event-timed repeats", "",
             "| n, D, V | impl | status | fwd ms | fwd+bwd ms | peak extra GiB | max logprob diff | max grad rel diff |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]

    def cell(r, k, fmt):
        return fmt.format(r[k]) if r.get(k) is not None else "—"

    for r in rows:
        lines.append(f"| {r['point']} | {r['impl']} | {r['status']} | {cell(r, 'fwd_ms', '{:.2f}')} | "
                     f"{cell(r, 'fwdbwd_ms', '{:.2f}')} | {cell(r, 'peak_extra_gib', '{:.2f}')} | "
                     f"{cell(r, 'max_lp_diff', '{:.2e}')} | {cell(r, 'max_grad_rel_diff', '{:.2e}')} |")
    lines += ["", "Differences are against the first implementation listed (``--impls``), on the same inputs.", ""]
    md = writer.dir / f"{writer.stem}.md"
    md.write_text("\n".join(lines))
    png = plot(rows, writer.dir / f"{writer.stem}.png", meta["card"]["name"])
    print(md, png or "(no plot)", sep="\n")
    return md


def plot(rows: list[dict], path: Path, title: str) -> Path | None:
    done = [r for r in rows if r.get("fwdbwd_ms") is not None]
    if not done:
        return None
    plt = pyplot()
    points = list(dict.fromkeys(r["point"] for r in done))
    impls = list(dict.fromkeys(r["impl"] for r in done))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(impls)
    for ax, key, label in zip(axes, ("fwd_ms", "fwdbwd_ms"), ("forward", "forward + backward")):
        for i, impl in enumerate(impls):
            ys = [next((r[key] for r in done if r["point"] == p and r["impl"] == impl), 0) for p in points]
            ax.bar([x + i * width for x in range(len(points))], ys, width, label=impl)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(points))], points, fontsize=7)
        ax.set_ylabel("ms")
        ax.set_title(f"log-prob head, {label}")
        ax.legend(fontsize=8)
    fig.suptitle(title)
    return save_figure(fig, path)


IMPLS = LOGPROB_IMPLS + ("matmul-only",)  # what --impls may name (matmul-only: the LM-head matmuls alone)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--points", default=DEFAULT_POINTS, help="';'-separated 'n=..,D=..,V=..' points")
    ap.add_argument("--impls", default="torch,triton,matmul-only",
                    help=f"comma-separated, from {IMPLS}; differences are against the first")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--budget-ms", type=float, default=400.0)
    ap.add_argument("--max-reps", type=int, default=20)
    add_timing_argument(ap, "host-visible")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--stem", default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        args.points = [parse_point(p) for p in args.points.split(";") if p.strip()]
    except ValueError as err:
        ap.error(str(err))
    args.impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    bad = [i for i in args.impls if i not in IMPLS]
    if bad or not args.impls:
        ap.error(f"--impls: expected names from {IMPLS}, got {bad or args.impls}")
    return args


def main(argv=None) -> Path:
    from tqdm.auto import tqdm

    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the interpreter has no bf16
    meta = environment(device, MODULE, sys.argv[1:] if argv is None else list(argv))
    meta.update(dtype=str(dtype).replace("torch.", ""), seed=args.seed)
    card = meta["card"]["name"].split()[-1].lower() if device.type == "cuda" else "cpu"
    stem = args.stem or f"logprobs_{card}_{datetime.now(timezone.utc):%Y%m%d-%H%M}"
    writer = ResultWriter(args.out, stem, meta, COLUMNS)
    timer = Timer(device, args.budget_ms, args.max_reps, hide_host=args.timing == "device")
    for pt in tqdm(args.points, desc="log-prob head", dynamic_ncols=True):
        ref = None
        for impl in args.impls:
            row, result = measure(impl, pt, dtype, device, timer, args.seed, ref)
            if ref is None and impl != "matmul-only":
                ref = result
            writer.add(row)
    return write_report(writer)


if __name__ == "__main__":
    main()
