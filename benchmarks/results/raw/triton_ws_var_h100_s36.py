"""Probe (s34): variants of the package's ``gluon_dkdv_ws`` kernel, as constexprs:

- EARLY: release the ring slot before waiting on the previous dQ reduce-add (s33's ws-early).
- ROT = 1: each program starts its walk over the REP query heads at head (key block % REP), so the
  programs of neighbouring key blocks that read the same query rows (the reader splits z > 0, which
  all start at r0) add into different dQ tiles at the same moment.
- ROT = 2: the reader part of the walk starts at block (16 * key block) mod n_read and wraps.
- ROT = 3: readers first, then the key block's own rows; ROT = 4: the same with row blocks outer and the
  REP query heads inner; ROT = 5 ("wave"): row blocks outer, both parts rotated by the item's start time
  from a list-scheduling simulation of the launch (a 10th table row); ROT = 6: programs kv head major
  (pid % n_items the item, pid // n_items the head), the package's order since s36.
- FAST_MASK: a step whose query block lies inside its bounds for all of the consumer's keys computes P
  without the mask (fewer instructions a step: energy, where the card is at its power limit).
- FEW_BARS: four block barriers a step instead of five (two of them the compiler's, after each mbarrier
  arrive): the wait for the previous dQ tile's read moves before the P / dS barrier, and the ring slot is
  released after the dQ tile's barrier.
- PIPE_S: the next step's S = Q K^T is issued behind this step's dV / dK / dQ products (before waiting
  for them), so the tensor cores have it while this step's dQ tile is stored and added; the loader loads
  the last step once more for the last (discarded) early S. sm_90 compile (3.6): no spills; with
  FAST_MASK and FEW_BARS 8 bytes.
- NO_DQ: no dQ reduce-add (a diagnostic: the time without dQ's adds; dQ is then wrong).
"""

from __future__ import annotations

from dualkv.core.backends.triton.bwd_kernel import I_BLOCK
from dualkv.core.backends.triton.gluon_compat import (AVAILABLE, block_barrier, compile_for_sm90 as _compile,
                                                      fence_async_shared, gl, gluon, hidden_zero, mbarrier, on_hopper,
                                                      tma, tma_add, tma_load, warpgroup_mma, warpgroup_mma_wait)
from dualkv.core.backends.triton.gluon_dkdv import (_key_and_step_buffers, _program_item, _store_keys, _walk,
                                                    dkdv_args, dkdv_signature)


