"""Run the CUDA kernels' source on a CPU (lane-by-lane emulation) and compare with the reference.

A debugging tool for kernel development on machines without a GPU: it compiles csrc/ with
-DDKV_EMULATE into a CPU torch extension (ops ``torch.ops.dualkv_cuda_emu.fwd/bwd``) and checks
forward and backward against ``dualkv.core.reference`` on small packed layouts. Slow (one OS thread
per CUDA thread): keep the shapes tiny.

    python csrc/emulation/emulate.py            # the default case list, and the reader chunks
    python csrc/emulation/emulate.py --quick    # two cases
    python csrc/emulation/emulate.py --wgmma    # the wgmma building blocks (csrc/dkv_wgmma.cuh) only
    python csrc/emulation/emulate.py --cluster  # the thread block cluster building blocks (csrc/dkv_cluster.cuh) only
    python csrc/emulation/emulate.py --sm90     # the wgmma forward (DUALKV_CUDA_WGMMA=1, 2, 3; 176-key tiles; persistent; merged walk)
    python csrc/emulation/emulate.py --sm90 --quick  # the same, the opt-in forms on fewer cases
    python csrc/emulation/emulate.py --sm90-bwd # the wgmma dQ and dK/dV kernels (DUALKV_CUDA_WGMMA_BWD=1 .. 6, 8)
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import sys
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from dualkv.core import PackedLayout  # noqa: E402
from dualkv.core.reference import AttnMeta, reference_attention_backward_meta, reference_attention_meta  # noqa: E402


def build():
    srcs = [str(HERE / n) for n in ("emu_api.cc", "emu_fwd.cc", "emu_bwd.cc", "emu_wgmma.cc", "emu_cluster.cc")]
    os.environ.setdefault("MAX_JOBS", "2")
    digest = hashlib.sha256()
    for path in sorted([*HERE.parent.glob("*"), *HERE.glob("*.cc")]):
        if path.is_file() and path.suffix in (".cu", ".cuh", ".h", ".cpp", ".cc"):
            digest.update(path.read_bytes())
    load(
        name=f"dualkv_emu_{digest.hexdigest()[:10]}",
        sources=srcs,
        extra_cflags=["-DDKV_EMULATE", "-std=c++20", "-O1", "-Wno-unknown-pragmas"],
        extra_include_paths=[str(ROOT / "csrc")],
        is_python_module=False,
        verbose=False,
    )


def meta_args(meta: AttnMeta):
    return list(meta)


def run_case(d, dtype, prompts, responses, H, Hkv, window=None, softcap=None, separate=False, deterministic=False,
             backward=True):
    layout = PackedLayout.from_lengths(prompts, responses)
    meta = AttnMeta.from_layout(layout)
    T = layout.total_tokens
    scale = 1.0 / math.sqrt(d)
    q = torch.randn(T, H, d).to(dtype)
    k = torch.randn(T, Hkv, d).to(dtype)
    v = torch.randn(T, Hkv, d).to(dtype)
    dout = torch.randn(T, H, d).to(dtype)
    k_ctx = v_ctx = None
    if separate:  # seed-paper layout: one shared context in its own tensors, every segment reads it
        P = prompts[0]
        n = [r for rs in responses for r in rs]
        T = sum(n)
        cu = torch.tensor([0] + torch.tensor(n).cumsum(0).tolist(), dtype=torch.int32)
        S = len(n)
        i32 = dict(dtype=torch.int32)
        meta = AttnMeta(cu, torch.zeros(S, **i32), torch.full((S,), P, **i32), torch.zeros(1, **i32),
                        torch.full((1,), P, **i32), torch.zeros(1, **i32), torch.full((1,), T, **i32))
        q = torch.randn(T, H, d).to(dtype)
        k = torch.randn(T, Hkv, d).to(dtype)
        v = torch.randn(T, Hkv, d).to(dtype)
        dout = torch.randn(T, H, d).to(dtype)
        k_ctx = torch.randn(P, Hkv, d).to(dtype)
        v_ctx = torch.randn(P, Hkv, d).to(dtype)
    w = -1 if window is None else window
    cap = 0.0 if softcap is None else softcap
    t0 = time.time()
    out, lse = torch.ops.dualkv_cuda_emu.fwd(q, k, v, k_ctx, v_ctx, *meta_args(meta), scale, w, cap)
    t1 = time.time()
    ref_out, ref_lse = reference_attention_meta(q.float(), k.float(), v.float(), meta, scale, window, softcap,
                                                None if k_ctx is None else k_ctx.float(),
                                                None if v_ctx is None else v_ctx.float())
    grads, ref_grads = [], []
    if backward:
        grads = torch.ops.dualkv_cuda_emu.bwd(dout, q, k, v, k_ctx, v_ctx, out, lse, *meta_args(meta), scale, w, cap,
                                              deterministic)
        ref_grads = reference_attention_backward_meta(dout.float(), q.float(), k.float(), v.float(), meta, scale,
                                                      window, softcap, None if k_ctx is None else k_ctx.float(),
                                                      None if v_ctx is None else v_ctx.float())
    t2 = time.time()
    errs = {"out": (out.float() - ref_out).abs().max().item(), "lse": (lse - ref_lse).abs().max().item()}
    names = ["dq", "dk", "dv", "dk_ctx", "dv_ctx"]
    for name, g, r in zip(names, grads, ref_grads):
        if r is None:
            continue
        errs[name] = (g.float() - r).abs().max().item()
        errs[name + "_scale"] = r.abs().max().item()
    tag = (f"d={d} {str(dtype)[6:]} P={prompts} R={responses} H={H}/{Hkv} win={window} cap={softcap} "
           f"sep={separate} det={deterministic}")
    bad = [k for k, e in errs.items() if not k.endswith("_scale") and not (e < 0.05 * max(1.0, errs.get(k + "_scale", 1.0)))]
    status = "FAIL" if bad else "ok"
    print(f"{status} {tag} fwd {t1 - t0:.1f}s bwd {t2 - t1:.1f}s " +
          " ".join(f"{k}={v:.3g}" for k, v in errs.items() if not k.endswith("_scale")), flush=True)
    return not bad


CASES = [
    dict(d=64, dtype=torch.bfloat16, prompts=[37], responses=[[19, 5]], H=2, Hkv=1),
    dict(d=64, dtype=torch.float16, prompts=[70, 9], responses=[[33], [1, 80]], H=2, Hkv=2),
    dict(d=64, dtype=torch.bfloat16, prompts=[37], responses=[[19, 5]], H=2, Hkv=1, deterministic=True),
    dict(d=64, dtype=torch.bfloat16, prompts=[90], responses=[[40, 3]], H=1, Hkv=1, window=23),
    dict(d=64, dtype=torch.float16, prompts=[50], responses=[[20, 17]], H=2, Hkv=1, softcap=5.0),
    dict(d=64, dtype=torch.bfloat16, prompts=[45], responses=[[30, 12]], H=2, Hkv=1, separate=True),
    dict(d=64, dtype=torch.bfloat16, prompts=[45], responses=[[30, 12]], H=2, Hkv=1, separate=True, deterministic=True),
    dict(d=64, dtype=torch.bfloat16, prompts=[90], responses=[[40, 3]], H=2, Hkv=1, window=23, deterministic=True),
    dict(d=96, dtype=torch.float16, prompts=[20], responses=[[17]], H=1, Hkv=1),
    dict(d=128, dtype=torch.bfloat16, prompts=[40], responses=[[17, 2]], H=2, Hkv=1),
    dict(d=192, dtype=torch.bfloat16, prompts=[20], responses=[[17]], H=1, Hkv=1),
    dict(d=256, dtype=torch.float16, prompts=[20], responses=[[17]], H=1, Hkv=1),
    dict(d=512, dtype=torch.bfloat16, prompts=[20], responses=[[17]], H=1, Hkv=1),
    # several query tiles per segment (forward / dq tiles are 128 rows at d <= 128)
    dict(d=64, dtype=torch.bfloat16, prompts=[150], responses=[[140, 3]], H=1, Hkv=1),
    dict(d=128, dtype=torch.float16, prompts=[130], responses=[[260]], H=2, Hkv=1, window=140),
]


# The wgmma forward's cases (bf16 and fp16, d = 64, 128, 192, 256; 128-row query tiles of two warpgroups,
# 128-key tiles up to d = 128, 64-key tiles above; d = 512): ragged tails, several tiles per segment and
# groups (up to six key tiles per query tile: the double-buffered K / V pipeline wraps around), GQA,
# windows reaching into the prompt, softcap, separate context.
SM90_CASES = [
    dict(d=128, dtype=torch.bfloat16, prompts=[40], responses=[[17, 2]], H=2, Hkv=1),
    dict(d=128, dtype=torch.bfloat16, prompts=[130, 5], responses=[[70, 1], [66]], H=4, Hkv=2),
    dict(d=128, dtype=torch.bfloat16, prompts=[100], responses=[[90, 3]], H=2, Hkv=1, window=70),
    dict(d=128, dtype=torch.bfloat16, prompts=[64], responses=[[65, 64]], H=1, Hkv=1, softcap=5.0),
    dict(d=128, dtype=torch.bfloat16, prompts=[45], responses=[[30, 12]], H=2, Hkv=1, separate=True),
    dict(d=64, dtype=torch.bfloat16, prompts=[70, 9], responses=[[33], [1, 80]], H=2, Hkv=2),
    dict(d=192, dtype=torch.bfloat16, prompts=[20], responses=[[17, 70]], H=1, Hkv=1, softcap=30.0),
    dict(d=256, dtype=torch.bfloat16, prompts=[66], responses=[[17]], H=2, Hkv=1, window=40),
    dict(d=128, dtype=torch.bfloat16, prompts=[520], responses=[[150, 7]], H=1, Hkv=1),
    dict(d=256, dtype=torch.bfloat16, prompts=[200], responses=[[140]], H=1, Hkv=1),
    dict(d=128, dtype=torch.float16, prompts=[150, 3], responses=[[70, 1], [40]], H=4, Hkv=1, window=100),
    # d = 512: 64-row query tiles, the head dim split between the warpgroups, 32-key tiles
    dict(d=512, dtype=torch.bfloat16, prompts=[70], responses=[[33, 9]], H=2, Hkv=1),
    dict(d=512, dtype=torch.float16, prompts=[100, 5], responses=[[70, 1], [9]], H=2, Hkv=2, window=50, softcap=5.0),
]

# --sm90 --quick: the cases of the opt-in forwards (DUALKV_CUDA_WGMMA=1 and 2, the persistent one on
# 128-key tiles): GQA over two groups, a softcap, a separate context, d = 64, d = 256 (which takes its
# own forward) and fp16 with a window
SM90_QUICK = [SM90_CASES[i] for i in (1, 3, 4, 5, 7, 10)]

# The wgmma backward's cases (DUALKV_CUDA_WGMMA_BWD=1, 2, 3 (dQ in the dK/dV kernel), 4 (warp-specialised dK/dV), 5 (both
# kernels warp-specialised), 6 (dQ in the warp-specialised dK/dV kernel) and 8 (5 with split waits); d = 64, 128; dQ on 128-row query tiles with
# 64-key tiles, dK/dV on 128-key tiles with 64-row query tiles; d = 192, 256: the split dK/dV kernel, run by every mode): prompt tiles summed over several
# readers (atomic and deterministic), ragged ends, GQA, several groups, window, softcap, separate context.
SM90_BWD_CASES = [
    dict(d=128, dtype=torch.bfloat16, prompts=[200], responses=[[150, 7]], H=2, Hkv=1),
    dict(d=64, dtype=torch.float16, prompts=[130, 5], responses=[[70, 1], [66]], H=4, Hkv=1),
    dict(d=128, dtype=torch.bfloat16, prompts=[200], responses=[[150, 7]], H=2, Hkv=1, deterministic=True),
    dict(d=64, dtype=torch.bfloat16, prompts=[140], responses=[[90, 3]], H=2, Hkv=1, window=70),
    dict(d=128, dtype=torch.float16, prompts=[64], responses=[[65, 64]], H=1, Hkv=1, softcap=5.0),
    dict(d=64, dtype=torch.bfloat16, prompts=[130], responses=[[30, 12]], H=2, Hkv=1, separate=True),
    dict(d=64, dtype=torch.bfloat16, prompts=[130], responses=[[30, 12]], H=2, Hkv=1, separate=True, deterministic=True),
    # d = 192 / 256: the dQ and dK/dV kernels with the warpgroups' roles split (64-row / 64-key tiles)
    dict(d=256, dtype=torch.bfloat16, prompts=[100], responses=[[70, 3]], H=2, Hkv=1),
    dict(d=192, dtype=torch.float16, prompts=[80, 5], responses=[[40, 1], [9]], H=2, Hkv=1, window=50, softcap=5.0),
    dict(d=256, dtype=torch.bfloat16, prompts=[100], responses=[[70, 3]], H=2, Hkv=1, deterministic=True),
    dict(d=256, dtype=torch.float16, prompts=[70], responses=[[30, 12]], H=1, Hkv=1, separate=True),
    # d = 128 with a separate context: the seed paper's layout on the default d = 128 backward (6)
    dict(d=128, dtype=torch.bfloat16, prompts=[130], responses=[[30, 12]], H=2, Hkv=1, separate=True),
    # d = 512: dQ on 16-key tiles, dK/dV on 16-row query tiles in two passes (one per half of the head dim)
    dict(d=512, dtype=torch.bfloat16, prompts=[100], responses=[[70, 3]], H=2, Hkv=1),
    dict(d=512, dtype=torch.float16, prompts=[80, 5], responses=[[40, 1], [9]], H=2, Hkv=1, window=50, softcap=5.0),
    dict(d=512, dtype=torch.bfloat16, prompts=[70], responses=[[30, 12]], H=1, Hkv=1, separate=True, deterministic=True),
    # two kv heads: the items' order over (key tile, kv head) matters (DUALKV_CUDA_BWD_ITEM_ORDER)
    dict(d=128, dtype=torch.bfloat16, prompts=[130], responses=[[70, 9]], H=4, Hkv=2),
    dict(d=64, dtype=torch.float16, prompts=[130, 5], responses=[[70, 1], [66]], H=4, Hkv=2),
]


def _restore_env(saved: dict[str, str | None]) -> None:
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def expect_error(env: dict[str, str], message: str, what: str, **case) -> bool:
    """run_case(**case) under the kernel-choice variables `env` raises a RuntimeError saying `message`."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        run_case(**case)
        print(f"FAIL {what} was accepted")
        return False
    except RuntimeError as err:
        good = message in str(err)
        print(("ok" if good else "FAIL") + f" {what} raises: {str(err).splitlines()[0][:120]}")
        return good
    finally:
        _restore_env(saved)


