"""DualKV benchmarks: one harness (``harness.py``) with a provider axis, peers built from PyTorch alone
(``peers.py``), one script per benchmark (``bench_*.py``), results and plots in ``results/``.

Run from the repository root, e.g. ``python -m benchmarks.bench_attention --preset issue3``.
"""
