"""Host (CPU) time per call of ``dualkv_attention``: what a call costs before any kernel runs.

A training step hides it behind the GPU queue, but a small micro-batch, a sequence-parallel slice or
the harness's event timing (which starts on an idle GPU after its L2 flush) does not. On a layout so
small that the kernels never hold the host back, each row is the mean wall time of ``--calls`` calls
after a warm-up, synchronised once at the end:

- ``forward``: ``dualkv_attention`` on inputs without grad;
- ``forward (grad)``: on inputs that require grad (the custom op's autograd wrapper);
- ``forward+backward``: ``torch.autograd.grad`` of it;
- ``op layers`` (``--layers``): the layers under the public function, down to the CUDA binding
  (``cuda.forward``, its C++ op), the custom op (``dualkv.core.ops.attention_fwd``) and the input checks.

Every backend that plans its launches (``cuda``, ``triton``, their pairs, and ``auto`` on CUDA) is
measured twice: with its plans kept per layout (the default) and with ``DUALKV_CUDA_PLAN_CACHE=0`` and
``DUALKV_TRITON_PLAN_CACHE=0`` (planned every call).

    python -m benchmarks.bench_host                              # auto, cuda, triton and cuda+triton on CUDA tensors
    python -m benchmarks.bench_host --backends reference --device cpu --calls 50   # smoke test
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "benchmarks"

import torch

from benchmarks.harness import AttnConfig, _random_qkv, _sync, restored_env, set_env
from benchmarks.report import ResultWriter, environment, pyplot, save_figure, shown_command
from dualkv.core import dualkv_attention
from dualkv.core.backends import BACKEND_CHOICES

MODULE = "benchmarks.bench_host"
COLUMNS = ["backend", "plan_cache", "what", "us_per_call", "calls"]
PLAN_CACHES = ("DUALKV_CUDA_PLAN_CACHE", "DUALKV_TRITON_PLAN_CACHE")


def per_call_us(fn, calls: int, device: torch.device) -> float:
    """Mean wall time of ``calls`` calls of ``fn`` (after ``calls // 10 + 1`` untimed ones), in microseconds."""
    for _ in range(calls // 10 + 1):
        fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / calls * 1e6


def measurements(backend: str, cfg: AttnConfig, device: torch.device, layers: bool) -> list[tuple[str, callable]]:
    """(what, fn) for one backend on the config's inputs."""
    layout = cfg.layout(device)
    q, k, v = _random_qkv(cfg, device, 0)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)
    rows = [
        ("forward", lambda: dualkv_attention(q, k, v, layout, backend=backend)),
        ("forward (grad)", lambda: dualkv_attention(qg, kg, vg, layout, backend=backend)),
        ("forward+backward", lambda: torch.autograd.grad(dualkv_attention(qg, kg, vg, layout, backend=backend),
                                                         (qg, kg, vg), dout)),
    ]
    if layers:
        from dualkv.core.backends import get_backend, resolve_backend, split_backend
        from dualkv.core.ops import attention_fwd
        from dualkv.core.reference import AttnMeta
        from dualkv.core.validation import check_attention_inputs

        meta = AttnMeta.from_layout(layout)
        scale = cfg.d ** -0.5
        name = resolve_backend(backend, q)  # what auto takes here
        forward = split_backend(name)[0]
        kernel = get_backend(forward)
        rows += [("input checks", lambda: check_attention_inputs(q, k, v, layout, None, None, None)),
                 (f"custom op (attention_fwd, {name})",
                  lambda: attention_fwd(q, k, v, None, None, list(meta), scale, -1, 0.0, False, name)),
                 (f"{forward}.forward", lambda: kernel.forward(q, k, v, None, None, meta, scale, None, None))]
    return rows


def plans_launches(backend: str, device: torch.device) -> bool:
    """Whether ``backend`` keeps launch plans per layout (so has an "off" row): the CUDA and Triton backends."""
    if backend == "auto":
        return device.type == "cuda"
    return any(part in ("cuda", "triton") for part in backend.split("+"))


def run(backends: list[str], cfg: AttnConfig, device: torch.device, calls: int, layers: bool, writer) -> list[dict]:
    from tqdm.auto import tqdm

    cases = [(b, plan) for b in backends for plan in (("on", "off") if plans_launches(b, device) else ("n/a",))]
    out = []
    with restored_env(*PLAN_CACHES):
        for backend, plan in tqdm(cases, desc="host time", dynamic_ncols=True):
            for var in PLAN_CACHES:
                set_env(var, "0" if plan == "off" else None)
            for what, fn in measurements(backend, cfg, device, layers):
                row = dict(backend=backend, plan_cache=plan, what=what, us_per_call=per_call_us(fn, calls, device),
                           calls=calls)
                out.append(row)
                if writer is not None:
                    writer.add(row)
    return out


def table(rows: list[dict]) -> str:
    lines = ["| backend | launch plan kept | what | us per call |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['backend']} | {r['plan_cache']} | {r['what']} | {r['us_per_call']:.1f} |" for r in rows]
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> Path:
    plt = pyplot()
    labels = [f"{r['backend']} ({r['plan_cache']})\n{r['what']}" if r["plan_cache"] != "n/a" else f"{r['backend']}\n{r['what']}"
              for r in rows]
    fig, ax = plt.subplots(figsize=(7.0, 0.35 * len(rows) + 1.2))
    ax.barh(range(len(rows)), [r["us_per_call"] for r in rows], color="#4477aa")
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("host time per call (us)")
    ax.set_title(f"dualkv_attention host time per call, {title}", fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    return save_figure(fig, path)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backends", default=None, help="comma-separated (default: auto,cuda,triton,cuda+triton on CUDA; reference on CPU)")
    ap.add_argument("--config", default="N=2,P=256,R=64,H=32,H_kv=8,d=128",
                    help="a layout small enough that the kernels never hold the host back")
    ap.add_argument("--calls", type=int, default=200, help="timed calls per row")
    ap.add_argument("--layers", action="store_true", help="also time the layers under the public function")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--stem", default=None)
    args = ap.parse_args(argv)
    if args.calls < 1:
        ap.error(f"--calls: expected a positive count, got {args.calls}")
    default = "auto,cuda,triton,cuda+triton" if args.device.startswith("cuda") else "reference"
    args.backends = [b.strip() for b in (args.backends or default).split(",") if b.strip()]
    bad = [b for b in args.backends if b not in BACKEND_CHOICES]
    if bad:
        ap.error(f"--backends: expected names from {list(BACKEND_CHOICES)}, got {bad}")
    try:
        args.config = AttnConfig.parse(args.config)
    except ValueError as e:
        ap.error(f"--config: {e}")
    return args


def main(argv=None) -> Path:
    args = parse_args(argv)
    device = torch.device(args.device)
    meta = environment(device, MODULE, sys.argv[1:] if argv is None else list(argv))
    meta.update(config=args.config.name, calls=args.calls)
    card = meta["card"]["name"].split()[-1].lower() if device.type == "cuda" else "cpu"
    stem = args.stem or f"host_{card}_{datetime.now(timezone.utc):%Y%m%d-%H%M}"
    writer = ResultWriter(args.out, stem, meta, COLUMNS)
    rows = run(args.backends, args.config, device, args.calls, args.layers, writer)
    writer.flush()
    md = writer.dir / f"{stem}.md"
    md.write_text(f"# {stem}\n\n- {meta['card']['name']}, {meta['date']}: `{shown_command(meta)}`  \n"
                  f"  torch {meta['versions'].get('torch')}, dualkv {meta['versions'].get('dualkv')} "
                  f"(commit {meta.get('git_commit')})\n- layout {args.config.label} (H={args.config.H}, "
                  f"H_kv={args.config.H_kv}, d={args.config.d}), {args.calls} calls a row, mean wall time, one "
                  "synchronisation at the end\n\n" + table(rows) + "\n")
    png = plot(rows, writer.dir / f"{stem}.png", meta["card"]["name"])
    print(table(rows))
    print(md, png, sep="\n")
    return writer.json_path


if __name__ == "__main__":
    main()
