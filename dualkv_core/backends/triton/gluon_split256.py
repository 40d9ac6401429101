"""The backward at d = 256 for Hopper in Gluon, the two warpgroups of a program split by role (as the CUDA
backend's split kernels): the Triton backend's default there (``DUALKV_TRITON_GLUON_BWD=0`` runs the
``tl`` kernels instead).

dK/dV (``dkdv_split_kernel``): a loader warp brings the key block's K / V once (64 keys) and each
step's Q / dO / LSE / delta into a ring. Warpgroup P computes S^T = K Q^T, P^T and dV += P^T dO;
warpgroup S computes dP^T = V dO^T, takes P^T from P through shared memory (double-buffered by step
parity, one mbarrier each way), dS^T = P^T (dP^T - delta) and dK += dS^T Q. Each holds one 64 x 256
fp32 accumulator (128 registers a thread), where one warpgroup holding both would need 256. The walk,
masks and outputs are ``gluon_dkdv``'s. dS^T is formed from P^T rounded to the input dtype (the ``tl``
kernel keeps it in fp32): dK differs from the ``tl`` kernel's by about 4e-3 of its largest element.

dQ (``dq_split_kernel``): a program takes 64 query rows of one segment and one head. The loader warp
brings the tile's Q and dO once and each key block's K and V (64 keys) into rings. Warpgroup S
computes S = Q K^T and F = P = exp2(S - LSE); warpgroup D computes dP = dO V^T and G = dP - delta;
they swap F and G through shared memory (fp32, one buffer each, an mbarrier each way), each forms
dS = F G and adds dS K[:, its 128 columns] to its half of dQ (64 x 128 fp32). dQ is scaled and
written once: no atomics, bit-identical run to run. Masks on edge blocks only.

sm_90 compile (Triton 3.6): 214 KB and 224 KB of shared memory, no spills. On an H200
(``benchmarks/results/raw/triton_bwd_probes_h200_s33.log``) the two together took 0.59-0.61x the
``tl`` backward's time at (16, 16K / 32K, 2K), H = 16, H_kv = 8.
"""

from __future__ import annotations

from . import schedule
from .gluon_compat import (AVAILABLE, block_barrier, compile_for_sm90 as _compile, desc, fence_async_shared, gl,
                           gluon, hidden_zero, mbarrier, on_hopper, tile_sig, tma_load, warpgroup_mma,
                           warpgroup_mma_wait)
from .gluon_dkdv import (_key_and_step_buffers, _mask_probs, _program_item, _sees_all_keys, _step, _store_keys,
                         _walk, dkdv_args, dkdv_signature)
from .gluon_dkdv_ws import _key_block_loader, _loader_barriers
from .gluon_fwd import _edge_mask, _geometry, _load_key_rings, _query_tile

BLOCK_M, BLOCK_N = 64, 64  # the tiles both kernels' layouts assume
# The dK/dV program order the launcher takes unless DUALKV_TRITON_BWD_HEAD_MAJOR says otherwise: item-major at every
# prompt length (None; kv head major measured within 2% on an H200, raw/triton_bwd_order_h200_s37.log).
HEAD_MAJOR_MIN_PROMPT = None


