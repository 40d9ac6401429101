"""Run a function on a local multi-process world (CPU + gloo by default): for tests and examples.

``run_local_world(fn, world_size, *args)`` spawns ``world_size`` processes, initialises the default
process group in each (a file store, so concurrent worlds never fight over a port), calls
``fn(*args)`` and returns every rank's result, rank 0 first. ``fn`` must be importable by name (a
module-level function). An exception on any rank is raised in the caller with that rank's traceback.
"""

from __future__ import annotations

import datetime
import os
import queue as queue_mod
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_local_world"]


def _worker(rank, world_size, store_path, backend, timeout_s, threads, results, fn, args):
    try:
        torch.set_num_threads(threads)
        dist.init_process_group(
            backend, init_method=f"file://{store_path}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        try:
            results.put((rank, True, fn(*args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # report everything, including SystemExit from a failed collective
        results.put((rank, False, traceback.format_exc()))


def run_local_world(fn, world_size: int, *args, backend: str = "gloo", timeout_s: float = 600, threads: int = 1):
    """Run ``fn(*args)`` on ``world_size`` spawned ranks; return the list of their results.

    Args:
        backend: process-group backend ("gloo" on CPU, "nccl" with one GPU per rank).
        timeout_s: per-collective timeout, and the limit on the whole run.
        threads: torch intra-op threads per rank (1 keeps many ranks on few cores responsive).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected an int >= 1, got {world_size!r}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, store, backend, timeout_s, threads, results, fn, args), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            collected = _collect(results, procs, timeout_s)
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.terminate()
                    p.join()
    failed = {r: msg for r, (ok, msg) in collected.items() if not ok}
    if failed:
        rank = min(failed)
        raise RuntimeError(f"rank {rank} of {world_size} failed:\n{failed[rank]}")
    return [collected[r][1] for r in range(world_size)]


def _collect(results, procs, timeout_s):
    collected, waited = {}, 0.0
    while len(collected) < len(procs):
        try:
            rank, ok, payload = results.get(timeout=1.0)
            collected[rank] = (ok, payload)
        except queue_mod.Empty:
            waited += 1.0
            dead = [i for i, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None) and i not in collected]
            if dead:
                collected.update({i: (False, f"process exited with code {procs[i].exitcode}") for i in dead})
            elif waited > timeout_s:
                missing = [i for i in range(len(procs)) if i not in collected]
                collected.update({i: (False, f"no result within {timeout_s} s") for i in missing})
    return collected
