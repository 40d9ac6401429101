"""Probe for the next GPU session: which change makes Triton's warp-specialised form of the one-loop
dK/dV correct? (Triton 3.6 on an H200 gave wrong dK / dV for the second consumer warpgroup's half of
each 128-key block: benchmarks/results/raw/triton_dkdv_rows_h200_s29.log.)

A copy of ``dkdv_rows_kernel``'s loop (packed layout, no window, no softcap, whole items: no reader
splits) with switches; each variant runs warp-specialised and not, and the two are compared, so no
reference is needed. Prints bad rows (of dK / dV) and the warp-specialised variant's time.

    PYTHONPATH=. python3 benchmarks/results/raw/triton_ws_dkdv_probe.py
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from dualkv.core.backends.triton import launcher, schedule
from dualkv.core.backends.triton.bwd_kernel import _item
from benchmarks.tune_triton import make_case


@triton.jit
def probe_kernel(Q, K, V, DO, LSE2, DELTA, DK, DV, ITEMS, CU, n_items, total_q, t4, nheads_k, qk_scale, sm_scale,
                 REP: tl.constexpr, DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 WS: tl.constexpr, RELOAD_KV: tl.constexpr, ROWS_IN_LOOP: tl.constexpr, DK_FIRST: tl.constexpr):
    nheads = nheads_k * REP
    Qd = tl.make_tensor_descriptor(Q, [total_q, nheads * DIM], [nheads * DIM, 1], [BLOCK_M, DIM])
    DOd = tl.make_tensor_descriptor(DO, [total_q, nheads * DIM], [nheads * DIM, 1], [BLOCK_M, DIM])
    Kd = tl.make_tensor_descriptor(K, [total_q, nheads_k * DIM], [nheads_k * DIM, 1], [BLOCK_N, DIM])
    Vd = tl.make_tensor_descriptor(V, [total_q, nheads_k * DIM], [nheads_k * DIM, 1], [BLOCK_N, DIM])
    Ld = tl.make_tensor_descriptor(LSE2, [nheads * t4], [1], [BLOCK_M])
    Dd = tl.make_tensor_descriptor(DELTA, [nheads * t4], [1], [BLOCK_M])
    pid = tl.program_id(0)
    item = pid // nheads_k
    hk = pid % nheads_k
    unit = tl.load(ITEMS + item)
    live = unit >= 0
    unit = tl.where(live, unit, 0)
    blk, _, _, region, r0, r1 = _item(ITEMS, n_items, item)
    seg_start = tl.load(CU + unit)
    seg_end = tl.load(CU + unit + 1)
    krow = seg_start + blk * BLOCK_N
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, DIM)
    k = Kd.load([krow, hk * DIM])
    v = Vd.load([krow, hk * DIM])
    own_lo = krow - krow % 4
    n_own = tl.where(live, tl.cdiv(seg_end - own_lo, BLOCK_M), 0)
    read_lo = r0 - r0 % 4
    n_read = tl.where(live & (region >= 0) & (r1 > r0), tl.cdiv(r1 - read_lo, BLOCK_M), 0)
    n_blocks = n_own + n_read
    key_rows = krow + offs_n
    dk = tl.zeros([BLOCK_N, DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, DIM], tl.float32)
    for i in tl.range(REP * n_blocks, warp_specialize=WS):
        r = i // n_blocks
        b = i - r * n_blocks
        hq = hk * REP + r
        in_own = b < n_own
        row = tl.where(in_own, own_lo + b * BLOCK_M, read_lo + (b - n_own) * BLOCK_M)
        if RELOAD_KV:
            k = Kd.load([krow, hk * DIM])
            v = Vd.load([krow, hk * DIM])
        q = Qd.load([row, hq * DIM])
        do = DOd.load([row, hq * DIM])
        lse2 = Ld.load([hq * t4 + row])
        delta = Dd.load([hq * t4 + row])
        s_t = tl.dot(k, tl.trans(q)) * qk_scale
        rows = (row + offs_m)[None, :]
        if ROWS_IN_LOOP:
            lower = tl.where(in_own, krow + tl.arange(0, BLOCK_N), r0)[:, None]
        else:
            lower = tl.where(in_own, key_rows, r0)[:, None]
        upper = tl.where(in_own, seg_end, r1)
        p_t = tl.where((rows >= lower) & (rows < upper), tl.math.exp2(s_t - lse2[None, :]), 0.0)
        if DK_FIRST:
            dp_t = tl.dot(v, tl.trans(do))
            ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
            dk = tl.dot(ds_t, q, dk)
            dv = tl.dot(p_t.to(do.dtype), do, dv)
        else:
            dv = tl.dot(p_t.to(do.dtype), do, dv)
            dp_t = tl.dot(v, tl.trans(do))
            ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
            dk = tl.dot(ds_t, q, dk)
    ok = (key_rows < tl.where(live, seg_end, 0))[:, None]
    out = key_rows.to(tl.int64)[:, None] * (nheads_k * DIM) + hk * DIM + offs_d[None, :]
    tl.store(DK + out, (dk * sm_scale).to(DK.dtype.element_ty), mask=ok)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=ok)


def main():
    launcher._ensure_allocator()
    N, P, R, H, Hkv, d = 16, 4096, 2048, 32, 8, 128
    meta, q, k, v, do = make_case(N, P, R, H, Hkv, d)
    scale = 1 / math.sqrt(d)
    out, lse = launcher.forward(q, k, v, None, None, meta, scale, None, None)
    T = q.shape[0]
    delta = (out.float() * do.float()).sum(-1).t().contiguous()
    t4 = -(-T // 4) * 4
    lse2 = lse.new_zeros((H, t4))
    lse2[:, :T] = lse * 1.4426950408889634
    dl = lse.new_zeros((H, t4))
    dl[:, :T] = delta
    items = schedule.key_items(meta, T, 0, False, 128, None, split_rows=1 << 30).table  # no reader splits
    n_items = items.shape[1]

    def run(ws, **flags):
        dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
        probe_kernel[(n_items * Hkv,)](q, k, v, do, lse2, dl, dk, dv, items, meta.cu_seqlens, n_items, T, t4, Hkv,
                                       scale * 1.4426950408889634, scale, REP=H // Hkv, DIM=d, BLOCK_M=64,
                                       BLOCK_N=128, WS=ws, num_warps=4 if ws else 8, num_stages=2, **flags)
        return dk, dv

    for flags in (dict(RELOAD_KV=False, ROWS_IN_LOOP=False, DK_FIRST=False),
                  dict(RELOAD_KV=True, ROWS_IN_LOOP=False, DK_FIRST=False),
                  dict(RELOAD_KV=False, ROWS_IN_LOOP=True, DK_FIRST=False),
                  dict(RELOAD_KV=False, ROWS_IN_LOOP=False, DK_FIRST=True),
                  dict(RELOAD_KV=True, ROWS_IN_LOOP=True, DK_FIRST=True)):
        try:
            ref = run(False, **flags)
            got = run(True, **flags)
            torch.cuda.synchronize()
        except Exception as err:  # noqa: BLE001 - a variant the pass rejects is reported
            print(flags, "failed:", type(err).__name__, str(err)[:200], flush=True)
            continue
        bad = [int(((a.float() - b.float()).abs().nan_to_num(1e9).amax(dim=(1, 2)) > 1e-2).sum()) for a, b in zip(got, ref)]
        ms_ws = do_bench(lambda: run(True, **flags), rep=200)
        ms_plain = do_bench(lambda: run(False, **flags), rep=200)
        print(flags, f"bad rows dK {bad[0]} dV {bad[1]} of {T}; ws {ms_ws:.2f} ms, not ws {ms_plain:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