def check_bad_kernel_choices() -> bool:
    """An unknown value of a kernel-choice variable is an error naming it, not a silent default."""
    small = dict(d=64, dtype=torch.bfloat16, prompts=[20], responses=[[9]], H=1, Hkv=1)
    return all([expect_error({name: bad}, f"{name}: expected one of {allowed} (or unset), got '{bad}'", f"{name}={bad}", **small)
                for name, bad, allowed in (("DUALKV_CUDA_WGMMA", "4", "0, 1, 2, 3"),
                                           ("DUALKV_CUDA_WGMMA_BWD", "7", "0, 1, 2, 3, 4, 5, 6, 8, 9"),
                                           ("DUALKV_CUDA_BWD_TMA", "2", "0, 1"),
                                           ("DUALKV_CUDA_BWD_LATE_DQ_ADD", "2", "0, 1"))])


def check_tma_head_dim() -> bool:
    """DUALKV_CUDA_WGMMA=3 (bulk tensor copies) at a head dim it lacks is an error naming the head dim."""
    return expect_error({"DUALKV_CUDA_WGMMA": "3"},
                        "DUALKV_CUDA_WGMMA=3 (bulk tensor copies): q: expected headdim 64, 128, 192, 256 or 512, got 96",
                        "DUALKV_CUDA_WGMMA=3 at d = 96", d=96, dtype=torch.float16, prompts=[20], responses=[[9]],
                        H=1, Hkv=1, backward=False)


