"""dQ of the packed layout in Gluon, warp-specialised for Hopper: the forward's structure
(``gluon_fwd``) with the backward's products.

A program takes 128 query rows of one segment and one head. The loader warp brings both halves of Q
and dO, then each key block's K and V into rings of ``STAGES`` buffers; two consumer warpgroups of 64
rows each walk the same key blocks. Per block a consumer issues S = Q K^T and dP = dO V^T, computes
P = exp2(S - LSE) while dP runs (masked only on edge blocks), forms dS = P (dP - delta) and issues
dQ += dS K, which runs under the next block's S and dP. K is released once its dQ product is done,
V once dP is. dQ is scaled by the softmax scale and written once in the input dtype: no atomics, so
it is bit-identical run to run.

Scope (``supported``): as ``gluon_fwd`` (sm_90, fp16 / bf16, d = 64 / 128, no window or softcap, the
packed layout).
"""

from __future__ import annotations

from . import schedule
from .gluon_compat import (AVAILABLE, compile_for_sm90 as _compile, desc, gl, gluon, mbarrier, on_hopper, tile_sig,
                           warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)

if AVAILABLE:
    from .gluon_fwd import _load_rows, edge_mask

    @gluon.jit
    def _consume(descs, bufs, bars, geo, outs, C: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 DIM: gl.constexpr, STAGES: gl.constexpr):
        """Consumer warpgroup C: dQ of query rows [2 mb + C, 2 mb + C + 1) * BLOCK_M of the segment."""
        q_desc, k_desc, v_desc, do_desc = descs
        q_bufs, k_ring, v_ring, do_bufs = bufs
        q_bars, k_ready, k_empty, v_ready, v_empty = bars
        seg_start, seg_len, ctx_start, ctx_len, mb, h, hk, n_c, n = geo
        DQ, LSE, DELTA, total_q, nheads, qk_scale, sm_scale = outs
        dtype: gl.constexpr = q_desc.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, DIM, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        q_smem = q_bufs.index(C)
        do_smem = do_bufs.index(C)
        m0 = mb * (2 * BLOCK_M) + C * BLOCK_M
        offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        ok = offs_m < seg_len
        stat = h.to(gl.int64) * total_q + seg_start + offs_m
        lse2 = gl.expand_dims(gl.load(LSE + stat, mask=ok, other=0.0) * 1.4426950408889634, 1)
        delta = gl.expand_dims(gl.load(DELTA + stat, mask=ok, other=0.0), 1)
        qpos = gl.expand_dims(ctx_len + offs_m, 1)
        offs_n = gl.expand_dims(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout)), 0)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        dq = warpgroup_mma_init(gl.zeros([BLOCK_M, DIM], gl.float32, o_layout))  # carried while in flight
        mbarrier.wait(q_bars.index(C), 0)
        for j in range(n):
            slot = j % STAGES
            phase = (j // STAGES) & 1
            mbarrier.wait(k_ready.index(slot), phase)
            s = warpgroup_mma(q_smem, k_ring.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(slot), phase)
            dp = warpgroup_mma(do_smem, v_ring.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            # S done, and with it the previous block's dQ product (issued before it): that K is free
            s = warpgroup_mma_wait(num_outstanding=1, deps=[s])
            if j > 0:
                mbarrier.arrive(k_empty.index((j - 1) % STAGES), count=1)
            p = gl.exp2(s * qk_scale - lse2)
            p = edge_mask(p, j, n_c, ctx_len, seg_len, m0, offs_n, qpos, 0.0, BLOCK_N)
            dp = warpgroup_mma_wait(num_outstanding=0, deps=[dp])
            mbarrier.arrive(v_empty.index(slot), count=1)
            ds = gl.convert_layout((p * (dp - delta)).to(dtype), a_layout)
            dq = warpgroup_mma(ds, k_ring.index(slot), dq, is_async=True)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=[dq])
        mbarrier.arrive(k_empty.index((n - 1) % STAGES), count=1)

        dq = dq * sm_scale
        rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
        cols = gl.arange(0, DIM, layout=gl.SliceLayout(0, o_layout))
        tile = (seg_start + gl.expand_dims(rows, 1)).to(gl.int64) * (nheads * DIM) + gl.expand_dims(cols, 0)
        gl.store(DQ + h * DIM + tile, dq.to(dtype), mask=gl.expand_dims(rows < seg_len, 1))

    @gluon.jit
    def _consumer0(descs, bufs, bars, geo, outs, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DIM: gl.constexpr,
                   STAGES: gl.constexpr):
        _consume(descs, bufs, bars, geo, outs, 0, BLOCK_M, BLOCK_N, DIM, STAGES)

    @gluon.jit
    def _consumer1(descs, bufs, bars, geo, outs, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DIM: gl.constexpr,
                   STAGES: gl.constexpr):
        _consume(descs, bufs, bars, geo, outs, 1, BLOCK_M, BLOCK_N, DIM, STAGES)

    @gluon.jit
    def _loader(descs, bufs, bars, geo, outs, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DIM: gl.constexpr,
                STAGES: gl.constexpr):
        _load_rows(descs, bufs, bars, geo, BLOCK_M, BLOCK_N, DIM, STAGES, True)

    @gluon.jit
    def dq_ws_kernel(q_desc, k_desc, v_desc, do_desc, DQ, LSE, DELTA, TILES, CU, CTX_START, CTX_LEN, n_tiles,
                     total_q, nheads, qk_scale, sm_scale, REP: gl.constexpr, DIM: gl.constexpr,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                     CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
        """Program = (query tile of 2 * BLOCK_M rows, head). LSE (natural log) and DELTA: (nheads,
        total_q) fp32. num_warps = 4 (consumer 0); consumer 1 and the loader are worker partitions."""
        dtype: gl.constexpr = q_desc.dtype
        pid = gl.program_id(0)
        tile = pid // nheads
        h = pid % nheads
        seg = gl.load(TILES + tile)
        mb = gl.load(TILES + n_tiles + tile)
        if seg >= 0:  # padding entries exit
            seg_start = gl.load(CU + seg)
            seg_len = gl.load(CU + seg + 1) - seg_start
            ctx_start = gl.load(CTX_START + seg)
            ctx_len = gl.load(CTX_LEN + seg)
            n_c = gl.cdiv(ctx_len, BLOCK_N)
            n = n_c + gl.cdiv(gl.minimum(seg_len, (mb + 1) * 2 * BLOCK_M), BLOCK_N)
            q_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_M, DIM], q_desc.layout)
            do_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_M, DIM], do_desc.layout)
            k_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, DIM], k_desc.layout)
            v_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, DIM], v_desc.layout)
            q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(2):
                mbarrier.init(q_bars.index(i), count=1)
            for i in gl.static_range(STAGES):
                mbarrier.init(k_ready.index(i), count=1)
                mbarrier.init(v_ready.index(i), count=1)
                mbarrier.init(k_empty.index(i), count=2)  # released by both consumers
                mbarrier.init(v_empty.index(i), count=2)
            descs = (q_desc, k_desc, v_desc, do_desc)
            bufs = (q_bufs, k_ring, v_ring, do_bufs)
            bars = (q_bars, k_ready, k_empty, v_ready, v_empty)
            geo = (seg_start, seg_len, ctx_start, ctx_len, mb, h, h // REP, n_c, n)
            outs = (DQ, LSE, DELTA, total_q, nheads, qk_scale, sm_scale)
            gl.warp_specialize([
                (_consumer0, (descs, bufs, bars, geo, outs, BLOCK_M, BLOCK_N, DIM, STAGES)),
                (_consumer1, (descs, bufs, bars, geo, outs, BLOCK_M, BLOCK_N, DIM, STAGES)),
                (_loader, (descs, bufs, bars, geo, outs, BLOCK_M, BLOCK_N, DIM, STAGES)),
            ], [4, 1], [CONSUMER_REGS, 24])


def run(q, k, v, dout, dq, lse, delta, meta, qk_scale: float, sm_scale: float, block_m: int = 64,
        block_n: int = 64, stages: int = 4, consumer_regs: int = 240, maxnreg: int = 168):
    """Launch: ``dq`` (T, H, d), contiguous, is written. lse (natural log) and delta: (H, T) fp32."""
    T, H, d = q.shape
    tiles = schedule.query_tiles(meta, T, 2 * block_m, None)
    n_tiles = tiles.shape[1]
    dq_ws_kernel[(n_tiles * H,)](
        desc(q, block_m), desc(k, block_n), desc(v, block_n), desc(dout, block_m), dq, lse, delta, tiles,
        meta.cu_seqlens, meta.seg_ctx_start, meta.seg_ctx_len, n_tiles, T, H, qk_scale, sm_scale,
        REP=H // k.shape[1], DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages, CONSUMER_REGS=consumer_regs,
        num_warps=4, maxnreg=maxnreg,
    )


def compile_for_sm90(dim: int = 128, block_m: int = 64, block_n: int = 64, stages: int = 4, rep: int = 4,
                     dtype: str = "bf16", consumer_regs: int = 240, maxnreg: int = 168):
    """Compile the kernel for sm_90 without a GPU (the CPU tests' check that it lowers)."""
    sig = dict(q_desc=tile_sig(dtype, block_m, dim), k_desc=tile_sig(dtype, block_n, dim),
               v_desc=tile_sig(dtype, block_n, dim), do_desc=tile_sig(dtype, block_m, dim), DQ=f"*{dtype}",
               LSE="*fp32", DELTA="*fp32", TILES="*i32", CU="*i32", CTX_START="*i32", CTX_LEN="*i32",
               n_tiles="i32", total_q="i32", nheads="i32", qk_scale="fp32", sm_scale="fp32")
    const = dict(REP=rep, DIM=dim, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages, CONSUMER_REGS=consumer_regs,
                 num_warps=4)
    return _compile(dq_ws_kernel, sig, const, 4, maxnreg)


supported = None  # set below: the forward's scope


def _supported(o, q, separate_context: bool) -> bool:
    from .gluon_fwd import supported as fwd_supported

    return fwd_supported(o, q, separate_context)


supported = _supported

__all__ = ["AVAILABLE", "compile_for_sm90", "run", "supported", "on_hopper"]
