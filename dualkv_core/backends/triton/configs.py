"""Kernel configurations: candidates per head dim, a shared-memory/register pruning filter, the
defaults, and a small tuner keyed on what changes the best choice (kernel, head dim, dtype, GQA
ratio, the P/R regime, window, softcap).

The tile schedules depend on the block sizes, so tuning times the whole launch (schedule + kernel)
for each candidate instead of using ``triton.autotune`` inside one launch. Tuning runs on CUDA
tensors when ``DUALKV_TRITON_AUTOTUNE=1`` (each key once per process); otherwise, and always under
the interpreter, the per-head-dim default below is used.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable

SMEM_LIMIT = 227 * 1024  # bytes per block on H100/H200
MAX_ACC_REGS = 128  # fp32 accumulator registers per thread we allow before a config is pruned


@dataclass(frozen=True)
class KernelConfig:
    block_m: int  # queries per tile
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int
    warp_specialize: bool = False  # fwd / dq: the single key loop split into producer / consumer warps

    def __str__(self) -> str:
        ws = "-ws" if self.warp_specialize else ""
        return f"M{self.block_m}-N{self.block_n}-w{self.num_warps}-s{self.num_stages}{ws}"


def _bucket(d: int) -> int:
    return 64 if d <= 64 else 128 if d <= 128 else 256 if d <= 256 else 512


# Candidates per kernel and head-dim bucket: (block_m, block_n, warps, stages), the default first.
# Chosen from sm_90 compiles (``benchmarks/tune_triton.py compile-report``): no register spills where
# possible, shared memory within a Hopper block; then ordered by H200 timings.
_CANDIDATES = {
    "fwd": {  # a fifth entry True: the warp-specialised loop (num_warps = one consumer warpgroup)
        64: [(128, 128, 8, 3), (128, 128, 4, 2, True), (128, 64, 8, 4), (128, 64, 4, 3)],
        128: [(128, 128, 4, 2, True), (128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 3)],
        256: [(128, 64, 4, 2, True), (128, 64, 8, 2), (128, 32, 8, 2), (64, 64, 4, 2)],
        512: [(32, 32, 4, 2), (64, 32, 8, 2)],
    },
    "dkdv": {  # block_m = queries per step, block_n = keys held by the program
        64: [(32, 128, 8, 2), (64, 128, 8, 2), (32, 64, 4, 3)],
        128: [(32, 64, 4, 3), (32, 128, 8, 3), (32, 64, 4, 2), (32, 128, 8, 2), (64, 128, 8, 2)],
        256: [(32, 32, 4, 2), (32, 64, 8, 2), (16, 64, 8, 2), (16, 32, 4, 2)],
        512: [(16, 16, 4, 2), (16, 32, 8, 2)],
    },
    "dkdv_rows": {  # the one-loop dK/dV of the packed layout on descriptors (none at d = 512: no descriptors)
        64: [(64, 64, 4, 3), (128, 128, 8, 2), (64, 128, 8, 2)],
        128: [(64, 128, 8, 3), (64, 128, 8, 2), (32, 128, 8, 3), (64, 64, 4, 3), (64, 64, 4, 2)],
        256: [(64, 64, 8, 2), (32, 64, 8, 2), (32, 32, 4, 2)],
    },
    "dkdv_rows_atomic": {  # the same with dQ added through fp32 reduce-add (a dQ tile staged in shared memory)
        64: [(64, 64, 4, 3), (128, 128, 8, 2), (64, 128, 8, 2)],
        128: [(64, 128, 8, 2), (32, 128, 8, 3), (64, 64, 4, 3)],
        256: [(32, 64, 8, 2), (32, 32, 4, 2)],
    },
    "dq": {
        # the warp-specialised loop at 64 / 128 only: at 256 (M128-N32) it gave NaN with Triton 3.6
        64: [(128, 64, 4, 2, True), (128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2)],
        128: [(128, 64, 4, 2, True), (128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 8, 2), (64, 64, 4, 3),
              (128, 128, 4, 2, True)],
        256: [(128, 32, 8, 2), (64, 64, 8, 2), (64, 32, 4, 2), (64, 32, 8, 2)],
        512: [(32, 32, 8, 1), (32, 16, 4, 2)],
    },
}

# Small tiles for the CPU interpreter: few programs, few loop trips, every mask path still taken.
INTERPRET_CONFIG = KernelConfig(32, 32, 4, 1)


def smem_bytes(kind: str, cfg: KernelConfig, head_dim: int, elem: int) -> int:
    """Estimate of the shared memory one program needs (pipelined tiles plus resident tiles)."""
    m, n, st = cfg.block_m, cfg.block_n, max(cfg.num_stages, 1)
    if kind.startswith("dkdv"):  # Q and dO stream in; K and V stay (and a dQ tile in fp32 for the atomic dQ)
        staged = m * head_dim * 4 if kind.endswith("atomic") else 0
        return (2 * m * head_dim * st + 2 * n * head_dim) * elem + staged
    # fwd / dq: K and V stream in, Q (and dO) stay
    resident = (2 if kind == "dq" else 1) * m * head_dim
    return (2 * n * head_dim * st + resident) * elem


def acc_regs(kind: str, cfg: KernelConfig, head_dim: int) -> int:
    """fp32 accumulator registers per thread (two tiles for dK/dV, one otherwise)."""
    rows = cfg.block_n if kind.startswith("dkdv") else cfg.block_m
    tiles = 2 if kind.startswith("dkdv") else 1
    warps = cfg.num_warps * (2 if cfg.warp_specialize else 1)  # two consumer warpgroups share the rows
    return tiles * rows * head_dim // (32 * warps)


def keep(kind: str, cfg: KernelConfig, head_dim: int, elem: int, smem_limit: int = SMEM_LIMIT) -> bool:
    """Pruning filter: fits the shared memory of a block (a Hopper block's unless told) and keeps
    accumulators in registers; a warp-specialised loop with at most 2 stages (3 gave NaN outputs
    with Triton 3.6 on an H200)."""
    if cfg.warp_specialize and cfg.num_stages > 2:
        return False
    return smem_bytes(kind, cfg, head_dim, elem) <= smem_limit and acc_regs(kind, cfg, head_dim) <= MAX_ACC_REGS


def candidates(kind: str, head_dim: int, elem: int, warp_specialize: bool = False,
               smem_limit: int = SMEM_LIMIT) -> list[KernelConfig]:
    """Candidates for a kernel ("fwd", "dkdv", "dkdv_rows", "dkdv_rows_atomic", "dq") at a head dim,
    pruned; warp-specialised ones only where the launch allows them."""
    cands = _listed(kind, head_dim, warp_specialize)
    kept = [c for c in cands if keep(kind, c, padded_head_dim(head_dim), elem, smem_limit)]
    return kept or cands[-1:]


def _listed(kind: str, head_dim: int, warp_specialize: bool) -> list[KernelConfig]:
    cands = [KernelConfig(*c) for c in _CANDIDATES[kind][_bucket(padded_head_dim(head_dim))]]
    return [c for c in cands if warp_specialize or not c.warp_specialize]


def device_smem_limit(device) -> int:
    """Shared memory a block may use on a CUDA ``device`` (its opt-in maximum: 227 KB on H100 / H200,
    163 KB on A100, 99 KB on Ada), or the Hopper figure where torch does not say."""
    import torch

    return int(getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0) or SMEM_LIMIT)


def padded_head_dim(head_dim: int) -> int:
    """Head dims are padded to a power of two inside the kernels (tl.arange needs one)."""
    return 1 << max(4, math.ceil(math.log2(head_dim)))


def regime(total_q: int, n_segments: int, n_regions: int) -> tuple[int, int]:
    """Coarse P/R regime from shapes alone: log2 of tokens per segment and per group."""
    per_seg = max(total_q // max(n_segments, 1), 1)
    per_group = max(total_q // max(n_regions, 1), 1)
    return int(math.log2(per_seg)), int(math.log2(per_group))


def _switch(name: str, default: str) -> bool:
    value = os.environ.get(name, default)
    if value not in ("0", "1"):
        raise ValueError(f"{name}: expected 0 or 1, got {value!r}")
    return value == "1"


def warp_specialize_enabled() -> bool:
    """The forward's and dQ's warp-specialised loops where a launch allows them (``DUALKV_TRITON_WS``: 1 on,
    0 off)."""
    return _switch("DUALKV_TRITON_WS", "1")


def atomic_dq_default(fused_kernel: bool) -> bool:
    """dQ added inside the dK/dV kernel (fp32 reduce-adds) instead of the query-parallel dQ kernel:
    ``DUALKV_TRITON_ATOMIC_DQ=1`` / ``0`` where set, otherwise where the warp-specialised Gluon dK/dV
    with its fused dQ runs (``fused_kernel``: sm_90, d = 128; 1.2-1.3x the backward's speed on an
    H200). The dQ kernel makes dQ bit-identical run to run; ``deterministic=True`` always takes it."""
    env = os.environ.get("DUALKV_TRITON_ATOMIC_DQ")
    return fused_kernel if env is None else env == "1"


def gluon_bwd_enabled() -> bool:
    """The warp-specialised Gluon backward kernels where they apply (sm_90, fp16 / bf16, the packed
    layout without a window or softcap): at d = 128 ``gluon_dkdv_ws`` (dK/dV with dQ fused), at d = 256
    ``gluon_split256`` (dK/dV and dQ, warpgroups split by role). On by default;
    ``DUALKV_TRITON_GLUON_BWD=0`` runs the ``tl`` kernels."""
    return _switch("DUALKV_TRITON_GLUON_BWD", "1")


def gluon_fwd_enabled() -> bool:
    """The warp-specialised Gluon forward (``gluon_fwd``) where it applies: Hopper, fp16 / bf16, d = 64 /
    128, no window or softcap, the packed layout. On by default (1.16-1.24x the ``tl`` forward's speed
    on an H200); ``DUALKV_TRITON_GLUON_FWD=0`` runs ``fwd_kernel`` instead."""
    return _switch("DUALKV_TRITON_GLUON_FWD", "1")


def gluon_dkdv_enabled() -> bool:
    """The Gluon dK/dV (``gluon_dkdv``, ``DUALKV_TRITON_GLUON_DKDV=1``) in place of the one-loop Triton
    row kernel where it applies. Opt-in: the same gradients bit for bit and the same speed at d=128 on
    an H200 (slower at d=64). With ``DUALKV_TRITON_ATOMIC_DQ=1`` it also adds dQ (0.96-1.01x the
    default backward's speed at d=128)."""
    return _switch("DUALKV_TRITON_GLUON_DKDV", "0")


def bwd_head_major() -> bool | None:
    """The program order of the warp-specialised Gluon dK/dV where ``DUALKV_TRITON_BWD_HEAD_MAJOR`` sets it:
    1, kv head major (every item of kv head 0, then of head 1, ...); 0, an item's kv heads side by side;
    unset (None), the kernel's measured choice for the layout (``schedule.head_major_flag`` with the
    kernel's ``HEAD_MAJOR_MIN_PROMPT``). Read on every call, so ``benchmarks.env_ab`` can time the orders."""
    if os.environ.get("DUALKV_TRITON_BWD_HEAD_MAJOR") is None:
        return None
    return _switch("DUALKV_TRITON_BWD_HEAD_MAJOR", "0")


def autotune_enabled() -> bool:
    return os.environ.get("DUALKV_TRITON_AUTOTUNE", "0") == "1" and os.environ.get("TRITON_INTERPRET", "0") != "1"


_TUNED: dict[tuple, KernelConfig] = {}
_FITTED: dict[tuple, KernelConfig] = {}  # the config that ran where the chosen one did not fit the GPU


def choose(kind: str, key: tuple, head_dim: int, elem: int, on_cuda: bool,
           run: Callable[[KernelConfig], None] | None = None, warp_specialize: bool = False,
           smem_limit: int = SMEM_LIMIT) -> KernelConfig:
    """The config for a launch: the interpreter's, a tuned one (once per key), or the default."""
    if not on_cuda:
        return INTERPRET_CONFIG
    cands = candidates(kind, head_dim, elem, warp_specialize, smem_limit)
    if run is None or not autotune_enabled():
        return cands[0]
    full_key = (kind, head_dim, elem, warp_specialize, smem_limit, *key)
    if full_key not in _TUNED:
        _TUNED[full_key] = _tune(cands, run)
    return _TUNED[full_key]


def launch(kind: str, key: tuple, head_dim: int, elem: int, on_cuda: bool, run: Callable[[KernelConfig], None],
           warp_specialize: bool = False, smem_limit: int = SMEM_LIMIT, config: KernelConfig | None = None
           ) -> KernelConfig:
    """Run a kernel once with ``config``, or with the chosen config; where the GPU rejects that one
    for its resources (the shared-memory estimate is an estimate, and GPUs other than Hopper have less),
    with the next listed candidates in turn, remembering per key the one that ran. ``run`` must leave
    nothing behind when its launch is rejected. Returns the config that ran."""
    if config is not None:
        run(config)
        return config
    full_key = (kind, head_dim, elem, warp_specialize, smem_limit, *key)
    first = (_FITTED.get(full_key) if on_cuda else None) or choose(
        kind, key, head_dim, elem, on_cuda, run, warp_specialize=warp_specialize, smem_limit=smem_limit)
    if not on_cuda:  # the interpreter: no resource limits
        run(first)
        return first
    # then the candidates estimated to fit, then the rest of the list
    order = [first, *candidates(kind, head_dim, elem, warp_specialize, smem_limit),
             *_listed(kind, head_dim, warp_specialize)]
    tried, last = [], None
    for cfg in dict.fromkeys(order):
        tried.append(cfg)
        try:
            run(cfg)
        except Exception as err:  # noqa: BLE001 - only a rejection for resources moves on to the next config
            if not _out_of_resources(err):
                raise
            last = err
            continue
        if cfg != first:
            _FITTED[full_key] = cfg
        return cfg
    raise RuntimeError(f"dualkv triton: no {kind} kernel config at head dim {head_dim} fits this GPU "
                       f"({smem_limit // 1024} KB of shared memory per block); tried "
                       f"{', '.join(map(str, tried))}") from last


def _out_of_resources(err: BaseException) -> bool:
    return "OutOfResources" in type(err).__name__ or "out of resource" in str(err)


def _tune(cands: list[KernelConfig], run: Callable[[KernelConfig], None],
          bench: Callable[[Callable[[], None]], float] | None = None) -> KernelConfig:
    """The fastest candidate by ``bench`` (median of event-timed repeats); ones that do not build are skipped."""
    if bench is None:
        from triton.testing import do_bench

        def bench(fn):
            return do_bench(fn, warmup=5, rep=20, return_mode="median")

    best, best_ms = cands[0], math.inf
    for cfg in cands:
        try:
            ms = bench(lambda: run(cfg))
        except Exception as err:  # noqa: BLE001 - a config that does not fit the chip is skipped
            if not _out_of_resources(err):
                raise
            continue
        if ms < best_ms:
            best, best_ms = cfg, ms
    return best