def check_tma_fallback(backward: bool) -> bool:
    """When the driver cannot build a tensor map (DUALKV_EMULATE_TMA_ENCODE_FAILS=1 makes the emulated
    encoders fail), the device's defaults run the cp.async forms of the forward and dK/dV kernel and
    match the reference; asked for by its variable, the TMA form is an error naming it and the tensor."""
    names = ("DUALKV_CUDA_WGMMA", "DUALKV_CUDA_WGMMA_BWD", "DUALKV_CUDA_BWD_TMA", "DUALKV_EMULATE_DEVICE_DEFAULTS",
             "DUALKV_EMULATE_TMA_ENCODE_FAILS")
    saved = {n: os.environ.get(n) for n in names}
    small = dict(dtype=torch.bfloat16, prompts=[70], responses=[[33, 9]], H=2, Hkv=1)
    try:
        for n in names[:3]:
            os.environ.pop(n, None)
        os.environ["DUALKV_EMULATE_DEVICE_DEFAULTS"] = "1"
        os.environ["DUALKV_EMULATE_TMA_ENCODE_FAILS"] = "1"
        print("device defaults, tensor maps failing (DUALKV_EMULATE_TMA_ENCODE_FAILS=1)", flush=True)
        ok = all([run_case(d=d, backward=backward, **small) for d in (64, 128, 256)])
        why = "cuTensorMapEncodeTiled failed (CUresult 1)"
        ok = expect_error({"DUALKV_CUDA_WGMMA": "3"}, f"DUALKV_CUDA_WGMMA=3 (bulk tensor copies): q: {why}",
                          "DUALKV_CUDA_WGMMA=3 without tensor maps", d=128, backward=False, **small) and ok
        if backward:
            ok = expect_error({"DUALKV_CUDA_BWD_TMA": "1"}, f"DUALKV_CUDA_BWD_TMA=1 (bulk tensor copies): q: {why}",
                              "DUALKV_CUDA_BWD_TMA=1 without tensor maps", d=128, **small) and ok
        return ok
    finally:
        _restore_env(saved)


def expect_choice_errors(name: str, bad: str, expected: str, conflict: dict[str, str], conflict_message: str) -> bool:
    """Kernel-choice variable `name` (set as the caller left it) at d = 128: the value `bad` is an error
    saying `expected`, and the variables `conflict`, under which its forward does not run, an error
    saying `conflict_message`."""
    small = dict(d=128, dtype=torch.bfloat16, prompts=[20], responses=[[9]], H=1, Hkv=1, backward=False)
    ok = expect_error({name: bad}, f"{name}: expected {expected} (or unset), got '{bad}'", f"{name}={bad}", **small)
    what = f"{name}={os.environ.get(name)} with " + " ".join(f"{k}={v}" for k, v in conflict.items())
    return expect_error(conflict, conflict_message, what, **small) and ok


