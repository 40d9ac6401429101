"""Time the one-loop Triton dK/dV (Backward.dkdv, M64-N128-w8-s3) at two d=128 shapes (device script).

    PYTHONPATH=. python3 benchmarks/results/raw/triton_dkdv_rows_time.py
"""
import math, torch
from triton.testing import do_bench
from benchmarks.tune_triton import make_case
from dualkv.core.backends.triton import launcher
from dualkv.core.backends.triton.configs import KernelConfig
launcher._ensure_allocator()
for N, P, R in ((28, 4096, 2048), (16, 32768, 2048)):
    meta, q, k, v, do = make_case(N, P, R, 32, 8, 128)
    s = 1 / math.sqrt(128)
    out, lse = launcher.forward(q, k, v, None, None, meta, s, None, None)
    b = launcher.Backward(do, q, k, v, None, None, out, lse, meta, s, None, None, False)
    b.preprocess()
    print(N, P, R, f"row dK/dV {do_bench(lambda: b.dkdv(KernelConfig(64, 128, 8, 3)), rep=200):.2f} ms", flush=True)