if AVAILABLE:
    @gluon.jit
    def _probs(descs, bufs, bars, geo, outs, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DIM: gl.constexpr,
               REP: gl.constexpr, STAGES: gl.constexpr):
        """Warpgroup P: S^T, P^T (handed to S), dV."""
        q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, DK, DV, WSK, WSV = descs
        k_all, v_all, q_ring, do_ring, lse_ring, delta_ring, pt_ring = bufs
        kv_bar, ready, empty, pt_full, pt_empty = bars
        krow, seg_end, own_lo, read_lo, n_own, n_blocks, r0, r1, hk, total = geo
        ws_row, nz, nheads_k, qk_scale, sm_scale = outs
        dtype: gl.constexpr = q_desc.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_M, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, DIM // 2, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
        dv = gl.zeros([BLOCK_N, DIM], gl.float32, acc_layout)
        key_rows = krow + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
        keys_inside = krow + BLOCK_N <= seg_end
        mbarrier.wait(kv_bar, 0)
        for i in range(total):
            slot = i % STAGES
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            q_s = q_ring.index(slot)
            k_s = k_all.index(hidden_zero(i))
            st = warpgroup_mma(k_s, q_s.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            lse2 = lse_ring.index(slot).load(s_layout)  # (1, BLOCK_M)
            row, hq, in_own = _step(i, n_blocks, n_own, own_lo, read_lo, hk, REP, BLOCK_M)
            st = warpgroup_mma_wait(num_outstanding=0, deps=[st])
            p = gl.exp2(st * qk_scale - lse2)
            if not _sees_all_keys(row, in_own, krow, keys_inside, seg_end, r0, r1, BLOCK_N, BLOCK_M):  # most see all
                p = _mask_probs(p, row, in_own, key_rows, seg_end, r0, r1, 0)
            p = p.to(dtype)
            par = i % 2
            mbarrier.wait(pt_empty.index(par), ((i // 2) & 1) ^ 1)  # S has read the buffer's last P^T
            pt_ring.index(par).store(p)
            fence_async_shared()
            block_barrier()
            mbarrier.arrive(pt_full.index(par), count=1)
            dv = warpgroup_mma(gl.convert_layout(p, a_layout), do_ring.index(slot), dv, is_async=True)
            dv = warpgroup_mma_wait(num_outstanding=0, deps=[dv])
            block_barrier()  # every thread's reads of the slot (LSE) are done
            mbarrier.arrive(empty.index(slot), count=1)
        _store_keys(dv, krow, DV, WSV, ws_row, nz, seg_end, hk, nheads_k, DIM, BLOCK_N, acc_layout)

    @gluon.jit
    def _grads(descs, bufs, bars, geo, outs, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DIM: gl.constexpr,
               REP: gl.constexpr, STAGES: gl.constexpr):
        """Warpgroup S: dP^T, dS^T (with P's P^T), dK."""
        q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, DK, DV, WSK, WSV = descs
        k_all, v_all, q_ring, do_ring, lse_ring, delta_ring, pt_ring = bufs
        kv_bar, ready, empty, pt_full, pt_empty = bars
        krow, seg_end, own_lo, read_lo, n_own, n_blocks, r0, r1, hk, total = geo
        ws_row, nz, nheads_k, qk_scale, sm_scale = outs
        dtype: gl.constexpr = q_desc.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_M, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, DIM // 2, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
        dk = gl.zeros([BLOCK_N, DIM], gl.float32, acc_layout)
        mbarrier.wait(kv_bar, 0)
        for i in range(total):
            slot = i % STAGES
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            do_s = do_ring.index(slot)
            v_s = v_all.index(hidden_zero(i))
            dpt = warpgroup_mma(v_s, do_s.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            delta = delta_ring.index(slot).load(s_layout)  # (1, BLOCK_M)
            par = i % 2
            dpt = warpgroup_mma_wait(num_outstanding=0, deps=[dpt])
            mbarrier.wait(pt_full.index(par), (i // 2) & 1)
            p = pt_ring.index(par).load(s_layout).to(gl.float32)
            block_barrier()  # every thread has read P^T
            mbarrier.arrive(pt_empty.index(par), count=1)
            ds = (p * (dpt - delta)).to(dtype)
            dk = warpgroup_mma(gl.convert_layout(ds, a_layout), q_ring.index(slot), dk, is_async=True)
            dk = warpgroup_mma_wait(num_outstanding=0, deps=[dk])
            block_barrier()  # every thread's reads of the slot (delta) are done
            mbarrier.arrive(empty.index(slot), count=1)
        _store_keys(dk * sm_scale, krow, DK, WSK, ws_row, nz, seg_end, hk, nheads_k, DIM, BLOCK_N, acc_layout)

    @gluon.jit
    def dkdv_split_kernel(
        q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, DK, DV, WSK, WSV, ITEMS, CU,
        ORDER, n_items, nheads_k, qk_scale, sm_scale,
        REP: gl.constexpr, DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr,
    ):
        dtype: gl.constexpr = q_desc.dtype
        item, hk, unit = _program_item(ITEMS, n_items, nheads_k, gl.load(ORDER) != 0)
        if unit >= 0:
            krow, seg_end, own_lo, n_own, read_lo, n_blocks, r0, r1, ws_row, nz = _walk(
                ITEMS, CU, n_items, item, unit, BLOCK_M, BLOCK_N)
            total = REP * n_blocks

            k_all, v_all, q_ring, do_ring, lse_ring, delta_ring = _key_and_step_buffers(
                k_desc, v_desc, q_desc, do_desc, lse_desc, delta_desc, STAGES, BLOCK_M, BLOCK_N, DIM)
            ptl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
            pt_ring = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ptl)
            kv_bar, ready, empty = _loader_barriers(STAGES)
            pt_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            pt_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            for s in gl.static_range(2):
                mbarrier.init(pt_full.index(s), count=1)
                mbarrier.init(pt_empty.index(s), count=1)
            descs = (q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, DK, DV, WSK, WSV)
            bufs = (k_all, v_all, q_ring, do_ring, lse_ring, delta_ring, pt_ring)
            bars = (kv_bar, ready, empty, pt_full, pt_empty)
            geo = (krow, seg_end, own_lo, read_lo, n_own, n_blocks, r0, r1, hk, total)
            outs = (ws_row, nz, nheads_k, qk_scale, sm_scale)
            gl.warp_specialize([
                (_probs, (descs, bufs, bars, geo, outs, BLOCK_M, BLOCK_N, DIM, REP, STAGES)),
                (_grads, (descs, bufs, bars, geo, outs, BLOCK_M, BLOCK_N, DIM, REP, STAGES)),
                (_key_block_loader, (descs, bufs, bars, geo, outs, BLOCK_M, BLOCK_N, DIM, REP, STAGES)),
            ], [4, 1], [CONSUMER_REGS, 24])

    @gluon.jit
    def _load_tile_and_keys(descs, bufs, bars, geo, NQ: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                            DIM: gl.constexpr, STAGES: gl.constexpr):
        """The loader warp: the tile's NQ row blocks of Q and dO (one barrier each), then K and V of every key
        block into their rings. descs: (Q, K, V, dO); bufs: (Q blocks, dO blocks, K ring, V ring)."""
        q_desc, k_desc, v_desc, do_desc = descs
        q_bufs, do_bufs, k_ring, v_ring = bufs
        q_bars, k_ready, k_empty, v_ready, v_empty = bars
        seg_start, seg_len, ctx_start, ctx_len, mb, h, hk, n_c, n = geo
        for c in gl.static_range(NQ):
            row = seg_start + mb * (NQ * BLOCK_M) + c * BLOCK_M
            mbarrier.expect(q_bars.index(c), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
            tma_load(q_desc, [row, h * DIM], q_bars.index(c), q_bufs.index(c))
            tma_load(do_desc, [row, h * DIM], q_bars.index(c), do_bufs.index(c))
        _load_key_rings(k_desc, v_desc, (k_ring, v_ring), bars, geo, BLOCK_N, DIM, STAGES)

    @gluon.jit
    def _row_stat(X, h, total_q, seg_start, seg_len, offs_m, scale):
        """(BLOCK_M, 1): scale * X[h, the tile's rows] (0 past the segment); X is (nheads, total_q) fp32."""
        ok = offs_m < seg_len
        return gl.expand_dims(gl.load(X + h.to(gl.int64) * total_q + seg_start + offs_m, mask=ok, other=0.0) * scale, 1)

    @gluon.jit
    def _store_dq(dq, DQ, h, seg_start, seg_len, m0, col0, nheads, DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                  COLS: gl.constexpr, o_layout: gl.constexpr):
        """dQ of rows m0 .. m0 + BLOCK_M - 1 of the segment, columns col0 .. col0 + COLS - 1, in DQ's dtype."""
        rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
        cols = col0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, o_layout))
        tile = (seg_start + gl.expand_dims(rows, 1)).to(gl.int64) * (nheads * DIM) + gl.expand_dims(cols, 0)
        gl.store(DQ + h * DIM + tile, dq.to(DQ.dtype.element_ty), mask=gl.expand_dims(rows < seg_len, 1))

    @gluon.jit
    def _dq_consume(descs, bufs, bars, xchg, geo, outs, C: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 DIM: gl.constexpr, STAGES: gl.constexpr):
        """C = 0: S, P, and dQ[:, :DIM / 2]; C = 1: dP, dP - delta, and dQ[:, DIM / 2:]."""
        q_buf, do_buf, k_ring, v_ring = bufs
        q_bar, k_ready, k_empty, v_ready, v_empty = bars
        x_ring, x_full, x_empty = xchg
        seg_start, seg_len, ctx_start, ctx_len, mb, h, hk, n_c, n = geo
        DQ, LSE, DELTA, total_q, nheads, qk_scale, sm_scale = outs
        dtype: gl.constexpr = descs[0].dtype
        HALF: gl.constexpr = DIM // 2
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HALF, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        m0 = mb * BLOCK_M
        offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        if C == 0:
            sub = _row_stat(LSE, h, total_q, seg_start, seg_len, offs_m, 1.4426950408889634)
        else:
            sub = _row_stat(DELTA, h, total_q, seg_start, seg_len, offs_m, 1.0)
        qpos = gl.expand_dims(ctx_len + offs_m, 1)
        offs_n = gl.expand_dims(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout)), 0)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        dq = gl.zeros([BLOCK_M, HALF], gl.float32, o_layout)
        mbarrier.wait(q_bar.index(0), 0)
        for j in range(n):
            slot = j % STAGES
            phase = (j // STAGES) & 1
            zero = hidden_zero(j)
            mbarrier.wait(k_ready.index(slot), phase)
            if C == 0:
                x = warpgroup_mma(q_buf.index(zero), k_ring.index(slot).permute((1, 0)), s_zero, use_acc=False,
                                  is_async=True)
            else:
                mbarrier.wait(v_ready.index(slot), phase)
                x = warpgroup_mma(do_buf.index(zero), v_ring.index(slot).permute((1, 0)), s_zero, use_acc=False,
                                  is_async=True)
            x = warpgroup_mma_wait(num_outstanding=0, deps=[x])
            if C == 0:  # F = P (0 where not visible)
                x = gl.exp2(_edge_mask(x, j, n_c, ctx_len, seg_len, m0, offs_n, qpos, float("-inf"), BLOCK_N)
                            * qk_scale - sub)
            else:  # G = dP - delta; V is free
                mbarrier.arrive(v_empty.index(slot), count=1)
                x = x - sub
            # swap: this warpgroup's factor into x_ring[C] (once the other has read the last one), the other's
            # from x_ring[1 - C]
            mbarrier.wait(x_empty.index(C), (j & 1) ^ 1)  # mbarriers start with phase 1 complete
            x_ring.index(C).store(x)
            block_barrier()
            mbarrier.arrive(x_full.index(C), count=1)
            mbarrier.wait(x_full.index(1 - C), j & 1)
            other = x_ring.index(1 - C).load(s_layout)
            block_barrier()
            mbarrier.arrive(x_empty.index(1 - C), count=1)
            ds = gl.convert_layout((x * other).to(dtype), a_layout)
            dq = warpgroup_mma(ds, k_ring.index(slot).slice(C * HALF, HALF, dim=1), dq, is_async=True)
            dq = warpgroup_mma_wait(num_outstanding=0, deps=[dq])
            mbarrier.arrive(k_empty.index(slot), count=1)  # both warpgroups release K

        _store_dq(dq * sm_scale, DQ, h, seg_start, seg_len, m0, C * HALF, nheads, DIM, BLOCK_M, HALF, o_layout)

    @gluon.jit
    def _dq_consumer0(descs, bufs, bars, xchg, geo, outs, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   DIM: gl.constexpr, STAGES: gl.constexpr):
        _dq_consume(descs, bufs, bars, xchg, geo, outs, 0, BLOCK_M, BLOCK_N, DIM, STAGES)

    @gluon.jit
    def _dq_consumer1(descs, bufs, bars, xchg, geo, outs, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   DIM: gl.constexpr, STAGES: gl.constexpr):
        _dq_consume(descs, bufs, bars, xchg, geo, outs, 1, BLOCK_M, BLOCK_N, DIM, STAGES)

    @gluon.jit
    def _dq_loader(descs, bufs, bars, xchg, geo, outs, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DIM: gl.constexpr,
                STAGES: gl.constexpr):
        _load_tile_and_keys(descs, bufs, bars, geo, 1, BLOCK_M, BLOCK_N, DIM, STAGES)

    @gluon.jit
    def dq_split_kernel(q_desc, k_desc, v_desc, do_desc, DQ, LSE, DELTA, TILES, CU, CTX_START, CTX_LEN, n_tiles,
                        total_q, nheads, qk_scale, sm_scale, REP: gl.constexpr, DIM: gl.constexpr,
                        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                        CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
        """Program = (query tile of BLOCK_M rows, head). LSE (natural log) and DELTA: (nheads, total_q)."""
        dtype: gl.constexpr = q_desc.dtype
        h, seg, mb = _query_tile(TILES, n_tiles, nheads)
        if seg >= 0:  # padding entries exit
            seg_start, seg_len, ctx_start, ctx_len, n_c, n = _geometry(CU, CTX_START, CTX_LEN, seg, mb, BLOCK_M,
                                                                        BLOCK_N)
            q_buf = gl.allocate_shared_memory(dtype, [1, BLOCK_M, DIM], q_desc.layout)
            do_buf = gl.allocate_shared_memory(dtype, [1, BLOCK_M, DIM], do_desc.layout)
            k_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, DIM], k_desc.layout)
            v_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, DIM], v_desc.layout)
            xl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.float32)
            x_ring = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, BLOCK_N], xl)  # [warpgroup]
            q_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
            k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            x_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            x_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            mbarrier.init(q_bar.index(0), count=1)
            for i in gl.static_range(STAGES):
                mbarrier.init(k_ready.index(i), count=1)
                mbarrier.init(v_ready.index(i), count=1)
                mbarrier.init(k_empty.index(i), count=2)  # released by both warpgroups
                mbarrier.init(v_empty.index(i), count=1)  # read by warpgroup D only
            for i in gl.static_range(2):
                mbarrier.init(x_full.index(i), count=1)
                mbarrier.init(x_empty.index(i), count=1)
            descs = (q_desc, k_desc, v_desc, do_desc)
            bufs = (q_buf, do_buf, k_ring, v_ring)
            bars = (q_bar, k_ready, k_empty, v_ready, v_empty)
            xchg = (x_ring, x_full, x_empty)
            geo = (seg_start, seg_len, ctx_start, ctx_len, mb, h, h // REP, n_c, n)
            outs = (DQ, LSE, DELTA, total_q, nheads, qk_scale, sm_scale)
            gl.warp_specialize([
                (_dq_consumer0, (descs, bufs, bars, xchg, geo, outs, BLOCK_M, BLOCK_N, DIM, STAGES)),
                (_dq_consumer1, (descs, bufs, bars, xchg, geo, outs, BLOCK_M, BLOCK_N, DIM, STAGES)),
                (_dq_loader, (descs, bufs, bars, xchg, geo, outs, BLOCK_M, BLOCK_N, DIM, STAGES)),
            ], [4, 1], [CONSUMER_REGS, 24])


def supported(o, q) -> bool:
    """Whether the kernels apply to a call (``o``: the launcher's options; the packed layout without a
    window on descriptors is the launcher's to check): sm_90, fp16 / bf16, d = 256, no softcap."""
    return on_hopper(q) and o.tma and o.dim == o.head_dim == 256 and not o.has_softcap and o.elem == 2


def run_dkdv(q, k, v, dout, lse2, delta, dk, dv, wsk, wsv, table, cu_seqlens, nheads_k, rep, qk_scale, sm_scale,
             block_m: int = BLOCK_M, block_n: int = BLOCK_N, stages: int = 2, consumer_regs: int = 240,
             maxnreg: int = 168, head_major=False):
    """dK/dV: ``gluon_dkdv.run``'s arguments without dQ. The item table must be built for ``BLOCK_N``-key blocks.
    head_major: the programs kv head major (``gluon_dkdv._program_item``), a bool or the device flag
    ``schedule.head_major_flag`` makes (``HEAD_MAJOR_MIN_PROMPT`` says why not by default)."""
    if (block_m, block_n) != (BLOCK_M, BLOCK_N) or q.shape[2] != 256:
        raise ValueError(f"gluon_split256: expected d = 256 and {BLOCK_M} x {BLOCK_N} tiles, got d = {q.shape[2]}, "
                         f"{block_m} x {block_n}")
    args = dkdv_args(q, k, v, dout, lse2, delta, dk, dv, wsk, wsv, table, cu_seqlens, nheads_k, qk_scale, sm_scale,
                     None, block_m, block_n, head_major=head_major)
    return dkdv_split_kernel[(table.shape[1] * nheads_k,)](
        *args, REP=rep, DIM=q.shape[2], BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages,
        CONSUMER_REGS=consumer_regs, num_warps=4, maxnreg=maxnreg)


def dq_args(q, k, v, dout, dq, lse, delta, meta, tiles, qk_scale, sm_scale, block_m, block_n):
    """The dQ kernel's launch arguments."""
    T, H, _ = q.shape
    return [desc(q, block_m), desc(k, block_n), desc(v, block_n), desc(dout, block_m), dq, lse, delta, tiles,
            meta.cu_seqlens, meta.seg_ctx_start, meta.seg_ctx_len, tiles.shape[1], T, H, qk_scale, sm_scale]


def run_dq(q, k, v, dout, dq, lse, delta, meta, qk_scale: float, sm_scale: float, stages: int = 2,
           consumer_regs: int = 240, maxnreg: int = 168):
    """dQ: ``dq`` (T, H, 256), contiguous, is written. lse (natural log) and delta: (H, T) fp32."""
    T, H, d = q.shape
    if d != 256 or not dq.is_contiguous():
        raise ValueError(f"gluon_split256: expected d = 256 and a contiguous dq, got d = {d}, "
                         f"contiguous={dq.is_contiguous()}")
    tiles = schedule.query_tiles(meta, T, BLOCK_M, None)
    dq_split_kernel[(tiles.shape[1] * H,)](
        *dq_args(q, k, v, dout, dq, lse, delta, meta, tiles, qk_scale, sm_scale, BLOCK_M, BLOCK_N),
        REP=H // k.shape[1], DIM=d, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, STAGES=stages, CONSUMER_REGS=consumer_regs,
        num_warps=4, maxnreg=maxnreg)


def dq_signature(dim: int, block_m: int, block_n: int, dtype: str = "bf16") -> dict:
    """``gluon_compat.compile_for_sm90``'s signature of the dQ kernel's arguments."""
    return dict(q_desc=tile_sig(dtype, block_m, dim), k_desc=tile_sig(dtype, block_n, dim),
                v_desc=tile_sig(dtype, block_n, dim), do_desc=tile_sig(dtype, block_m, dim), DQ=f"*{dtype}",
                LSE="*fp32", DELTA="*fp32", TILES="*i32", CU="*i32", CTX_START="*i32", CTX_LEN="*i32",
                n_tiles="i32", total_q="i32", nheads="i32", qk_scale="fp32", sm_scale="fp32")


def compile_for_sm90(kernel: str = "dkdv", dim: int = 256, stages: int = 2, rep: int = 2, dtype: str = "bf16",
                     consumer_regs: int = 240, maxnreg: int = 168):
    """Compile ``kernel`` ("dkdv" or "dq") for sm_90 without a GPU (the CPU tests' check that it lowers)."""
    const = dict(REP=rep, DIM=dim, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, STAGES=stages, CONSUMER_REGS=consumer_regs,
                 num_warps=4)
    if kernel == "dkdv":
        return _compile(dkdv_split_kernel, dkdv_signature(dim, BLOCK_M, BLOCK_N, dtype), const, 4, maxnreg)
    return _compile(dq_split_kernel, dq_signature(dim, BLOCK_M, BLOCK_N, dtype), const, 4, maxnreg)


__all__ = ["AVAILABLE", "BLOCK_M", "BLOCK_N", "HEAD_MAJOR_MIN_PROMPT", "compile_for_sm90", "run_dkdv", "run_dq", "supported"]
