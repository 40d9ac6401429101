"""The benchmark harness: configs, the provider registry, formulas, timing, memory, validation.

Every attention benchmark goes through this file: a *provider* (DualKV through its public op, or a
peer built from PyTorch alone in ``peers.py``) is timed on one *config* with the same inputs, the same
timer and the same formulas.

Vocabulary: one prompt group of P tokens and N responses of R tokens (``AttnConfig``); T = P + N*R
packed tokens; T_rep = N*(P+R) tokens of the N-replicated layout; H query heads, H_kv key/value
heads, head dim d, element size e bytes.

FLOPs are the USEFUL work of the packed layout (the same number for every provider, so a provider
that recomputes the prompt N times is not credited for it)::

    pairs = P(P+1)/2 + sum_i [ P*R_i + R_i(R_i+1)/2 ]     attended (query, key) pairs
    flops_fwd    = 4 * d * H * pairs                       (QK^T and PV, 2 FLOPs per multiply-add)
    flops_bwd    = 2.5 * flops_fwd                          (dV, dP, dQ, dK and the recomputed QK^T)
    flops_fwdbwd = 3.5 * flops_fwd

Bytes are the least HBM traffic of an exact fused kernel on the packed tensors (reads + writes)::

    bytes_fwd = e * (2*T*H*d + 2*T*H_kv*d) + 4*H*T                    q, k, v in; out, lse (fp32) out
    bytes_bwd = e * (4*T*H*d + 4*T*H_kv*d) + 4*H*T                    q, k, v, out, dout, lse in; dq, dk, dv out

Timing: the median of CUDA-event-timed repeats, the L2 cache flushed (a 256 MiB buffer zeroed)
before every repeat, after one untimed warm-up (which absorbs compilation and autotuning). With
``hide_host`` (``--timing device``) the GPU spins in a wait kernel between the flush and the start event
for longer than the host takes to enqueue the call, so the events time the device's work, as a
training loop's queue of launched work sees it, and not the host's launch latency; a call that
synchronises with the GPU inside still shows what follows the synchronisation. The
host's enqueue time is reported beside (``<mode>_host_ms``). The
backward is timed alone, each repeat on a fresh (untimed) forward. The
number of repeats follows a time budget per measurement (``budget_ms``), at least 1: a provider
that needs seconds per call is timed once per mode, a fast one up to ``max_reps`` times. Inputs are
fresh random tensors per case; every config's q alone is larger than the 60 MB L2 of an H100/H200.

Memory: peak extra = ``max_memory_allocated`` during the timed forward+backward repeats minus what
was allocated before them (inputs, dout and the flush buffer), i.e. outputs, gradients, saved
tensors and workspaces.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from dualkv.core import PackedLayout, dualkv_attention

__all__ = [
    "AttnConfig", "parse_size", "fmt_size", "attended_pairs", "replicated_pairs", "attention_flops",
    "attention_bytes", "Provider", "PROVIDERS", "register", "get_provider", "Timer", "Timing",
    "run_case", "validate_provider", "dense_mask", "dense_attention", "MODES", "restored_env",
]

MODES = ("fwd", "bwd", "fwdbwd")
FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def set_env(name: str, value: str | None) -> None:
    """Environment variable ``name`` = ``value``, or removed for None."""
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


@contextlib.contextmanager
def restored_env(*names: str):
    """Environment variables ``names`` as they were on entry, again on exit (a benchmark that switches
    kernel choices between calls leaves the process's settings alone)."""
    saved = {name: os.environ.get(name) for name in names}
    try:
        yield
    finally:
        for name, value in saved.items():
            set_env(name, value)


# ----------------------------------------------------------------------------------------- configs
def parse_size(text: str | int) -> int:
    """``"4K"`` -> 4096, ``"128k"`` -> 131072, ``"512"`` -> 512, ``"1.5K"`` -> 1536."""
    if isinstance(text, int):
        return text
    s = str(text).strip().upper()
    scale = 1024 if s.endswith("K") else 1024 * 1024 if s.endswith("M") else 1
    number = s[:-1] if scale > 1 else s
    try:
        value = float(number) * scale
    except ValueError:
        raise ValueError(f"size: expected an integer with an optional K/M suffix (e.g. 4K), got {text!r}") from None
    if value != int(value) or value < 1:
        raise ValueError(f"size: expected a positive whole number of tokens, got {text!r}")
    return int(value)


def fmt_size(n: int) -> str:
    """4096 -> ``"4K"``, 512 -> ``"512"``."""
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


@dataclass(frozen=True)
class AttnConfig:
    """One prompt group: a prompt of P tokens and N responses of R tokens each; heads and dtype."""

    N: int
    P: int
    R: int
    H: int = 32
    H_kv: int = 8
    d: int = 128
    dtype: str = "bfloat16"

    def __post_init__(self):
        for name in ("N", "P", "R", "H", "H_kv", "d"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected a positive integer, got {getattr(self, name)}")
        if self.H % self.H_kv:
            raise ValueError(f"H_kv: expected it to divide H={self.H}, got {self.H_kv}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {list(DTYPES)}, got {self.dtype!r}")

    @classmethod
    def parse(cls, text: str, **defaults) -> AttnConfig:
        """``"28,4K,2K"`` (N, P, R) or ``"N=16,P=32K,R=2K,H=16,H_kv=8,d=256"``; ``defaults`` fill the rest."""
        parts = [p.strip() for p in text.split(",") if p.strip()]
        values = dict(defaults)
        if parts and all("=" not in p for p in parts):
            if len(parts) != 3:
                raise ValueError(f"config: expected 'N,P,R' (e.g. 28,4K,2K), got {text!r}")
            values.update(N=parse_size(parts[0]), P=parse_size(parts[1]), R=parse_size(parts[2]))
        else:
            for p in parts:
                key, _, val = p.partition("=")
                key = {"hkv": "H_kv", "h_kv": "H_kv"}.get(key.strip().lower(), key.strip())
                if key not in {"N", "P", "R", "H", "H_kv", "d", "dtype"}:
                    raise ValueError(f"config: unknown key {key!r} in {text!r}; expected N, P, R, H, H_kv, d, dtype")
                values[key] = val.strip() if key == "dtype" else parse_size(val)
        missing = {"N", "P", "R"} - set(values)
        if missing:
            raise ValueError(f"config: {text!r} lacks {sorted(missing)}")
        return cls(**values)

    @property
    def name(self) -> str:
        return f"N{self.N}_P{fmt_size(self.P)}_R{fmt_size(self.R)}_H{self.H}_Hkv{self.H_kv}_d{self.d}_{self.dtype}"

    @property
    def label(self) -> str:
        return f"{self.N}, {fmt_size(self.P)}, {fmt_size(self.R)}"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def prompt_lens(self) -> list[int]:
        return [self.P]

    @property
    def response_lens(self) -> list[list[int]]:
        return [[self.R] * self.N]

    @property
    def tokens(self) -> int:
        return self.P + self.N * self.R

    @property
    def replicated_tokens(self) -> int:
        return self.N * (self.P + self.R)

    @property
    def rho(self) -> float:
        return self.replicated_tokens / self.tokens

    def layout(self, device) -> PackedLayout:
        return PackedLayout.from_lengths(self.prompt_lens, self.response_lens, device=device)


# ---------------------------------------------------------------------------------------- formulas
def attended_pairs(prompt_lens, response_lens) -> int:
    """(query, key) pairs the packed layout attends: sum_g P(P+1)/2 + sum_i [P*R_i + R_i(R_i+1)/2]."""
    total = 0
    for p, rs in zip(prompt_lens, response_lens):
        total += p * (p + 1) // 2 + sum(p * r + r * (r + 1) // 2 for r in rs)
    return total


def replicated_pairs(prompt_lens, response_lens) -> int:
    """Pairs computed over the N-replicated layout: sum_g sum_i (P+R_i)(P+R_i+1)/2."""
    return sum((p + r) * (p + r + 1) // 2 for p, rs in zip(prompt_lens, response_lens) for r in rs)


def attention_flops(cfg: AttnConfig, mode: str) -> float:
    """Useful FLOPs of ``mode`` ("fwd", "bwd", "fwdbwd") on the packed layout (module docstring)."""
    return FLOP_FACTOR[mode] * 4 * cfg.d * cfg.H * attended_pairs(cfg.prompt_lens, cfg.response_lens)


def attention_bytes(cfg: AttnConfig, mode: str) -> int:
    """Least HBM bytes of ``mode`` for an exact fused kernel on the packed tensors (module docstring)."""
    e = torch.empty(0, dtype=cfg.torch_dtype).element_size()
    T, q_elems, kv_elems, lse = cfg.tokens, cfg.tokens * cfg.H * cfg.d, cfg.tokens * cfg.H_kv * cfg.d, 4 * cfg.H * cfg.tokens
    fwd = e * (2 * q_elems + 2 * kv_elems) + lse
    bwd = e * (4 * q_elems + 4 * kv_elems) + lse
    return {"fwd": fwd, "bwd": bwd, "fwdbwd": fwd + bwd}[mode] if T else 0


# --------------------------------------------------------------------------------------- providers
class Provider:
    """One way to compute attention over a config. Subclasses set ``name`` via ``@register``.

    ``prepare`` (untimed) turns the packed q, k, v into the provider's inputs (leaf tensors that
    require grad: the packed tensors themselves, or the N-replicated copies); ``forward`` (timed)
    returns the output in the provider's own token order; ``gather`` maps a packed tensor to that
    order differentiably and ``to_packed`` maps an output back (both used by validation).
    """

    name = "?"
    replicated = False  # True: works on the N-replicated layout (T_rep tokens)
    plan_tflops: float | None = None  # rough rate on COMPUTED pairs, only to skip runs over --max-est-s

    def __init__(self, cfg: AttnConfig, layout: PackedLayout, device: torch.device):
        self.cfg, self.layout, self.device = cfg, layout, device
        self.scale = 1.0 / math.sqrt(cfg.d)

    @classmethod
    def unsupported(cls, cfg: AttnConfig, device: torch.device) -> str | None:
        """None if the provider can run ``cfg`` on ``device``, else the reason (a short sentence)."""
        return None

    @classmethod
    def computed_pairs(cls, cfg: AttnConfig) -> int:
        if cls.replicated:
            return replicated_pairs(cfg.prompt_lens, cfg.response_lens)
        return attended_pairs(cfg.prompt_lens, cfg.response_lens)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def to_packed(self, out: torch.Tensor) -> torch.Tensor:
        return out

    def prepare(self, q, k, v) -> tuple[torch.Tensor, ...]:
        return tuple(self.gather(t).detach().requires_grad_() for t in (q, k, v))

    def forward(self, q, k, v) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the provider built for this config (compiled graphs, masks)."""


PROVIDERS: dict[str, type[Provider]] = {}


def register(name: str):
    def deco(cls):
        cls.name = name
        PROVIDERS[name] = cls
        return cls

    return deco


def get_provider(name: str) -> type[Provider]:
    if name not in PROVIDERS:
        raise ValueError(f"provider: expected one of {sorted(PROVIDERS)}, got {name!r}")
    return PROVIDERS[name]


KERNEL_CHOICE_VARS = ("DUALKV_CUDA_WGMMA", "DUALKV_CUDA_FWD_BLOCK_N", "DUALKV_CUDA_FWD_PERSISTENT", "DUALKV_CUDA_FWD_MERGE",
                      "DUALKV_CUDA_WGMMA_BWD",
                      "DUALKV_CUDA_BWD_TMA",
                      "DUALKV_TRITON_WS", "DUALKV_TRITON_GLUON_FWD", "DUALKV_TRITON_GLUON_BWD",
                      "DUALKV_TRITON_GLUON_DKDV", "DUALKV_TRITON_ATOMIC_DQ")


class _DualKV(Provider):
    """DualKV through its public op ``dualkv.core.dualkv_attention`` (custom op + autograd)."""

    backend = "reference"
    # Kernel choices of the CUDA backend (KERNEL_CHOICE_VARS), read by its binding at every call: set
    # before each forward (the backward of that forward follows it); a variable this dict does not
    # name is unset (the default), so no provider inherits the choice of the variant timed before it.
    # The CUDA variants below time the backend's kernel paths against each other in one run.
    env: dict[str, str] = {}

    @classmethod
    def unsupported(cls, cfg, device):
        from dualkv.core.backends import get_backend, split_backend

        if cls.backend == "auto":
            return None
        if cls.backend != "reference" and device.type != "cuda":
            return f"backend {cls.backend!r} needs a CUDA device"
        for part in split_backend(cls.backend):
            try:
                backend = get_backend(part)
            except RuntimeError as err:
                return str(err)
            if not backend.is_available():
                return f"backend {part!r} is not available: {backend.unavailable_reason()}"
        return None

    def forward(self, q, k, v):
        for key in KERNEL_CHOICE_VARS:
            set_env(key, self.env.get(key))
        return dualkv_attention(q, k, v, self.layout, softmax_scale=self.scale, backend=self.backend)


# The DualKV providers: (name, backend, kernel-choice variables, what it runs). The variants time the
# backends' kernel paths against each other in one run; "triton+cuda" is Triton's forward with the CUDA
# backward named by the variables (``auto`` takes that pair at d = 512).
_CUDA_BWD = "DUALKV_CUDA_WGMMA_BWD"
DUALKV_VARIANTS: list[tuple[str, str, dict[str, str], str]] = [
    ("dualkv-auto", "auto", {},
     'What ``backend="auto"`` takes for the config (per head dim, dtype and, at d = 128, the longest '
     'prompt: see dualkv.core.backends).'),
    ("dualkv-triton", "triton", {}, "The Triton backend's defaults."),
    ("dualkv-triton-no-ws", "triton", {"DUALKV_TRITON_WS": "0"},
     "Triton's forward and dQ without the warp-specialised loop (the multi-loop kernels, whose unmasked "
     "blocks skip the mask)."),
    ("dualkv-triton-tl-fwd", "triton", {"DUALKV_TRITON_GLUON_FWD": "0"},
     "Triton with the ``tl`` forward (``fwd_kernel``) in place of the Gluon one."),
    ("dualkv-triton-tl-bwd", "triton", {"DUALKV_TRITON_GLUON_BWD": "0"},
     "Triton with the ``tl`` backward kernels in place of the warp-specialised Gluon ones (the default "
     "before 2026-12-05: a dK/dV kernel and a dQ kernel)."),
    ("dualkv-triton-gluon-dkdv", "triton", {"DUALKV_TRITON_GLUON_BWD": "0", "DUALKV_TRITON_GLUON_DKDV": "1"},
     "Triton with the one-warpgroup-pair Gluon dK/dV in place of the ``tl`` row kernel, dQ still from the "
     "dQ kernel."),
    ("dualkv-triton-fused-dq", "triton", {"DUALKV_TRITON_GLUON_BWD": "0", "DUALKV_TRITON_GLUON_DKDV": "1",
                                          "DUALKV_TRITON_ATOMIC_DQ": "1"},
     "Triton with dQ added inside that Gluon dK/dV by TMA reduce-add (not warp-specialised)."),
    ("dualkv-cuda", "cuda", {},
     "The CUDA backend's defaults: on sm_90 the wgmma forward and (d 64 - 256) the wgmma backward."),
    ("dualkv-cuda-mma", "cuda", {"DUALKV_CUDA_WGMMA": "0", _CUDA_BWD: "0"},
     "mma.sync kernels only (the sm_80 path), on any card."),
    ("dualkv-cuda-mma-bwd", "cuda", {_CUDA_BWD: "0"},
     "The default forward with the mma.sync backward (the default before the wgmma backward)."),
    ("dualkv-cuda-ws", "cuda", {"DUALKV_CUDA_WGMMA": "2"},
     "The warp-specialised wgmma forward with cp.async loads (a producer warpgroup, K and V rings with "
     "mbarrier hand-over; opt-in, the default at d = 64 / 128 before the TMA form)."),
    ("dualkv-cuda-tma-fwd", "cuda", {"DUALKV_CUDA_WGMMA": "3"},
     "The wgmma forward with one thread issuing bulk tensor copies (TMA; the default: the "
     "warp-specialised form at d = 64 / 128, the in-turn form at 192 / 256 / 512)."),
    ("dualkv-cuda-fwd-128", "cuda", {"DUALKV_CUDA_FWD_BLOCK_N": "128"},
     "The default forward at d = 128 on 128-key tiles, K and V in rings of 3 (the default before the "
     "176-key tiles; other head dims are unchanged)."),
    ("dualkv-cuda-fwd-persistent", "cuda", {"DUALKV_CUDA_FWD_PERSISTENT": "1"},
     "The default forward at d = 64 / 128 on persistent blocks: one a SM, taking query tiles from a "
     "counter, the K / V rings running on from one tile to the next."),
    ("dualkv-cuda-fwd-merge", "cuda", {"DUALKV_CUDA_FWD_MERGE": "1"},
     "The default forward at d = 128 walking the prompt's and the response's keys as one range: the "
     "prompt's last partial 176-key tile runs on into the response's first keys (opt-in)."),
    ("dualkv-cuda-tma-bwd", "cuda", {"DUALKV_CUDA_BWD_TMA": "1"},
     "The default schedules with the warp-specialised dK/dV kernel's loads as bulk tensor copies from "
     "one producer thread (the default; schedules 6 / 8, d = 64 / 128)."),
    ("dualkv-cuda-cp-async-bwd", "cuda", {"DUALKV_CUDA_BWD_TMA": "0"},
     "The default schedules with the dK/dV kernel's producer warpgroup loading by cp.async (the default "
     "before the bulk tensor copies)."),
    ("dualkv-cuda-in-turn-fwd", "cuda", {"DUALKV_CUDA_WGMMA": "1"},
     "The in-turn wgmma forward with cp.async (every thread loads and computes; the default at d = 192 / "
     "256 / 512 before its bulk tensor copies, opt-in at 64 / 128)."),
    ("dualkv-cuda-wgmma-bwd", "cuda", {_CUDA_BWD: "1"},
     "The wgmma backward's in-turn schedule 1 (d 64 / 128; the products of a tile in turn)."),
    ("dualkv-cuda-wgmma-bwd-overlap", "cuda", {_CUDA_BWD: "2"},
     "Schedule 2: the next tile's products overlapping (d 64 / 128)."),
    ("dualkv-cuda-fused-dq", "cuda", {_CUDA_BWD: "3"},
     "Schedule 3: the wgmma dK/dV kernel also accumulates dQ (fp32 atomics; no dQ kernel; d 64 / 128)."),
    ("dualkv-cuda-ws-bwd", "cuda", {_CUDA_BWD: "4"},
     "Schedule 4: the warp-specialised wgmma dK/dV kernel with the in-turn dQ kernel (a producer "
     "warpgroup loads; d 64 / 128)."),
    ("dualkv-cuda-ws-both-bwd", "cuda", {_CUDA_BWD: "5"},
     "Schedule 5: both wgmma backward kernels warp-specialised (dQ and dK/dV; d 64 / 128)."),
    ("dualkv-cuda-ws-fused-dq", "cuda", {_CUDA_BWD: "6"},
     "Schedule 6: the warp-specialised wgmma dK/dV kernel that also accumulates dQ (no dQ kernel; d 64 / "
     "128; the default at d = 128)."),
    ("dualkv-cuda-ws-split-bwd", "cuda", {_CUDA_BWD: "8"},
     "Schedule 8: 5 with S^T and dP^T waited for apart (P^T computed while dP^T runs; d 64 / 128; the "
     "default at d = 64 until 2026-12-02)."),
    ("dualkv-pair", "triton+cuda", {}, "Triton's forward with the CUDA backend's default backward."),
    ("dualkv-pair-cuda-triton", "cuda+triton", {}, "The CUDA backend's forward with Triton's default backward."),
    ("dualkv-pair-in-turn-bwd", "triton+cuda", {_CUDA_BWD: "1"}, "Triton's forward with schedule 1."),
    ("dualkv-pair-fused-dq", "triton+cuda", {_CUDA_BWD: "3"}, "Triton's forward with schedule 3."),
    ("dualkv-pair-ws-bwd", "triton+cuda", {_CUDA_BWD: "4"}, "Triton's forward with schedule 4."),
    ("dualkv-pair-ws-both-bwd", "triton+cuda", {_CUDA_BWD: "5"},
     "Triton's forward with schedule 5 (what ``auto`` ran at d = 64 before 8)."),
    ("dualkv-pair-ws-fused-dq", "triton+cuda", {_CUDA_BWD: "6"},
     "Triton's forward with schedule 6, the CUDA backward's default at d = 128."),
    ("dualkv-pair-ws-split-bwd", "triton+cuda", {_CUDA_BWD: "8"},
     "Triton's forward with schedule 8 (what ``auto`` ran at d = 64 until 2026-12-02)."),
    ("reference", "reference", {}, "The pure-PyTorch oracle through the same op (correctness anchor, CPU tests; slow)."),
]
for _name, _backend, _env, _doc in DUALKV_VARIANTS:
    register(_name)(type(f"DualKV[{_name}]", (_DualKV,), {"backend": _backend, "env": _env, "__doc__": _doc}))


# ------------------------------------------------------------------------------------------ timing
@dataclass
class Timing:
    median_ms: float
    reps: int
    times_ms: list[float]
    busy_ms: float = 0.0  # every timed call's time, the first estimate's too
    host_ms: float = 0.0  # median host time to enqueue a timed call (CPU: the call's time)
    host_exposed: int = 0  # of the median's calls, those whose enqueue outlasted the GPU's wait (hide_host only)


TIMINGS = ("device", "host-visible")  # --timing: Timer(hide_host=True / False)


def add_timing_argument(ap, default: str) -> None:
    """The benchmarks' ``--timing`` option; ``Timer(..., hide_host=args.timing == "device")`` reads it."""
    ap.add_argument("--timing", choices=TIMINGS, default=default,
                    help="device: the GPU waits after each L2 flush until the host has enqueued the call, so "
                         "events time the device's work (bench_attention's default); host-visible: the host's "
                         f"enqueue latency after the flush is inside the times (the method of every run before "
                         f"2026-12-06). Default: {default}")


class Timer:
    """Median of event-timed repeats with an L2 flush before each (host clock on CPU).

    ``hide_host``: the GPU waits (``torch.cuda._sleep``) after the flush for 1.5x the longest enqueue
    seen so far plus 0.5 ms (20 ms before the first call, at most ``MAX_WAIT_MS``), so the host has
    enqueued the whole call before the start event is reached. A call whose start event had already
    been reached when its enqueue ended (the GPU waited for the host after all: a long enqueue, a
    synchronisation inside the call, a clock faster than calibrated) is counted in
    ``Timing.host_exposed``; its time is partly the host's. Without ``hide_host`` the host's launch
    latency after the flush is inside the time."""

    FIRST_WAIT_MS = 20.0
    MAX_WAIT_MS = 50.0  # a call that synchronises inside blocks on the wait itself: its enqueue time grows with it

    def __init__(self, device: torch.device, budget_ms: float = 400.0, max_reps: int = 30, flush_mib: int = 256,
                 hide_host: bool = False):
        self.device, self.budget_ms, self.max_reps = device, budget_ms, max_reps
        self.cuda = device.type == "cuda"
        self.hide_host = hide_host and self.cuda
        self._flush = torch.empty(flush_mib * 2**20 // 4, dtype=torch.int32, device=device) if self.cuda else None
        self._cycles_per_ms = self._calibrate() if self.hide_host else 0.0

    def _calibrate(self) -> float:
        """GPU clock cycles per ms of the wait kernel: the fastest of three timings (another process's
        work on the GPU can only lengthen one). A clock that differs later is caught by the exposure
        check of ``_once``."""
        cycles = 10_000_000
        torch.cuda._sleep(cycles // 10)  # warm-up
        best = float("inf")
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end))
        return cycles / max(best, 1e-3)

    def _once(self, fn: Callable, setup: Callable | None, wait_ms: float = 0.0) -> tuple[float, float, bool]:
        """(device ms, host enqueue ms, exposed) of one call; exposed: ``hide_host`` and the GPU reached
        the start event before the host had enqueued the whole call."""
        arg = setup() if setup is not None else None  # untimed: enqueued before the start event
        call = (lambda: fn(arg)) if setup is not None else fn
        if not self.cuda:
            t0 = time.perf_counter()
            call()
            ms = (time.perf_counter() - t0) * 1e3
            return ms, ms, False
        self._flush.zero_()
        if self.hide_host:
            torch.cuda._sleep(int(wait_ms * self._cycles_per_ms))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        call()
        exposed = self.hide_host and start.query()
        end.record()
        host = (time.perf_counter() - t0) * 1e3
        end.synchronize()
        return start.elapsed_time(end), host, exposed

    def _wait_ms(self, hosts: list[float]) -> float:
        return min(self.MAX_WAIT_MS, 1.5 * max(hosts) + 0.5)

    def measure(self, fn: Callable, setup: Callable | None = None) -> Timing:
        """One timed call estimates the cost; then repeats up to the budget (at least one more).

        ``setup`` (optional) runs untimed before every call and its result is passed to ``fn``
        (the backward is timed on a fresh forward each time, never on a retained graph)."""
        first, first_host, first_exposed = self._once(fn, setup, self.FIRST_WAIT_MS)
        hosts = [first_host]
        reps = int(max(1, min(self.max_reps - 1, self.budget_ms // max(first, 1e-3))))
        if reps < 3 and first_exposed:  # the estimate cannot join the median: one more call instead
            reps += 1
        calls = []  # (ms, host ms, exposed) of the calls that make the median
        for _ in range(reps):
            calls.append(self._once(fn, setup, self._wait_ms(hosts)))
            hosts.append(calls[-1][1])
        busy = first + sum(c[0] for c in calls)
        if len(calls) < 3 and not first_exposed:  # too few for a median of the later calls: keep the estimate
            calls.append((first, first_host, first_exposed))
        times = [c[0] for c in calls]
        return Timing(statistics.median(times), len(times), times, busy, statistics.median(c[1] for c in calls),
                      sum(c[2] for c in calls))


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _short(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".strip().splitlines()
    return (text[0] if text else type(err).__name__)[:300]


def _is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def base_row(cfg: AttnConfig, provider: str) -> dict:
    pairs = attended_pairs(cfg.prompt_lens, cfg.response_lens)
    return dict(
        config=cfg.name, label=cfg.label, N=cfg.N, P=cfg.P, R=cfg.R, H=cfg.H, H_kv=cfg.H_kv, d=cfg.d,
        dtype=cfg.dtype, T=cfg.tokens, T_rep=cfg.replicated_tokens, rho=round(cfg.rho, 4), pairs=pairs,
        provider=provider, status="ok",
    )


def run_case(cfg: AttnConfig, provider: str, device: torch.device, timer: Timer, *, modes=MODES,
             max_est_s: float | None = None, seed: int = 0, monitor=None) -> dict:
    """Time one provider on one config; returns a result row (status 'ok', 'OOM', 'unsupported: ...',
    'skipped: ...' or 'error: ...'). Never raises for a provider's own failure. ``monitor`` (a running
    ``benchmarks.gpu_monitor.GpuMonitor``) adds ``<mode>_clock_mhz`` / ``<mode>_power_w``: the medians of
    the GPU's SM clock and power while each mode was timed, where it sampled any, and ``<mode>_busy``: the
    share of that stretch's wall time the timed calls took (the rest is setup, flushes and host time; a
    power reading averaged over the last second, as nvidia-smi's is on Ampere and newer, falls with it
    and, for a mode timed for less than a second, reads partly the stretch before)."""
    row = base_row(cfg, provider)
    cls = get_provider(provider)
    computed = cls.computed_pairs(cfg)
    row.update(computed_pairs=computed, bytes_fwd=attention_bytes(cfg, "fwd"), bytes_bwd=attention_bytes(cfg, "bwd"))
    reason = cls.unsupported(cfg, device)
    if reason:
        row["status"] = f"unsupported: {reason}"
        return row
    if max_est_s and cls.plan_tflops and device.type == "cuda":
        planned = FLOP_FACTOR["fwdbwd"] * 4 * cfg.d * cfg.H * computed / (cls.plan_tflops * 1e12)
        if planned > max_est_s:
            row["status"] = f"skipped: planned {planned:.0f} s per fwd+bwd call > --max-est-s {max_est_s:g}"
            return row
    prov = None
    try:
        prov = cls(cfg, cfg.layout(device), device)
        row.update(_measure(prov, cfg, device, timer, modes, seed, monitor))
    except Exception as err:  # a peer that fails is recorded, not fatal
        row["status"] = "OOM" if _is_oom(err) else f"error: {_short(err)}"
    finally:
        if prov is not None:
            prov.close()
        del prov
        _free(device)
    return row


def _random_qkv(cfg: AttnConfig, device, seed: int):
    gen = torch.Generator(device=device).manual_seed(seed)
    shape_q, shape_kv = (cfg.tokens, cfg.H, cfg.d), (cfg.tokens, cfg.H_kv, cfg.d)
    return [torch.randn(s, generator=gen, device=device, dtype=cfg.torch_dtype) for s in (shape_q, shape_kv, shape_kv)]


def _measure(prov: Provider, cfg: AttnConfig, device, timer: Timer, modes, seed: int, monitor=None) -> dict:
    inputs = prov.prepare(*_random_qkv(cfg, device, seed))
    result = dict(input_gib=sum(t.numel() * t.element_size() for t in inputs) / 2**30)
    t0 = time.perf_counter()
    out = prov.forward(*inputs)
    dout = torch.randn_like(out)
    torch.autograd.grad(out, inputs, dout)  # warm-up: compilation, autotuning, plan caches
    del out
    _sync(device)
    result["warmup_s"] = round(time.perf_counter() - t0, 3)

    def fwd():
        prov.forward(*inputs)

    def fwd_out():
        return prov.forward(*inputs)

    def fwdbwd():
        torch.autograd.grad(prov.forward(*inputs), inputs, dout)

    timings = {}

    def measure(mode, fn, setup=None):  # and the GPU's clock and power meanwhile, where a monitor sampled them
        t0 = time.monotonic()
        timings[mode] = timer.measure(fn, setup)
        t1 = time.monotonic()
        clocks = monitor.window(t0, t1) if monitor is not None else None
        if clocks is not None:
            busy = min(timings[mode].busy_ms / max((t1 - t0) * 1e3, 1e-6), 1.0)
            result.update({f"{mode}_clock_mhz": clocks["sm_clock_mhz"], f"{mode}_power_w": clocks["power_w"],
                           f"{mode}_busy": round(busy, 3)})

    if "fwd" in modes:
        measure("fwd", fwd)
    if "bwd" in modes:
        measure("bwd", lambda out: torch.autograd.grad(out, inputs, dout), setup=fwd_out)
    if "fwdbwd" in modes:
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        measure("fwdbwd", fwdbwd)
        if device.type == "cuda":
            result["peak_extra_gib"] = (torch.cuda.max_memory_allocated(device) - base) / 2**30
    for mode, t in timings.items():
        result[f"{mode}_ms"] = t.median_ms
        result[f"{mode}_reps"] = t.reps
        result[f"{mode}_min_ms"], result[f"{mode}_max_ms"] = min(t.times_ms), max(t.times_ms)
        result[f"{mode}_tflops"] = attention_flops(cfg, mode) / (t.median_ms * 1e-3) / 1e12
        result[f"{mode}_host_ms"] = round(t.host_ms, 3)
        if timer.hide_host:
            result[f"{mode}_host_exposed"] = t.host_exposed
    return result


# -------------------------------------------------------------------------------------- validation
def dense_mask(layout: PackedLayout) -> torch.Tensor:
    """(T, T) bool, True where query row i attends key column j (the DualKV rule, no window)."""
    seg = layout.token_segment.long()
    lo = layout.seg_ctx_start.long()[seg]
    hi = lo + layout.seg_ctx_len.long()[seg]
    idx = torch.arange(seg.numel(), device=seg.device)
    own = (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])
    ctx = (idx[None, :] >= lo[:, None]) & (idx[None, :] < hi[:, None])
    return own | ctx


def dense_attention(q, k, v, mask: torch.Tensor, scale: float, upcast: bool = True) -> torch.Tensor:
    """Plain PyTorch attention over a dense (T, T) mask; ``upcast=False`` computes in q's dtype
    (PyTorch's own low-precision error, the yardstick of the tolerances)."""
    dtype = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    probs = torch.softmax(scores.masked_fill(~mask, -math.inf), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v).to(dtype)


def validate_provider(provider: str, cfg: AttnConfig, device: torch.device, seed: int = 0) -> dict:
    """Check a provider's output and dq, dk, dv against ``dualkv.core.reference_attention`` (fp32).

    Tolerance (FlashAttention's tests): ``max|x - ref| <= 2 * max|x_pt - ref| + floor`` for the
    output, 3x for gradients, where ``x_pt`` is plain PyTorch attention computed in the input dtype
    and ``floor`` the rounding error of the reference values in that dtype.
    """
    from dualkv.core import reference_attention

    cls = get_provider(provider)
    reason = cls.unsupported(cfg, device)
    if reason:
        return dict(provider=provider, config=cfg.name, ok=None, status=f"unsupported: {reason}")
    layout = cfg.layout(device)
    prov = cls(cfg, layout, device)
    try:
        q, k, v = (t.requires_grad_() for t in _random_qkv(cfg, device, seed))
        dout = torch.randn_like(q)
        scale = prov.scale
        q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
        ref = reference_attention(q32, k32, v32, layout, softmax_scale=scale)
        ref_grads = torch.autograd.grad(ref, (q32, k32, v32), dout.float())
        mask = dense_mask(layout)
        pt = dense_attention(q, k, v, mask, scale, upcast=False)
        pt_grads = torch.autograd.grad(pt, (q, k, v), dout)
        out = prov.to_packed(prov.forward(*(prov.gather(t) for t in (q, k, v))))
        grads = torch.autograd.grad(out, (q, k, v), dout)
        report = dict(provider=provider, config=cfg.name, ok=True, status="ok")
        for name, x, x_pt, x_ref, mult in [("out", out, pt, ref, 2)] + [
            (n, g, gp, gr, 3) for n, g, gp, gr in zip(("dq", "dk", "dv"), grads, pt_grads, ref_grads)
        ]:
            x_ref = x_ref.float()
            floor = (x_ref.to(cfg.torch_dtype).float() - x_ref).abs().max().item()
            err = (x.float() - x_ref).abs().max().item()
            err_pt = (x_pt.float() - x_ref).abs().max().item()
            tol = mult * err_pt + floor + 1e-6
            report[f"{name}_err"], report[f"{name}_tol"] = err, tol
            if not err <= tol:  # NaN fails too
                report["ok"], report["status"] = False, f"{name} error {err:.3g} > tolerance {tol:.3g}"
        return report
    except Exception as err:
        return dict(provider=provider, config=cfg.name, ok=False, status=("OOM" if _is_oom(err) else f"error: {_short(err)}"))
    finally:
        prov.close()
        _free(device)
