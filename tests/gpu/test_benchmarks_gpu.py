"""The benchmark harness's timer on a GPU: ``hide_host`` times the device's work, not the host's
enqueue, and never hides what follows a synchronisation inside the timed call. The host waits are
long (40 ms) so that other processes sharing the GPU (pytest-xdist workers), whose kernels can take
the GPU for a few ms at a time, cannot decide the outcome."""

from __future__ import annotations

import time

import pytest
import torch

from benchmarks.harness import Timer

pytestmark = pytest.mark.gpu


def _host_then_kernel(x: torch.Tensor, host_ms: float, sync_first: bool = False):
    def fn():
        if sync_first:
            torch.cuda.synchronize()
        time.sleep(host_ms / 1e3)  # the host's work before its first launch (a planner, autograd)
        x.add_(1.0)
    return fn


def test_timer_hides_host_enqueue():
    x = torch.zeros(1 << 20, device="cuda")
    fn = _host_then_kernel(x, 40.0)
    visible = Timer(torch.device("cuda"), budget_ms=100, max_reps=5).measure(fn)
    hidden = Timer(torch.device("cuda"), budget_ms=100, max_reps=5, hide_host=True).measure(fn)
    assert visible.median_ms > 35.0, visible
    assert hidden.median_ms < 15.0, hidden
    assert hidden.host_ms > 35.0 and hidden.host_exposed == 0, hidden


def test_timer_does_not_hide_what_follows_a_sync():
    """A call that synchronises blocks on the wait itself, so its enqueue time grows with the wait: the
    waits stay bounded (``MAX_WAIT_MS``), the time after the synchronisation is inside the measurement,
    and every timed call is counted as exposed."""
    x = torch.zeros(1 << 20, device="cuda")
    t0 = time.perf_counter()
    hidden = Timer(torch.device("cuda"), budget_ms=1000, max_reps=12, hide_host=True).measure(
        _host_then_kernel(x, 40.0, sync_first=True))
    wall = time.perf_counter() - t0
    assert hidden.median_ms > 35.0, hidden
    assert hidden.reps >= 3 and hidden.host_exposed == hidden.reps, hidden
    assert wall < 12 * (Timer.MAX_WAIT_MS + 40.0 + 50.0) / 1e3, wall  # the 1.5x growth is capped
