"""Tuning and timing of the Triton backend: forward and backward timed separately, several kernel
configurations in one call, on the issue's shapes; plus a compile report that needs no GPU.

    # time every kernel candidate on one shape (forward, dK/dV, dQ apart), then a table of shapes
    # with the best configurations (shapes of another head dim use the library defaults)
    python benchmarks/tune_triton.py tune --shape n28-p4k-r2k --table n28-p4k-r2k,n8-p16k-r512 --precompile 8
    # registers / shared memory / spills of every candidate (and of the Gluon kernels at d = 64 / 128),
    # compiled for sm_90 on any machine
    python benchmarks/tune_triton.py compile-report --head-dims 64,128

Useful TFLOP/s follow DESIGN.md: forward 4*d*H*pairs, backward 2.5x that, forward+backward 3.5x,
where ``pairs`` are the attended query-key pairs of the packed layout. Times are medians of
event-timed repeats (``triton.testing.do_bench``). ``--precompile N`` compiles every candidate in
N processes first (small inputs, same specialisations), so the timing process only loads binaries.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import shlex
import sys
import time

import torch

# (N, P, R, H, H_kv, d): the configurations.
SHAPES = {
    "n28-p4k-r2k": (28, 4096, 2048, 32, 8, 128),
    "n28-p16k-r2k": (28, 16384, 2048, 32, 8, 128),
    "n16-p32k-r2k": (16, 32768, 2048, 32, 8, 128),
    "n16-p64k-r2k": (16, 65536, 2048, 32, 8, 128),
    "n32-p8k-r2k": (32, 8192, 2048, 32, 8, 128),
    "n8-p16k-r512": (8, 16384, 512, 32, 8, 128),
    "n16-p128k-r2k": (16, 131072, 2048, 32, 8, 128),
    "d256-p16k": (16, 16384, 2048, 16, 8, 256),
    "d256-p32k": (16, 32768, 2048, 16, 8, 256),
    "d512-p16k": (16, 16384, 2048, 16, 2, 512),
}
# Peers measured on one H200 (DESIGN.md / issue 3), forward+backward ms: (Flex packed, cuDNN cascade).
PEER_MS = {
    "n28-p4k-r2k": (48, 44), "n28-p16k-r2k": (163, 131), "n16-p32k-r2k": (236, 181),
    "n16-p64k-r2k": (621, 457), "n32-p8k-r2k": (94, 81), "n8-p16k-r512": (30, 23),
    "d256-p16k": (243, 152), "d256-p32k": (570, 345),  # d=256: (Flex, FA2 cascade)
}


# Candidates timed by ``tune`` (d=128), per kernel: (block_m, block_n, warps, stages).
TUNE_CANDIDATES = {
    "fwd": [(128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 3),
            # one warpgroup per program, small enough for two or three programs per SM
            (64, 64, 4, 2), (64, 32, 4, 4), (64, 32, 4, 3), (64, 128, 4, 2)],
    # the one-loop dK/dV (the packed layout on descriptors, no window: what these shapes take)
    "dkdv": [(64, 128, 8, 3), (64, 128, 8, 2), (64, 128, 8, 4), (32, 128, 8, 3), (64, 64, 4, 3), (32, 64, 4, 3),
             (64, 64, 4, 4), (128, 64, 8, 2),
             # small enough in registers and shared memory for two programs per SM (sm_90 compile); M64-N64-w4-s2
             # took 22.39 ms against 20.02 for M64-N128-w8-s3 at n28-p4k-r2k (raw/triton_s30_first_call.log)
             (64, 64, 4, 2), (32, 64, 4, 2)],
    "dq": [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 3)],
    "dkdv_atomic": [(32, 128, 8, 3), (64, 128, 8, 2)],
}


def tune_candidates(d: int) -> dict:
    """TUNE_CANDIDATES at d=128; the library's pruned candidates at other head dims (for dK/dV those of
    the one-loop kernel where these shapes take it: head dims up to 256, read through descriptors)."""
    if d == 128:
        return TUNE_CANDIDATES
    from dualkv.core.backends.triton import configs

    rows = d <= 256
    library_kind = {"fwd": "fwd", "dkdv": "dkdv_rows" if rows else "dkdv", "dq": "dq",
                    "dkdv_atomic": "dkdv_rows_atomic" if rows else "dkdv"}
    cands = {kind: [(c.block_m, c.block_n, c.num_warps, c.num_stages, c.warp_specialize)
                    for c in configs.candidates(name, d, 2, warp_specialize=True)]
             for kind, name in library_kind.items()}
    return dict(cands, dkdv_atomic=cands["dkdv_atomic"][:1])


def attended_pairs(P: int, N: int, R: int, G: int = 1) -> int:
    """Query-key pairs of the packed layout: each prompt causally, each response over P + its own causal part."""
    return G * (P * (P + 1) // 2 + N * (R * P + R * (R + 1) // 2))


def make_case(N, P, R, H, Hkv, d, dtype=torch.bfloat16, device="cuda", seed=0):
    from dualkv.core import AttnMeta, PackedLayout

    layout = PackedLayout.from_lengths([P], [[R] * N], device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    T = layout.total_tokens
    q, k, v, do = (torch.randn(T, h, d, device=device, dtype=dtype, generator=g) for h in (H, Hkv, Hkv, H))
    return AttnMeta.from_layout(layout), q, k, v, do


def _cfg(t):
    from dualkv.core.backends.triton.configs import KernelConfig

    return None if t is None else KernelConfig(*t)


def kernel_closure(kind: str, cfg, meta, q, k, v, do):
    """A closure running one kernel (with what it needs before it) under ``cfg``."""
    from dualkv.core.backends.triton import launcher

    scale = 1 / math.sqrt(q.shape[2])
    if kind == "fwd":
        return lambda: launcher.forward(q, k, v, None, None, meta, scale, None, None, config=_cfg(cfg))
    out, lse = launcher.forward(q, k, v, None, None, meta, scale, None, None)
    bwd = launcher.Backward(do, q, k, v, None, None, out, lse, meta, scale, None, None, kind == "dkdv_atomic")
    bwd.preprocess()
    if kind == "dq":
        return lambda: bwd.dq_kernel(_cfg(cfg))
    return lambda: (bwd.preprocess(), bwd.dkdv(_cfg(cfg)))


def full_closures(configs: dict, meta, q, k, v, do):
    """Forward and backward with explicit configs ({"fwd", "dkdv", "dq"} tuples or None = defaults)."""
    from dualkv.core.backends.triton import launcher

    scale = 1 / math.sqrt(q.shape[2])
    out, lse = launcher.forward(q, k, v, None, None, meta, scale, None, None, config=_cfg(configs.get("fwd")))

    def fwd():
        launcher.forward(q, k, v, None, None, meta, scale, None, None, config=_cfg(configs.get("fwd")))

    def bwd():
        launcher.backward(do, q, k, v, None, None, out, lse, meta, scale, None, None, False,
                          dkdv_config=_cfg(configs.get("dkdv")), dq_config=_cfg(configs.get("dq")))

    return fwd, bwd


def _bench(fn, budget_ms: float = 400.0) -> float:
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    one = (time.perf_counter() - t0) * 1e3
    rep = max(3 * one, min(budget_ms, 25 * one))
    return do_bench(fn, warmup=max(one, 1.0), rep=rep, return_mode="median")


def tune(name: str, kinds: list[str] | None = None) -> dict:
    """Time every candidate of every kernel on one shape; returns {kind: [(cfg, ms), ...]} and the best."""
    N, P, R, H, Hkv, d = SHAPES[name]
    meta, q, k, v, do = make_case(N, P, R, H, Hkv, d)
    fwd_flop = 4 * d * H * attended_pairs(P, N, R)
    # matmuls per pair relative to the forward's two: dK/dV kernel 4, dQ kernel 3, atomic dK/dV 5
    work = {"fwd": 1.0, "dkdv": 2.0, "dq": 1.5, "dkdv_atomic": 2.5}
    timings = {}
    for kind, cands in tune_candidates(d).items():
        if kinds and kind not in kinds:
            continue
        timings[kind] = []
        for cfg in cands:
            try:
                ms = _bench(kernel_closure(kind, cfg, meta, q, k, v, do))
            except Exception as err:  # noqa: BLE001 - a candidate that does not build is reported and skipped
                print(f"{name} {kind:11s} {str(cfg):18s} failed: {type(err).__name__}: {str(err)[:120]}", flush=True)
                continue
            timings[kind].append((cfg, ms))
            print(f"{name} {kind:11s} {str(cfg):18s} {ms:8.2f} ms  {work[kind] * fwd_flop / ms / 1e9:5.0f} TFLOP/s "
                  "(kernel's own matmuls)", flush=True)
    best = {kind: min(rows, key=lambda r: r[1])[0] for kind, rows in timings.items() if kind != "dkdv_atomic"}
    best["head_dim"] = d
    print(f"best: {best}", flush=True)
    return dict(timings=timings, best=best)


def time_shape(name: str, configs: dict, label: str) -> dict:
    N, P, R, H, Hkv, d = SHAPES[name]
    meta, q, k, v, do = make_case(N, P, R, H, Hkv, d)
    fwd_flop = 4 * d * H * attended_pairs(P, N, R)
    tuned_d = configs.get("head_dim")
    fwd, bwd = full_closures(configs if d == tuned_d else {}, meta, q, k, v, do)
    f_ms, b_ms = _bench(fwd), _bench(bwd)
    row = dict(shape=name, configs=label if d == tuned_d else "defaults", fwd_ms=f_ms, bwd_ms=b_ms,
               total_ms=f_ms + b_ms, fwd_tflops=fwd_flop / f_ms / 1e9, bwd_tflops=2.5 * fwd_flop / b_ms / 1e9,
               total_tflops=3.5 * fwd_flop / (f_ms + b_ms) / 1e9, peers_ms=PEER_MS.get(name))
    print(f"{name:15s} fwd {f_ms:8.2f} ms ({row['fwd_tflops']:4.0f})  bwd {b_ms:8.2f} ms ({row['bwd_tflops']:4.0f})  "
          f"fwd+bwd {row['total_ms']:8.2f} ms ({row['total_tflops']:4.0f} TFLOP/s)"
          + (f"  peers {PEER_MS[name]}" if name in PEER_MS else ""), flush=True)
    return row


def _precompile_worker(job):
    name, kind, cfg = job
    N, P, R, H, Hkv, d = SHAPES[name]
    meta, q, k, v, do = make_case(2, 300, 100, H, Hkv, d)  # same specialisations, tiny work
    if kind == "all":
        for fn in full_closures({}, meta, q, k, v, do):
            fn()
    else:
        kernel_closure(kind, cfg, meta, q, k, v, do)()
    torch.cuda.synchronize()
    return job


def precompile(jobs: list[tuple], procs: int) -> None:
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(procs) as pool:
        for job in pool.imap_unordered(_precompile_worker, jobs):
            print(f"compiled {job} ({time.perf_counter() - t0:.0f} s)", flush=True)


def compile_report(head_dims: list[int], dtype: str = "bf16") -> None:
    """Compile every candidate config for sm_90 (no GPU needed): registers, shared memory, spills."""
    from dualkv.core.backends.triton import configs
    from dualkv.core.backends.triton.bwd_kernel import dkdv_kernel, dkdv_rows_kernel, dq_kernel
    from dualkv.core.backends.triton.fwd_kernel import fwd_kernel
    from dualkv.core.backends.triton.launcher import MAX_TMA_HEAD_DIM

    kernels = {"fwd": fwd_kernel, "dkdv": dkdv_kernel, "dkdv_rows": dkdv_rows_kernel, "dq": dq_kernel}
    for d in head_dims:
        hd = configs.padded_head_dim(d)
        tma = hd <= MAX_TMA_HEAD_DIM
        for kind, fn in kernels.items():
            if kind == "dkdv_rows" and not tma:  # the one-loop dK/dV reads through descriptors only
                continue
            for cfg in configs.candidates(kind, d, 2, warp_specialize=tma):
                usage = _compile_sm90(fn, kind, d, hd, dtype, cfg, tma)
                print(f"d={d:3d} {kind:4s} {cfg!s:16s} tma={tma!s:5s} {usage}", flush=True)
        if d in (64, 128):
            _gluon_report(d, dtype)


def _gluon_report(d: int, dtype: str) -> None:
    """The Gluon kernels at their launch settings: the forward, the dK/dV, and the dK/dV with dQ
    fused in one or two column slices."""
    from dualkv.core.backends.triton import configs, gluon_compat, gluon_dkdv, gluon_fwd

    if not gluon_compat.AVAILABLE:
        print(f"d={d:3d} gluon: this Triton has no Gluon Hopper API", flush=True)
        return
    cfg = configs.candidates("dkdv_rows", d, 2)[0]  # what the launcher hands the Gluon dK/dV
    block_n, warps = cfg.block_n, cfg.num_warps
    builds = {"gluon fwd": lambda: gluon_fwd.compile_for_sm90(d, dtype=dtype),
              "gluon dkdv": lambda: gluon_dkdv.compile_for_sm90(d, block_n=block_n, num_warps=warps, dtype=dtype)}
    for parts in (1, 2):
        builds[f"gluon dkdv+dq parts={parts}"] = (
            lambda parts=parts: gluon_dkdv.compile_for_sm90(d, block_n=block_n, num_warps=warps, dtype=dtype,
                                                            fuse_dq=True, dq_parts=parts))
    for name, build in builds.items():
        try:
            usage = _usage(build())
        except Exception as err:  # noqa: BLE001 - reported, not raised, as for the tl kernels
            usage = f"FAILED {type(err).__name__}: {str(err).splitlines()[0][:200]}"
        print(f"d={d:3d} {name:22s} {usage}", flush=True)


def _compile_sm90(fn, kind, d, hd, dtype, cfg, tma, atomic_dq=False) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    const = dict(REP=4, DIM=d, HEAD_DIM=hd, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HAS_WINDOW=False,
                 HAS_SOFTCAP=False, DOT_PREC="tf32", TMA=tma)
    if kind.startswith("dkdv"):
        const.update(ATOMIC_DQ=atomic_dq, DQ_TMA=tma and atomic_dq)
    else:
        const.update(WS=cfg.warp_specialize)
    const = {name: value for name, value in const.items() if name in fn.arg_names}
    in_kernel_desc = kind == "dkdv_rows" or cfg.warp_specialize  # pointers the kernel wraps in descriptors
    sig, attrs = {}, {}
    for i, arg in enumerate(fn.arg_names):
        if arg in const:
            sig[arg] = "constexpr"
        elif not in_kernel_desc and (arg in ("Q", "DO", "K", "V", "KC", "VC")
                                     or (arg == "DQ_ACC" and kind == "dkdv" and atomic_dq)):
            rows = cfg.block_n if arg in ("K", "V", "KC", "VC") else cfg.block_m
            ty = "fp32" if arg == "DQ_ACC" else dtype
            sig[arg] = f"tensordesc<{ty}[{rows}, {hd}]>" if tma else f"*{ty}"
        elif arg.isupper():
            sig[arg] = "*i32" if arg in ("TILES", "ITEMS", "CU", "CTX_START", "CTX_LEN", "CTX_KEY_START",
                                         "CTX_KEY_LEN", "PAD_START") else ("*fp32" if arg in ("LSE", "LSE2", "DELTA", "WSK",
                                                                               "WSV", "DQ_ACC") else f"*{dtype}")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif arg in ("qk_scale", "cap_log2", "pre_cap", "sm_scale"):
            sig[arg] = "fp32"
        else:
            sig[arg] = "i32"
            if arg.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    try:
        src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    except Exception as err:  # noqa: BLE001 - reported, not raised: the report covers every candidate
        return f"FAILED {type(err).__name__}: {str(err).splitlines()[0][:200]}"
    return _usage(k)


def _usage(k) -> str:
    """Shared memory, registers, spilled bytes and wgmma count of a compiled sm_90 kernel, as one line."""
    r = resources(k)
    return f"smem={r['smem']:6d} regs={r['regs']} spill_bytes={r['spill_bytes']} wgmma={r['wgmma']}"


def resources(k) -> dict:
    """A compiled sm_90 kernel's shared memory (bytes), registers and spilled bytes (ptxas's, read from
    the cubin; None where the tool does not report them) and its wgmma count."""
    import subprocess
    import tempfile

    import triton

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        res = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    usage = next((ln.strip() for ln in res.splitlines() if "REG:" in ln), res.strip())
    fields = dict(p.split(":") for p in usage.split() if ":" in p and p.split(":")[0] in ("REG", "STACK"))
    return dict(smem=k.metadata.shared, regs=fields.get("REG"), spill_bytes=fields.get("STACK"),
                wgmma=k.asm["ptx"].count("wgmma.mma_async"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tune", help="time every kernel candidate on one shape, then the table with the best")
    t.add_argument("--shape", default="n28-p4k-r2k", choices=list(SHAPES))
    t.add_argument("--table", default="", help="comma-separated shapes to time with the best configs after")
    t.add_argument("--precompile", type=int, default=0, help="compile in this many processes first")
    t.add_argument("--out", default=None, help="write timings and rows as JSON here")
    t.add_argument("--kinds", default="", help="comma-separated kernels to time (fwd,dkdv,dq,dkdv_atomic; default all)")
    c = sub.add_parser("compile-report", help="sm_90 registers / shared memory / spills, no GPU needed")
    c.add_argument("--head-dims", default="64,96,128,192,256,512")
    args = ap.parse_args()

    if args.cmd == "compile-report":
        compile_report([int(x) for x in args.head_dims.split(",")])
        return
    # The candidates are the ``tl`` kernels' configs: the warp-specialised Gluon backward kernels take
    # one tile each and would stand in for them on Hopper (set the variable to 1 to time those instead).
    os.environ.setdefault("DUALKV_TRITON_GLUON_BWD", "0")
    table = [s for s in args.table.split(",") if s]
    kinds = [k for k in args.kinds.split(",") if k]
    if args.precompile:
        d = SHAPES[args.shape][5]
        jobs = [(args.shape, kind, cfg) for kind, cands in tune_candidates(d).items() for cfg in cands
                if not kinds or kind in kinds]
        jobs += [(s, "all", None) for s in table if SHAPES[s][5] != d]
        precompile(jobs, args.precompile)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {__import__('triton').__version__}, {time.strftime('%Y-%m-%d')}", flush=True)
    tuned = tune(args.shape, kinds)
    rows = [time_shape(s, tuned["best"], "tuned on " + args.shape) for s in table]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"),
                           command=shlex.join(["python", *sys.argv]), torch=torch.__version__,
                           triton=__import__("triton").__version__,
                           timings={k: [(list(c), ms) for c, ms in v] for k, v in tuned["timings"].items()},
                           best=tuned["best"], rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
