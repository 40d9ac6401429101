"""Launch plans kept per layout: the Triton backend's tile tables, computed once for every layer.

A schedule (``schedule.query_tiles``, ``key_items``, ...) takes dozens of small tensor ops, and as
many launches on a GPU, each call (the backward's three: 333 ATen calls, nested ones counted). It
depends on the layout alone, which is the same for every layer of a micro-batch, so ``planned`` keeps
its result. The key holds:

- weak references to the layout tensors the plan was computed from (the ``AttnMeta`` fields and any
  tensor argument), so a freed tensor's address can never be taken for a new one's, and their version
  counters, so an in-place change of a layout tensor computes anew;
- the other arguments (ints, bools, None), the device and the current stream (a plan computed on one
  stream is not read on another before it is ready).

Nothing is cached for tensors made under ``torch.inference_mode`` (they have no version counter), and
under it plans are read but not kept (a plan made there would be an inference tensor); nothing is
cached or read while a CUDA graph is being captured (a
plan computed then exists only when the graph replays), or while ``torch.compile`` traces. Plans are
read-only: no caller writes into them. Entries whose layout tensors were freed are dropped at the next
insertion.

Writes that PyTorch does not count in a tensor's version (through ``.data``, NumPy or DLPack views,
collectives such as ``dist.broadcast`` into an existing tensor, custom kernels) are not seen: after
such a write into a layout tensor, call ``PLANS.clear()`` or build the layout anew.

``DUALKV_TRITON_PLAN_CACHE=0`` computes every call (1 or unset: keep plans).
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from collections import OrderedDict
from typing import Callable

import torch

ENV = "DUALKV_TRITON_PLAN_CACHE"
ENTRIES = 32  # plans in flight at once: a few layouts (policy, reference, SP slices) x a few schedules


def enabled() -> bool:
    choice = os.environ.get(ENV, "")
    if choice not in ("", "0", "1"):
        raise ValueError(f"{ENV}: expected one of 0, 1 (or unset), got {choice!r}")
    return choice != "0"


class PlanCache:
    """Most recently used plans first, at most ``entries``; ``computed`` counts the misses (for tests)."""

    def __init__(self, entries: int = ENTRIES):
        self.entries = entries
        self.computed = 0
        self._plans: OrderedDict[tuple, tuple[list[weakref.ref], list[int], object]] = OrderedDict()
        self._lock = threading.Lock()

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)

    def get(self, name: str, tensors: list[torch.Tensor], settings: tuple, compute: Callable[[], object]):
        if not _cacheable(tensors):
            self.computed += 1
            return compute()
        device = tensors[0].device
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        key = (name, settings, str(device), stream, tuple(id(t) for t in tensors))
        with self._lock:
            hit = self._plans.get(key)
            if hit is not None:
                refs, versions, plan = hit
                if all(r() is t and v == t._version for r, v, t in zip(refs, versions, tensors)):
                    self._plans.move_to_end(key, last=False)
                    return plan
                del self._plans[key]  # a tensor freed (its id reused) or changed in place
        versions = [t._version for t in tensors]  # before computing: a change meanwhile plans anew next time
        plan = compute()
        self.computed += 1
        if torch.is_inference_mode_enabled():  # the plan is an inference tensor: used, never kept
            return plan
        with self._lock:
            for dead in [k for k, (refs, _, _) in self._plans.items() if any(r() is None for r in refs)]:
                del self._plans[dead]
            self._plans[key] = ([weakref.ref(t) for t in tensors], versions, plan)
            self._plans.move_to_end(key, last=False)
            while len(self._plans) > self.entries:
                self._plans.popitem(last=True)
        return plan


def _cacheable(tensors: list[torch.Tensor]) -> bool:
    if not tensors or not enabled() or torch.compiler.is_compiling():
        return False
    if any(t.is_inference() for t in tensors):
        return False
    return not (tensors[0].device.type == "cuda" and torch.cuda.is_current_stream_capturing())


PLANS = PlanCache()


_KEY_TYPES = (int, float, bool, str, type(None))  # argument values a key holds (tensors by identity)
TENSOR = object()  # marks a tensor argument's place in a key

# the layout tensors of an ``AttnMeta`` (or a ``PackedLayout``, which has them too)
META_FIELDS = ("cu_seqlens", "seg_ctx_start", "seg_ctx_len", "ctx_key_start", "ctx_key_len", "ctx_reader_start",
               "ctx_reader_end")


def planned(fn: Callable) -> Callable:
    """Keep ``fn(meta, *args)``'s result in ``PLANS``: keyed by the layout tensors of ``meta`` and the
    tensor arguments by identity and version, and by the other arguments' values. ``fn.uncached`` is
    the function itself."""

    @functools.wraps(fn)
    def wrapper(meta, *args, **kwargs):
        tensors = [getattr(meta, f) for f in META_FIELDS]
        settings = []
        for name, value in [(None, a) for a in args] + sorted(kwargs.items()):
            if isinstance(value, torch.Tensor):
                tensors.append(value)
                settings.append((name, TENSOR, len(tensors) - 1))
            elif isinstance(value, _KEY_TYPES):
                settings.append((name, type(value).__name__, value))  # 1 and True and 1.0 stay apart
            else:  # an argument that cannot be a key: plan anew
                return fn(meta, *args, **kwargs)
        return PLANS.get(fn.__qualname__, tensors, tuple(settings), lambda: fn(meta, *args, **kwargs))

    wrapper.uncached = fn
    return wrapper


__all__ = ["ENTRIES", "ENV", "META_FIELDS", "PLANS", "PlanCache", "enabled", "planned"]
