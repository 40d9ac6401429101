"""Where a profiled GPU run sat idle, what the host was doing meanwhile, and where it synchronised.

Read from a ``torch.profiler`` run that recorded CPU and CUDA activity:

``idle_report``: the GPU's span (first device activity's start to the last one's end), the time no
kernel, copy or memset ran in it, and the longest idle stretches, each with the device activity after
it and, when CPU operators were recorded, the host operator running at the stretch's middle
(innermost first, then the ``phase:`` region around it); then that idle time summed by ``phase:``
region and by innermost host operator, so that a step's idle time can be attributed.

``kind_report``: the device time of the kernels and copies summed by what they do (matrix products,
attention forward / backward, compiled element-wise kernels, copies, the optimizer, ...), per
``phase:`` region, and how much of it ran on streams other than the main one and overlapped it.

``minor_kernels_report``: the kernels of every kind but the products and attention, the largest by
device time, each with the operator that launched it and its time per phase.

``speed_report``: per ``phase:`` region, the model FLOPs the phase ran (the trainer's count by part,
of the tokens its packing runs) against its kernels' device time: the TFLOP/s of the matrix products,
of the attention forward and backward, of the phase as a whole (and its share of the peak), and the
time of everything else.

``host_syncs(fn)`` counts the synchronising CUDA calls one call of ``fn`` makes (torch's sync debug
mode), each named by its innermost caller outside torch.

Device events that are user annotations (a ``record_function`` region as the profiler draws it on
the GPU's timeline, spanning the kernels launched inside it) are regions, not work: they never count
as busy time.

Phases are ``torch.profiler.record_function`` regions named ``phase:<name>`` (the trainer's
``PhaseTimer`` opens one per phase). A stretch inside no operator is host time spent in Python
between operators.
"""

from __future__ import annotations

import heapq
import traceback
import warnings
from collections import defaultdict

import torch

PHASE_PREFIX = "phase:"
NO_OP = "(between operators)"


def device_work(prof) -> list:
    """The kernels, copies and memsets the profile recorded on the GPU (no user annotations), by start."""
    device = torch.autograd.DeviceType.CUDA
    return sorted((e for e in prof.events() if e.device_type == device and not getattr(e, "is_user_annotation", False)),
                  key=lambda e: e.time_range.start)


def phase_regions(prof) -> list[tuple[float, float, str]]:
    """The ``phase:`` regions as the profiler drew them on the GPU's timeline: (start us, end us, name), by start."""
    device = torch.autograd.DeviceType.CUDA
    return sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                  if e.device_type == device and getattr(e, "is_user_annotation", False)
                  and e.name.startswith(PHASE_PREFIX))


def phase_at(phases: list[tuple[float, float, str]], t: float, default: str | None = None) -> str | None:
    """The name of the ``phase_regions`` region that time ``t`` (us) lies in, else ``default``."""
    return next((name for start, end, name in phases if start <= t < end), default)


def idle_stretches(prof) -> tuple[float, list[tuple[float, float, str]]]:
    """(span us, [(start us, end us, name of the device activity after it)]) in time order."""
    work = device_work(prof)
    if not work:
        return 0.0, []
    busy_until, stretches = work[0].time_range.end, []
    for e in work[1:]:
        if e.time_range.start > busy_until:
            stretches.append((busy_until, e.time_range.start, e.name))
        busy_until = max(busy_until, e.time_range.end)
    return busy_until - work[0].time_range.start, stretches


