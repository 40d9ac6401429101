"""Where a profiled GPU run sat idle, what the host was doing meanwhile, and where it synchronised.

Read from a ``torch.profiler`` run that recorded CPU and CUDA activity:

``idle_report``: the GPU's span (first device activity's start to the last one's end), the time no
kernel, copy or memset ran in it, and the longest idle stretches, each with the device activity after
it and, when CPU operators were recorded, the host operator running at the stretch's middle
(innermost first, then the ``phase:`` region around it); then that idle time summed by ``phase:``
region and by innermost host operator, so that a step's idle time can be attributed.

``host_syncs(fn)`` counts the synchronising CUDA calls one call of ``fn`` makes (torch's sync debug
mode), each named by its innermost caller outside torch.

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


def idle_stretches(prof) -> tuple[float, list[tuple[float, float, str]]]:
    """(span us, [(start us, end us, name of the device activity after it)]) in time order."""
    device = torch.autograd.DeviceType.CUDA
    work = sorted((e for e in prof.events() if e.device_type == device), key=lambda e: e.time_range.start)
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
