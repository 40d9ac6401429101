"""Policy-update step through the real training code, on one device or several: DualKV vs replicated packing.

Each configuration builds a ``dualkv.train.Trainer`` (the object ``python -m dualkv.train.grpo`` runs)
with synthetic rollouts (prompt of P tokens, responses R_i ~ U(131, 2048), random 0/1 rewards,
seeded), GRPO with a KL term (so all three phases run: ``--old-logprobs recompute``, the default here,
keeps the old_log_prob pass that the trainer skips by default with one optimizer step per batch;
``from-update`` measures that), AdamW on the full parameters, and runs
``--warmup`` untimed steps then ``--steps`` measured ones. Reported, per (packing, mb), from the
trainer's own step metrics (medians over the measured steps):

- ``old_log_prob``, ``ref_log_prob`` and ``update`` phase seconds (device-synchronised wall time);
- tokens/s = tokens the model ran in the update phase / update seconds, and effective tokens/s (the
  replicated tokens the step is equivalent to, so both packings are on one scale);
- MFU as ``dualkv.train.metrics`` computes it: FLOPs / (old + ref + update seconds * world * peak),
  FLOPs = the model FLOPs of the tokens actually run (a forward = T*F_token + logits + attention
  pairs; ref/old passes 1 forward, update 3 forwards); and ``useful_mfu``, the same with the FLOPs
  of the DualKV (prompt-once) layout of the same batch for both packings, so the replicated
  baseline is not credited for recomputing the prompt;
- peak memory (``torch.cuda.max_memory_allocated`` over the measured steps), OOM recorded.

Micro-batches: the trainer never splits a prompt group, so a micro-batch of mb responses is one
group of N = mb responses (``--micro-batch-tokens 1`` puts every group in a micro-batch of its own);
a step trains ``--responses-per-step`` (default 16) responses = 16/mb groups. rho = N(P+R)/(P+NR)
is the batch's replicated / packed token ratio; it is tabulated next to the measured speedups.

    python -m benchmarks.bench_policy_step                                  # qwen3-1.7b, P = 8K, mb 4, 8, 16
    python -m benchmarks.bench_policy_step --preset tiny-qwen3 --prompt 64 --response-range 8:16 \\
        --mbs 4,8 --responses-per-step 8 --device cpu                       # smoke test
    python -m benchmarks.bench_policy_step --merge a.json b.json --stem policy_step_h200  # one report
    python -m benchmarks.bench_policy_step --mbs 8 --profile         # + the top ops of one step, per configuration
    python -m benchmarks.bench_policy_step --mbs 8 --old-logprobs from-update   # the trainer's default: no old pass

Several GPUs: run it under torchrun (one rank per GPU; FSDP2 over all ranks, ``--sp`` sequence-parallel
ranks per micro-batch, the groups of a step spread over the dp = world / sp replicas). Times and
tokens/s are rank 0's (the ranks meet in every collective), peak memory the largest of any rank,
MFU over all devices; only rank 0 writes the results::

    torchrun --nproc-per-node 8 -m benchmarks.bench_policy_step --preset qwen3-8b --mbs 4,8 \
        --responses-per-step 32 --sp 2
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "benchmarks"

import torch
import torch.distributed as dist

from benchmarks.bench_memory_scaling import parse_range
from benchmarks.gpu_monitor import GpuMonitor
from benchmarks.harness import _is_oom, fmt_size, parse_size
from benchmarks.report import ResultWriter, environment, shown_command
from dualkv.core.backends import BACKEND_CHOICES
from dualkv.core.logprobs import LOGPROB_IMPLS
from dualkv.models.fused import FUSED_MODES, liger_runs_on, set_fused_ops
from dualkv.train.trainer import OPTIMIZER_IMPLS

MODULE = "benchmarks.bench_policy_step"
PACKINGS = ("dualkv", "replicated")
PHASES = ("old_log_prob", "ref_log_prob", "update")
COLUMNS = ["packing", "P", "mb", "groups", "status", "rho", "packed_tokens", "replicated_tokens",
           "time_old_log_prob", "time_ref_log_prob", "time_update", "time_compute", "tokens_per_s",
           "effective_tokens_per_s", "tflops", "mfu", "useful_mfu", "peak_memory_gib", "steps", "sm_clock_mhz", "power_w", "oom_at"]


def predicted_rho(N: int, P: float, R: float) -> float:
    """rho = N(P+R) / (P+NR): replicated over packed tokens of one group with mean response length R."""
    return N * (P + R) / (P + N * R)


def train_config(args, packing: str, mb: int):
    from dualkv.train.distributed import ParallelConfig
    from dualkv.train.losses import LossConfig
    from dualkv.train.trainer import OptimConfig, TrainConfig
    from dualkv.train.update import UpdateConfig

    cuda = args.device.startswith("cuda")
    return TrainConfig(
        model=args.preset, rollouts="synthetic", groups=args.responses_per_step // mb, n=mb,
        steps=args.warmup + args.steps, seed=args.seed, synthetic_prompt_len=(args.prompt, args.prompt),
        synthetic_response_len=tuple(args.response_range), peak_tflops=args.peak_tflops, progress=False,
        loss=LossConfig.grpo(kl_beta=args.kl_beta),
        update=UpdateConfig(packing=packing, micro_batch_tokens=1, logprob_micro_batch_tokens=args.logprob_micro_batch_tokens,
                            recompute_old_logprobs=args.old_logprobs == "recompute"),
        optim=OptimConfig(lr=1e-6, implementation=args.optimizer_impl),
        parallel=ParallelConfig(sp=args.sp, param_dtype="bf16" if cuda else "fp32",
                                activation_checkpointing=args.activation_checkpointing, compile=args.compile,
                                checkpoint_keep_attention=args.keep_attention, attention_backend=args.attention_backend,
                                logprobs_impl=args.logprobs_impl, fused_ops=args.fused_ops,
                                reshard_after_forward=args.reshard_after_forward,
                                reduce_grads_once=args.reduce_grads_once),
    )


def useful_flops(trainer, step: int) -> float:
    """FLOPs of the step's batch on the DualKV layout (prompt once), whatever the packing run."""
    from dualkv.core import PackedLayout
    from dualkv.train.metrics import forward_flops

    batch = trainer.source.rollouts(step)
    update = trainer.cfg.update
    passes = (0 if update.old_logprobs_from_update else 1) + (1 if trainer.cfg.loss.needs_reference else 0) + 3 * update.epochs
    fwd = sum(forward_flops(trainer.policy.config, PackedLayout.from_lengths([g.prompt_len], [g.response_lens], device="cpu"))
              for g in batch.groups)
    return float(passes * fwd)