def host_ops_at(prof, times: list[float]) -> list[tuple[str | None, str]]:
    """For each time (us, ascending), (the innermost ``phase:`` region, the innermost CPU operator)
    running then; ``NO_OP`` where no operator ran. One sweep: an operator that has ended before a time
    has ended before every later one too."""
    cpu = torch.autograd.DeviceType.CPU
    ops = sorted((e for e in prof.events() if e.device_type == cpu), key=lambda e: e.time_range.start)
    answers, active, phases, i = [], [], [], 0
    for t in times:
        while i < len(ops) and ops[i].time_range.start <= t:
            e = ops[i]
            heap = phases if e.name.startswith(PHASE_PREFIX) else active
            heapq.heappush(heap, (-e.time_range.start, i, e.time_range.end, e.name))
            i += 1
        for heap in (active, phases):
            while heap and heap[0][2] < t:
                heapq.heappop(heap)
        # The top is the latest started of those that may still run; one that ended before t sits
        # below it only if it started earlier, so the top is the innermost running operator.
        answers.append((phases[0][3] if phases else None, active[0][3] if active else NO_OP))
    return answers


def idle_report(prof, top: int) -> list[str]:
    """Report lines: the GPU's idle time in the profiled run and its ``top`` longest idle stretches,
    each with the device activity after it and the host operator at its middle (when CPU operators
    were recorded); then the idle time summed by ``phase:`` region and by innermost host operator
    (the ``top`` largest). The stretches and their host operators are read once, in time order (their
    middles ascend as the stretches do)."""
    span, stretches = idle_stretches(prof)
    if span == 0.0 and not stretches:
        return ["   no device activity recorded"]
    hosts = host_ops_at(prof, [(start + end) / 2 for start, end, _ in stretches])
    idle = sum(end - start for start, end, _ in stretches)
    lines = [f"   GPU span {span / 1000:.2f} ms, idle {idle / 1000:.2f} ms in {len(stretches)} stretches; longest:"]
    by_phase: dict[str, float] = defaultdict(float)
    by_op: dict[str, float] = defaultdict(float)
    for (start, end, _), (phase, op) in zip(stretches, hosts):
        by_phase[phase or "(no phase)"] += end - start
        by_op[op] += end - start
    for (start, end, name), (phase, op) in sorted(zip(stretches, hosts), key=lambda sh: sh[0][0] - sh[0][1])[:top]:
        where = op if phase is None else f"{op} in {phase}"
        host = "" if (phase, op) == (None, NO_OP) else f"  (host: {where[:60]})"
        lines.append(f"   {end - start:8.1f} us  before {name[:70]}{host}")
    lines.append("   idle time by phase:")
    lines += [f"   {us / 1000:9.2f} ms  {name}" for name, us in sorted(by_phase.items(), key=lambda kv: -kv[1])]
    lines.append("   idle time by the host operator running then (innermost):")
    lines += [f"   {us / 1000:9.2f} ms  {name[:90]}" for name, us in sorted(by_op.items(), key=lambda kv: -kv[1])[:top]]
    return lines


# What a device activity does, from its name: the first kind one of whose patterns it contains (lower
# case). The attention kernels are this project's (CUDA backend: ``dkv::dkv_*``; Triton / Gluon: their
# function names); products are cuBLAS's (``nvjet``, ``gemm``, ``Kernel2``), CUTLASS's or Inductor's
# templates (``triton_tem_``); Inductor's other kernels are ``triton_poi_`` / ``triton_red_`` / ....
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("log-prob head", ("_logprob",)),
    ("attention forward", ("dkv_fwd", "fwd_kernel", "fwd_ws_kernel")),
    ("attention backward", ("dkv_dkdv", "dkv_dq", "dkv_bwd_prep", "dkv_convert", "dkdv_", "dq_kernel", "dq_split",
                            "preprocess_kernel", "reduce_kernel", "scale_cast_kernel")),
    ("matrix products", ("nvjet", "gemm", "cutlass", "xmma", "kernel2", "cublas", "matmul", "triton_tem_")),
    ("optimizer", ("multi_tensor_apply", "adam")),
    ("communication", ("nccl",)),
    ("copies and memsets", ("memcpy", "memset")),
    ("compiled element-wise", ("triton_",)),
)
OTHER_KIND = "other (eager element-wise, reductions, ...)"


