"""The GPU's SM clock and board power, sampled while a benchmark runs, so that a result says at what
clock it was measured.

A long training step on an H200 runs at the card's power cap, with the SM clock 13-17% below the
1980 MHz a short kernel benchmark sees (``benchmarks/results/raw/policy_step_h200_mb8_s27_clocks.csv``):
the same kernel is that much slower inside the step. ``GpuMonitor`` runs ``nvidia-smi`` in the
background and hands out the median clock and power of any stretch of the run::

    with GpuMonitor(torch.cuda.current_device()) as mon:
        t0 = time.monotonic(); run(); t1 = time.monotonic()
    mon.window(t0, t1)   # {"sm_clock_mhz": 1690.0, "power_w": 675.2, "samples": 41}, or None

Without ``nvidia-smi`` (a CPU run) it samples nothing and ``window`` returns None.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import threading
import time

__all__ = ["GpuMonitor", "parse_sample"]


def parse_sample(line: str) -> tuple[float, float | None] | None:
    """``"1980, 120.14"`` (``clocks.sm, power.draw`` without units) -> (1980.0, 120.14); power may be
    ``[N/A]`` (None); anything else (a header, an error line) -> None."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 2:
        return None
    try:
        clock = float(parts[0])
    except ValueError:
        return None
    try:
        power = float(parts[1])
    except ValueError:
        power = None
    return clock, power


class GpuMonitor:
    """Samples one GPU every ``interval_ms`` while the context is open.

    device: a CUDA device index as torch numbers them (mapped through ``CUDA_VISIBLE_DEVICES``) or
    None (nothing sampled). command: the sampling
    command (tests); by default ``nvidia-smi``'s query loop, or nothing where it is not installed.
    """

    def __init__(self, device: int | None, interval_ms: int = 200, command: list[str] | None = None):
        if interval_ms < 20:
            raise ValueError(f"interval_ms: expected at least 20, got {interval_ms}")
        self.command = command if command is not None else _nvidia_smi(device, interval_ms)
        self.interval_s = interval_ms / 1000
        self.samples: list[tuple[float, float, float | None]] = []  # (monotonic time, MHz, W)
        self._proc = None
        self._thread = None

    def __enter__(self) -> GpuMonitor:
        if self.command:
            try:
                self._proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            except OSError:
                self._proc = None
            else:
                self._thread = threading.Thread(target=self._read, daemon=True)
                self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
            self._thread.join(timeout=5)
            self._proc = None

    def _read(self) -> None:
        for line in self._proc.stdout:
            sample = parse_sample(line)
            if sample is not None:
                self.samples.append((time.monotonic(), *sample))

    def window(self, t0: float, t1: float) -> dict | None:
        """Median SM clock (MHz) and board power (W) of the samples taken in [t0, t1] (``time.monotonic``
        seconds), with their count. A window too short to hold a sample (a kernel timed for 30 ms) takes
        the one sample nearest to it within one sampling interval; None when there is none."""
        samples = list(self.samples)
        inside = [s for s in samples if t0 <= s[0] <= t1]
        if not inside:
            near = [s for s in samples if t0 - self.interval_s <= s[0] <= t1 + self.interval_s]
            inside = [min(near, key=lambda s: max(t0 - s[0], s[0] - t1))] if near else []
        if not inside:
            return None
        powers = [s[2] for s in inside if s[2] is not None]
        return dict(sm_clock_mhz=statistics.median(s[1] for s in inside),
                    power_w=statistics.median(powers) if powers else None, samples=len(inside))


def _nvidia_smi(device: int | None, interval_ms: int) -> list[str] | None:
    """nvidia-smi's query loop for torch's CUDA device ``device`` (through ``CUDA_VISIBLE_DEVICES``, whose
    entries nvidia-smi's ``-i`` takes as they are: indices or UUIDs)."""
    if device is None or shutil.which("nvidia-smi") is None:
        return None
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    target = visible[device] if device < len(visible) else str(device)
    return ["nvidia-smi", "-i", target, "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
            "-lms", str(interval_ms)]