def check_wide_key_tiles(backward: bool) -> bool:
    """DUALKV_CUDA_FWD_BLOCK_N=176 (the device's default at d = 128; the emulation's default is 128, as
    for the kernel-choice variables): the TMA forward's 176-key tiles (two K / V buffers: the longer
    walks wrap them several times) match the reference on the d = 128 cases and a long prompt read by
    ragged responses, as =128 does; other head dims keep their tiles; an unknown value, or 176 where
    another forward runs, is an error naming the variable."""
    names = ("DUALKV_CUDA_WGMMA", "DUALKV_CUDA_FWD_BLOCK_N")
    saved = {n: os.environ.get(n) for n in names}
    try:
        os.environ["DUALKV_CUDA_WGMMA"] = "3"
        os.environ["DUALKV_CUDA_FWD_BLOCK_N"] = "176"
        print("DUALKV_CUDA_WGMMA=3 DUALKV_CUDA_FWD_BLOCK_N=176", flush=True)
        cases = [c for c in SM90_CASES if c["d"] == 128]
        cases.append(dict(d=128, dtype=torch.float16, prompts=[700, 176], responses=[[180, 3, 176], [177]], H=2, Hkv=1))
        cases.append(dict(d=64, dtype=torch.bfloat16, prompts=[70], responses=[[33, 9]], H=2, Hkv=1))
        ok = all([run_case(**c, backward=backward) for c in cases])
        os.environ["DUALKV_CUDA_FWD_BLOCK_N"] = "128"  # the 128-key tiles asked for
        print("DUALKV_CUDA_WGMMA=3 DUALKV_CUDA_FWD_BLOCK_N=128", flush=True)
        ok = run_case(**cases[1], backward=backward) and ok
        os.environ["DUALKV_CUDA_FWD_BLOCK_N"] = "176"
        return expect_choice_errors("DUALKV_CUDA_FWD_BLOCK_N", "64", "128 or 176", {"DUALKV_CUDA_WGMMA": "2"},
                                    "DUALKV_CUDA_FWD_BLOCK_N=176: expected the forward with bulk tensor copies") and ok
    finally:
        _restore_env(saved)


def check_merged_walk() -> bool:
    """DUALKV_CUDA_FWD_MERGE=1: the 176-key TMA forward walks the context and the own keys as one range
    (the tile where the context ends loaded as 16-row boxes of both; a lead of masked rows before the
    first key where the context's length is not a multiple of 16) and matches the reference: contexts of
    residues 0, 1, 8, 12 and 13 mod 16, shorter and longer than a tile or a whole number of tiles, responses
    that end inside the shared tile and ones that run on past it, GQA, windows that reach into the
    context, a separate context, persistent blocks; an unknown value, or 1 where the 176-key forward
    does not run at d = 128, is an error naming it. (The backward does not depend on the walk.)"""
    names = ("DUALKV_CUDA_WGMMA", "DUALKV_CUDA_FWD_BLOCK_N", "DUALKV_CUDA_FWD_MERGE", "DUALKV_CUDA_FWD_PERSISTENT")
    saved = {n: os.environ.get(n) for n in names}
    try:
        os.environ["DUALKV_CUDA_WGMMA"] = "3"
        os.environ["DUALKV_CUDA_FWD_BLOCK_N"] = "176"
        os.environ["DUALKV_CUDA_FWD_MERGE"] = "1"
        os.environ.pop("DUALKV_CUDA_FWD_PERSISTENT", None)
        print("DUALKV_CUDA_WGMMA=3 DUALKV_CUDA_FWD_BLOCK_N=176 DUALKV_CUDA_FWD_MERGE=1", flush=True)
        cases = [
            dict(d=128, dtype=torch.bfloat16, prompts=[40, 33], responses=[[17, 150], [2, 200]], H=4, Hkv=2),
            dict(d=128, dtype=torch.float16, prompts=[368, 176], responses=[[180, 3], [177]], H=2, Hkv=1),
            dict(d=128, dtype=torch.bfloat16, prompts=[300], responses=[[90, 3]], H=2, Hkv=1, window=150),
            dict(d=128, dtype=torch.bfloat16, prompts=[45], responses=[[30, 140]], H=2, Hkv=1, separate=True),
        ]
        ok = all([run_case(**c, backward=False) for c in cases])
        os.environ["DUALKV_CUDA_FWD_PERSISTENT"] = "1"
        print("DUALKV_CUDA_WGMMA=3 DUALKV_CUDA_FWD_BLOCK_N=176 DUALKV_CUDA_FWD_MERGE=1 DUALKV_CUDA_FWD_PERSISTENT=1", flush=True)
        ok = run_case(**cases[1], backward=False) and ok
        os.environ.pop("DUALKV_CUDA_FWD_PERSISTENT", None)
        return expect_choice_errors("DUALKV_CUDA_FWD_MERGE", "2", "0 or 1", {"DUALKV_CUDA_FWD_BLOCK_N": "128"},
                                    "DUALKV_CUDA_FWD_MERGE=1: expected the forward on 176-key tiles") and ok
    finally:
        _restore_env(saved)


def check_persistent_forward(backward: bool, quick: bool = False) -> bool:
    """DUALKV_CUDA_FWD_PERSISTENT=1: the TMA forward at d = 64 / 128 on persistent blocks (three in the
    emulation) that take every query tile of every head from the counter, one after another, their K / V
    rings and the consumers' turns running on from one tile to the next, on 128- and 176-key tiles,
    matches the reference; other head dims keep their forward; an unknown value, or 1 where another
    forward runs at d = 64 / 128, is an error naming it. quick: on 128-key tiles (not the default width)
    SM90_QUICK's cases only (the long walks, over many tiles, on 176-key tiles only)."""
    names = ("DUALKV_CUDA_WGMMA", "DUALKV_CUDA_FWD_BLOCK_N", "DUALKV_CUDA_FWD_PERSISTENT")
    saved = {n: os.environ.get(n) for n in names}
    try:
        os.environ["DUALKV_CUDA_WGMMA"] = "3"
        os.environ["DUALKV_CUDA_FWD_PERSISTENT"] = "1"
        long_walks = dict(d=128, dtype=torch.float16, prompts=[700, 176], responses=[[180, 3, 176], [177]], H=2, Hkv=1)
        ok = True
        for block_n in ("128", "176"):
            os.environ["DUALKV_CUDA_FWD_BLOCK_N"] = block_n
            print(f"DUALKV_CUDA_WGMMA=3 DUALKV_CUDA_FWD_PERSISTENT=1 DUALKV_CUDA_FWD_BLOCK_N={block_n}", flush=True)
            # (with 128-key tiles, d = 192 / 256 / 512 too: they keep their forward)
            if quick and block_n == "128":
                cases = SM90_QUICK
            else:
                cases = [c for c in SM90_CASES if block_n == "128" or c["d"] == 128] + [long_walks]
            ok = all([run_case(**c, backward=backward) for c in cases]) and ok
        os.environ["DUALKV_CUDA_FWD_BLOCK_N"] = "128"
        return expect_choice_errors("DUALKV_CUDA_FWD_PERSISTENT", "2", "0 or 1", {"DUALKV_CUDA_WGMMA": "2"},
                                    "DUALKV_CUDA_FWD_PERSISTENT=1: expected the forward with bulk tensor copies") and ok
    finally:
        _restore_env(saved)


