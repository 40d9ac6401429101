"""Memory scaling: peak device memory of one policy-update forward + backward, DualKV vs replicated.

A dualkv.models Qwen3 model (random weights, bf16, activation checkpointing on every layer) runs
``model.response_logprobs`` on one prompt of P tokens and mb responses of R_i ~ U(131, 2048) tokens
(seeded), then a GRPO loss (``dualkv.train.losses.policy_loss``, random advantages) and its backward::

    dualkv      PackedLayout.from_groups with one group: P + sum R_i tokens (the prompt once)
    replicated  one group per response, each with its own prompt copy: sum (P + R_i) tokens
                (the same model code, the baseline)

P grows over ``--prompts`` until a packing runs out of memory (recorded as OOM; larger P for that
(packing, mb) are not run). Peak = ``torch.cuda.max_memory_allocated`` over the step (weights,
gradients, activations, workspaces). Per packing the linear model

    memory = M0 + c_P * P_held + c_R * (mb * R)   (mb * R = sum of the sampled R_i)

with P_held the prompt tokens the packing holds (P for dualkv: the prompt term paid once; mb * P for
replicated: paid per copy) is fitted by least squares over the measured points and plotted with
them. On a CPU there is no memory counter: peaks are recorded as None and the fit is skipped.

    python -m benchmarks.bench_memory_scaling                              # qwen3-1.7b, P = 8K, 16K, ...
    python -m benchmarks.bench_memory_scaling --preset qwen3-8b --layers 4
    python -m benchmarks.bench_memory_scaling --preset tiny-qwen3 --prompts 64 --mbs 4 --device cpu   # smoke test
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "benchmarks"

import numpy as np
import torch

from benchmarks.harness import _is_oom, fmt_size, parse_size
from benchmarks.report import ResultWriter, environment, shown_command
from dualkv.core import PackedLayout
from dualkv.models.fused import FUSED_MODES, liger_runs_on, set_fused_ops

MODULE = "benchmarks.bench_memory_scaling"
PACKINGS = ("dualkv", "replicated")
PROMPTS = "8K,16K,32K,64K,96K,128K,192K,256K"
COLUMNS = ["packing", "P", "mb", "sum_R", "R_mean", "T", "rho", "status", "peak_gib", "weights_gib", "step_s"]
R_RANGE = (131, 2048)


# ------------------------------------------------------------------------------------------ fit
def fit_memory(points: list[tuple[float, float, float]]) -> dict | None:
    """Least squares of ``memory = M0 + c_P * P + c_R * mbR`` over ``(P, mbR, memory)`` points.

    Returns ``{"M0", "c_P", "c_R", "r2", "n"}`` or None when there are fewer than 3 points or the
    design matrix has rank < 3 (e.g. one mb and one P only)."""
    pts = [p for p in points if p[2] is not None]
    if len(pts) < 3:
        return None
    A = np.array([[1.0, p[0], p[1]] for p in pts])
    y = np.array([p[2] for p in pts], dtype=float)
    if np.linalg.matrix_rank(A) < 3:
        return None
    coef, *_ = np.linalg.lstsq(A, y, rcond=None)
    resid = y - A @ coef
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float((resid ** 2).sum()) / ss_tot if ss_tot > 0 else 1.0
    return dict(M0=float(coef[0]), c_P=float(coef[1]), c_R=float(coef[2]), r2=r2, n=len(pts))


def predict(fit: dict, P: float, mbR: float) -> float:
    return fit["M0"] + fit["c_P"] * P + fit["c_R"] * mbR


def prompt_tokens_held(packing: str, P: int, mb: int) -> int:
    """Prompt tokens the packing runs: once (dualkv) or once per response (replicated)."""
    return P if packing == "dualkv" else mb * P


# ---------------------------------------------------------------------------------------- model
def first_layers(hf: dict, layers: int) -> dict:
    """A config.json dict cut to its first ``layers`` decoder layers (1 <= layers <= all): per-layer
    types follow, and a cut Gemma-4 keeps no KV sharing (the layers it shares with may be gone)."""
    total = hf["num_hidden_layers"]
    hf = {**hf, "num_hidden_layers": layers}
    if isinstance(hf.get("layer_types"), list):
        hf["layer_types"] = hf["layer_types"][:layers]
    if hf.get("num_kv_shared_layers") and layers < total:
        hf["num_kv_shared_layers"] = 0
    return hf


def build(preset: str, layers: int | None, device, seed: int, keep_attention: bool = False):
    from dualkv.models import build_model, preset_hf_config

    hf = preset_hf_config(preset)
    if layers is not None:
        if layers < 1 or layers > hf["num_hidden_layers"]:
            raise ValueError(f"--layers: expected 1..{hf['num_hidden_layers']} for {preset}, got {layers}")
        hf = first_layers(hf, layers)
    model = build_model(hf, seed=seed).to(device=device, dtype=torch.bfloat16)
    model.set_activation_checkpointing(True, keep_attention=keep_attention)
    return model


def response_lengths(P: int, mb: int, seed: int, r_range: tuple[int, int] = R_RANGE) -> list[int]:
    """mb lengths uniform in ``r_range`` (inclusive), seeded by (seed, P, mb)."""
    rng = random.Random(f"{seed}-{P}-{mb}")
    return [rng.randint(*r_range) for _ in range(mb)]


def parse_range(text: str) -> tuple[int, int]:
    """``MIN:MAX`` (or one length) of response lengths, sizes like 2K allowed (each >= 1: ``parse_size``)."""
    lo, _, hi = text.partition(":")
    lo_, hi_ = parse_size(lo), parse_size(hi or lo)
    if lo_ > hi_:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX with MIN <= MAX, got {text!r}")
    return lo_, hi_


def make_layout(packing: str, P: int, lens: list[int], vocab: int, device, seed: int) -> PackedLayout:
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (P,), generator=gen)
    responses = [torch.randint(0, vocab, (r,), generator=gen) for r in lens]
    groups = [(prompt, responses)] if packing == "dualkv" else [(prompt, [r]) for r in responses]
    return PackedLayout.from_groups(groups, device=device)


def fwd_bwd(model, layout: PackedLayout, seed: int) -> None:
    """One GRPO policy-update forward + backward on ``layout``."""
    from dualkv.train.losses import LossConfig, policy_loss

    logp = model.response_logprobs(layout)
    mask = layout.response_mask()
    gen = torch.Generator().manual_seed(seed)
    adv = torch.randn(logp.shape[0], generator=gen).to(logp.device)
    loss, _ = policy_loss(logp, logp.detach(), adv, mask, LossConfig.grpo(kl_beta=0.0))
    loss.backward()


def _free(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(model, packing: str, P: int, mb: int, device, seed: int, weights_gib,
            r_range: tuple[int, int] = R_RANGE) -> dict:
    lens = response_lengths(P, mb, seed, r_range)
    T = P + sum(lens) if packing == "dualkv" else mb * P + sum(lens)
    rho = (mb * P + sum(lens)) / (P + sum(lens))
    row = dict(packing=packing, P=P, mb=mb, sum_R=sum(lens), R_mean=sum(lens) / mb, T=T, rho=rho,
               weights_gib=weights_gib)
    model.zero_grad(set_to_none=True)
    _free(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    try:
        layout = make_layout(packing, P, lens, model.config.vocab_size, device, seed)
        fwd_bwd(model, layout, seed)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        row["status"] = "ok"
        row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    except Exception as e:  # noqa: BLE001 - OOM is a result; anything else is recorded too
        if not _is_oom(e):
            raise
        row["status"], row["peak_gib"] = "OOM", None
    row["step_s"] = time.perf_counter() - t0
    layout = None
    model.zero_grad(set_to_none=True)
    _free(device)
    return row


# -------------------------------------------------------------------------------------- outputs
def fits_of(rows: list[dict]) -> dict[str, dict | None]:
    return {p: fit_memory([(prompt_tokens_held(p, r["P"], r["mb"]), r["sum_R"], r.get("peak_gib")) for r in rows
                           if r["packing"] == p and r["status"] == "ok"]) for p in PACKINGS}


def tables(rows: list[dict], fits: dict) -> str:
    out = ["Peak memory of one forward+backward, GiB (OOM = out of memory):", "",
           "| P | mb | sum R | rho | dualkv | replicated |", "| --- | --- | --- | --- | --- | --- |"]
    by = {(r["P"], r["mb"], r["packing"]): r for r in rows}

    def cell(r):
        if r is None:
            return "—"
        if r["status"] != "ok":
            return r["status"].split(":")[0]
        return "n/a" if r.get("peak_gib") is None else f"{r['peak_gib']:.2f}"

    for P, mb in sorted(dict.fromkeys((r["P"], r["mb"]) for r in rows), key=lambda k: (k[1], k[0])):
        first = next((r for r in rows if r["P"] == P and r["mb"] == mb and "sum_R" in r), None)
        if first is None:  # neither packing was measured at this point
            continue
        out.append(f"| {fmt_size(P)} | {mb} | {first['sum_R']} | {first['rho']:.2f} | "
                   f"{cell(by.get((P, mb, 'dualkv')))} | {cell(by.get((P, mb, 'replicated')))} |")
    out += ["", "Fit memory = M0 + c_P * P_held + c_R * (mb * R), P_held = the prompt tokens held (dualkv: P once; "
                    "replicated: mb * P), least squares over the measured points:", ""]
    for p, f in fits.items():
        if f is None:
            out.append(f"- {p}: not fitted (fewer than 3 measured points, or no memory counter on this device)")
        else:
            out.append(f"- {p}: M0 = {f['M0']:.3f} GiB, c_P = {f['c_P'] * 2**20:.1f} GiB per M prompt tokens, "
                       f"c_R = {f['c_R'] * 2**20:.1f} GiB per M response tokens, R^2 = {f['r2']:.4f} ({f['n']} points)")
    return "\n".join(out) + "\n"


def plot(rows: list[dict], fits: dict, path: Path, title: str) -> Path | None:
    from benchmarks.report import pyplot, save_figure

    plt = pyplot()

    mbs = sorted({r["mb"] for r in rows})
    if not any(r.get("peak_gib") is not None for r in rows):
        return None
    fig, axes = plt.subplots(1, len(mbs), figsize=(4.5 * len(mbs), 4.2), squeeze=False, sharey=True)
    for ax, mb in zip(axes[0], mbs):
        for j, p in enumerate(PACKINGS):
            pts = [r for r in rows if r["mb"] == mb and r["packing"] == p]
            ok = [r for r in pts if r.get("peak_gib") is not None]
            color = f"C{j}"
            ax.plot([r["P"] / 1024 for r in ok], [r["peak_gib"] for r in ok], "o", color=color, label=f"{p} measured")
            if fits.get(p) and ok:
                fit_gib = [predict(fits[p], prompt_tokens_held(p, r["P"], r["mb"]), r["sum_R"]) for r in ok]
                ax.plot([r["P"] / 1024 for r in ok], fit_gib, "--", color=color, label=f"{p} fit")
            for r in pts:
                if r["status"] == "OOM":
                    ax.axvline(r["P"] / 1024, color=color, alpha=0.4, ls=":")
                    ax.text(r["P"] / 1024, 0.02, f"{p} OOM", rotation=90, fontsize=7, color=color,
                            transform=ax.get_xaxis_transform())
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt length P (K tokens)")
        ax.set_title(f"mb = {mb}", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("peak memory, GiB")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"Policy-update forward+backward memory, {title}", fontsize=10)
    return save_figure(fig, path)


# ----------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3-1.7b", help="dualkv.models Qwen3 preset (random weights)")
    ap.add_argument("--layers", type=int, default=None, help="keep only the first LAYERS decoder layers of the preset")
    ap.add_argument("--prompts", default=PROMPTS, help="comma-separated prompt lengths, ascending (e.g. 8K,16K)")
    ap.add_argument("--mbs", default="4,8,16", help="comma-separated responses per prompt")
    ap.add_argument("--packings", default=",".join(PACKINGS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--stem", default=None)
    ap.add_argument("--deadline-s", type=float, default=None, help="stop starting new points after this many seconds")
    ap.add_argument("--response-range", type=parse_range, default=R_RANGE,
                    help="response lengths MIN:MAX, uniform (default 131:2048)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep-attention", action="store_true",
                    help="checkpointed layers keep their attention outputs (the memory that costs)")
    ap.add_argument("--fused-ops", choices=FUSED_MODES, default="auto",
                    help="RMSNorm, RoPE and SwiGLU: Liger's fused kernels (auto: on CUDA where installed; they keep "
                         "no fp32 copies) or PyTorch's ops (off)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="measure nothing: one report (table, fit, plot) from earlier results of the same settings")
    return ap.parse_args(argv)


def main(argv=None) -> Path:
    from tqdm.auto import tqdm

    args = parse_args(argv)
    if args.merge:
        return merge(args.merge, args.out, args.stem or Path(args.merge[0]).stem)
    device = torch.device(args.device)
    prompts = sorted(parse_size(p) for p in args.prompts.split(","))
    mbs = [int(m) for m in args.mbs.split(",")]
    packings = [p.strip() for p in args.packings.split(",")]
    bad = set(packings) - set(PACKINGS)
    if bad:
        raise SystemExit(f"--packings: expected a subset of {PACKINGS}, got {sorted(bad)}")
    set_fused_ops(args.fused_ops)
    meta = environment(device, MODULE, sys.argv[1:] if argv is None else list(argv))
    meta.update(preset=args.preset, layers=args.layers, dtype="bfloat16", activation_checkpointing=True,
                keep_attention=args.keep_attention, fused_ops=args.fused_ops,
                liger_ops=liger_runs_on(device),
                response_lengths=f"U{tuple(args.response_range)}", seed=args.seed)
    card = meta["card"]["name"].split()[-1].lower() if device.type == "cuda" else "cpu"
    stem = args.stem or f"memory_scaling_{card}_{datetime.now(timezone.utc):%Y%m%d-%H%M}"
    writer = ResultWriter(args.out, stem, meta, COLUMNS)
    model = build(args.preset, args.layers, device, args.seed, args.keep_attention)
    weights_gib = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None
    start, oom_at = time.monotonic(), {}
    # prompt length outermost: a deadline cuts the longest prompts, never a whole packing or mb
    cases = [(p, mb, P) for P in prompts for mb in mbs for p in packings]
    for packing, mb, P in tqdm(cases, desc="memory scaling", dynamic_ncols=True):
        base = dict(packing=packing, P=P, mb=mb)
        if (packing, mb) in oom_at:
            writer.add({**base, "status": f"not run: OOM at P={fmt_size(oom_at[packing, mb])}"})
            continue
        if args.deadline_s is not None and time.monotonic() - start > args.deadline_s:
            writer.add({**base, "status": "not run: --deadline-s reached"})
            continue
        row = measure(model, packing, P, mb, device, args.seed, weights_gib, args.response_range)
        if row["status"] == "OOM":
            oom_at[packing, mb] = P
        writer.add(row)
    return write_report(writer)


SETTINGS = ("preset", "layers", "dtype", "activation_checkpointing", "keep_attention", "response_lengths", "seed",
            "liger_ops")


def merge(paths: list[str], out: str, stem: str) -> Path:
    """One report from several result files of the same settings (later files win, 'not run' never does)."""
    from benchmarks.report import merge_runs

    try:
        meta, rows = merge_runs(paths, ("packing", "P", "mb"), SETTINGS)
    except ValueError as e:
        raise SystemExit(f"--merge: {e}") from None
    writer = ResultWriter(out, stem, meta, COLUMNS)
    writer.rows = sorted(rows, key=lambda r: (r["P"], r["mb"], PACKINGS.index(r["packing"])))
    return write_report(writer)


def write_report(writer) -> Path:
    """JSON/CSV with the fits, the markdown table and the plot of a finished run (or a merge)."""
    meta, rows = writer.meta, writer.rows
    fits = fits_of(rows)
    meta["fits"] = fits
    writer.flush()
    md = writer.dir / f"{writer.stem}.md"
    v = meta["versions"]
    r_range = meta["response_lengths"]
    layers = "" if meta.get("layers") is None else f" (first {meta['layers']} layers)"
    head = (f"# {writer.stem}\n\n- {meta['card']['name']}, {meta['date']}: `{shown_command(meta)}`  \n"
            f"  torch {v.get('torch')}, CUDA {v.get('cuda')}, Triton {v.get('triton')}, dualkv {v.get('dualkv')} "
            f"(commit {meta.get('git_commit')})\n- model {meta['preset']}"
            f"{layers}, bf16 weights, random init, "
            f"activation checkpointing on every layer{' (keeping attention outputs)' if meta.get('keep_attention') else ''}"
            f"{', Liger ' + str(v.get('liger-kernel')) + ' fused norms / RoPE / SwiGLU' if meta.get('liger_ops') else ''}"
            f", GRPO loss over response_logprobs; R_i ~ {r_range}, "
            f"seed {meta['seed']}\n\n")
    md.write_text(head + tables(rows, fits))
    png = plot(rows, fits, writer.dir / f"{writer.stem}.png", meta["card"]["name"])
    print(md, png or "(no plot: no memory measurements)", sep="\n")
    return writer.json_path


if __name__ == "__main__":
    main()
