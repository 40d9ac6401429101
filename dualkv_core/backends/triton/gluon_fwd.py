"""The packed-layout forward in Gluon (Triton's tile-level language), warp-specialised for Hopper.

A program takes 128 query rows of one segment and one head. Three partitions share it:
- a loader warp issues TMA loads: the two 64-row halves of Q, then each key block's K and V into
  rings of ``STAGES`` buffers (ready / empty mbarriers; a buffer is refilled once both consumers
  have released it);
- two consumer warpgroups, one per 64-row half, each walk the same key blocks (the group's prompt
  for a response, then the segment's own keys) with an online softmax in fp32, log2 domain. Each
  overlaps its softmax with its own products: block j's S = Q K^T and block j-1's P V are issued,
  and the softmax of block j runs while P V does. Masks apply only to blocks that cross the
  context's end, the causal edge or the segment's end.

Measured on an H200 against the ``tl`` warp-specialised forward (``fwd_kernel``, which Triton 3.6
splits into a producer and consumers itself): 1.16-1.24x faster at d = 64 / 128 in four configs
(``benchmarks/results/raw/gluon_fwd_h200_s30.log``).

Scope (``supported``): sm_90, fp16 / bf16, head dims 64 / 128, no window, no softcap, the packed
layout (the context's keys are rows of K / V), descriptors usable on q, k, v. LSE is written as a
natural log, (nheads, total_q), as ``fwd_kernel`` does.
"""

from __future__ import annotations

import torch

from . import schedule
from .gluon_compat import (AVAILABLE, compile_for_sm90 as _compile, desc, gl, gluon, mbarrier, on_hopper, tile_sig,
                           tma_load, warpgroup_mma, warpgroup_mma_wait)