def _median(recs: list[dict], key: str):
    vals = [r[key] for r in recs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _report_step(packing: str, mb: int, step: int, args, rec: dict) -> None:
    """One line per step on rank 0 (a large model's step takes minutes; the warm-up autotunes)."""
    if _rank() != 0:
        return
    from tqdm.auto import tqdm

    kind = "warm-up" if step < args.warmup else "measured"
    phases = ", ".join(f"{k} {rec[f'time_{k}']:.2f} s" for k in PHASES if rec.get(f"time_{k}") is not None)
    tqdm.write(f"{packing} mb={mb} step {step + 1}/{args.warmup + args.steps} ({kind}): {phases}", file=sys.stderr)


def run_config(args, packing: str, mb: int, meta: dict | None = None) -> dict:
    from dualkv.train.metrics import peak_flops
    from dualkv.train.trainer import Trainer

    row = dict(packing=packing, P=args.prompt, mb=mb, groups=args.responses_per_step // mb)
    trainer = None
    stage = "building the trainer"  # where an out-of-memory error struck, for the report
    # this rank's GPU clock and power over the measured steps (the step runs at the card's power cap)
    with GpuMonitor(torch.cuda.current_device() if args.device.startswith("cuda") else None) as monitor:
        try:
            trainer = Trainer(train_config(args, packing, mb))
            for step in range(args.warmup):
                stage = f"warm-up step {step + 1}"
                _report_step(packing, mb, step, args, trainer.train_step(step))
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            recs, useful = [], []
            measured_from = time.monotonic()
            for step in range(args.warmup, args.warmup + args.steps):
                stage = f"measured step {step - args.warmup + 1}"
                rec = trainer.train_step(step)
                _report_step(packing, mb, step, args, rec)
                compute = sum(rec.get(f"time_{k}", 0.0) for k in PHASES)
                rec["time_compute"] = compute
                peak = peak_flops(args.peak_tflops)
                rec["useful_mfu"] = useful_flops(trainer, step) / (compute * trainer.ctx.world_size * peak) if peak and compute else None
                recs.append(rec)
            clocks = monitor.window(measured_from, time.monotonic())
            if clocks is not None:
                row.update(sm_clock_mhz=clocks["sm_clock_mhz"], power_w=clocks["power_w"])
            if args.profile:
                stage = "the profiled step"
                row["profile"] = profile_step(trainer, args.warmup + args.steps,
                                              Path(args.out) / f"{args.stem or 'policy_step'}_{packing}_mb{mb}_profile.txt",
                                              meta or {}, peak=peak_flops(args.peak_tflops))
            peak_gib = max((r["peak_memory_gib"] for r in recs if r.get("peak_memory_gib") is not None), default=None)
            # every measured step's three phases, so that the table shows the spread behind the median
            row["time_compute_steps"] = [r["time_compute"] for r in recs]
            row.update(status="ok", steps=len(recs), rho=_median(recs, "rho"),
                       packed_tokens=_median(recs, "packed_tokens"), replicated_tokens=_median(recs, "replicated_tokens"),
                       peak_memory_gib=_max_over_ranks(peak_gib))
            for key in [f"time_{k}" for k in PHASES] + ["time_compute", "tokens_per_s", "effective_tokens_per_s", "tflops",
                                                        "mfu", "useful_mfu"]:
                row[key] = _median(recs, key)
        except Exception as e:  # noqa: BLE001
            if not _is_oom(e) or _world() > 1:  # several ranks: one rank's OOM would leave the others waiting
                raise
            row["status"] = "OOM"
            row["oom_at"] = oom_place(stage, trainer.timer.failed_in if trainer is not None else None, e)
        finally:
            if trainer is not None:
                trainer.close()
            trainer = None
            _free()
    return row


def oom_place(stage: str, phase: str | None, err: BaseException) -> str:
    """Where an out-of-memory error struck: the stage, the step's phase, and the allocation it tried."""
    place = f"{stage}, {phase}" if phase else stage
    tried = re.search(r"Tried to allocate ([0-9.]+ [KMGT]?i?B)", str(err))
    return f"{place} (tried to allocate {tried.group(1)})" if tried else place


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def _max_over_ranks(value: float | None) -> float | None:
    """The largest value over all ranks (peak memory per GPU); the value itself on one rank."""
    if _world() == 1 or value is None:
        return value
    t = torch.tensor([value], dtype=torch.float64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _deadline_passed(start: float, deadline_s: float | None) -> bool:
    """Whether to stop starting configurations: rank 0's clock decides for every rank."""
    passed = deadline_s is not None and time.monotonic() - start > deadline_s
    if _world() == 1:
        return passed
    t = torch.tensor([float(passed)], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.broadcast(t, src=0)
    return bool(t.item())


def profile_step(trainer, step: int, path: Path, meta: dict, top: int = 40, peak: float | None = None) -> str:
    """One more step under torch.profiler, written to ``path`` under the run's card, date and command
    (``meta``), so the time an MFU figure leaves on the table can be attributed: the ``top`` ops by
    self device time (CPU time on a CPU), then the same ops split by their input shapes (which
    tensors a copy or an element-wise kernel worked on); on a GPU also the device time by kind of
    kernel and phase, with what ran beside the main stream, each phase's speed by kind of kernel (its
    model FLOPs against their device time; ``peak`` FLOP/s for the share), and where the GPU sat idle
    and what the host was doing then (``benchmarks.timeline``)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=True) as prof:
        trainer.train_step(step)
        if cuda:
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    path.parent.mkdir(parents=True, exist_ok=True)
    card = meta.get("card", {}).get("name", "?")
    head = f"{card}, {meta.get('date')}: `{shown_command(meta)}`; one step (#{step}) under torch.profiler\n\n"
    tables = [("by op", prof.key_averages()),
              ("by op and input shapes", prof.key_averages(group_by_input_shape=True))]
    text = head + "\n".join(f"## {title}\n\n{avg.table(sort_by=key, row_limit=top, max_name_column_width=80)}\n"
                             for title, avg in tables)
    if cuda:
        from benchmarks.timeline import idle_report, kind_report, minor_kernels_report, speed_report

        text += "\n## device time by kind and phase\n\n" + "\n".join(kind_report(prof)) + "\n"
        text += ("\n## speed by kind and phase (model FLOPs over device time)\n\n"
                 + "\n".join(speed_report(prof, trainer.updater.flops_by_phase, peak=peak)) + "\n")
        text += ("\n## the other kinds' largest kernels (launching operator; ms per phase)\n\n"
                 + "\n".join(minor_kernels_report(prof, 10)) + "\n")
        text += "\n## idle GPU time (host operator at each stretch's middle)\n\n" + "\n".join(idle_report(prof, 25)) + "\n"
    path.write_text(text)
    return path.name


# -------------------------------------------------------------------------------------- outputs
def speedups(rows: list[dict], P: int | None = None, r_mean: float | None = None) -> list[dict]:
    """Per mb: rho (the batch's token ratio; and the formula at P and the expected R when given) next to
    the replicated/dualkv time ratio of the update phase and of the three phases."""
    out = []
    by = {(r["mb"], r["packing"]): r for r in rows}
    for mb in dict.fromkeys(r["mb"] for r in rows):
        d, rep = by.get((mb, "dualkv")), by.get((mb, "replicated"))
        rho = d.get("rho") if d else None
        expected = predicted_rho(mb, P, r_mean) if P is not None and r_mean is not None else None
        item = dict(mb=mb, rho=rho, predicted_rho=expected, update_speedup=None, step_speedup=None,
                    replicated_status=rep["status"] if rep else None)
        if d and rep and d["status"] == "ok" and rep["status"] == "ok":
            item["update_speedup"] = rep["time_update"] / d["time_update"]
            item["step_speedup"] = rep["time_compute"] / d["time_compute"]
        out.append(item)
    return out


def _f(v, spec):
    return "n/a" if v is None else format(v, spec)


def _phase_range(row: dict) -> str:
    """The median three-phase time and, where the file lists every step's, their range."""
    steps = row.get("time_compute_steps") or []
    median = _f(row.get("time_compute"), ".3f")
    return f"{median} ({min(steps):.3f}-{max(steps):.3f})" if len(steps) > 1 else median


def tables(rows: list[dict], meta: dict) -> str:
    """The phase table and the rho table; ``meta`` holds the run settings (P, response_range, ...)."""
    P, r_range = meta["P"], tuple(meta["response_range"])
    out = [f"One policy-update step, P = {fmt_size(P)}, {meta['responses_per_step']} responses per step, "
           f"R_i ~ U{r_range}; medians of {meta['steps']} measured steps after {meta['warmup']} warm-up:", "",
           "| packing | mb | status | old_log_prob s | ref_log_prob s | update s | 3 phases s (steps' range) | tokens/s "
           "| effective tokens/s | MFU | useful MFU | peak GiB |", "|" + " --- |" * 12]
    for r in rows:
        if r["status"] != "ok":
            status = f"OOM in {r['oom_at']}" if r["status"] == "OOM" and r.get("oom_at") else r["status"]
            out.append(f"| {r['packing']} | {r['mb']} | {status} |" + " |" * 9)
            continue
        out.append(f"| {r['packing']} | {r['mb']} | ok | {_f(r['time_old_log_prob'], '.3f')} "
                   f"| {_f(r['time_ref_log_prob'], '.3f')} | {_f(r['time_update'], '.3f')} | {_phase_range(r)} "
                   f"| {_f(r['tokens_per_s'], '.0f')} "
                   f"| {_f(r['effective_tokens_per_s'], '.0f')} | {_f(r['mfu'], '.1%')} | {_f(r['useful_mfu'], '.1%')} "
                   f"| {_f(r['peak_memory_gib'], '.2f')} |")
    clocked = [r for r in rows if r["status"] == "ok" and r.get("sm_clock_mhz") is not None]
    if clocked:
        out += ["", "SM clock and board power over the measured steps (medians of nvidia-smi samples every 200 ms; "
                "the card's unloaded maximum is higher): " + "; ".join(
                    f"{r['packing']} mb={r['mb']} {r['sm_clock_mhz']:.0f} MHz"
                    + (f", {r['power_w']:.0f} W" if r.get("power_w") is not None else "") for r in clocked) + "."]
    out += ["", "rho = N(P+R)/(P+NR) (the batch's replicated / packed tokens) next to the measured speedup "
            "(replicated time / dualkv time):", "",
            "| mb | rho (batch) | rho (E[R]) | update-phase speedup | 3-phase speedup |", "| --- | --- | --- | --- | --- |"]
    for s in speedups(rows, P, sum(r_range) / 2):
        na = s["replicated_status"] if s["update_speedup"] is None and s["replicated_status"] not in (None, "ok") else None
        out.append(f"| {s['mb']} | {_f(s['rho'], '.2f')} | {_f(s['predicted_rho'], '.2f')} | {na or _f(s['update_speedup'], '.2f')} "
                   f"| {na or _f(s['step_speedup'], '.2f')} |")
    out += ["", "MFU = (old + ref forward FLOPs + 3 x update forward FLOPs) / ((old + ref + update seconds) x devices x "
            "peak bf16 FLOP/s), forward FLOPs = T x F_token + response tokens x 2 x D x V + sum over layers of "
            "4 x H x d x attended pairs, T the tokens the packing runs (dualkv.train.metrics). Useful MFU counts "
            "the prompt-once layout's FLOPs for both packings."]
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: Path, title: str) -> Path | None:
    from benchmarks.report import pyplot, save_figure

    plt = pyplot()

    if not rows:
        return None
    mbs = list(dict.fromkeys(r["mb"] for r in rows))
    by = {(r["mb"], r["packing"]): r for r in rows}
    fig, ax = plt.subplots(figsize=(2.0 + 1.6 * len(mbs), 4.2))
    width = 0.38
    labelled = set()  # each phase named in the legend once, by the first bar drawn for it
    for j, p in enumerate(PACKINGS):
        for i, mb in enumerate(mbs):
            r, x = by.get((mb, p)), i - 0.2 + j * width
            if r is None:
                continue
            if r["status"] != "ok":
                ax.text(x, 0.02, r["status"].split(":")[0], rotation=90, ha="center", fontsize=8,
                        transform=ax.get_xaxis_transform())
                continue
            bottom = 0.0
            for k, phase in enumerate(PHASES):
                v = r.get(f"time_{phase}") or 0.0
                ax.bar(x, v, width, bottom=bottom, color=f"C{k}", hatch="//" if p == "replicated" else None,
                       edgecolor="white", label=None if phase in labelled else phase)
                labelled.add(phase)
                bottom += v
    ax.set_xticks(range(len(mbs)), [f"mb={m}\n(dualkv | repl.)" for m in mbs], fontsize=8)
    ax.set_ylabel("seconds per step")
    if labelled:
        ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(f"Policy-update step phases, {title}", fontsize=9)
    return save_figure(fig, path)


# ----------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3-1.7b", help="dualkv.models preset (random weights)")
    ap.add_argument("--prompt", type=parse_size, default=8192, help="prompt length P (e.g. 8K)")
    ap.add_argument("--response-range", type=parse_range, default=(131, 2048), help="response lengths MIN:MAX")
    ap.add_argument("--mbs", default="4,8,16", help="comma-separated responses per micro-batch (= per group)")
    ap.add_argument("--responses-per-step", type=int, default=16, help="responses trained per step (a multiple of each mb)")
    ap.add_argument("--packings", default=",".join(PACKINGS))
    ap.add_argument("--kl-beta", type=float, default=0.04, help="GRPO KL weight (> 0 runs the ref_log_prob phase)")
    ap.add_argument("--no-activation-checkpointing", dest="activation_checkpointing", action="store_false")
    ap.add_argument("--compile", action="store_true", help="torch.compile every decoder layer (fuses the element-wise chains)")
    ap.add_argument("--attention-backend", choices=BACKEND_CHOICES, default="auto",
                    help="dualkv_attention backend of both packings (auto: what measured fastest per head dim on CUDA "
                         "tensors; a+b: a's forward, b's backward)")
    ap.add_argument("--logprobs-impl", choices=LOGPROB_IMPLS, default=None,
                    help="log-prob head's reduction of each chunk of logits, both packings (default: "
                         "$DUALKV_LOGPROBS_IMPL, else auto: triton for bf16 on CUDA); the report names the one that ran")
    ap.add_argument("--keep-attention", action="store_true",
                    help="checkpointed layers keep their attention outputs (no attention forward in the recompute)")
    ap.add_argument("--fused-ops", choices=FUSED_MODES, default="auto",
                    help="eager layers' RMSNorm, RoPE and SwiGLU: Liger's fused kernels (auto: on CUDA where installed) "
                         "or PyTorch's ops (off), both packings")
    ap.add_argument("--no-reshard-after-forward", dest="reshard_after_forward", action="store_false",
                    help="FSDP keeps each layer's gathered parameters from forward to backward, both packings")
    ap.add_argument("--reduce-grads-once", action="store_true",
                    help="FSDP reduces each mini-batch's gradients once, after its last micro-batch, both packings")
    ap.add_argument("--optimizer-impl", choices=OPTIMIZER_IMPLS, default="auto",
                    help="AdamW implementation (auto: torch's fused kernel on CUDA), both packings")
    ap.add_argument("--old-logprobs", choices=("recompute", "from-update"), default="recompute",
                    help="recompute: the old_log_prob pass runs (the three phases); from-update: the trainer's default "
                         "for one optimizer step per batch, the update's own log-probs detached (no old_log_prob pass)")
    ap.add_argument("--logprob-micro-batch-tokens", type=parse_size, default=None,
                    help="token budget of the no-grad old / ref passes' micro-batches (e.g. 64K: every group of the "
                         "step in one forward); default: one group per micro-batch, as the update")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per configuration")
    ap.add_argument("--steps", type=int, default=3, help="measured steps per configuration")
    ap.add_argument("--peak-tflops", type=float, default=None, help="per-device peak for MFU (default: known GPUs)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="the trainer's device (CUDA when available)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--stem", default=None)
    ap.add_argument("--deadline-s", type=float, default=None, help="stop starting new configurations after this many seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sp", type=int, default=1, help="sequence-parallel ranks per micro-batch (under torchrun)")
    ap.add_argument("--profile", action="store_true",
                    help="after the measured steps, profile one more step per configuration (<stem>_<packing>_mb<mb>_profile.txt)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="measure nothing: one report from earlier results of the same settings (later files win)")
    args = ap.parse_args(argv)
    args.mbs = [int(m) for m in args.mbs.split(",")]
    args.packings = [p.strip() for p in args.packings.split(",")]
    if set(args.packings) - set(PACKINGS):
        ap.error(f"--packings: expected a subset of {PACKINGS}, got {args.packings}")
    if any(args.responses_per_step % m for m in args.mbs):
        ap.error(f"--responses-per-step: expected a multiple of every mb {args.mbs}, got {args.responses_per_step}")
    if args.steps < 1:
        ap.error("--steps: expected >= 1")
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.sp < 1 or world % args.sp:
        ap.error(f"--sp: expected a divisor of the world size {world}, got {args.sp}")
    if args.merge is None and args.device.startswith("cuda") != torch.cuda.is_available():
        ap.error(f"--device: the trainer runs on CUDA exactly when CUDA is available; got {args.device}")
    return args


def main(argv=None) -> Path | None:
    """The result JSON (on rank 0; None on the other ranks of a torchrun)."""
    args = parse_args(argv)
    if args.merge:
        return merge(args.merge, args.out, args.stem or Path(args.merge[0]).stem)
    threads = torch.get_num_threads()
    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # as dualkv.train.grpo does on a CPU
    own_group = int(os.environ.get("WORLD_SIZE", 1)) > 1 and not dist.is_initialized()
    if own_group:  # one process group for every configuration (trainers join it, none tears it down)
        cuda = args.device.startswith("cuda")
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if cuda else "gloo")
    try:
        return _run(args, argv)
    finally:
        torch.set_num_threads(threads)
        if own_group:
            dist.destroy_process_group()


def _run(args, argv) -> Path:
    from tqdm.auto import tqdm

    device = torch.device(args.device)
    set_fused_ops(args.fused_ops)  # as the trainer does when it builds the models
    meta = environment(device, MODULE, sys.argv[1:] if argv is None else list(argv))
    meta.update(preset=args.preset, P=args.prompt, response_range=list(args.response_range),
                responses_per_step=args.responses_per_step, algorithm="grpo", kl_beta=args.kl_beta,
                activation_checkpointing=args.activation_checkpointing, compile=args.compile,
                keep_attention=args.keep_attention, warmup=args.warmup, steps=args.steps, seed=args.seed,
                world_size=_world(), sp=args.sp, attention_backend=args.attention_backend,
                logprobs_impl=_logprobs_impl_run(args, device),
                old_logprobs=args.old_logprobs, logprob_micro_batch_tokens=args.logprob_micro_batch_tokens,
                reshard_after_forward=args.reshard_after_forward, reduce_grads_once=args.reduce_grads_once,
                fused_ops=args.fused_ops, liger_ops=not args.compile and liger_runs_on(device),
                optimizer_impl=_optimizer_impl_run(args, device))
    card = meta["card"]["name"].split()[-1].lower() if device.type == "cuda" else "cpu"
    stem = args.stem or f"policy_step_{card}_{datetime.now(timezone.utc):%Y%m%d-%H%M}"
    main_rank = _rank() == 0
    writer = ResultWriter(args.out, stem, meta, COLUMNS) if main_rank else None
    start = time.monotonic()
    cases = [(mb, p) for mb in args.mbs for p in args.packings]
    for mb, packing in tqdm(cases, desc="policy step", dynamic_ncols=True, disable=not main_rank):
        if _deadline_passed(start, args.deadline_s):
            row = dict(packing=packing, P=args.prompt, mb=mb, status="not run: --deadline-s reached")
        else:
            row = run_config(args, packing, mb, meta)
        if writer is not None:
            writer.add(row)
    return write_report(writer) if writer is not None else None


def _logprobs_impl_run(args, device) -> str:
    """The log-prob head's reduction the run takes ("torch" / "triton"), for the model's compute dtype."""
    from dualkv.core.logprobs import resolve_logprobs_impl

    dtype = train_config(args, args.packings[0], args.mbs[0]).parallel.dtype
    return resolve_logprobs_impl(args.logprobs_impl, torch.empty(0, device=device, dtype=dtype))


def _optimizer_impl_run(args, device) -> str:
    """The AdamW implementation the run takes: "auto" resolved as the trainer resolves it."""
    if args.optimizer_impl != "auto":
        return args.optimizer_impl
    return "fused" if device.type == "cuda" else "for-loop"


SETTINGS = ("preset", "P", "response_range", "responses_per_step", "algorithm", "kl_beta", "activation_checkpointing",
            "compile", "keep_attention", "warmup", "steps", "seed", "world_size", "sp", "attention_backend",
            "logprobs_impl", "liger_ops", "optimizer_impl", "old_logprobs", "logprob_micro_batch_tokens",
            "reshard_after_forward", "reduce_grads_once")
# What files written before these settings existed ran (torch's default AdamW on CUDA: foreach).
SETTING_DEFAULTS = {"world_size": 1, "sp": 1, "attention_backend": "auto", "logprobs_impl": "torch", "liger_ops": False,
                    "optimizer_impl": "foreach", "old_logprobs": "recompute", "logprob_micro_batch_tokens": None,
                    "reshard_after_forward": True, "reduce_grads_once": False}


def merge(paths: list[str], out: str, stem: str) -> Path:
    """One report from several result files of the same settings (later files win, 'not run' never does)."""
    from benchmarks.report import merge_runs

    try:
        meta, rows = merge_runs(paths, ("mb", "packing"), SETTINGS, SETTING_DEFAULTS)
    except ValueError as e:
        raise SystemExit(f"--merge: {e}") from None
    writer = ResultWriter(out, stem, meta, COLUMNS)
    writer.rows = sorted(rows, key=lambda r: (r["mb"], PACKINGS.index(r["packing"])))
    return write_report(writer)


def _logprob_budget_text(meta: dict) -> str:
    budget = meta.get("logprob_micro_batch_tokens")
    return "" if budget is None else f", no-grad passes in micro-batches of up to {budget} tokens"


def _fsdp_text(meta: dict) -> str:
    keep = "" if meta.get("reshard_after_forward", True) else ", FSDP keeps the gathered parameters from forward to backward"
    return keep + (", gradients reduced once per mini-batch" if meta.get("reduce_grads_once") else "")


def _ranks_text(meta: dict) -> str:
    world, sp = meta.get("world_size") or 1, meta.get("sp") or 1
    return "" if world == 1 else f"; {world} ranks: FSDP2 over all, sequence parallelism {sp}, data parallelism {world // sp}"


def write_report(writer) -> Path:
    """JSON/CSV, the markdown tables and the phase plot of a finished run (or a merge)."""
    meta, rows = writer.meta, writer.rows
    meta["rho_table"] = speedups(rows, meta["P"], sum(meta["response_range"]) / 2)
    writer.flush()
    v = meta["versions"]
    md = writer.dir / f"{writer.stem}.md"
    md.write_text(f"# {writer.stem}\n\n- {meta['card']['name']}, {meta['date']}: `{shown_command(meta)}`  \n"
                  f"  torch {v.get('torch')}, CUDA {v.get('cuda')}, Triton {v.get('triton')}, dualkv {v.get('dualkv')} "
                  f"(commit {meta.get('git_commit')})\n- model {meta['preset']} (random weights), GRPO kl_beta "
                  f"{meta['kl_beta']}, AdamW ({meta.get('optimizer_impl', 'foreach')}), activation checkpointing {'on' if meta['activation_checkpointing'] else 'off'}"
                  f"{' (keeping attention outputs)' if meta.get('keep_attention') else ''}"
                  f"{', torch.compile per decoder layer' if meta.get('compile') else ''}"
                  f"{', Liger ' + v['liger-kernel'] + ' fused norms / RoPE / SwiGLU' if meta.get('liger_ops') else ''}"
                  f"{', attention backend ' + meta['attention_backend'] if meta.get('attention_backend', 'auto') != 'auto' else ''}"
                  f"{', log-prob head ' + meta['logprobs_impl'] if meta.get('logprobs_impl', 'torch') != 'torch' else ''}"
                  f"{', old log-probs from the update (no old_log_prob pass)' if meta.get('old_logprobs') == 'from-update' else ''}"
                  f"{_logprob_budget_text(meta)}"
                  f"{_fsdp_text(meta)}"
                  f"{_ranks_text(meta)}\n\n"
                  + tables(rows, meta))
    png = plot(rows, writer.dir / f"{writer.stem}.png", meta["card"]["name"])
    print(md, png, sep="\n")
    return writer.json_path


if __name__ == "__main__":
    main()
