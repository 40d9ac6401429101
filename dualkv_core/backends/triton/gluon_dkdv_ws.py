"""dK/dV with dQ fused for Hopper at d = 128, warp-specialised, in Gluon: the Triton backend's default
backward there (``DUALKV_TRITON_GLUON_BWD=0`` runs the ``tl`` kernels instead).

A program holds one block of 128 keys. A loader warp brings the block's K / V once and each step's
Q / dO / LSE / delta into a ring of STAGES buffers (ready / empty mbarriers). Two consumer warpgroups
each own 64 of the keys: S = Q K_c^T and dP = dO V_c^T (scores laid out (queries, keys)), P and dS to
shared memory, dV_c += P^T dO and dK_c += dS^T Q; once both consumers' dS are stored (an mbarrier per
step parity, dS double-buffered) each computes dQ[:, 64 c : 64 c + 64] = dS K[:, 64 c : 64 c + 64] and
adds it to an fp32 accumulator by TMA reduce-add from a tile of its own. The consumers meet only
through mbarriers, never at a block barrier. Five products a step instead of the seven of a dK/dV
kernel and a dQ kernel. The walk over the item table, the masks and the dK / dV outputs are
``gluon_dkdv``'s (the same gradients; dQ's last bits vary run to run with the order of the adds, so
``deterministic=True`` never takes it). Most steps' rows see all of a consumer's 64 keys
(``gluon_dkdv._sees_all_keys``): their P skips the mask. Four block barriers a step: the previous dQ
tile's store is awaited before the first, and the ring slot is released after the dQ tile's. sm_90
compile (Triton 3.6): 240 registers a consumer thread, 16 bytes spilled (one reload a step).

On an H200 (``benchmarks/results/raw/triton_bwd_probes_h200_s33.log``) the whole backward took
0.77-0.85x the ``tl`` default's time at (16, 32K, 2K) and (8, 16K, 512), 1.02x at (28, 4K, 2K). Where
this kernel runs, the launcher orders and splits the items for dQ's adds
(``schedule.balanced_split_rows``, ``key_items(by_segment=True)``): against 4096-row splits heaviest
first, the backward then took 0.71-0.88x the time at the four shapes with the most readers per prompt
token, 0.95-0.98x at (28, 16K, 2K) / (16, 32K, 2K) (``raw/triton_balanced_splits_h200_s34.log``).
The unmasked path and the fifth barrier's removal together: 1.09x at (8, 16K, 512), 1.17x at
(28, 4K, 2K) on an H100 (``raw/triton_bwd_ab_h100_s36.log``, interleaved rounds). On that card, with
an item's kv heads side by side, dQ's reduce-adds were bimodal at the long prompts: the same kernel took
362-365 ms or 587-597 ms at (16, 64K, 2K), 335 ms without dQ (``raw/triton_bwd_dq_diag_h100_s36.log``).

Where the longest prompt has at least ``HEAD_MAJOR_MIN_PROMPT`` keys, programs run kv head major
(``gluon_dkdv._program_item``; the flag is made on the device from the layout, ``schedule.head_major_flag``;
``DUALKV_TRITON_BWD_HEAD_MAJOR=0`` / ``1`` fixes the order): at a time the programs in flight serve one kv
head's query heads, so dQ's adds and the Q / dO reads stay in L2. In interleaved rounds on the H100 that
took (16, 64K, 2K) to 323 ms every round and (28, 16K, 2K) to 86 ms (1.30-1.87x the item-major order's
medians, which sat in the slow mode), 1.00-1.02x at the other long-prompt shapes and 0.95x at (28, 4K,
2K) (``raw/triton_bwd_order_h100_s36.log``, ``raw/triton_bwd_head_major_h100_s36.log``; each program's
walk unchanged; outputs within 1.3e-4-3.4e-4 of the item-major kernel's, relative to their largest
value: dQ's add-order noise). On an H200 (no slow mode there): 1.02-1.04x at P >= 16K, level at 8K,
0.90-0.94x at (28, 4K, 2K) (``raw/triton_bwd_order_h200_s37.log``): shorter prompts keep an item's kv
heads side by side.
"""

from __future__ import annotations