if AVAILABLE:
    @gluon.jit
    def _key_row(b, n_c, ctx_start, seg_start, BLOCK_N: gl.constexpr):
        """First row of key block b: the context's blocks first, then the segment's own."""
        return gl.where(b < n_c, ctx_start + b * BLOCK_N, seg_start + (b - n_c) * BLOCK_N)

    @gluon.jit
    def _loader(descs, bufs, bars, geo, outs, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DIM: gl.constexpr,
                STAGES: gl.constexpr):
        """The loader warp: both Q halves, then K and V of every key block into their rings."""
        q_desc, k_desc, v_desc = descs
        q_bufs, k_ring, v_ring = bufs
        q_bars, k_ready, k_empty, v_ready, v_empty = bars
        seg_start, seg_len, ctx_start, ctx_len, mb, h, hk, n_c, n = geo
        for c in gl.static_range(2):
            row = seg_start + mb * (2 * BLOCK_M) + c * BLOCK_M
            mbarrier.expect(q_bars.index(c), q_desc.block_type.nbytes)
            tma_load(q_desc, [row, h * DIM], q_bars.index(c), q_bufs.index(c))
        _load_key_rings(k_desc, v_desc, (k_ring, v_ring), bars, geo, BLOCK_N, DIM, STAGES)

    @gluon.jit
    def _query_tile(TILES, n_tiles, nheads):
        """This program's (head, segment, tile index within the segment) in a launch over (query tiles of
        ``schedule.query_tiles`` x heads); segment < 0 marks a padding entry."""
        pid = gl.program_id(0)
        tile = pid // nheads
        return pid % nheads, gl.load(TILES + tile), gl.load(TILES + n_tiles + tile)

    @gluon.jit
    def _geometry(CU, CTX_START, CTX_LEN, seg, mb, ROWS: gl.constexpr, BLOCK_N: gl.constexpr):
        """Query tile mb (ROWS rows) of segment seg: (segment start, length, context start, length, context
        key blocks, key blocks in all: the context's, then the segment's own up to the tile's last row)."""
        seg_start = gl.load(CU + seg)
        seg_len = gl.load(CU + seg + 1) - seg_start
        ctx_start = gl.load(CTX_START + seg)
        ctx_len = gl.load(CTX_LEN + seg)
        n_c = gl.cdiv(ctx_len, BLOCK_N)
        n = n_c + gl.cdiv(gl.minimum(seg_len, (mb + 1) * ROWS), BLOCK_N)
        return seg_start, seg_len, ctx_start, ctx_len, n_c, n

    @gluon.jit
    def _load_key_rings(k_desc, v_desc, rings, bars, geo, BLOCK_N: gl.constexpr, DIM: gl.constexpr,
                        STAGES: gl.constexpr):
        """K and V of every key block a query tile reads (its context's, then its segment's own) into
        their rings of STAGES slots, each slot refilled once its readers have released it. bars and geo
        as the query-tile loaders hold them (this forward's and ``gluon_split256``'s dQ)."""
        k_ring, v_ring = rings
        _, k_ready, k_empty, v_ready, v_empty = bars
        seg_start, seg_len, ctx_start, ctx_len, mb, h, hk, n_c, n = geo
        for j in range(n):
            slot = j % STAGES
            phase = (j // STAGES) & 1
            row = _key_row(j, n_c, ctx_start, seg_start, BLOCK_N)
            mbarrier.wait(k_empty.index(slot), phase ^ 1)  # mbarriers start with phase 1 complete
            mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
            tma_load(k_desc, [row, hk * DIM], k_ready.index(slot), k_ring.index(slot))
            mbarrier.wait(v_empty.index(slot), phase ^ 1)
            mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
            tma_load(v_desc, [row, hk * DIM], v_ready.index(slot), v_ring.index(slot))

    @gluon.jit
    def _edge_mask(s, j, n_c, ctx_len, seg_len, m0, offs_n, qpos, fill, BLOCK_N: gl.constexpr):
        """Scores of key block j with invisible keys set to ``fill``, masked only where the block crosses
        the context's end, the causal edge (rows from m0) or the segment's end."""
        in_c = j < n_c
        b0 = gl.where(in_c, j, j - n_c) * BLOCK_N
        edge = gl.where(in_c, b0 + BLOCK_N > ctx_len, (b0 + BLOCK_N > m0 + 1) | (b0 + BLOCK_N > seg_len))
        if edge:
            kidx = b0 + offs_n
            vis = (kidx < gl.where(in_c, ctx_len, seg_len)) & (gl.where(in_c, 0, ctx_len) + kidx <= qpos)
            s = gl.where(vis, s, fill)
        return s

    @gluon.jit
    def _consume(descs, bufs, bars, geo, outs, C: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 DIM: gl.constexpr, STAGES: gl.constexpr):
        """Consumer warpgroup C: query rows [2 mb + C, 2 mb + C + 1) * BLOCK_M of the segment."""
        q_desc, k_desc, v_desc = descs
        q_bufs, k_ring, v_ring = bufs
        q_bars, k_ready, k_empty, v_ready, v_empty = bars
        seg_start, seg_len, ctx_start, ctx_len, mb, h, hk, n_c, n = geo
        O, LSE, total_q, nheads, qk_scale = outs
        dtype: gl.constexpr = q_desc.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        q_smem = q_bufs.index(C)
        m0 = mb * (2 * BLOCK_M) + C * BLOCK_M
        offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        qpos = gl.expand_dims(ctx_len + offs_m, 1)  # logical positions: the context's keys come first
        offs_n = gl.expand_dims(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout)), 0)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)

        # Block 0 (every row sees its key 0, so the running maximum is finite from here on)
        mbarrier.wait(q_bars.index(C), 0)
        mbarrier.wait(k_ready.index(0), 0)
        s = warpgroup_mma(q_smem, k_ring.index(0).permute((1, 0)), s_zero, use_acc=False)
        mbarrier.arrive(k_empty.index(0), count=1)
        vis = (offs_n < gl.where(0 < n_c, ctx_len, seg_len)) & (gl.where(0 < n_c, 0, ctx_len) + offs_n <= qpos)
        s = gl.where(vis, s * qk_scale, float("-inf"))
        m_i = gl.max(s, 1)
        p = gl.exp2(s - gl.expand_dims(m_i, 1))
        l_i = gl.sum(p, 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        acc = gl.zeros([BLOCK_M, DIM], gl.float32, o_layout)
        for j in range(1, n):
            ks = j % STAGES
            vs = (j - 1) % STAGES
            mbarrier.wait(k_ready.index(ks), (j // STAGES) & 1)
            s = warpgroup_mma(q_smem, k_ring.index(ks).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(vs), ((j - 1) // STAGES) & 1)
            acc = warpgroup_mma(p_op, v_ring.index(vs), acc, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=[s])  # S done; P V still running
            mbarrier.arrive(k_empty.index(ks), count=1)
            s = _edge_mask(s, j, n_c, ctx_len, seg_len, m0, offs_n, qpos, float("-inf"), BLOCK_N)
            m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
            mbarrier.arrive(v_empty.index(vs), count=1)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
        vs = (n - 1) % STAGES
        mbarrier.wait(v_ready.index(vs), ((n - 1) // STAGES) & 1)
        acc = warpgroup_mma(p_op, v_ring.index(vs), acc)
        mbarrier.arrive(v_empty.index(vs), count=1)

        acc = acc / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)), 1)
        rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
        cols = gl.arange(0, DIM, layout=gl.SliceLayout(0, o_layout))
        tile = (seg_start + gl.expand_dims(rows, 1)).to(gl.int64) * (nheads * DIM) + gl.expand_dims(cols, 0)
        gl.store(O + h * DIM + tile, acc.to(dtype), mask=gl.expand_dims(rows < seg_len, 1))
        lse = (m_i + gl.log2(l_i)) * 0.6931471805599453  # natural log
        gl.store(LSE + h.to(gl.int64) * total_q + seg_start + offs_m, lse, mask=offs_m < seg_len)

    @gluon.jit
    def _consumer0(descs, bufs, bars, geo, outs, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DIM: gl.constexpr,
                   STAGES: gl.constexpr):
        _consume(descs, bufs, bars, geo, outs, 0, BLOCK_M, BLOCK_N, DIM, STAGES)

    @gluon.jit
    def _consumer1(descs, bufs, bars, geo, outs, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DIM: gl.constexpr,
                   STAGES: gl.constexpr):
        _consume(descs, bufs, bars, geo, outs, 1, BLOCK_M, BLOCK_N, DIM, STAGES)

    @gluon.jit
    def fwd_ws_kernel(q_desc, k_desc, v_desc, O, LSE, TILES, CU, CTX_START, CTX_LEN, n_tiles, total_q, nheads,
                      qk_scale, REP: gl.constexpr, DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
        """Program = (query tile of 2 * BLOCK_M rows, head), tiles from ``schedule.query_tiles``.
        num_warps = 4 (consumer 0); consumer 1 (4 warps, CONSUMER_REGS registers) and the loader
        (1 warp, 24 registers) are worker partitions."""
        dtype: gl.constexpr = q_desc.dtype
        h, seg, mb = _query_tile(TILES, n_tiles, nheads)
        if seg >= 0:  # padding entries exit
            seg_start, seg_len, ctx_start, ctx_len, n_c, n = _geometry(CU, CTX_START, CTX_LEN, seg, mb,
                                                                        2 * BLOCK_M, BLOCK_N)
            q_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_M, DIM], q_desc.layout)
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
            descs = (q_desc, k_desc, v_desc)
            bufs = (q_bufs, k_ring, v_ring)
            bars = (q_bars, k_ready, k_empty, v_ready, v_empty)
            geo = (seg_start, seg_len, ctx_start, ctx_len, mb, h, h // REP, n_c, n)
            outs = (O, LSE, total_q, nheads, qk_scale)
            # (the compile-time block sizes go in each argument list itself: a tuple variable would not keep them
            # compile-time)
            gl.warp_specialize([
                (_consumer0, (descs, bufs, bars, geo, outs, BLOCK_M, BLOCK_N, DIM, STAGES)),
                (_consumer1, (descs, bufs, bars, geo, outs, BLOCK_M, BLOCK_N, DIM, STAGES)),
                (_loader, (descs, bufs, bars, geo, outs, BLOCK_M, BLOCK_N, DIM, STAGES)),
            ], [4, 1], [CONSUMER_REGS, 24])


def supported(o, q, separate_context: bool) -> bool:
    """Whether the Gluon forward applies (``o``: the launcher's options)."""
    return (on_hopper(q) and o.tma and not separate_context and o.dim == o.head_dim and o.dim in (64, 128)
            and not o.has_window and not o.has_softcap and o.elem == 2)


def run(q, k, v, out, lse, meta, qk_scale: float, block_m: int = 64, block_n: int = 128, stages: int = 2,
        consumer_regs: int = 240, maxnreg: int = 168):
    """Launch: ``out`` (T, H, d) and ``lse`` (H, T) fp32 are written. qk_scale = softmax scale * log2(e).
    block_m: rows per consumer (a program takes 2 * block_m). Registers: the program's three warpgroups
    (consumer 0, consumer 1, the loader's) start at ``maxnreg`` a thread (3 x 128 x 168 fills the 64K
    register file); the loader drops to 24, consumer 1 takes ``consumer_regs`` and consumer 0 the rest."""
    T, H, d = q.shape
    tiles = schedule.query_tiles(meta, T, 2 * block_m, None)
    n_tiles = tiles.shape[1]
    fwd_ws_kernel[(n_tiles * H,)](
        desc(q, block_m), desc(k, block_n), desc(v, block_n), out, lse, tiles, meta.cu_seqlens,
        meta.seg_ctx_start, meta.seg_ctx_len, n_tiles, T, H, qk_scale,
        REP=H // k.shape[1], DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages, CONSUMER_REGS=consumer_regs,
        num_warps=4, maxnreg=maxnreg,
    )


def compile_for_sm90(dim: int = 128, block_m: int = 64, block_n: int = 128, stages: int = 2, rep: int = 4,
                     dtype: str = "bf16", consumer_regs: int = 240, maxnreg: int = 168):
    """Compile the kernel for sm_90 without a GPU (the CPU tests' check that it lowers)."""
    sig = dict(q_desc=tile_sig(dtype, block_m, dim), k_desc=tile_sig(dtype, block_n, dim),
               v_desc=tile_sig(dtype, block_n, dim), O=f"*{dtype}", LSE="*fp32", TILES="*i32", CU="*i32",
               CTX_START="*i32", CTX_LEN="*i32", n_tiles="i32", total_q="i32", nheads="i32", qk_scale="fp32")
    const = dict(REP=rep, DIM=dim, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages, CONSUMER_REGS=consumer_regs,
                 num_warps=4)
    return _compile(fwd_ws_kernel, sig, const, 4, maxnreg)


__all__ = ["AVAILABLE", "compile_for_sm90", "run", "supported"]