def check_device_defaults(backward: bool) -> bool:
    """Every head dim with the kernel-choice variables unset and the device's defaults
    (DUALKV_EMULATE_DEVICE_DEFAULTS=1: the forms an sm_90 GPU takes, e.g. the TMA forward and dK/dV
    kernels at d = 64 / 128, mma.sync at 96) runs and matches the reference: a default that
    names a form a head dim lacks fails here, not on the GPU."""
    names = ("DUALKV_CUDA_WGMMA", "DUALKV_CUDA_WGMMA_BWD", "DUALKV_CUDA_BWD_TMA", "DUALKV_EMULATE_DEVICE_DEFAULTS")
    saved = {n: os.environ.get(n) for n in names}
    try:
        for n in names[:3]:
            os.environ.pop(n, None)
        os.environ["DUALKV_EMULATE_DEVICE_DEFAULTS"] = "1"
        print("device defaults (DUALKV_EMULATE_DEVICE_DEFAULTS=1)", flush=True)
        ok = True
        for d in (64, 96, 128, 192, 256, 512):
            try:
                ok = run_case(d=d, dtype=torch.bfloat16, prompts=[70], responses=[[33, 9]], H=2, Hkv=1,
                              backward=backward) and ok
            except RuntimeError as err:
                print(f"FAIL d={d} with the device's defaults: {err}")
                ok = False
        return ok
    finally:
        _restore_env(saved)


def check_chunk_ends() -> bool:
    """The binding's reader chunks (op reader_chunks) on one layout, against chunk ends worked out by
    hand: [P70 | 33 20 45 1 7 | P9 | 17 80], segments 0 .. 8; the first group's responses start 0, 33,
    53, 98 and 99 rows into their run, so 40-row bins make segments 1, 3 and 4 leaders; and one whose
    first prompt is longer than the chunked limit (32768 keys)."""
    layout = PackedLayout.from_lengths([70, 9], [[33, 20, 45, 1, 7], [17, 80]])
    meta = AttnMeta.from_layout(layout)
    args = (meta.cu_seqlens, meta.seg_ctx_start, meta.seg_ctx_len)
    want = {0: [1, 2, 3, 4, 5, 6, 7, 8, 9], 40: [1, 3, 2, 4, 6, 5, 7, 9, 8], 8192: [1, 6, 2, 3, 4, 5, 7, 9, 8]}
    ok = True
    saved = {"DUALKV_CUDA_BWD_CHUNK_ROWS": os.environ.pop("DUALKV_CUDA_BWD_CHUNK_ROWS", None)}
    try:
        for rows, ends in [*want.items(), (-1, want[8192])]:  # -1: the variable's default
            got = torch.ops.dualkv_cuda_emu.reader_chunks(*args, rows).tolist()
            good = got == ends
            ok &= good
            print(f"{'ok' if good else 'FAIL'} reader chunk ends at {rows} rows: {got}", flush=True)
        # [P40000 | 3 5 | P9 | 17 80]: a context past 32768 keys is never chunked, a short one still is
        long_meta = AttnMeta.from_layout(PackedLayout.from_lengths([40000, 9], [[3, 5], [17, 80]]))
        got = torch.ops.dualkv_cuda_emu.reader_chunks(long_meta.cu_seqlens, long_meta.seg_ctx_start,
                                                      long_meta.seg_ctx_len, 8192).tolist()
        good = got == [1, 2, 3, 4, 6, 5]
        ok &= good
        print(f"{'ok' if good else 'FAIL'} reader chunk ends with a 40000-key context at 8192 rows: {got}", flush=True)
        try:
            torch.ops.dualkv_cuda_emu.reader_chunks(meta.cu_seqlens[:-1], *args[1:], 0)
            print("FAIL reader_chunks accepted a short cu_seqlens")
            ok = False
        except RuntimeError as err:
            good = "cu_seqlens: expected 10 entries, got 9" in str(err)
            ok &= good
            print(f"{'ok' if good else 'FAIL'} reader_chunks with a short cu_seqlens raises: {str(err).splitlines()[0][:110]}")
    finally:
        _restore_env(saved)
    return ok


def check_tile_order(device_defaults: bool) -> bool:
    """The query tiles' launch order (DUALKV_CUDA_TILE_ORDER): a context's readers first (the default)
    and the layout's own order (0) match the reference where segments have several tiles, in the
    forward and in the dQ kernels (deterministic: no dQ inside the dK/dV kernel); a bad value is an
    error naming the variable. device_defaults: the kernels an sm_90 GPU runs (else mma.sync)."""
    names = ("DUALKV_CUDA_WGMMA", "DUALKV_CUDA_WGMMA_BWD", "DUALKV_CUDA_BWD_TMA", "DUALKV_EMULATE_DEVICE_DEFAULTS",
             "DUALKV_CUDA_TILE_ORDER")
    saved = {n: os.environ.get(n) for n in names}
    cases = [dict(d=64, dtype=torch.bfloat16, prompts=[300, 70], responses=[[150, 20], [140]], H=2, Hkv=1),
             dict(d=64, dtype=torch.float16, prompts=[260], responses=[[130, 5]], H=1, Hkv=1, deterministic=True)]
    try:
        for n in names:
            os.environ.pop(n, None)
        if device_defaults:
            os.environ["DUALKV_EMULATE_DEVICE_DEFAULTS"] = "1"
        ok = True
        for order in (None, "0"):
            if order is not None:
                os.environ["DUALKV_CUDA_TILE_ORDER"] = order
            print(f"tile order: DUALKV_CUDA_TILE_ORDER={order or 'unset'}"
                  f"{' (device defaults)' if device_defaults else ''}", flush=True)
            ok = all([run_case(**c) for c in cases]) and ok
        ok = expect_error({"DUALKV_CUDA_TILE_ORDER": "2"}, "DUALKV_CUDA_TILE_ORDER: expected one of 0, 1 (or unset), got '2'",
                          "DUALKV_CUDA_TILE_ORDER=2", **cases[1]) and ok
        return ok
    finally:
        _restore_env(saved)


