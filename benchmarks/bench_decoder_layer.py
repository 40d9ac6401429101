"""Decoder-layer benchmark: one Qwen3 decoder layer (Qwen3-8B shapes: D=4096, F=12288, H=32, H_kv=8,
d=128, RoPE, q/k norm; bf16), forward + backward of a loss on the response tokens, four ways.

Variants (one prompt of P tokens, mb responses of R_i ~ U(131, 2048) tokens, seeded)::

    dualkv          the layer on the packed P + sum R_i tokens, attention = dualkv_attention
    fa2-replicated  the layer on the N-replicated tokens (mb rows of P + R_i), attention = FA2 varlen
    prefix-grouper  the layer on the packed tokens (prompt encoded once), but inside attention the
                    prompt K/V are copied per response and responses padded to R_max: prompt queries
                    = FA2 causal over the prompt, response queries = FA2 over (mb, P + R_max) keys
    flex-packed     the layer on the packed tokens, attention = FlexAttention with the shared-prompt
                    block mask (compiled once per shape)

Loss: ``sum_t <out_t, probe_t> / n`` over response tokens t (probe fixed, the same values in every
variant), so every variant computes the same number; gradients w.r.t. the layer input and every
parameter. Each variant is checked against the pure-PyTorch reference layer at a small shape first
(``--validate``). Reported: forward+backward ms (median of event-timed repeats), speedup of dualkv,
peak extra memory, OOM; rho = N(P+R)/(P+NR) (exact, from the sampled lengths) beside it.

    python -m benchmarks.bench_decoder_layer --validate
    python -m benchmarks.bench_decoder_layer --points "5K,32;8K,16" --variants dualkv,fa2-replicated
    python -m benchmarks.bench_decoder_layer --compile    # every variant's layer under torch.compile
    python -m benchmarks.bench_decoder_layer --fused-ops off   # eager norms / RoPE / SwiGLU as PyTorch ops
    python -m benchmarks.bench_decoder_layer --preset tiny-qwen3 --points "64,3" --device cpu   # smoke test
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "benchmarks"

import torch
import torch.nn.functional as F

from benchmarks.harness import Timer, _free, _is_oom, _short, _sync, add_timing_argument, parse_size
from benchmarks.peers import FA2Piece, FlexPacked, _FA2Varlen
from benchmarks.report import ResultWriter, environment, shown_command
from dualkv.core import PackedLayout, dualkv_attention
from dualkv.core.backends import BACKEND_CHOICES
from dualkv.models.fused import FUSED_MODES, liger_runs_on, set_fused_ops

MODULE = "benchmarks.bench_decoder_layer"
SWEEP = "5K,32;8K,16;16K,8;32K,4;64K,4;128K,8"
VARIANTS = ("dualkv", "fa2-replicated", "prefix-grouper", "flex-packed")
COLUMNS = ["point", "P", "mb", "R_mean", "T", "T_rep", "rho", "variant", "status", "fwdbwd_ms", "fwdbwd_reps",
           "peak_extra_gib", "input_gib", "warmup_s"]


# ------------------------------------------------------------------------------------- attention
def varlen_attention(q, k, v, piece: FA2Piece):
    """FA2 varlen on CUDA; on a CPU the same rule (bottom-right causal) in plain PyTorch (tests)."""
    if q.is_cuda:
        return _FA2Varlen.apply(q, k, v, piece)
    cu_q, cu_k = piece.cu_q.tolist(), piece.cu_k.tolist()
    rep = q.shape[1] // k.shape[1]
    outs = []
    for qa, qe, ka, ke in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]):
        mask = None
        if piece.causal:
            i = torch.arange(qe - qa)[:, None]
            mask = torch.arange(ke - ka)[None, :] <= i + (ke - ka) - (qe - qa)
        o = F.scaled_dot_product_attention(q[qa:qe].transpose(0, 1), k[ka:ke].repeat_interleave(rep, 1).transpose(0, 1),
                                           v[ka:ke].repeat_interleave(rep, 1).transpose(0, 1), attn_mask=mask,
                                           scale=piece.scale)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


def _i32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


class ReplicatedAttention:
    """FA2 varlen over the replicated rows (the layout passed in is the replicated one: a group a row)."""

    def __init__(self, rep_layout: PackedLayout, scale: float):
        lens = [p + sum(rs) for p, rs in zip(rep_layout.prompt_lens, rep_layout.response_lens)]
        cu = _i32([0, *torch.tensor(lens).cumsum(0).tolist()], rep_layout.device)
        self.piece = FA2Piece(cu, cu, max(lens), max(lens), True, scale)

    def __call__(self, q, k, v, layout, softmax_scale=None, window=None, softcap=None):
        return varlen_attention(q, k, v, self.piece)


class PrefixGrouperAttention:
    """Prompt K/V copied per response inside attention, responses padded to R_max (one group).

    Pad slots gather the response's last real token: as keys they sit after every real key of their
    row (never visible under the causal rule), as queries their outputs are dropped."""

    def __init__(self, layout: PackedLayout, scale: float):
        dev, P, rs = layout.device, layout.prompt_lens[0], list(layout.response_lens[0])
        if layout.num_groups != 1:
            raise ValueError("layout: the prefix-grouper variant takes one prompt group")
        r_max, starts = max(rs), [P + sum(rs[:i]) for i in range(len(rs))]
        q_idx, kv_idx, keep = [], [], []
        for i, (s, r) in enumerate(zip(starts, rs)):
            own = list(range(s, s + r)) + [s + r - 1] * (r_max - r)
            q_idx += own
            kv_idx += list(range(P)) + own
            keep += [i * r_max + j for j in range(r)]
        self.q_idx, self.kv_idx, self.keep = (torch.tensor(x, device=dev) for x in (q_idx, kv_idx, keep))
        n = len(rs)
        self.prompt = FA2Piece(_i32([0, P], dev), _i32([0, P], dev), P, P, True, scale)
        self.resp = FA2Piece(_i32([i * r_max for i in range(n + 1)], dev), _i32([i * (P + r_max) for i in range(n + 1)], dev),
                             r_max, P + r_max, True, scale)
        self.P = P

    def __call__(self, q, k, v, layout, softmax_scale=None, window=None, softcap=None):
        P = self.P
        out_p = varlen_attention(q[:P], k[:P], v[:P], self.prompt)
        out_pad = varlen_attention(q.index_select(0, self.q_idx), k.index_select(0, self.kv_idx),
                                   v.index_select(0, self.kv_idx), self.resp)
        return torch.cat([out_p, out_pad.index_select(0, self.keep)])


class FlexAttention:
    def __init__(self, layout: PackedLayout, cfg, device):
        from benchmarks.harness import AttnConfig

        acfg = AttnConfig(N=1, P=1, R=1, H=cfg.num_heads, H_kv=cfg.num_kv_heads, d=cfg.head_dim)
        self.flex = FlexPacked(acfg, layout, device)
        self.flex.scale = cfg.scale

    def __call__(self, q, k, v, layout, softmax_scale=None, window=None, softcap=None):
        return self.flex.forward(q, k, v)

    def close(self):
        self.flex.close()


# ------------------------------------------------------------------------------------------ cases
@dataclass
class Point:
    P: int
    mb: int
    rs: list[int]

    @property
    def name(self) -> str:
        return f"P{self.P}_mb{self.mb}"


def make_point(text: str, seed: int) -> Point:
    """``"P,mb"`` (R_i ~ U(131, 2048)) or ``"P,mb,lo-hi"``; lengths seeded by (seed, P, mb)."""
    parts = [s.strip() for s in text.split(",")]
    if len(parts) not in (2, 3):
        raise ValueError(f"point: expected 'P,mb' or 'P,mb,lo-hi', got {text!r}")
    P, mb = parse_size(parts[0]), parse_size(parts[1])
    lo, hi = (parse_size(x) for x in parts[2].split("-")) if len(parts) == 3 else (131, 2048)
    rng = random.Random(f"{seed}-{P}-{mb}-{lo}-{hi}")
    return Point(P, mb, [rng.randint(lo, hi) for _ in range(mb)])


def build_block(preset: str, device, dtype, seed: int):
    from dualkv.models import get_preset
    from dualkv.models.qwen3 import Qwen3Block

    cfg = get_preset(preset)
    torch.manual_seed(seed)
    block = Qwen3Block(cfg.layers[0], cfg).to(device=device, dtype=dtype)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02)
    return block, cfg.layers[0].attention


class Variant:
    """One way to run the layer: its token order, layout and attention function."""

    def __init__(self, name: str, point: Point, attn_cfg, device, backend: str):
        self.name, self.device = name, device
        self.packed = PackedLayout.from_lengths([point.P], [point.rs], device=device)
        self.closer = None
        scale = attn_cfg.scale
        if name == "fa2-replicated":
            self.layout = PackedLayout.from_lengths([point.P] * point.mb, [[r] for r in point.rs], device=device)
            self.index, _ = self.packed.replicated_index()  # replicated token -> packed token
            self.attn_fn = ReplicatedAttention(self.layout, scale)
        else:
            self.layout, self.index = self.packed, None
            if name == "dualkv" or name == "reference":
                be = "reference" if name == "reference" else backend
                self.attn_fn = lambda q, k, v, layout, **kw: dualkv_attention(q, k, v, layout, backend=be, **kw)
            elif name == "prefix-grouper":
                self.attn_fn = PrefixGrouperAttention(self.packed, scale)
            elif name == "flex-packed":
                self.attn_fn = FlexAttention(self.packed, attn_cfg, device)
                self.closer = self.attn_fn.close
            else:
                raise ValueError(f"variant: expected one of {VARIANTS}, got {name!r}")
        order = self.index if self.index is not None else torch.arange(self.packed.total_tokens, device=device)
        self.resp_pos = (order >= point.P).nonzero().squeeze(1)  # response tokens in this variant's order
        self.resp_packed = order[self.resp_pos]

    def tokens(self, x_packed):
        return x_packed if self.index is None else x_packed.index_select(0, self.index)

    def close(self):
        if self.closer is not None:
            self.closer()


def layer_loss(block, attn_cfg, variant: Variant, x_TD, probe_TD):
    from dualkv.models.layers import BlockInputs, rope_tables

    block.self_attn.attn_fn = variant.attn_fn
    cos, sin = rope_tables(attn_cfg.rope, attn_cfg.head_dim, variant.layout.position_ids, x_TD.dtype)
    out = block(x_TD, BlockInputs(variant.layout, {attn_cfg.rope_key: (cos, sin)})).hidden_TD
    resp = out.index_select(0, variant.resp_pos).float()
    return (resp * probe_TD.index_select(0, variant.resp_packed).float()).sum() / variant.resp_pos.numel()


# ------------------------------------------------------------------------------------- validation
def validate(variant_name: str, preset: str, device, backend: str, seed: int = 0) -> dict:
    """Loss and grads (input, q_proj, k_proj weights) vs the fp32 reference layer; tolerance 3x the
    error of the same reference layer in bf16, plus the bf16 rounding of the reference values."""
    point = make_point("300,4,17-97", seed)
    report = dict(variant=variant_name, point=point.name, ok=True, status="ok")
    try:
        grads = {}
        for tag, name, dtype in (("ref32", "reference", torch.float32), ("ref16", "reference", torch.bfloat16),
                                 ("x", variant_name, torch.bfloat16)):
            block, attn_cfg = build_block(preset, device, dtype, seed)
            gen = torch.Generator(device=device).manual_seed(seed)
            D = block.input_layernorm.weight.shape[0]
            var = Variant(name, point, attn_cfg, device, backend)
            x = torch.randn(var.packed.total_tokens, D, generator=gen, device=device).to(dtype).requires_grad_()
            probe = torch.randn(var.packed.total_tokens, D, generator=gen, device=device).to(dtype)
            loss = layer_loss(block, attn_cfg, var, var.tokens(x), probe)
            ws = [block.self_attn.q_proj.weight, block.self_attn.k_proj.weight]
            grads[tag] = [loss.detach().reshape(1)] + list(torch.autograd.grad(loss, [x] + ws))
            var.close()
        for i, what in enumerate(("loss", "dx", "dWq", "dWk")):
            ref = grads["ref32"][i].float()
            floor = (ref.to(torch.bfloat16).float() - ref).abs().max().item()
            err = (grads["x"][i].float() - ref).abs().max().item()
            tol = 3 * (grads["ref16"][i].float() - ref).abs().max().item() + floor + 1e-6
            report[f"{what}_err"], report[f"{what}_tol"] = err, tol
            if not err <= tol:
                report.update(ok=False, status=f"{what} error {err:.3g} > tolerance {tol:.3g}")
    except Exception as err:
        report.update(ok=False, status="OOM" if _is_oom(err) else f"error: {_short(err)}")
    _free(device)
    return report


# ----------------------------------------------------------------------------------------- timing
def prepare_layer(point: Point, variant_name: str, preset: str, device, backend: str, seed: int,
                  compile: bool = False):
    """One variant's layer on a point, ready to time: (block, variant, x, fwdbwd), fwdbwd() a forward +
    backward of the loss w.r.t. x and every parameter. compile: the whole layer, one graph per shape
    (FlexPacked has just reset dynamo's caches). The variant is closed again if a step here fails."""
    block, attn_cfg = build_block(preset, device, torch.bfloat16, seed)
    var = Variant(variant_name, point, attn_cfg, device, backend)
    try:
        if compile:
            block.compile(dynamic=False)
        T = var.packed.total_tokens
        gen = torch.Generator(device=device).manual_seed(seed)
        D = block.input_layernorm.weight.shape[0]
        probe = torch.randn(T, D, generator=gen, device=device, dtype=torch.bfloat16)
        x = var.tokens(torch.randn(T, D, generator=gen, device=device, dtype=torch.bfloat16))
        x.requires_grad_()
        wrt = [x] + list(block.parameters())
    except BaseException:
        var.close()
        raise

    def fwdbwd():
        torch.autograd.grad(layer_loss(block, attn_cfg, var, x, probe), wrt)

    return block, var, x, fwdbwd


def run_point(point: Point, variant_name: str, preset: str, device, timer: Timer, backend: str, seed: int,
              compile: bool = False) -> dict:
    packed = PackedLayout.from_lengths([point.P], [point.rs])
    row = dict(point=point.name, P=point.P, mb=point.mb, R_mean=round(sum(point.rs) / point.mb, 1),
               T=packed.total_tokens, T_rep=packed.replicated_tokens, rho=round(packed.rho, 4), variant=variant_name,
               status="ok")
    var = block = None
    try:
        block, var, x, fwdbwd = prepare_layer(point, variant_name, preset, device, backend, seed, compile)
        row["input_gib"] = x.numel() * x.element_size() / 2**30
        t0 = time.perf_counter()
        fwdbwd()
        _sync(device)
        row["warmup_s"] = round(time.perf_counter() - t0, 3)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        t = timer.measure(fwdbwd)
        row.update(fwdbwd_ms=t.median_ms, fwdbwd_reps=t.reps, fwdbwd_host_ms=round(t.host_ms, 3))
        if timer.hide_host:
            row["fwdbwd_host_exposed"] = t.host_exposed
        if device.type == "cuda":
            row["peak_extra_gib"] = (torch.cuda.max_memory_allocated(device) - base) / 2**30
    except Exception as err:
        row["status"] = "OOM" if _is_oom(err) else f"error: {_short(err)}"
    finally:
        if var is not None:
            var.close()
        del var, block
        if compile:
            torch._dynamo.reset()
        _free(device)
    return row


# ---------------------------------------------------------------------------------------- reports
def tables(rows: list[dict]) -> str:
    """ms per variant, dualkv's speedups, peak memory, and rho beside the measured speedups."""
    points = list(dict.fromkeys(r["point"] for r in rows))
    variants = [v for v in VARIANTS if any(r["variant"] == v for r in rows)]
    by = {(r["point"], r["variant"]): r for r in rows}

    def ms(r):
        if r is None:
            return "—"
        return f"{r['fwdbwd_ms']:.1f}" if r["status"] == "ok" else ("OOM" if r["status"] == "OOM" else r["status"].split(":")[0])

    def speedup(p, v):
        a, b = by.get((p, "dualkv")), by.get((p, v))
        if a and b and a["status"] == "ok" and b["status"] == "ok":
            return f"{b['fwdbwd_ms'] / a['fwdbwd_ms']:.2f}x"
        return "—"

    others = [v for v in variants if v != "dualkv"]
    head = "| P | mb | R mean | rho | " + " | ".join(f"{v} ms" for v in variants) + " | " + \
        " | ".join(f"speedup vs {v}" for v in others) + " | " + " | ".join(f"{v} peak GiB" for v in variants) + " |"
    out = [head, "|" + " --- |" * (4 + 2 * len(variants) + len(others))]
    for p in points:
        r0 = next(r for r in rows if r["point"] == p)
        mem = [f"{by[(p, v)]['peak_extra_gib']:.1f}" if (p, v) in by and "peak_extra_gib" in by[(p, v)] else "—" for v in variants]
        out.append(f"| {r0['P']} | {r0['mb']} | {r0['R_mean']:.0f} | {r0['rho']:.2f} | " + " | ".join(ms(by.get((p, v))) for v in variants)
                   + " | " + " | ".join(speedup(p, v) for v in others) + " | " + " | ".join(mem) + " |")
    return "\n".join(out)


def plot(rows: list[dict], path: Path, title: str) -> Path:
    from benchmarks.report import _color, pyplot, save_figure

    plt = pyplot()
    points = list(dict.fromkeys(r["point"] for r in rows))
    by = {(r["point"], r["variant"]): r for r in rows}
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for v in [v for v in VARIANTS if any(r["variant"] == v for r in rows)]:
        color = _color({"dualkv": "dualkv-triton", "prefix-grouper": "cudnn-cascade"}.get(v, v))
        xs = [i for i, p in enumerate(points) if by.get((p, v), {}).get("status") == "ok"]
        ax.plot(xs, [by[(points[i], v)]["fwdbwd_ms"] for i in xs], "o-", label=v, color=color)
        xm = [i for i in xs if "peak_extra_gib" in by[(points[i], v)]]
        ax2.plot(xm, [by[(points[i], v)]["peak_extra_gib"] for i in xm], "o-", label=v, color=color)
        for i, p in enumerate(points):
            r = by.get((p, v))
            if r is not None and r["status"] != "ok":
                ax.annotate("OOM" if r["status"] == "OOM" else "x", (i, 0), xycoords=("data", "axes fraction"), color=color,
                            fontsize=7, ha="center", va="bottom")
    first = {p: next(r for r in rows if r["point"] == p) for p in points}
    labels = [f"P={first[p]['P']}\nmb={first[p]['mb']}" for p in points]
    for a, yl in ((ax, "forward+backward ms (log)"), (ax2, "peak extra GiB (log)")):
        a.set_xticks(range(len(points)), labels, fontsize=8)
        a.set_xlim(-0.5, len(points) - 0.5)
        if any(math.isfinite(y) and y > 0 for line in a.get_lines() for y in line.get_ydata()):
            a.set_yscale("log")
        a.set_ylabel(yl)
        a.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(f"One Qwen3-8B decoder layer, forward+backward, {title}", fontsize=10)
    return save_figure(fig, path)


# ------------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3-8b", help="dualkv.models preset whose first layer is timed")
    ap.add_argument("--points", default=SWEEP, help="';'-separated 'P,mb' points")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--backend", default="auto", choices=BACKEND_CHOICES, help="dualkv backend of the 'dualkv' variant")
    ap.add_argument("--validate", action="store_true")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile the whole layer (dynamic=False) in every variant, as training with --compile does")
    ap.add_argument("--fused-ops", default="auto", choices=FUSED_MODES,
                    help="the eager layer's RMSNorm, RoPE and SwiGLU: Liger's fused kernels (auto: on CUDA where "
                         "installed) or PyTorch's ops (off); the same in every variant (dualkv.models.fused)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--stem", default=None)
    ap.add_argument("--budget-ms", type=float, default=1000.0)
    ap.add_argument("--max-reps", type=int, default=10)
    add_timing_argument(ap, "host-visible")
    ap.add_argument("--deadline-s", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def main(argv=None) -> Path:
    args = parse_args(argv)
    device = torch.device(args.device)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(variants) - set(VARIANTS) - {"reference"}
    if unknown:
        raise SystemExit(f"--variants: unknown {sorted(unknown)}; expected some of {VARIANTS}")
    points = [make_point(s, args.seed) for s in args.points.split(";") if s.strip()]
    set_fused_ops(args.fused_ops)
    fused = not args.compile and liger_runs_on(device)
    meta = environment(device, MODULE, sys.argv[1:] if argv is None else list(argv))
    meta.update(preset=args.preset, compile=args.compile, fused_ops=args.fused_ops, liger_ops=fused,
                response_lengths={p.name: p.rs for p in points})
    card = meta["card"]["name"].replace("NVIDIA ", "").split("(")[0].strip().replace(" ", "-").lower()
    writer = ResultWriter(args.out, args.stem or f"decoder_layer_{card}_{datetime.now(timezone.utc):%Y%m%d-%H%M}", meta, COLUMNS)
    failed = set()
    if args.validate:
        for v in variants:
            rep = validate(v, "tiny-qwen3" if device.type == "cpu" else args.preset, device, args.backend, args.seed)
            writer.add_validation(rep)
            print(f"validate {v:16s}: {rep['status']}", flush=True)
            if rep["ok"] is False:
                failed.add(v)
    timer = Timer(device, budget_ms=args.budget_ms, max_reps=args.max_reps, hide_host=args.timing == "device")
    start = time.monotonic()
    for point in points:
        for v in variants:
            if v in failed:
                row = dict(point=point.name, P=point.P, mb=point.mb, variant=v, status="skipped: failed validation")
            elif args.deadline_s is not None and time.monotonic() - start > args.deadline_s:
                row = dict(point=point.name, P=point.P, mb=point.mb, variant=v, status="not run: --deadline-s reached")
            else:
                row = run_point(point, v, args.preset, device, timer, args.backend, args.seed, args.compile)
            writer.add(row)
            ms = f"{row['fwdbwd_ms']:9.1f} ms" if row["status"] == "ok" else row["status"]
            print(f"P={point.P:<7d} mb={point.mb:<3d} {v:16s} {ms}", flush=True)
    writer.flush()
    rows = [r for r in writer.rows if "T" in r]
    md = [f"# {writer.stem}", "", f"- {meta['card']['name']}, {meta['date']}: `{shown_command(meta)}`",
          f"- torch {meta['versions']['torch']}, Triton {meta['versions']['triton']}, preset {args.preset}, "
          f"commit {meta['git_commit']}",
          "- the layer: " + ("torch.compile(dynamic=False) of the whole layer in every variant (warm-up untimed)"
                             if args.compile else "eager (FlexAttention alone compiled)")
          + "; RMSNorm, RoPE and SwiGLU: " + ("Liger's fused kernels" if fused else "PyTorch's ops")
          + f" (--fused-ops {args.fused_ops})", "", tables(rows), ""]
    (writer.dir / f"{writer.stem}.md").write_text("\n".join(md))
    if rows:
        plot(rows, writer.dir / f"{writer.stem}.png", meta["card"]["name"])
    print(writer.json_path)
    return writer.json_path


if __name__ == "__main__":
    main()
