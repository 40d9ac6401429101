"""Step metrics: per-phase times, tokens/s, MFU on a stated FLOP formula, peak memory.

FLOP formula (model FLOPs of the tokens the model actually runs; a multiply-add counts 2):

    forward  = T * F_token  +  n_logits * 2 * D * V  +  sum over layers of 4 * H * d * pairs_layer
    F_token  = sum over layers of [ 2 * D * (H + 2 * H_kv) * d  +  2 * H * d * D       (q, k, v, o)
                                    + 6 * D * I                                     (dense gated MLP)
                                    + 6 * D * I_e * top_k + 2 * D * E ]             (MoE experts + router)
    pairs_layer = attended (query, key) pairs of the layout in that layer: for a query at logical
                  position i, min(i + 1, window) keys (prompts causal; a response sees its prompt and
                  its own prefix)
    update pass = 3 * forward (backward = 2 * forward); old_log_prob / ref passes = 1 * forward

T is the packed length (P + sum R per group) under ``--packing dualkv`` and sum (P + R) under
``replicated``; ``n_logits`` is the number of response tokens (logits are only computed where a log-prob
is needed). MFU = FLOPs / (seconds * world size * peak FLOP/s per device). "Effective tokens/s" counts
the replicated tokens the step is equivalent to, so both packings are compared on the same scale.
"""

from __future__ import annotations

import json
import math
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

__all__ = ["token_flops", "attention_pairs", "forward_flops", "forward_flops_by_part", "peak_flops", "PhaseTimer",
           "MetricsLogger", "peak_memory_gib"]

# Dense bf16 tensor-core peak per device, FLOP/s, from the vendors' data sheets.
_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12, "B200": 2250e12,
              "L40S": 362e12, "A10G": 70e12, "4090": 165e12}


def token_flops(config) -> int:
    """F_token: forward FLOPs per token of every per-token matmul except the LM head."""
    D, total = config.hidden_size, 0
    for layer in config.layers:
        a = layer.attention
        kv = 0 if a.kv_source is not None else (1 if a.k_eq_v else 2) * a.num_kv_heads
        total += 2 * D * (a.num_heads + kv) * a.head_dim + 2 * a.num_heads * a.head_dim * D
        if layer.mlp is not None:
            total += 6 * D * layer.mlp.intermediate_size
        if layer.moe is not None:
            m = layer.moe
            total += 6 * D * m.intermediate_size * m.top_k + 2 * D * m.num_experts
    return total


def _sum_min(a: int, b: int, w: int | None) -> int:
    """sum_{i=a}^{b-1} min(i + 1, w) (w None = no window)."""
    if b <= a:
        return 0

    def prefix(n: int) -> int:  # sum_{i=0}^{n-1} min(i+1, w)
        if w is None or n <= w:
            return n * (n + 1) // 2
        return w * (w + 1) // 2 + (n - w) * w

    return prefix(b) - prefix(a)


def attention_pairs(layout, window: int | None = None) -> int:
    """Attended (query, key) pairs of a ``PackedLayout`` with an optional sliding window."""
    pairs = 0
    for p, rs in zip(layout.prompt_lens, layout.response_lens):
        pairs += _sum_min(0, p, window)
        pairs += sum(_sum_min(p, p + r, window) for r in rs)
    return pairs


def forward_flops_by_part(config, layout) -> dict[str, int]:
    """Forward FLOPs of one micro-batch by part (see the module docstring): ``products`` (T * F_token),
    ``head`` (the log-prob head's logits) and ``attention`` (the attended pairs' two products)."""
    T = layout.total_tokens
    n_logits = sum(layout.row_lens)
    attention, cache = 0, {}
    for layer in config.layers:
        a = layer.attention
        if a.window not in cache:
            cache[a.window] = attention_pairs(layout, a.window)
        attention += 4 * a.num_heads * a.head_dim * cache[a.window]
    return {"products": T * token_flops(config), "head": n_logits * 2 * config.hidden_size * config.vocab_size,
            "attention": attention}


def forward_flops(config, layout) -> int:
    """Forward FLOPs of one micro-batch (see the module docstring)."""
    return sum(forward_flops_by_part(config, layout).values())


def peak_flops(override_tflops: float | None = None) -> float | None:
    """Peak FLOP/s of one device: the override, or the bf16 data-sheet value of the CUDA device, or None."""
    if override_tflops is not None:
        return override_tflops * 1e12
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in _PEAK_BF16.items() if k in name), None)


def peak_memory_gib() -> float | None:
    if not torch.cuda.is_available():
        return None
    return torch.cuda.max_memory_allocated() / 2**30


class PhaseTimer:
    """Wall time per named phase (device-synchronised on CUDA), accumulated over a step. Each phase is
    also a ``phase:<name>`` region for torch.profiler, by which ``benchmarks.timeline`` attributes a
    profiled step's idle GPU time."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.failed_in: str | None = None  # the innermost phase an exception left, until reset()

    @contextmanager
    def phase(self, name: str):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            with torch.profiler.record_function(f"phase:{name}"):
                yield
        except BaseException:
            self.failed_in = self.failed_in or name
            raise
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.seconds[name] += time.perf_counter() - t0

    def reset(self) -> dict[str, float]:
        out, self.seconds, self.failed_in = dict(self.seconds), defaultdict(float), None
        return out


def _clean(v):
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class MetricsLogger:
    """One JSON line per step in ``<dir>/metrics.jsonl``; TensorBoard scalars too when installed."""

    def __init__(self, out_dir: str | Path | None, *, enabled: bool = True, tensorboard: bool = True) -> None:
        self.enabled = enabled and out_dir is not None
        self.path = None
        self.tb = None
        if not self.enabled:
            return
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / "metrics.jsonl"
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(out_dir / "tensorboard"))
            except (ImportError, ModuleNotFoundError):
                self.tb = None

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