def kind_of(name: str) -> str:
    """The ``KINDS`` entry a device activity of this name belongs to, else ``OTHER_KIND``."""
    low = name.lower()
    for kind, patterns in KINDS:
        if any(p in low for p in patterns):
            return kind
    return OTHER_KIND


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _overlap(intervals: list[tuple[float, float]], covered: list[tuple[float, float]]) -> float:
    """The time of ``intervals`` (any order) inside the disjoint, sorted ``covered``."""
    import bisect

    starts = [c[0] for c in covered]
    total = 0.0
    for start, end in intervals:
        k = max(bisect.bisect_right(starts, start) - 1, 0)
        while k < len(covered) and covered[k][0] < end:
            total += max(0.0, min(end, covered[k][1]) - max(start, covered[k][0]))
            k += 1
    return total


def kind_report(prof) -> list[str]:
    """Report lines: the device time of the recorded kernels and copies summed by ``kind_of``, in
    total and per ``phase:`` region (the regions as drawn on the GPU's timeline; a kernel belongs to
    the one its start lies in), largest first, with each kind's share and count; then the time on
    streams other than the main one (the stream with the most device time: FSDP's copies and
    reductions, for instance, run on their own) and how much of it overlapped the main stream's work,
    by kind. Times add up to more than the GPU's busy span where streams overlap."""
    work = device_work(prof)
    if not work:
        return ["   no device activity recorded"]
    phases = phase_regions(prof)
    stream_of = [getattr(e, "device_resource_id", 0) for e in work]
    busy_by_stream: dict = defaultdict(float)
    for e, stream in zip(work, stream_of):
        busy_by_stream[stream] += e.time_range.end - e.time_range.start
    main = max(busy_by_stream, key=busy_by_stream.get)

    table: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    side: dict[str, list] = defaultdict(list)
    for e, stream in zip(work, stream_of):
        kind, start, dur = kind_of(e.name), e.time_range.start, e.time_range.end - e.time_range.start
        phase = phase_at(phases, start, "(no phase)")
        for column in ("all", phase):
            cell = table[column][kind]
            cell[0] += dur
            cell[1] += 1
        if stream != main:
            side[kind].append((start, e.time_range.end))

    lines = []
    for column in ["all", *dict.fromkeys(name for *_, name in phases), "(no phase)"]:
        kinds = table.get(column)
        if not kinds:
            continue
        total = sum(t for t, _ in kinds.values())
        lines.append(f"   {'every phase' if column == 'all' else column}: {total / 1000:.2f} ms of device time")
        lines += [f"   {t / 1000:10.2f} ms  {100 * t / total:5.1f}%  {n:6d}x  {kind}"
                  for kind, (t, n) in sorted(kinds.items(), key=lambda kv: -kv[1][0])]
    main_busy = _union([(e.time_range.start, e.time_range.end) for e, s in zip(work, stream_of) if s == main])
    side_total = sum(end - start for spans in side.values() for start, end in spans)
    lines.append(f"   on streams other than the main one ({main}): {side_total / 1000:.2f} ms, "
                 f"{_overlap([x for spans in side.values() for x in spans], main_busy) / 1000:.2f} ms of it "
                 f"while the main stream worked")
    lines += [f"   {sum(b - a for a, b in spans) / 1000:10.2f} ms  ({_overlap(spans, main_busy) / 1000:.2f} ms "
              f"overlapped)  {kind}" for kind, spans in sorted(side.items(), key=lambda kv: -sum(b - a for a, b in kv[1]))]
    return lines


# Named regions around an operator that say which part of the step launched it (FSDP's gathers and
# reductions, a compiled graph, an autograd node, the optimizer).
CONTEXT_PREFIXES = ("FSDP::", "## Call CompiledFxGraph", "autograd::engine::evaluate_function", "Optimizer.")


def op_context(e) -> str:
    """A CPU operator's name, with the nearest enclosing region of ``CONTEXT_PREFIXES`` after a "<"
    (found through the profiler's ``cpu_parent`` links)."""
    parent = getattr(e, "cpu_parent", None)
    while parent is not None and not parent.name.startswith(CONTEXT_PREFIXES):
        parent = getattr(parent, "cpu_parent", None)
    return e.name if parent is None else f"{e.name} < {parent.name}"