def check_plan_cache() -> bool:
    """The launch metadata the binding keeps per layout (PlanCache in dkv_api.cpp), with the kernels an
    sm_90 GPU runs: a second call on the same layout tensors gives bit-identical results; layout tensors
    changed in place (their version counters move) are planned anew, so the kernels follow the new
    lengths; tensors made under torch.inference_mode (no version counter) are not kept;
    DUALKV_CUDA_PLAN_CACHE=0 plans every call, and a bad value is an error naming the variable."""
    names = ("DUALKV_CUDA_WGMMA", "DUALKV_CUDA_WGMMA_BWD", "DUALKV_CUDA_BWD_TMA", "DUALKV_EMULATE_DEVICE_DEFAULTS",
             "DUALKV_CUDA_TILE_ORDER", "DUALKV_CUDA_PLAN_CACHE")
    saved = {n: os.environ.get(n) for n in names}
    d, H, Hkv = 64, 2, 1
    gen = torch.Generator().manual_seed(5)
    # Same packed length and segment count, the two responses' lengths swapped: a stale plan would walk
    # the first response's 3 query tiles where it now has 1, and leave the second's last rows unwritten.
    first, second = ([130], [[150, 10]]), ([130], [[10, 150]])
    T = 290
    q, k, v, dout = (torch.randn(T, h, d, generator=gen).to(torch.bfloat16) for h in (H, Hkv, Hkv, H))
    scale = 1.0 / math.sqrt(d)

    def run(meta, what, deterministic=True):  # the reference reads the metadata's values as they are now
        out, lse = torch.ops.dualkv_cuda_emu.fwd(q, k, v, None, None, *meta, scale, -1, 0.0)
        grads = torch.ops.dualkv_cuda_emu.bwd(dout, q, k, v, None, None, out, lse, *meta, scale, -1, 0.0, deterministic)
        ref_out, _ = reference_attention_meta(q.float(), k.float(), v.float(), meta, scale, None, None)
        ref_grads = reference_attention_backward_meta(dout.float(), q.float(), k.float(), v.float(), meta, scale,
                                                      None, None)
        errs = {"out": (out.float() - ref_out).abs().max().item()}
        errs.update({n: (g.float() - r).abs().max().item() for n, g, r in zip(("dq", "dk", "dv"), grads, ref_grads)})
        good = all(e < 0.05 * max(1.0, r.abs().max().item())
                   for e, r in zip(errs.values(), (ref_out, *ref_grads[:3])))
        print(f"{'ok' if good else 'FAIL'} plan cache: {what} " + " ".join(f"{n}={e:.3g}" for n, e in errs.items()),
              flush=True)
        return good, (out, *grads[:3])

    try:
        for n in names:
            os.environ.pop(n, None)
        os.environ["DUALKV_EMULATE_DEVICE_DEFAULTS"] = "1"
        meta = AttnMeta.from_layout(PackedLayout.from_lengths(*first))
        ok, results = run(meta, "first call")
        good, again = run(meta, "second call, the same layout tensors")
        same = all(torch.equal(a, b) for a, b in zip(results, again))
        print(f"{'ok' if same else 'FAIL'} plan cache: the second call's results are bit-identical", flush=True)
        ok = ok and good and same
        swapped = AttnMeta.from_layout(PackedLayout.from_lengths(*second))
        for mine, theirs in zip(meta, swapped):
            mine.copy_(theirs)  # in place: the same tensor objects, new lengths
        ok = run(meta, "layout tensors changed in place")[0] and ok
        ok = run(meta, "the changed layout, atomic backward", deterministic=False)[0] and ok
        os.environ["DUALKV_CUDA_PLAN_CACHE"] = "0"
        ok = run(meta, "DUALKV_CUDA_PLAN_CACHE=0")[0] and ok
        os.environ.pop("DUALKV_CUDA_PLAN_CACHE")
        with torch.inference_mode():
            frozen = AttnMeta.from_layout(PackedLayout.from_lengths(*first))
            ok = run(frozen, "inference tensors (not kept)")[0] and ok
            ok = run(frozen, "inference tensors, again")[0] and ok
        ok = expect_error({"DUALKV_CUDA_PLAN_CACHE": "2"}, "DUALKV_CUDA_PLAN_CACHE: expected one of 0, 1 (or unset), got '2'",
                          "DUALKV_CUDA_PLAN_CACHE=2", d=64, dtype=torch.bfloat16, prompts=[20], responses=[[9]], H=1,
                          Hkv=1) and ok
        return ok
    finally:
        _restore_env(saved)