from .gluon_compat import (AVAILABLE, block_barrier, compile_for_sm90 as _compile, fence_async_shared, gl, gluon,
                           hidden_zero, mbarrier, on_hopper, tma, tma_add, tma_load, warpgroup_mma, warpgroup_mma_wait)
from .gluon_dkdv import (_issue, _key_and_step_buffers, _mask_probs, _program_item, _sees_all_keys, _step,
                         _store_keys, _walk, dkdv_args, dkdv_signature)


if AVAILABLE:
    @gluon.jit
    def _key_block_loader(descs, bufs, bars, geo, outs, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                          DIM: gl.constexpr, REP: gl.constexpr, STAGES: gl.constexpr):
        """The loader warp of a warp-specialised dK/dV kernel (this one's and ``gluon_split256``'s): the key
        block's K and V once, then every step's Q, dO, LSE and delta into the ring. descs, bufs and bars
        begin (Q, K, V, dO, LSE, delta), (K, V, Q ring, dO ring, LSE ring, delta ring), (K / V barrier,
        ready, empty) in both kernels."""
        q_desc, k_desc, v_desc, do_desc = descs[0], descs[1], descs[2], descs[3]
        lse_desc, delta_desc = descs[4], descs[5]
        k_all, v_all, q_ring, do_ring, lse_ring, delta_ring = bufs[0], bufs[1], bufs[2], bufs[3], bufs[4], bufs[5]
        kv_bar, ready, empty = bars[0], bars[1], bars[2]
        krow, seg_end, own_lo, read_lo, n_own, n_blocks, r0, r1, hk, total = geo
        mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma_load(k_desc, [krow, hk * DIM], kv_bar, k_all.index(0))
        tma_load(v_desc, [krow, hk * DIM], kv_bar, v_all.index(0))
        for j in range(total):
            slot = j % STAGES
            mbarrier.wait(empty.index(slot), ((j // STAGES) & 1) ^ 1)  # mbarriers start with phase 1 complete
            _issue(j, n_blocks, n_own, own_lo, read_lo, hk, q_desc, do_desc, lse_desc, delta_desc,
                   ready.index(slot), q_ring.index(slot), do_ring.index(slot), lse_ring.index(slot),
                   delta_ring.index(slot), REP, DIM, BLOCK_M)

    @gluon.jit
    def _loader_barriers(STAGES: gl.constexpr):
        """The barriers ``_key_block_loader`` works with, initialised: (K / V barrier, ready ring, empty ring);
        each empty slot is released by both consumer warpgroups."""
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=2)
        return kv_bar, ready, empty

    @gluon.jit
    def _consume(descs, bufs, bars, geo, outs, C: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 DIM: gl.constexpr, REP: gl.constexpr, STAGES: gl.constexpr):
        """Consumer C: keys krow + 64 C .. + 63 of the block."""
        q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, dq_desc = descs
        k_all, v_all, q_ring, do_ring, lse_ring, delta_ring, p_all, ds_all, dq_all = bufs
        kv_bar, ready, empty, ds_full = bars
        krow, seg_end, own_lo, read_lo, n_own, n_blocks, r0, r1, hk, total = geo
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
        keys_inside = key_lo + HALF <= seg_end
        s_zero = gl.zeros([BLOCK_M, HALF], gl.float32, s_layout)
        dq_zero = gl.zeros([BLOCK_M, DIM // 2], gl.float32, dq_layout)
        dk = gl.zeros([HALF, DIM], gl.float32, acc_layout)
        dv = gl.zeros([HALF, DIM], gl.float32, acc_layout)
        mbarrier.wait(kv_bar, 0)
        for i in range(total):
            slot = i % STAGES
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            q_s = q_ring.index(slot)
            do_s = do_ring.index(slot)
            zero = hidden_zero(i)
            k_c = k_all.index(zero).slice(C * HALF, HALF, dim=0)
            v_c = v_all.index(zero).slice(C * HALF, HALF, dim=0)
            sc = warpgroup_mma(q_s, k_c.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            dp = warpgroup_mma(do_s, v_c.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            lse2 = lse_ring.index(slot).permute((1, 0)).load(s_layout)
            row, hq, in_own = _step(i, n_blocks, n_own, own_lo, read_lo, hk, REP, BLOCK_M)
            sc = warpgroup_mma_wait(num_outstanding=1, deps=[sc])
            p = gl.exp2(sc * qk_scale - lse2)
            if not _sees_all_keys(row, in_own, key_lo, keys_inside, seg_end, r0, r1, HALF, BLOCK_M):  # most see all
                p = _mask_probs(p, row, in_own, key_rows, seg_end, r0, r1, 1)
            p_buf = p_all.index(C + zero)
            p_buf.store(p.to(dtype))
            dp = warpgroup_mma_wait(num_outstanding=0, deps=[dp])
            delta = delta_ring.index(slot).permute((1, 0)).load(s_layout)
            par = i % 2
            ds_buf = ds_all.index(2 * par + C)
            ds_buf.store((p * (dp - delta)).to(dtype))
            fence_async_shared()
            tma.store_wait(0)  # the previous step's dQ tile has been read (the barrier tells every thread)
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
            dv, dk, dq = warpgroup_mma_wait(num_outstanding=0, deps=[dv, dk, dq])
            dq_buf = dq_all.index(C + zero)
            dq_buf.store(dq)
            fence_async_shared()
            block_barrier()  # dQ's tile in place, and every warp's products (which read the ring slot) done
            mbarrier.arrive(empty.index(slot), count=1)
            tma_add(dq_desc, [row, hq * DIM + C * (DIM // 2)], dq_buf)
        tma.store_wait(0)

        _store_keys(dk * sm_scale, key_lo, DK, WSK, ws_row + C * HALF, nz, seg_end, hk, nheads_k, DIM, HALF, acc_layout)
        _store_keys(dv, key_lo, DV, WSV, ws_row + C * HALF, nz, seg_end, hk, nheads_k, DIM, HALF, acc_layout)

    @gluon.jit
    def _consumer0(descs, bufs, bars, geo, outs, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DIM: gl.constexpr,
                   REP: gl.constexpr, STAGES: gl.constexpr):
        _consume(descs, bufs, bars, geo, outs, 0, BLOCK_M, BLOCK_N, DIM, REP, STAGES)

    @gluon.jit
    def _consumer1(descs, bufs, bars, geo, outs, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DIM: gl.constexpr,
                   REP: gl.constexpr, STAGES: gl.constexpr):
        _consume(descs, bufs, bars, geo, outs, 1, BLOCK_M, BLOCK_N, DIM, REP, STAGES)

    @gluon.jit
    def dkdv_dq_ws_kernel(
        q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, dq_desc, DK, DV, WSK, WSV, ITEMS, CU,
        ORDER, n_items, nheads_k, qk_scale, sm_scale,
        REP: gl.constexpr, DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr,
    ):
        dtype: gl.constexpr = q_desc.dtype
        HALF: gl.constexpr = BLOCK_N // 2
        item, hk, unit = _program_item(ITEMS, n_items, nheads_k, gl.load(ORDER) != 0)
        if unit >= 0:
            krow, seg_end, own_lo, n_own, read_lo, n_blocks, r0, r1, ws_row, nz = _walk(
                ITEMS, CU, n_items, item, unit, BLOCK_M, BLOCK_N)
            total = REP * n_blocks

            k_all, v_all, q_ring, do_ring, lse_ring, delta_ring = _key_and_step_buffers(
                k_desc, v_desc, q_desc, do_desc, lse_desc, delta_desc, STAGES, BLOCK_M, BLOCK_N, DIM)
            pl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HALF], dtype)
            p_all = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HALF], pl)
            ds_all = gl.allocate_shared_memory(dtype, [4, BLOCK_M, HALF], pl)  # [2 * parity + consumer]
            dq_all = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, DIM // 2], dq_desc.layout)
            kv_bar, ready, empty = _loader_barriers(STAGES)
            ds_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            for s in gl.static_range(2):
                mbarrier.init(ds_full.index(s), count=2)
            descs = (q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, dq_desc)
            bufs = (k_all, v_all, q_ring, do_ring, lse_ring, delta_ring, p_all, ds_all, dq_all)
            bars = (kv_bar, ready, empty, ds_full)
            geo = (krow, seg_end, own_lo, read_lo, n_own, n_blocks, r0, r1, hk, total)
            outs = (DK, DV, WSK, WSV, ws_row, nz, nheads_k, qk_scale, sm_scale)
            gl.warp_specialize([
                (_consumer0, (descs, bufs, bars, geo, outs, BLOCK_M, BLOCK_N, DIM, REP, STAGES)),
                (_consumer1, (descs, bufs, bars, geo, outs, BLOCK_M, BLOCK_N, DIM, REP, STAGES)),
                (_key_block_loader, (descs, bufs, bars, geo, outs, BLOCK_M, BLOCK_N, DIM, REP, STAGES)),
            ], [4, 1], [CONSUMER_REGS, 24])


# The kernel's layouts assume these tiles: 64 query rows a step, 128 keys a program (64 a consumer).
BLOCK_M, BLOCK_N = 64, 128
# The program order the launcher takes unless DUALKV_TRITON_BWD_HEAD_MAJOR says otherwise: kv head major where the
# longest prompt of the layout has at least this many keys, else an item's kv heads side by side
# (schedule.head_major_flag, on the device). On an H200 head major took 0.96-0.98x the backward's time at
# P >= 16K, level at 8K, 1.07-1.11x at (28, 4K, 2K) (raw/triton_bwd_order_h200_s37.log).
HEAD_MAJOR_MIN_PROMPT = 8192


def supported(o, q) -> bool:
    """Whether the kernel applies to a call (``o``: the launcher's options; the packed layout without a
    window on descriptors is the launcher's to check): sm_90, fp16 / bf16, d = 128, no softcap."""
    return on_hopper(q) and o.tma and o.dim == o.head_dim == 128 and not o.has_softcap and o.elem == 2


def run(q, k, v, dout, lse2, delta, dk, dv, wsk, wsv, table, cu_seqlens, nheads_k, rep, qk_scale, sm_scale,
        dq_acc, block_m: int = BLOCK_M, block_n: int = BLOCK_N, stages: int = 2, consumer_regs: int = 240,
        maxnreg: int = 168, head_major=True):
    """``gluon_dkdv.run``'s arguments; dq_acc (an fp32 tensor like q, zeroed) is required: unscaled dQ is
    added into it. The item table must be built for ``BLOCK_N``-key blocks. head_major: the programs kv
    head major (``gluon_dkdv._program_item``), a bool or the device flag ``schedule.head_major_flag``
    makes; False: an item's kv heads side by side."""
    if (block_m, block_n) != (BLOCK_M, BLOCK_N) or q.shape[2] != 128 or dq_acc is None:
        raise ValueError(f"gluon_dkdv_ws: expected d = 128, {BLOCK_M} x {BLOCK_N} tiles and a dQ accumulator, got "
                         f"d = {q.shape[2]}, {block_m} x {block_n}, dq_acc={'given' if dq_acc is not None else None}")
    args = dkdv_args(q, k, v, dout, lse2, delta, dk, dv, wsk, wsv, table, cu_seqlens, nheads_k, qk_scale, sm_scale,
                     dq_acc, block_m, block_n, dq_cols=q.shape[2] // 2, head_major=head_major)
    return dkdv_dq_ws_kernel[(table.shape[1] * nheads_k,)](
        *args, REP=rep, DIM=q.shape[2], BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages,
        CONSUMER_REGS=consumer_regs, num_warps=4, maxnreg=maxnreg)


def compile_for_sm90(dim: int = 128, stages: int = 2, rep: int = 4, dtype: str = "bf16", consumer_regs: int = 240,
                     maxnreg: int = 168):
    """Compile the kernel for sm_90 without a GPU (the CPU tests' check that it lowers)."""
    const = dict(REP=rep, DIM=dim, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, STAGES=stages, CONSUMER_REGS=consumer_regs,
                 num_warps=4)
    return _compile(dkdv_dq_ws_kernel, dkdv_signature(dim, BLOCK_M, BLOCK_N, dtype, dq_cols=dim // 2), const, 4,
                    maxnreg)


__all__ = ["AVAILABLE", "BLOCK_M", "BLOCK_N", "HEAD_MAJOR_MIN_PROMPT", "compile_for_sm90", "run", "supported"]