def launching_ops(prof) -> dict[tuple[str, float], str]:
    """{(kernel name, duration us): ``op_context`` of the CPU operator whose correlation launched it} for
    the kernels the profiler tied to an operator (``FunctionEvent.kernels``); the innermost such
    operator wins. The profiler's kernel records carry a name and a duration but no start, so
    kernels of one name and the same duration launched by different operators are all named after
    one of them."""
    cpu = torch.autograd.DeviceType.CPU
    ops = sorted((e for e in prof.events() if e.device_type == cpu and getattr(e, "kernels", None)),
                 key=lambda e: e.time_range.start)
    return {(k.name, float(k.duration)): op_context(e) for e in ops for k in e.kernels}


def minor_kernels_report(prof, top: int = 8, skip: tuple[str, ...] = ("matrix products", "attention forward",
                                                                   "attention backward")) -> list[str]:
    """Report lines: for each kind of ``kind_of`` not in ``skip`` (the kinds ``speed_report`` leaves
    as "every other kind"), largest first, its ``top`` kernels by device time over the whole profile,
    each with its count, its time in every phase and the operator that launched it (where the profiler
    tied one), so that the time left beside the products and attention can be traced to code."""
    work = [e for e in device_work(prof) if kind_of(e.name) not in skip]
    if not work:
        return ["   no device activity recorded outside " + ", ".join(skip)]
    phases = phase_regions(prof)
    launched = launching_ops(prof)
    table: dict[str, dict[tuple[str, str], list]] = defaultdict(dict)
    for e in work:
        dur = e.time_range.end - e.time_range.start
        op = launched.get((e.name, float(dur)), "?")
        region = phase_at(phases, e.time_range.start)
        phase = region[len(PHASE_PREFIX):] if region else "-"
        cell = table[kind_of(e.name)].setdefault((e.name, op), [0.0, 0, defaultdict(float)])
        cell[0] += dur
        cell[1] += 1
        cell[2][phase] += dur
    lines = []
    for kind, rows in sorted(table.items(), key=lambda kv: -sum(c[0] for c in kv[1].values())):
        lines.append(f"   {kind}: {sum(c[0] for c in rows.values()) / 1000:.2f} ms in {len(rows)} kernel / operator pairs")
        for (name, op), (t, n, by_phase) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:top]:
            where = ", ".join(f"{ph} {us / 1000:.1f}" for ph, us in sorted(by_phase.items(), key=lambda kv: -kv[1]))
            lines.append(f"   {t / 1000:10.2f} ms {n:6d}x  {name[:80]}  [{op[:80]}; {where}]")
    return lines


# How many of a phase's forward FLOPs by part (train.metrics.forward_flops_by_part) each kind of kernel
# runs. A pass with gradients runs the products (the head's logits too) three times (the backward
# twice); the attention backward's five products are counted 2.5 times its forward's two, as
# bench_attention counts them (the MFU formula counts the backward as 2 forwards, the recomputed
# QK^T not being model FLOPs).
SPEED_KINDS = (("matrix products", {"products": 1.0, "head": 1.0}, {"products": 3.0, "head": 3.0}),
               ("attention forward", {"attention": 1.0}, {"attention": 1.0}),
               ("attention backward", {}, {"attention": 2.5}))