def check_reader_chunks(device_defaults: bool) -> bool:
    """The default backward's reader chunks (DUALKV_CUDA_BWD_CHUNK_ROWS): every segment its own chunk
    (0), runs cut into several chunks (40 rows: chunks of one to three responses, ragged), and whole
    groups in one chunk (the default, 8192) match the reference, with several groups, GQA, a window and
    a separate context; a bad value is an error naming the variable. device_defaults: the kernels an
    sm_90 GPU runs (else mma.sync)."""
    names = ("DUALKV_CUDA_WGMMA", "DUALKV_CUDA_WGMMA_BWD", "DUALKV_CUDA_BWD_TMA", "DUALKV_EMULATE_DEVICE_DEFAULTS",
             "DUALKV_CUDA_BWD_CHUNK_ROWS")
    saved = {n: os.environ.get(n) for n in names}
    cases = [dict(d=128, dtype=torch.bfloat16, prompts=[70, 9], responses=[[33, 20, 45, 1, 7], [17, 80]], H=2, Hkv=1),
             dict(d=64, dtype=torch.float16, prompts=[90], responses=[[40, 3, 25, 60]], H=2, Hkv=1, window=50),
             dict(d=64, dtype=torch.bfloat16, prompts=[45], responses=[[30, 12, 25]], H=2, Hkv=1, separate=True)]
    try:
        for n in names:
            os.environ.pop(n, None)
        if device_defaults:
            os.environ["DUALKV_EMULATE_DEVICE_DEFAULTS"] = "1"
        ok = True
        for rows in ("0", "40", None):
            if rows is not None:
                os.environ["DUALKV_CUDA_BWD_CHUNK_ROWS"] = rows
            print(f"reader chunks: DUALKV_CUDA_BWD_CHUNK_ROWS={rows or 'unset'}"
                  f"{' (device defaults)' if device_defaults else ''}", flush=True)
            ok = all([run_case(**c) for c in cases]) and ok
        ok = expect_error({"DUALKV_CUDA_BWD_CHUNK_ROWS": "many"},
                          "DUALKV_CUDA_BWD_CHUNK_ROWS: expected a number of rows >= 0 (0: one chunk a segment), got 'many'",
                          "DUALKV_CUDA_BWD_CHUNK_ROWS=many", **cases[1]) and ok
        return ok
    finally:
        _restore_env(saved)


def check_wgmma_path() -> bool:
    """The extension's answer to backend="auto" (op wgmma_path): the wgmma forward and backward run
    for head dims 64 / 128 / 192 / 256 / 512 when both kernel-choice variables allow them, never for 96."""
    ok = True
    saved = {n: os.environ.get(n) for n in ("DUALKV_CUDA_WGMMA", "DUALKV_CUDA_WGMMA_BWD")}
    try:
        for fwd, bwd, dims in (("1", "1", (64, 128, 192, 256, 512)), ("1", "0", ()), ("0", "1", ())):
            os.environ["DUALKV_CUDA_WGMMA"], os.environ["DUALKV_CUDA_WGMMA_BWD"] = fwd, bwd
            got = tuple(d for d in (64, 96, 128, 192, 256, 512) if torch.ops.dualkv_cuda_emu.wgmma_path(0, d))
            good = got == dims
            ok &= good
            print(f"{'ok' if good else 'FAIL'} wgmma_path with DUALKV_CUDA_WGMMA={fwd} DUALKV_CUDA_WGMMA_BWD={bwd}: {got}")
    finally:
        _restore_env(saved)
    return ok


def run_wgmma_checks(seed: int = 0) -> bool:
    """The wgmma check kernels (csrc/dkv_wgmma_check.cuh) against torch on 64 x 64 bf16 tiles."""
    g = torch.Generator().manual_seed(seed)
    a, b, c = (torch.randn(64, 64, generator=g).to(torch.bfloat16) for _ in range(3))
    af, bf, cf = a.float(), b.float(), c.float()
    checks = [("A B^T (K-major B)", 0, af @ bf.T, 1e-4), ("A B (MN-major B)", 1, af @ bf, 1e-4),
              ("A (registers) B^T", 2, af @ bf.T, 1e-4),
              ("bf16(A B^T) C (attention step)", 3, (af @ bf.T).to(torch.bfloat16).float() @ cf, 2e-2),
              ("A (registers) [B | C] (m64n128, MN-major)", 4, af @ torch.cat([bf, cf], dim=1), 1e-4)]
    ok = True
    for name, which, want, tol in checks:
        got = torch.ops.dualkv_cuda_emu.wgmma_check(which, a, b, c)
        err = (got - want).abs().max().item()
        good = err <= tol * max(1.0, want.abs().max().item())
        ok &= good
        print(f"{'ok' if good else 'FAIL'} wgmma {name}: max error {err:.2e}", flush=True)
    return ok


