"""Test-suite set-up: GPU tests are skipped without CUDA; Triton kernels run in the interpreter on CPU."""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Must be set before any @triton.jit function is launched.
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("PYTEST_XDIST_WORKER") and not HAS_CUDA:
    # One of several test workers (pytest -n) on a CPU machine: one intra-op thread each (and in the
    # processes they start), so that the workers share the cores instead of oversubscribing them.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    # Long tests first, so that test workers (pytest -n) start them early and finish together.
    items.sort(key=lambda item: "slow" not in item.keywords)
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: one intra-op thread is fastest (and robust to a busy machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