def speed_report(prof, flops_by_phase: dict, grad_phases: tuple[str, ...] = ("update",),
                 peak: float | None = None) -> list[str]:
    """Report lines: for each phase of ``flops_by_phase`` ({phase: {part: forward FLOPs}}; a phase in
    ``grad_phases`` ran forward and backward) whose ``phase:`` region the profile holds, its device
    time (kernels summed over every stream, by start) and model FLOPs, their rate and its share of
    ``peak`` FLOP/s; then each kind of ``SPEED_KINDS``' time, FLOPs and useful TFLOP/s, and the time
    of every other kind. Kernels recomputed under activation checkpointing add time, not FLOPs."""
    regions = {name[len(PHASE_PREFIX):]: (start, end) for start, end, name in phase_regions(prof)}
    work = device_work(prof)
    lines = []
    for phase, parts in flops_by_phase.items():
        if phase not in regions:
            lines.append(f"   {phase}: no {PHASE_PREFIX}{phase} region on the GPU's timeline")
            continue
        start, end = regions[phase]
        by_kind: dict[str, float] = defaultdict(float)
        for e in work:
            if start <= e.time_range.start < end:
                by_kind[kind_of(e.name)] += e.time_range.end - e.time_range.start
        busy = sum(by_kind.values())  # us
        grad = phase in grad_phases
        model = (3.0 if grad else 1.0) * sum(parts.values())  # a pass with gradients: forward + 2 x backward
        share = f" ({100 * model / (busy * 1e-6) / peak:.1f}% of the peak)" if peak and busy else ""
        rate = f"{model / (busy * 1e-6) / 1e12:.0f} TFLOP/s{share}" if busy else "no device time"
        lines.append(f"   {phase}: {busy / 1000:.1f} ms of device time, {model / 1e12:.1f} TFLOP of model FLOPs: "
                     f"{rate}")
        for kind, no_grad_factors, grad_factors in SPEED_KINDS:
            factors = grad_factors if grad else no_grad_factors
            if not factors:
                continue
            flops = sum(f * parts.get(part, 0) for part, f in factors.items())
            t = by_kind.pop(kind, 0.0)
            speed = f"{flops / (t * 1e-6) / 1e12:6.0f} TFLOP/s" if t else "   (no kernel)"
            lines.append(f"   {t / 1000:10.1f} ms  {100 * t / busy if busy else 0:5.1f}%  {flops / 1e12:9.1f} TFLOP  "
                         f"{speed}  {kind}")
        rest = sum(by_kind.values())
        lines.append(f"   {rest / 1000:10.1f} ms  {100 * rest / busy if busy else 0:5.1f}%  every other kind")
    return lines


def is_sync_warning(message) -> bool:
    """Whether a warning is torch's report of a synchronising CUDA call. Not the notice that the
    debug mode itself is a prototype ("... does not yet detect all synchronizing operations"), which
    torch gives once per process when the mode is first set: read as a sync, it once had a DualKV
    layer call counted with one sync that was not there."""
    return "called a synchronizing CUDA operation" in str(message)


def host_syncs(fn, skip: tuple[str, ...] = ()) -> list[str]:
    """Report lines: the synchronising CUDA calls one call of ``fn`` makes (torch's sync debug mode),
    counted by the innermost calling frame outside torch and the files in ``skip`` (the caller's
    own tool), followed by the innermost torch frame where the sync came from inside torch (say
    ``torch.autograd.grad``: a sync in the backward)."""
    previous = torch.cuda.get_sync_debug_mode()
    where: dict[str, int] = defaultdict(int)
    skip = (*skip, warnings.__file__, __file__)

    def record(message, category, filename, lineno, file=None, line=None):
        if not is_sync_warning(message):
            return
        stack = traceback.extract_stack()[:-1]
        # the innermost caller outside torch and skip (-1: none), then torch's frames below it
        last = max((k for k, f in enumerate(stack) if "/torch/" not in f.filename and f.filename not in skip),
                   default=-1)
        in_torch = [f for f in stack[last + 1:] if "/torch/" in f.filename]
        frames = [f"{f.filename}:{f.lineno} ({f.name})" for f in stack[last:last + 1] if last >= 0]
        frames += [f"torch: {f.filename}:{f.lineno} ({f.name})" for f in in_torch[-1:]]
        where[" -> ".join(frames) or f"{filename}:{lineno}"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        torch.cuda.synchronize()
    if not where:
        return ["   host synchronisations: none"]
    return [f"   host synchronisations: {sum(where.values())}"] + [f"   {n:4d}x  {key}" for key, n in where.items()]