def run_cluster_checks(seed: int = 0) -> bool:
    """The cluster check kernels (csrc/dkv_cluster_check.cuh, clusters of two blocks) against torch, and a
    planted bug (each block announcing half the bytes its peer sends, one round) that the emulation must refuse."""
    g = torch.Generator().manual_seed(seed)
    rounds = 3
    a = torch.randn(rounds, 2, 64, 64, generator=g)
    src = torch.randn(64 * rounds, 64, generator=g).to(torch.bfloat16)
    ok = True
    got = torch.ops.dualkv_cuda_emu.cluster_pair_sum(a, 64 * 32 * 4)
    err = (got - a.sum(dim=1)).abs().max().item()
    good = err <= 1e-6
    ok &= good
    print(f"{'ok' if good else 'FAIL'} cluster pair_sum ({rounds} rounds: st.async into the peer, remote arrivals): "
          f"max error {err:.2e}", flush=True)
    got = torch.ops.dualkv_cuda_emu.cluster_multicast(src, rounds)
    want = src.view(rounds, 1, 64, 64).expand(rounds, 2, 64, 64)
    good = torch.equal(got, want)
    ok &= good
    print(f"{'ok' if good else 'FAIL'} cluster multicast ({rounds} rounds, issued by each block in turn): "
          f"{'equal' if good else 'differs'}", flush=True)
    try:
        torch.ops.dualkv_cuda_emu.cluster_pair_sum(a[:1], 64 * 32 * 2)
        good = False
        why = "ran"
    except RuntimeError as e:
        why = str(e).splitlines()[0]
        good = "transaction count not at zero" in why
    ok &= good
    print(f"{'ok' if good else 'FAIL'} cluster pair_sum with half the bytes announced is refused: {why}", flush=True)
    for name, call, expected in (
            ("a tile of the wrong shape", lambda: torch.ops.dualkv_cuda_emu.cluster_pair_sum(a[:, :, :32], 8192),
             "a: expected a contiguous CPU fp32 tensor of shape (rounds, 2, 64, 64)"),
            ("no rounds", lambda: torch.ops.dualkv_cuda_emu.cluster_multicast(src, 0), "rounds: expected at least 1")):
        try:
            call()
            why = "ran"
        except RuntimeError as e:
            why = str(e).splitlines()[0]
        good = expected in why
        ok &= good
        print(f"{'ok' if good else 'FAIL'} cluster check op with {name} is refused: {why}", flush=True)
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", type=int, default=None, help="one case of the list (with --sm90-bwd: of its list)")
    ap.add_argument("--wgmma", action="store_true", help="only the wgmma building blocks")
    ap.add_argument("--cluster", action="store_true", help="only the thread block cluster building blocks")
    ap.add_argument("--sm90", action="store_true", help="the wgmma forward kernels' cases (DUALKV_CUDA_WGMMA=1, 2, 3)")
    ap.add_argument("--sm90-bwd", action="store_true",
                    help="the wgmma backward's cases (DUALKV_CUDA_WGMMA_BWD=1 .. 6 and 8, with the wgmma forward)")
    ap.add_argument("--forward-only", action="store_true", help="with --sm90: skip the backward")
    args = ap.parse_args()
    listed = SM90_BWD_CASES if args.sm90_bwd else CASES
    if args.only is not None and not 0 <= args.only < len(listed):
        ap.error(f"--only: expected a case index 0 .. {len(listed) - 1}, got {args.only}")
    t = time.time()
    build()
    print(f"built in {time.time() - t:.0f}s", flush=True)
    if args.wgmma or args.cluster:
        ok = run_wgmma_checks() if args.wgmma else run_cluster_checks()
        print("ALL OK" if ok else "FAILURES")
        sys.exit(0 if ok else 1)
    torch.manual_seed(0)
    if args.sm90:
        ok = check_bad_kernel_choices()
        for mode in ("1", "2", "3"):  # the wgmma forward, its warp-specialised form, that form with TMA loads
            os.environ["DUALKV_CUDA_WGMMA"] = mode
            print(f"DUALKV_CUDA_WGMMA={mode}", flush=True)
            cases = SM90_QUICK if args.quick and mode != "3" else SM90_CASES
            ok = all([run_case(**c, backward=not args.forward_only) for c in cases]) and ok
        ok = check_tma_head_dim() and ok
        ok = check_wide_key_tiles(backward=not args.forward_only) and ok
        ok = check_persistent_forward(backward=not args.forward_only, quick=args.quick) and ok
        ok = check_merged_walk() and ok
        ok = check_device_defaults(backward=not args.forward_only) and ok
        ok = check_tma_fallback(backward=not args.forward_only) and ok
        print("ALL OK" if ok else "FAILURES")
        sys.exit(0 if ok else 1)
    if args.sm90_bwd:
        os.environ["DUALKV_CUDA_WGMMA"] = "1"
        # --quick: for the fused dQ (3), prompt tiles read by several responses at d = 128 and d = 64
        # and for the split dK/dV kernel (d = 192 / 256) one prompt read by several responses (d = 512, its
        # two passes and the dQ kernel's 16-key tiles, runs in the device-defaults check above)
        # and for the warp-specialised dQ (5) key walks longer than its ring (prompt tiles wrap it)
        # and for the default at d = 128 (6) a separate context too
        # and for 5 with split waits (8, with cp.async: opt-in) a d = 64 case with a window ("8t" below
        # has its fallback to 5 under a softcap)
        # and for 6 and 8 with bulk tensor copies (DUALKV_CUDA_BWD_TMA=1: "6t", "8t") ragged tiles, GQA,
        # a window, a separate context and (8) the softcap fallback, which loads by cp.async
        # and for the split kernels at d = 256 with their bulk tensor copies ("1t"), atomic and with a
        # separate context
        # and for 6 with the deferred dQ (9, TMA only, opt-in) items of several tiles at d = 128 and 64, GQA
        # (the opt-in 2, 3, 4, 8 and 9 on fewer cases since 2026-12-06, to keep CI's time down)
        # and for the defaults at d = 128 / 64 two kv heads, their items kv head major too ("h")
        # and for 6 with each tile's dQ reduce-add issued in the tile ("e", DUALKV_CUDA_BWD_LATE_DQ_ADD=0; the
        # others run 6 with the default, each tile's add issued at the next tile)
        quick = {"1": (3, 4, 6, 7), "1t": (7, 10), "2": (4,), "3": (0, 5), "4": (0,), "5": (0, 1), "6": (0, 1, 4, 5, 11),
                 "8": (3,), "6t": (0, 1, 4, 11, 15), "8t": (3, 4, 16), "9t": (0, 1),
                 "6th": (15,), "8th": (16,), "6te": (1, 15)}
        ok = check_wgmma_path()
        ok = check_device_defaults(backward=True) and ok
        ok = check_tma_fallback(backward=True) and ok
        ok = check_chunk_ends() and ok
        ok = check_reader_chunks(device_defaults=True) and ok
        ok = check_tile_order(device_defaults=True) and ok
        ok = check_plan_cache() and ok
        for mode in quick:  # the schedules above; "t": with the TMA producer; "h": items kv head major
            os.environ["DUALKV_CUDA_WGMMA_BWD"] = mode[0]
            os.environ["DUALKV_CUDA_BWD_TMA"] = "1" if "t" in mode else "0"
            os.environ["DUALKV_CUDA_BWD_ITEM_ORDER"] = "1" if "h" in mode else "0"
            os.environ["DUALKV_CUDA_BWD_LATE_DQ_ADD"] = "0" if "e" in mode else "1"
            print(f"DUALKV_CUDA_WGMMA_BWD={mode[0]} DUALKV_CUDA_BWD_TMA={os.environ['DUALKV_CUDA_BWD_TMA']} "
                  f"DUALKV_CUDA_BWD_ITEM_ORDER={os.environ['DUALKV_CUDA_BWD_ITEM_ORDER']}", flush=True)
            cases = [SM90_BWD_CASES[i] for i in quick[mode]] if args.quick else SM90_BWD_CASES
            if args.only is not None:
                cases = [SM90_BWD_CASES[args.only]]
            ok = all([run_case(**c) for c in cases]) and ok
        ok = expect_error({"DUALKV_CUDA_BWD_ITEM_ORDER": "2"},
                          "DUALKV_CUDA_BWD_ITEM_ORDER: expected one of 0, 1 (or unset), got '2'",
                          "DUALKV_CUDA_BWD_ITEM_ORDER=2", **SM90_BWD_CASES[15]) and ok
        print("ALL OK" if ok else "FAILURES")
        sys.exit(0 if ok else 1)
    cases = CASES[:2] if args.quick else CASES
    if args.only is not None:
        cases = [CASES[args.only]]
    ok = all([run_case(**c) for c in cases])
    if args.only is None:
        ok = check_reader_chunks(device_defaults=False) and ok
        ok = check_tile_order(device_defaults=False) and ok
    print("ALL OK" if ok else "FAILURES")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
