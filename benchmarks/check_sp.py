"""Sequence-parallel correctness at realistic shapes on several GPUs: SP log-probs and gradients
against the same model on one device.

Run under torchrun, one rank per GPU (NCCL; gloo on CPUs)::

    torchrun --nproc-per-node 8 -m benchmarks.check_sp                       # sp 2, 4, 8
    torchrun --nproc-per-node 8 -m benchmarks.check_sp --presets qwen3-8b,qwen3-30b-a3b,gemma4-31b \\
        --layers 4 --prompt 64K --responses 16 --response-range 131:2048
    torchrun --nproc-per-node 2 -m benchmarks.check_sp --presets tiny-qwen3 --prompt 300 \\
        --responses 4 --response-range 8:64 --device cpu                    # smoke test

For every preset (random weights, bf16, activation checkpointing, the first ``--layers`` decoder layers,
a hybrid at least up to its first layer of every attention type) every rank builds the
same model and the same packed micro-batch (one prompt of P tokens, N responses of seeded lengths),
then:

- reference: ``model.response_logprobs`` on the whole micro-batch on this rank alone, and the
  gradient of ``sum(w * logprobs)`` (w: fixed random weights over the response tokens);
- for each SP size: the ranks form groups of that size (``init_sp_mesh``), every group runs the
  same micro-batch through ``parallelize_sequence`` + ``sp_response_logprobs``, and the group sums
  its ranks' gradient shares.

Reported per (preset, sp): the largest log-prob difference, the relative gradient error
``||g_sp - g_ref|| / ||g_ref||`` over all parameters, and both against ``--lp-tol`` / ``--grad-tol``
(defaults: bf16 rounding of activations over a few layers). Rank 0 writes ``<stem>.json``,
``.csv`` and ``.md`` with the card, date and exact command. MoE models are checked on the log-prob
loss only (their load-balancing loss goes through ``sp_router_stats``, tested on CPU).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.bench_memory_scaling import first_layers, parse_range
from benchmarks.harness import fmt_size, parse_size
from benchmarks.report import ResultWriter, environment, shown_command

MODULE = "benchmarks.check_sp"
COLUMNS = ["preset", "layers", "sp", "tokens", "P", "N", "status", "max_logprob_diff", "grad_rel_err",
           "ref_s", "sp_s", "peak_memory_gib"]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="qwen3-8b,qwen3-30b-a3b,gemma4-31b", help="comma-separated model presets")
    ap.add_argument("--layers", type=int, default=4,
                    help="keep the first LAYERS decoder layers of each preset (at most all; a hybrid keeps at "
                         "least up to its first layer of each attention type)")
    ap.add_argument("--sp", default=None, help="comma-separated SP sizes (default: 2, 4, ... up to the world size)")
    ap.add_argument("--prompt", type=parse_size, default=parse_size("64K"), help="prompt length P")
    ap.add_argument("--responses", type=int, default=16, help="responses N after the prompt")
    ap.add_argument("--response-range", type=parse_range, default=(131, 2048), help="response lengths MIN:MAX")
    ap.add_argument("--lp-tol", type=float, default=5e-2, help="largest allowed log-prob difference")
    ap.add_argument("--grad-tol", type=float, default=5e-2, help="largest allowed relative gradient error")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--stem", default=None)
    return ap.parse_args(argv)


def sp_sizes(text: str | None, world: int) -> list[int]:
    """The SP sizes to check: each must divide the world size (a group of ranks per micro-batch copy)."""
    sizes = [int(s) for s in text.split(",")] if text else [s for s in (2, 4, 8, 16, 32, 64) if s <= world]
    bad = [s for s in sizes if s < 1 or world % s]
    if bad or not sizes:
        raise SystemExit(f"--sp: expected sizes that divide the world size {world}, got {text or sizes}")
    return sizes


def layers_to_cover_every_type(hf: dict) -> int:
    """How many leading layers hold every attention type of a hybrid model (Gemma-4: the first global
    layer is the 6th), so that a cut model still checks the global layers; 1 for uniform models."""
    types = hf.get("layer_types")
    if not isinstance(types, list) or not types:
        return 1
    return max(types.index(t) for t in set(types)) + 1


def build_model(preset: str, layers: int, device, seed: int):
    """The preset's first ``layers`` decoder layers, random weights, bf16 (a cut Gemma-4 keeps no KV sharing),
    with activation checkpointing as in training (without it the single-device reference of a long
    Gemma-4 micro-batch does not fit one card). Built on the meta device and allocated on ``device``
    one decoder layer at a time (each cast to bf16 before the next exists): no whole fp32 copy on the
    host or the device."""
    from dualkv.models import build_model as build, materialize, preset_hf_config

    hf = preset_hf_config(preset)
    if layers < 1:
        raise SystemExit(f"--layers: expected >= 1, got {layers}")
    layers = min(max(layers, layers_to_cover_every_type(hf)), hf["num_hidden_layers"])
    hf = first_layers(hf, layers)
    model = build(hf, device="meta")
    materialize(model, device, seed=seed, units=list(model.model.layers), on_unit=lambda layer: layer.to(torch.bfloat16))
    model.to(dtype=torch.bfloat16)
    model.set_activation_checkpointing(True)
    return model


def make_batch(vocab: int, P: int, N: int, r_range: tuple[int, int], seed: int, device):
    """The packed micro-batch and the loss weights, the same on every rank."""
    from dualkv.core import PackedLayout

    rng = random.Random(f"{seed}-{P}-{N}")
    lens = [rng.randint(*r_range) for _ in range(N)]
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (P,), generator=g)
    responses = [torch.randint(0, vocab, (r,), generator=g) for r in lens]
    layout = PackedLayout.from_groups([(prompt, responses)], device=device)
    weights = torch.randn(N, max(lens), generator=g)
    mask = torch.arange(max(lens))[None, :] < torch.tensor(lens)[:, None]
    return layout, (weights * mask).to(device)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: (torch.zeros_like(p, dtype=torch.float32) if p.grad is None else p.grad.float())
            for n, p in model.named_parameters()}


def _timed(fn, device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - t0


def check_preset(preset: str, args, sizes: list[int], device) -> list[dict]:
    """Rows for one preset: the reference on this rank, then every SP size."""
    from dualkv.parallel import init_sp_mesh, parallelize_sequence, sp_response_logprobs, unparallelize_sequence

    model = build_model(preset, args.layers, device, args.seed)
    layout, weights = make_batch(model.config.vocab_size, args.prompt, args.responses, args.response_range,
                                 args.seed, device)
    base = dict(preset=preset, layers=model.config.num_layers, tokens=layout.total_tokens, P=args.prompt,
                N=args.responses)

    def reference():
        model.zero_grad(set_to_none=True)
        lp = model.response_logprobs(layout)
        (lp * weights).sum().backward()
        return lp.detach().float()

    lp_ref, ref_s = _timed(reference, device)
    g_ref = _grads(model)
    ref_norm = torch.sqrt(sum(g.double().square().sum() for g in g_ref.values()))
    rows = []
    for sp in sizes:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        mesh = init_sp_mesh(sp, device_type=device.type)
        parallelize_sequence(model, mesh.sp_group)

        def sp_pass():
            model.zero_grad(set_to_none=True)
            lp = sp_response_logprobs(model, layout, mesh.sp_group)
            (lp * weights).sum().backward()
            return lp.detach().float()

        try:
            lp_sp, sp_s = _timed(sp_pass, device)
        finally:
            unparallelize_sequence(model)
        diff2 = torch.zeros((), dtype=torch.float64, device=device)
        for name, g in _grads(model).items():
            dist.all_reduce(g, group=mesh.sp_group)  # the group's gradient shares add up
            diff2 += (g.double() - g_ref[name].double()).square().sum()
        lp_diff = (lp_sp - lp_ref).abs().max().item()
        grad_err = (diff2.sqrt() / ref_norm).item()
        ok = lp_diff <= args.lp_tol and grad_err <= args.grad_tol
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        rows.append(dict(base, sp=sp, status="ok" if ok else "FAIL", max_logprob_diff=lp_diff, grad_rel_err=grad_err,
                         ref_s=ref_s, sp_s=sp_s, peak_memory_gib=peak))
    del model
    return rows


def _worst(rows: list[dict], key: str) -> dict:
    """Each row's value as the worst over ranks (every rank checks its own group)."""
    t = torch.tensor([r[key] for r in rows], dtype=torch.float64,
                     device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {i: v for i, v in enumerate(t.tolist())}


def main(argv=None) -> tuple[Path | None, bool]:
    """Runs the check on every rank; returns (rank 0's result JSON or None, whether every row passed)."""
    from tqdm.auto import tqdm

    args = parse_args(argv)
    device = torch.device(args.device)
    if not dist.is_initialized():  # torchrun sets the environment; tests may pass an initialised group
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    world, rank = dist.get_world_size(), dist.get_rank()
    sizes = sp_sizes(args.sp, world)
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    meta = environment(device, MODULE, sys.argv[1:] if argv is None else list(argv))
    meta.update(world_size=world, layers=args.layers, dtype="bfloat16", response_range=list(args.response_range),
                lp_tol=args.lp_tol, grad_tol=args.grad_tol, seed=args.seed)
    writer = None
    if rank == 0:
        stem = args.stem or f"check_sp_{world}x_{datetime.now(timezone.utc):%Y%m%d-%H%M}"
        writer = ResultWriter(args.out, stem, meta, COLUMNS)
    passed = True
    for preset in tqdm(presets, desc="sp check", disable=rank != 0, dynamic_ncols=True):
        rows = check_preset(preset, args, sizes, device)
        worst = {k: _worst(rows, k) for k in ("max_logprob_diff", "grad_rel_err")}
        for i, row in enumerate(rows):
            row.update(max_logprob_diff=worst["max_logprob_diff"][i], grad_rel_err=worst["grad_rel_err"][i])
            row["status"] = "ok" if row["max_logprob_diff"] <= args.lp_tol and row["grad_rel_err"] <= args.grad_tol \
                else "FAIL"
            passed &= row["status"] == "ok"
            if writer is not None:
                writer.add(row)
                print(f"{preset} sp={row['sp']}: max |dlogprob| {row['max_logprob_diff']:.3e}, grad rel err "
                      f"{row['grad_rel_err']:.3e} -> {row['status']}", flush=True)
    if writer is None:
        return None, passed
    writer.flush()
    md = writer.dir / f"{writer.stem}.md"
    lines = [f"# {writer.stem}", "", f"- {meta['card']['name']} x {world}, {meta['date']}: `{shown_command(meta)}`",
             f"- torch {meta['versions'].get('torch')}, Triton {meta['versions'].get('triton')}, commit "
             f"{meta.get('git_commit')}; bf16, random weights, the first --layers {args.layers} decoder layers (a hybrid "
             f"keeps up to its first layer of each attention type: the layers column); one prompt of "
             f"P tokens and N responses of U{tuple(args.response_range)} tokens; tolerances "
             f"|dlogprob| <= {args.lp_tol}, grad rel err <= {args.grad_tol}", "",
             "| preset | layers | sp | tokens | max abs log-prob diff | grad rel err | status | ref s | sp s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in writer.rows:
        lines.append(f"| {r['preset']} | {r['layers']} | {r['sp']} | {fmt_size(r['tokens'])} | {r['max_logprob_diff']:.2e} | "
                     f"{r['grad_rel_err']:.2e} | {r['status']} | {r['ref_s']:.2f} | {r['sp_s']:.2f} |")
    md.write_text("\n".join(lines) + "\n")
    return writer.json_path, passed


if __name__ == "__main__":
    path, passed = main()
    if dist.is_initialized():
        dist.destroy_process_group()
    if path is not None:
        print(path)
    sys.exit(0 if passed else 1)