if AVAILABLE:
    @gluon.jit
    def _step(i, n_blocks, n_own, own_lo, read_lo, hk, rot, ROT: gl.constexpr, REP: gl.constexpr,
              BLOCK_M: gl.constexpr):
        r = i // n_blocks
        b = i - r * n_blocks
        if ROT == 4:  # block outer, the REP heads inner
            b = i // REP
            r = i - b * REP
        if ROT == 5:  # wavefront: block outer, readers then own rows, both rotated by the item's start time
            bl = i // REP
            r = i - bl * REP
            n_rd5 = n_blocks - n_own
            b = gl.where(bl < n_rd5, n_own + (bl + rot) % gl.maximum(n_rd5, 1),
                         n_own - 1 - (bl + rot) % gl.maximum(n_own, 1))
        if (ROT == 3) or (ROT == 4):  # readers first, then the key block's own rows
            n_rd = n_blocks - n_own
            b = gl.where(b < n_rd, b + n_own, b - n_rd)
        in_own = b < n_own
        rb = b - n_own
        if ROT == 2:
            n_read = gl.maximum(n_blocks - n_own, 1)
            rb = (gl.maximum(rb, 0) + (rot * 16) % n_read) % n_read
        if ROT == 1:
            r = (r + rot) % REP
        row = gl.where(in_own, own_lo + b * BLOCK_M, read_lo + rb * BLOCK_M)
        return row, hk * REP + r, in_own

    @gluon.jit
    def _issue(j, n_blocks, n_own, own_lo, read_lo, hk, rot, ROT: gl.constexpr, q_desc, do_desc, lse_desc,
               delta_desc, bar, q_buf, do_buf, lse_buf, delta_buf, REP: gl.constexpr, DIM: gl.constexpr,
               BLOCK_M: gl.constexpr):
        row, hq, _ = _step(j, n_blocks, n_own, own_lo, read_lo, hk, rot, ROT, REP, BLOCK_M)
        nbytes: gl.constexpr = (q_desc.block_type.nbytes + do_desc.block_type.nbytes
                                + lse_desc.block_type.nbytes + delta_desc.block_type.nbytes)
        mbarrier.expect(bar, nbytes)
        tma_load(q_desc, [row, hq * DIM], bar, q_buf)
        tma_load(do_desc, [row, hq * DIM], bar, do_buf)
        tma_load(lse_desc, [hq, row], bar, lse_buf)
        tma_load(delta_desc, [hq, row], bar, delta_buf)


    @gluon.jit
    def _key_block_loader(descs, bufs, bars, geo, outs, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                          DIM: gl.constexpr, REP: gl.constexpr, STAGES: gl.constexpr, V: gl.constexpr):
        """The loader warp of a warp-specialised dK/dV kernel (this one's and ``gluon_split256``'s): the key
        block's K and V once, then every step's Q, dO, LSE and delta into the ring. descs, bufs and bars
        begin (Q, K, V, dO, LSE, delta), (K, V, Q ring, dO ring, LSE ring, delta ring), (K / V barrier,
        ready, empty) in both kernels."""
        q_desc, k_desc, v_desc, do_desc = descs[0], descs[1], descs[2], descs[3]
        lse_desc, delta_desc = descs[4], descs[5]
        k_all, v_all, q_ring, do_ring, lse_ring, delta_ring = bufs[0], bufs[1], bufs[2], bufs[3], bufs[4], bufs[5]
        kv_bar, ready, empty = bars[0], bars[1], bars[2]
        krow, seg_end, own_lo, read_lo, n_own, n_blocks, r0, r1, hk, total, rot = geo
        mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma_load(k_desc, [krow, hk * DIM], kv_bar, k_all.index(0))
        tma_load(v_desc, [krow, hk * DIM], kv_bar, v_all.index(0))
        for j in range(total + V[5]):  # PIPE_S: the last step again, for the consumers' (discarded) early S
            slot = j % STAGES
            mbarrier.wait(empty.index(slot), ((j // STAGES) & 1) ^ 1)  # mbarriers start with phase 1 complete
            _issue(gl.minimum(j, total - 1), n_blocks, n_own, own_lo, read_lo, hk, rot, V[1], q_desc, do_desc, lse_desc, delta_desc,
                   ready.index(slot), q_ring.index(slot), do_ring.index(slot), lse_ring.index(slot),
                   delta_ring.index(slot), REP, DIM, BLOCK_M)

    @gluon.jit
    def _consume(descs, bufs, bars, geo, outs, C: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 DIM: gl.constexpr, REP: gl.constexpr, STAGES: gl.constexpr, V: gl.constexpr):
        """Consumer C: keys krow + 64 C .. + 63 of the block."""
        q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, dq_desc = descs
        k_all, v_all, q_ring, do_ring, lse_ring, delta_ring, p_all, ds_all, dq_all = bufs
        kv_bar, ready, empty, ds_full = bars
        krow, seg_end, own_lo, read_lo, n_own, n_blocks, r0, r1, hk, total, rot = geo
        DK, DV, WSK, WSV, ws_row, nz, nheads_k, qk_scale, sm_scale = outs
        dtype: gl.constexpr = q_desc.dtype
        HALF: gl.constexpr = BLOCK_N // 2
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HALF, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, DIM, 16])
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, DIM // 2, 16])
        key_lo = krow + C * HALF
        key_rows = key_lo + gl.arange(0, HALF, layout=gl.SliceLayout(0, s_layout))
        offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        lower = gl.where(key_rows < seg_end, 0, 2147483647)  # keys past the segment: nobody's
        s_zero = gl.zeros([BLOCK_M, HALF], gl.float32, s_layout)
        dq_zero = gl.zeros([BLOCK_M, DIM // 2], gl.float32, dq_layout)
        dk = gl.zeros([HALF, DIM], gl.float32, acc_layout)
        dv = gl.zeros([HALF, DIM], gl.float32, acc_layout)
        mbarrier.wait(kv_bar, 0)
        if V[5]:  # PIPE_S: step 0's S before the loop; each step issues the next one's
            mbarrier.wait(ready.index(0), 0)
            sc = warpgroup_mma(q_ring.index(0), k_all.index(0).slice(C * HALF, HALF, dim=0).permute((1, 0)), s_zero,
                               use_acc=False, is_async=True)
        else:
            sc = s_zero
        for i in range(total):
            slot = i % STAGES
            if not V[5]:
                mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            q_s = q_ring.index(slot)
            do_s = do_ring.index(slot)
            zero = hidden_zero(i)
            k_c = k_all.index(zero).slice(C * HALF, HALF, dim=0)
            v_c = v_all.index(zero).slice(C * HALF, HALF, dim=0)
            if not V[5]:
                sc = warpgroup_mma(q_s, k_c.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            dp = warpgroup_mma(do_s, v_c.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            lse2 = lse_ring.index(slot).permute((1, 0)).load(s_layout)
            row, hq, in_own = _step(i, n_blocks, n_own, own_lo, read_lo, hk, rot, V[1], REP, BLOCK_M)
            rows = gl.expand_dims(row + offs_m, 1)
            low = gl.expand_dims(gl.maximum(lower, gl.where(in_own, key_rows, r0)), 0)
            upper = gl.where(in_own, seg_end, r1)
            sc = warpgroup_mma_wait(num_outstanding=1, deps=[sc])
            if V[3]:  # FAST_MASK: a block inside its bounds skips the mask
                first = gl.where(in_own, key_lo + HALF - 1, r0)
                inside = (row >= first) & (row + BLOCK_M <= upper) & (key_lo + HALF <= seg_end)
                p = gl.exp2(sc * qk_scale - lse2)
                if not inside:
                    p = gl.where((rows >= low) & (rows < upper), p, 0.0)
            else:
                p = gl.where((rows >= low) & (rows < upper), gl.exp2(sc * qk_scale - lse2), 0.0)
            p_buf = p_all.index(C + zero)
            p_buf.store(p.to(dtype))
            dp = warpgroup_mma_wait(num_outstanding=0, deps=[dp])
            delta = delta_ring.index(slot).permute((1, 0)).load(s_layout)
            par = i % 2
            ds_buf = ds_all.index(2 * par + C)
            ds_buf.store((p * (dp - delta)).to(dtype))
            fence_async_shared()
            if V[4]:  # FEW_BARS: the previous step's dQ tile has been read (the barrier below tells every thread)
                tma.store_wait(0)
            block_barrier()  # this warpgroup's P and dS are in place
            mbarrier.arrive(ds_full.index(par), count=1)
            dv = warpgroup_mma(p_buf.permute((1, 0)), do_s, dv, is_async=True)
            dk = warpgroup_mma(ds_buf.permute((1, 0)), q_s, dk, is_async=True)
            mbarrier.wait(ds_full.index(par), (i // 2) & 1)  # the other consumer's dS too
            kk = k_all.index(zero)
            dq = warpgroup_mma(ds_all.index(2 * par), kk.slice(0, HALF, dim=0).slice(C * (DIM // 2), DIM // 2, dim=1),
                               dq_zero, use_acc=False, is_async=True)
            dq = warpgroup_mma(ds_all.index(2 * par + 1),
                               kk.slice(HALF, HALF, dim=0).slice(C * (DIM // 2), DIM // 2, dim=1), dq, is_async=True)
            if V[5]:  # the next step's S goes on the tensor cores behind this step's products
                nslot = (i + 1) % STAGES
                mbarrier.wait(ready.index(nslot), ((i + 1) // STAGES) & 1)
                sc = warpgroup_mma(q_ring.index(nslot), kk.slice(C * HALF, HALF, dim=0).permute((1, 0)), s_zero,
                                   use_acc=False, is_async=True)
                dv, dk, dq = warpgroup_mma_wait(num_outstanding=1, deps=[dv, dk, dq])
            else:
                dv, dk, dq = warpgroup_mma_wait(num_outstanding=0, deps=[dv, dk, dq])
            if V[4]:  # FEW_BARS: one barrier for dQ's tile and the slot (every warp's products are done)
                dq_buf = dq_all.index(C + zero)
                dq_buf.store(dq)
                fence_async_shared()
                block_barrier()
                mbarrier.arrive(empty.index(slot), count=1)
                if not V[2]:
                    tma_add(dq_desc, [row, hq * DIM + C * (DIM // 2)], dq_buf)
            else:
                if V[0]:
                    block_barrier()
                    mbarrier.arrive(empty.index(slot), count=1)
                tma.store_wait(0)  # the previous step's dQ tile has been read
                block_barrier()  # ... as every thread now knows; and the slot's LSE / delta are read
                if not V[0]:
                    mbarrier.arrive(empty.index(slot), count=1)
                dq_buf = dq_all.index(C + zero)
                dq_buf.store(dq)
                fence_async_shared()
                block_barrier()
                if not V[2]:
                    tma_add(dq_desc, [row, hq * DIM + C * (DIM // 2)], dq_buf)
        if V[5]:
            sc = warpgroup_mma_wait(num_outstanding=0, deps=[sc])  # the repeated last step's S: discarded
        tma.store_wait(0)

        _store_keys(dk * sm_scale, key_lo, DK, WSK, ws_row + C * HALF, nz, seg_end, hk, nheads_k, DIM, HALF, acc_layout)
        _store_keys(dv, key_lo, DV, WSV, ws_row + C * HALF, nz, seg_end, hk, nheads_k, DIM, HALF, acc_layout)

    @gluon.jit
    def _consumer0(descs, bufs, bars, geo, outs, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DIM: gl.constexpr,
                   REP: gl.constexpr, STAGES: gl.constexpr, V: gl.constexpr):
        _consume(descs, bufs, bars, geo, outs, 0, BLOCK_M, BLOCK_N, DIM, REP, STAGES, V)

    @gluon.jit
    def _consumer1(descs, bufs, bars, geo, outs, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DIM: gl.constexpr,
                   REP: gl.constexpr, STAGES: gl.constexpr, V: gl.constexpr):
        _consume(descs, bufs, bars, geo, outs, 1, BLOCK_M, BLOCK_N, DIM, REP, STAGES, V)

    @gluon.jit
    def dkdv_dq_ws_kernel(
        q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, dq_desc, DK, DV, WSK, WSV, ITEMS, CU,
        n_items, nheads_k, qk_scale, sm_scale,
        REP: gl.constexpr, DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, EARLY: gl.constexpr, ROT: gl.constexpr,
        NO_DQ: gl.constexpr, FAST_MASK: gl.constexpr, FEW_BARS: gl.constexpr, PIPE_S: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        V: gl.constexpr = (EARLY, ROT, NO_DQ, FAST_MASK, FEW_BARS, PIPE_S)
        dtype: gl.constexpr = q_desc.dtype
        HALF: gl.constexpr = BLOCK_N // 2
        item, hk, unit = _program_item(ITEMS, nheads_k)
        if ROT == 6:  # kv head major: every item of head 0, then head 1, ...
            pid = gl.program_id(0)
            item = pid % n_items
            hk = pid // n_items
            unit = gl.load(ITEMS + item)
        if unit >= 0:
            krow, seg_end, own_lo, n_own, read_lo, n_blocks, r0, r1, ws_row, nz = _walk(
                ITEMS, CU, n_items, item, unit, BLOCK_M, BLOCK_N)
            total = REP * n_blocks
            if ROT == 5:
                rot = gl.load(ITEMS + 9 * n_items + item)  # the wavefront row ws_var.run appends
            else:
                rot = gl.load(ITEMS + I_BLOCK * n_items + item)

            k_all, v_all, q_ring, do_ring, lse_ring, delta_ring = _key_and_step_buffers(
                k_desc, v_desc, q_desc, do_desc, lse_desc, delta_desc, STAGES, BLOCK_M, BLOCK_N, DIM)
            pl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HALF], dtype)
            p_all = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HALF], pl)
            ds_all = gl.allocate_shared_memory(dtype, [4, BLOCK_M, HALF], pl)  # [2 * parity + consumer]
            dq_all = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, DIM // 2], dq_desc.layout)
            kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            ds_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            mbarrier.init(kv_bar, count=1)
            for s in gl.static_range(STAGES):
                mbarrier.init(ready.index(s), count=1)
                mbarrier.init(empty.index(s), count=2)  # released by both consumers
            for s in gl.static_range(2):
                mbarrier.init(ds_full.index(s), count=2)
            descs = (q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, dq_desc)
            bufs = (k_all, v_all, q_ring, do_ring, lse_ring, delta_ring, p_all, ds_all, dq_all)
            bars = (kv_bar, ready, empty, ds_full)
            geo = (krow, seg_end, own_lo, read_lo, n_own, n_blocks, r0, r1, hk, total, rot)
            outs = (DK, DV, WSK, WSV, ws_row, nz, nheads_k, qk_scale, sm_scale)
            gl.warp_specialize([
                (_consumer0, (descs, bufs, bars, geo, outs, BLOCK_M, BLOCK_N, DIM, REP, STAGES, V)),
                (_consumer1, (descs, bufs, bars, geo, outs, BLOCK_M, BLOCK_N, DIM, REP, STAGES, V)),
                (_key_block_loader, (descs, bufs, bars, geo, outs, BLOCK_M, BLOCK_N, DIM, REP, STAGES, V)),
            ], [4, 1], [CONSUMER_REGS, 24])


# The kernel's layouts assume these tiles: 64 query rows a step, 128 keys a program (64 a consumer).
BLOCK_M, BLOCK_N = 64, 128


def supported(o, q) -> bool:
    """Whether the kernel applies to a call (``o``: the launcher's options; the packed layout without a
    window on descriptors is the launcher's to check): sm_90, fp16 / bf16, d = 128, no softcap."""
    return on_hopper(q) and o.tma and o.dim == o.head_dim == 128 and not o.has_softcap and o.elem == 2


_WAVE = {}


def _with_wavefront(table, cu_seqlens, nheads_k, n_sm=132):
    """table plus a 10th row: each item's start time in row blocks, from a list-scheduling simulation of
    the launch (programs in pid order, one per SM, each taking its walk's row blocks)."""
    import heapq

    import numpy as np
    import torch

    key = (tuple(table.shape), nheads_k)
    if key not in _WAVE:
        t = table.cpu().numpy().astype(np.int64)
        cu = cu_seqlens.cpu().numpy().astype(np.int64)
        unit, blk, z, region, r0, r1 = t[0], t[1], t[2], t[4], t[5], t[6]
        ok = unit >= 0
        u = np.where(ok, unit, 0)
        seg_start, seg_end = cu[u], cu[u + 1]
        krow = seg_start + blk * BLOCK_N
        own_lo = krow - krow % 4
        n_own = np.where(z == 0, -(-(seg_end - own_lo) // BLOCK_M), 0)
        read_lo = r0 - r0 % 4
        n_read = np.where((region >= 0) & (r1 > r0), -(-(r1 - read_lo) // BLOCK_M), 0)
        work = np.where(ok, n_own + n_read, 0)
        free = [0] * n_sm
        start = np.zeros(t.shape[1], dtype=np.int64)
        for j in range(t.shape[1]):
            for h in range(nheads_k):
                s0 = heapq.heappop(free)
                if h == 0:
                    start[j] = s0
                heapq.heappush(free, s0 + int(work[j]) + 1)
        _WAVE[key] = torch.cat([table, torch.as_tensor(start, dtype=table.dtype, device=table.device)[None]])
    return _WAVE[key]


def run(q, k, v, dout, lse2, delta, dk, dv, wsk, wsv, table, cu_seqlens, nheads_k, rep, qk_scale, sm_scale,
        dq_acc, block_m: int = BLOCK_M, block_n: int = BLOCK_N, stages: int = 2, consumer_regs: int = 240,
        maxnreg: int = 168, early: bool = False, rot: int = 0, no_dq: bool = False, fast_mask: bool = False,
        few_bars: bool = False, pipe_s: bool = False, **_):
    """``gluon_dkdv.run``'s arguments; dq_acc (an fp32 tensor like q, zeroed) is required: unscaled dQ is
    added into it. The item table must be built for ``BLOCK_N``-key blocks."""
    if (block_m, block_n) != (BLOCK_M, BLOCK_N) or q.shape[2] != 128 or dq_acc is None:
        raise ValueError(f"gluon_dkdv_ws: expected d = 128, {BLOCK_M} x {BLOCK_N} tiles and a dQ accumulator, got "
                         f"d = {q.shape[2]}, {block_m} x {block_n}, dq_acc={'given' if dq_acc is not None else None}")
    if rot == 5:
        table = _with_wavefront(table, cu_seqlens, nheads_k)
    args = dkdv_args(q, k, v, dout, lse2, delta, dk, dv, wsk, wsv, table, cu_seqlens, nheads_k, qk_scale, sm_scale,
                     dq_acc, block_m, block_n, dq_cols=q.shape[2] // 2)
    return dkdv_dq_ws_kernel[(table.shape[1] * nheads_k,)](
        *args, REP=rep, DIM=q.shape[2], BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages,
        CONSUMER_REGS=consumer_regs, EARLY=early, ROT=rot, NO_DQ=no_dq, FAST_MASK=fast_mask, FEW_BARS=few_bars, PIPE_S=pipe_s,
        num_warps=4, maxnreg=maxnreg)


def compile_for_sm90(dim: int = 128, stages: int = 2, rep: int = 4, dtype: str = "bf16", consumer_regs: int = 240,
                     maxnreg: int = 168, early: bool = False, rot: int = 0, no_dq: bool = False, fast_mask: bool = False,
                     few_bars: bool = False, pipe_s: bool = False):
    """Compile the kernel for sm_90 without a GPU (the CPU tests' check that it lowers)."""
    const = dict(REP=rep, DIM=dim, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, STAGES=stages, CONSUMER_REGS=consumer_regs,
                 EARLY=early, ROT=rot, NO_DQ=no_dq, FAST_MASK=fast_mask, FEW_BARS=few_bars, PIPE_S=pipe_s, num_warps=4)
    return _compile(dkdv_dq_ws_kernel, dkdv_signature(dim, BLOCK_M, BLOCK_N, dtype, dq_cols=dim // 2), const, 4,
                    maxnreg)


__all__ = ["AVAILABLE", "BLOCK_M", "BLOCK_N", "compile_for_sm90", "run", "supported"]
