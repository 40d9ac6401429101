"""dK/dV of the packed layout in Gluon (Triton's tile-level language) for Hopper: the one-loop row
walk of ``bwd_kernel.dkdv_rows_kernel`` with its matrix products issued asynchronously, and
optionally dQ added inside the same loop.

The idea: ``tl.dot`` waits for every product before the next statement. Here each step issues
S^T = K Q^T and dP^T = V dO^T together, computes P^T while dP^T runs, issues dV += P^T dO, computes
dS^T while dV runs, then issues dK += dS^T Q. Q / dO / LSE / delta of later steps arrive by TMA into
a ring of ``STAGES`` buffers (one mbarrier each). Measured on an H200 it gives the row kernel's
gradients bit for bit at the same speed (d = 128; slower at d = 64:
``benchmarks/results/raw/gluon_dkdv_h200_s30.log``), so waiting is not what holds the row kernel
back (by estimate, not profiled: shared-memory operand traffic and registers are). So it is opt-in
(``DUALKV_TRITON_GLUON_DKDV=1``).

FUSE_DQ (with ``DUALKV_TRITON_ATOMIC_DQ=1``): five products per step instead of the seven of the
dK/dV + dQ kernel pair. dS^T goes to shared memory, dQ = dS K is computed in ``DQ_PARTS`` column
slices (the warpgroups split each slice's columns) into a shared fp32 tile, and the copy engine adds
that tile to an fp32 accumulator while the next step runs.
On an H200 the whole backward took 0.96-1.01x the default's time at d = 128
(``benchmarks/results/raw/gluon_fused_dq_h200_s31.log``), so it stays opt-in; dQ is not bit-identical
run to run (``deterministic=True`` never takes it).

Registers: K, V, dS^T and the dQ tile are read in every step from fixed shared-memory buffers, and
left to itself the compiler builds their wgmma descriptors once before the loop and holds them
(about 80 registers at d = 128: the kernel spilled 24-248 bytes). The loop indexes them through
``gluon_compat.hidden_zero`` so the descriptors are rebuilt where they are used: no spills at d = 128
in either dQ form (sm_90 compile, Triton 3.6 and 3.9). Those timings above predate it.

Scope (the launcher checks it): sm_90, fp16 / bf16, head dims 64 / 128 (a box of DIM elements, no
padding), no softcap, the packed layout without a window: the same items, masks and outputs as
``dkdv_rows_kernel``. Gluon names as ``gluon_compat`` gives them (Triton 3.6 and 3.9).
"""

from __future__ import annotations

import torch

from .bwd_kernel import I_BLOCK, I_NSPLIT, I_R0, I_R1, I_REGION, I_SPLIT, I_WS_BASE
from .gluon_compat import (AVAILABLE, block_barrier, compile_for_sm90 as _compile, desc, fence_async_shared, gl,
                           gluon, hidden_zero, mbarrier, on_hopper, tile_sig, tma, TensorDescriptor, tma_add, tma_load,
                           warpgroup_mma, warpgroup_mma_wait)

if AVAILABLE:
    @gluon.jit
    def _step(i, n_blocks, n_own, own_lo, read_lo, hk, REP: gl.constexpr, BLOCK_M: gl.constexpr):
        """Step i of the walk: (first query row, query head, whether the rows are the key block's own)."""
        r = i // n_blocks
        b = i - r * n_blocks
        in_own = b < n_own
        row = gl.where(in_own, own_lo + b * BLOCK_M, read_lo + (b - n_own) * BLOCK_M)
        return row, hk * REP + r, in_own

    @gluon.jit
    def _sees_all_keys(row, in_own, key_lo, keys_inside, seg_end, r0, r1, N_KEYS: gl.constexpr,
                       BLOCK_M: gl.constexpr):
        """Whether every query row of a step (row .. row + BLOCK_M - 1) sees every one of keys key_lo ..
        key_lo + N_KEYS - 1 (``keys_inside``: all of them before seg_end): its P then needs no mask. Own
        rows must lie at or below the last key and inside the segment, readers inside [r0, r1)."""
        first = gl.where(in_own, key_lo + N_KEYS - 1, r0)
        upper = gl.where(in_own, seg_end, r1)
        return keys_inside & (row >= first) & (row + BLOCK_M <= upper)

    @gluon.jit
    def _mask_probs(p, row, in_own, keys, seg_end, r0, r1, KEY_AXIS: gl.constexpr):
        """p with the pairs a step's rows do not see set to 0. p holds (query rows row.., keys) (KEY_AXIS
        1) or the transpose (KEY_AXIS 0); keys: their rows, sliced from p's layout. Own rows see the keys at
        or before them, readers' rows in [r0, r1) all of the keys; keys past seg_end nobody (the next
        tokens' keys, for a prompt's readers)."""
        rows = row + gl.arange(0, p.shape[1 - KEY_AXIS], layout=gl.SliceLayout(KEY_AXIS, p.type.layout))
        lower = gl.where(keys < seg_end, gl.where(in_own, keys, r0), 2147483647)
        upper = gl.where(in_own, seg_end, r1)
        rows = gl.expand_dims(rows, KEY_AXIS)
        lower = gl.expand_dims(lower, 1 - KEY_AXIS)
        return gl.where((rows >= lower) & (rows < upper), p, 0.0)

    @gluon.jit
    def _issue(j, n_blocks, n_own, own_lo, read_lo, hk, q_desc, do_desc, lse_desc, delta_desc,
               bar, q_buf, do_buf, lse_buf, delta_buf, REP: gl.constexpr, DIM: gl.constexpr,
               BLOCK_M: gl.constexpr):
        """Start step j's Q, dO, LSE and delta loads into one ring slot; ``bar`` counts their bytes."""
        row, hq, _ = _step(j, n_blocks, n_own, own_lo, read_lo, hk, REP, BLOCK_M)
        nbytes: gl.constexpr = (q_desc.block_type.nbytes + do_desc.block_type.nbytes
                                + lse_desc.block_type.nbytes + delta_desc.block_type.nbytes)
        mbarrier.expect(bar, nbytes)
        tma_load(q_desc, [row, hq * DIM], bar, q_buf)
        tma_load(do_desc, [row, hq * DIM], bar, do_buf)
        tma_load(lse_desc, [hq, row], bar, lse_buf)
        tma_load(delta_desc, [hq, row], bar, delta_buf)

    @gluon.jit
    def _program_item(ITEMS, n_items, nheads_k, head_major=False):
        """This program's (item, kv head, unit) in a launch over (items x kv heads); unit < 0 marks a
        padding entry of the item table. head_major (a constant, or a flag read from the device): every
        item of kv head 0, then of head 1, ... (else an item's kv heads side by side). Head major, the
        programs in flight share their query heads' Q / dO rows and, where dQ is added in the kernel, its
        rows in L2 (on an H100, eight heads in flight left the d = 128 backward's fp32 dQ adds to DRAM at
        long prompts)."""
        pid = gl.program_id(0)
        if head_major:
            item = pid % n_items
            hk = pid // n_items
        else:
            item = pid // nheads_k
            hk = pid % nheads_k
        return item, hk, gl.load(ITEMS + item)

    @gluon.jit
    def _walk(ITEMS, CU, n_items, item, unit, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """Key item ``item`` (of segment ``unit``) and the query rows that read it, as
        ``dkdv_rows_kernel`` walks them: (first key row, segment end, own rows from own_lo
        (n_own blocks: the segment's queries, causally; split 0 only), reader rows from read_lo (the
        split's range [r0, r1)), blocks in all, r0, r1, the workspace row of a split's partial, nz)."""
        blk = gl.load(ITEMS + I_BLOCK * n_items + item)
        z = gl.load(ITEMS + I_SPLIT * n_items + item)
        nz = gl.load(ITEMS + I_NSPLIT * n_items + item)
        region = gl.load(ITEMS + I_REGION * n_items + item)
        r0 = gl.load(ITEMS + I_R0 * n_items + item)
        r1 = gl.load(ITEMS + I_R1 * n_items + item)
        seg_start = gl.load(CU + unit)
        seg_end = gl.load(CU + unit + 1)
        krow = seg_start + blk * BLOCK_N
        own_lo = krow - krow % 4
        n_own = gl.where(z == 0, gl.cdiv(seg_end - own_lo, BLOCK_M), 0)
        read_lo = r0 - r0 % 4
        n_read = gl.where((region >= 0) & (r1 > r0), gl.cdiv(r1 - read_lo, BLOCK_M), 0)
        ws_row = gl.load(ITEMS + I_WS_BASE * n_items + item) + z * (seg_end - seg_start) + blk * BLOCK_N
        return krow, seg_end, own_lo, n_own, read_lo, n_own + n_read, r0, r1, ws_row, nz

    @gluon.jit
    def _key_and_step_buffers(k_desc, v_desc, q_desc, do_desc, lse_desc, delta_desc, STAGES: gl.constexpr,
                              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DIM: gl.constexpr):
        """The key block's K and V (one-deep rings, for ``hidden_zero``) and the rings of STAGES steps'
        Q, dO, LSE and delta: what every dK/dV kernel of the row walk holds."""
        dtype: gl.constexpr = q_desc.dtype
        k_buf = gl.allocate_shared_memory(dtype, [1, BLOCK_N, DIM], k_desc.layout)
        v_buf = gl.allocate_shared_memory(dtype, [1, BLOCK_N, DIM], v_desc.layout)
        q_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, DIM], q_desc.layout)
        do_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, DIM], do_desc.layout)
        lse_ring = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], lse_desc.layout)
        delta_ring = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], delta_desc.layout)
        return k_buf, v_buf, q_ring, do_ring, lse_ring, delta_ring

    @gluon.jit
    def _store_keys(acc, key_lo, OUT, WS, ws_row, nz, seg_end, hk, nheads_k, DIM: gl.constexpr,
                    ROWS: gl.constexpr, acc_layout: gl.constexpr):
        """dK or dV of key rows key_lo .. key_lo + ROWS - 1, as the row kernel: rows past the segment
        are dropped; a split item (nz > 1) writes its fp32 partial at workspace row ws_row."""
        offs_n = gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_layout))
        offs_d = gl.arange(0, DIM, layout=gl.SliceLayout(0, acc_layout))
        krows = key_lo + offs_n
        row_stride = nheads_k * DIM
        tile = gl.expand_dims(offs_n * row_stride, 1) + hk * DIM + gl.expand_dims(offs_d, 0)
        gl.store(WS + ws_row.to(gl.int64) * row_stride + tile, acc,
                 mask=gl.expand_dims(krows < gl.where(nz > 1, seg_end, 0), 1))
        gl.store(OUT + key_lo.to(gl.int64) * row_stride + tile, acc.to(OUT.dtype.element_ty),
                 mask=gl.expand_dims(krows < gl.where(nz > 1, 0, seg_end), 1))

    @gluon.jit
    def dkdv_rows_gluon_kernel(
        q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, dq_desc, DK, DV, WSK, WSV, ITEMS, CU,
        n_items, nheads_k, qk_scale, sm_scale,
        REP: gl.constexpr, DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr, FUSE_DQ: gl.constexpr, DQ_PARTS: gl.constexpr, num_warps: gl.constexpr,
        HIDE_DESC: gl.constexpr = True,
    ):
        """dK/dV of one (key item, kv head): ``dkdv_rows_kernel``'s walk and masks, products asynchronous.

        q_desc / do_desc: (total_q, nheads * DIM) boxes (BLOCK_M, DIM); k_desc / v_desc: (total_q,
        nheads_k * DIM) boxes (BLOCK_N, DIM); lse_desc / delta_desc: (nheads, t4) fp32 boxes (1, BLOCK_M),
        LSE in log2 units. The key block's rows are split over the warpgroups (warps (num_warps, 1)).
        FUSE_DQ: each step also adds its unscaled dQ = dS K to the fp32 (total_q, nheads * DIM) behind
        dq_desc (boxes (BLOCK_M, DIM)) by TMA reduce-add; dS goes through shared memory, and the
        warpgroups split dQ's columns.
        """
        dtype: gl.constexpr = q_desc.dtype
        # Accumulator layouts: scores (keys, queries) and dK / dV (keys, DIM), rows over the warps.
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, BLOCK_M, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, DIM, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, num_warps // 4],
                                                            instr_shape=[16, DIM // DQ_PARTS // (num_warps // 4), 16])

        item, hk, unit = _program_item(ITEMS, n_items, nheads_k)
        if unit >= 0:
            krow, seg_end, own_lo, n_own, read_lo, n_blocks, r0, r1, ws_row, nz = _walk(
                ITEMS, CU, n_items, item, unit, BLOCK_M, BLOCK_N)
            total = REP * n_blocks

            # K and V are read in every step: one-deep rings, indexed in the loop by hidden_zero
            k_buf, v_buf, q_ring, do_ring, lse_ring, delta_ring = _key_and_step_buffers(
                k_desc, v_desc, q_desc, do_desc, lse_desc, delta_desc, STAGES, BLOCK_M, BLOCK_N, DIM)
            if FUSE_DQ:
                ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
                ds_buf = gl.allocate_shared_memory(dtype, [1, BLOCK_N, BLOCK_M], ds_layout)
                dq_buf = gl.allocate_shared_memory(gl.float32, [1, BLOCK_M, DIM], dq_desc.layout)
            bars = gl.allocate_shared_memory(gl.int64, [STAGES + 1, 1], mbarrier.MBarrierLayout())
            for s in gl.static_range(STAGES + 1):
                mbarrier.init(bars.index(s), count=1)

            kv_bar = bars.index(STAGES)
            mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            tma_load(k_desc, [krow, hk * DIM], kv_bar, k_buf.index(0))
            tma_load(v_desc, [krow, hk * DIM], kv_bar, v_buf.index(0))
            for s in gl.static_range(STAGES - 1):
                if s < total:
                    _issue(s, n_blocks, n_own, own_lo, read_lo, hk, q_desc, do_desc, lse_desc, delta_desc,
                           bars.index(s), q_ring.index(s), do_ring.index(s), lse_ring.index(s),
                           delta_ring.index(s), REP, DIM, BLOCK_M)
            mbarrier.wait(kv_bar, 0)

            key_rows = krow + gl.arange(0, BLOCK_N, layout=row_layout)
            offs_m = gl.arange(0, BLOCK_M, layout=col_layout)
            s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
            dk = gl.zeros([BLOCK_N, DIM], gl.float32, acc_layout)
            dv = gl.zeros([BLOCK_N, DIM], gl.float32, acc_layout)
            cols: gl.constexpr = DIM // DQ_PARTS
            dq_zero = gl.zeros([BLOCK_M, cols], gl.float32, dq_layout)
            for i in range(total):
                # The slot step i - 1 used is free (its products were waited for): load step i + STAGES - 1.
                j = i + STAGES - 1
                if j < total:
                    sj = j % STAGES
                    _issue(j, n_blocks, n_own, own_lo, read_lo, hk, q_desc, do_desc, lse_desc, delta_desc,
                           bars.index(sj), q_ring.index(sj), do_ring.index(sj), lse_ring.index(sj),
                           delta_ring.index(sj), REP, DIM, BLOCK_M)
                slot = i % STAGES
                mbarrier.wait(bars.index(slot), (i // STAGES) & 1)
                q_s = q_ring.index(slot)
                do_s = do_ring.index(slot)
                zero = hidden_zero(i) if HIDE_DESC else 0  # (False: the s31 form, for A/B timing)
                k_smem = k_buf.index(zero)
                v_smem = v_buf.index(zero)
                if FUSE_DQ:
                    ds_smem = ds_buf.index(zero)
                    dq_smem = dq_buf.index(zero)
                st = warpgroup_mma(k_smem, q_s.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                dpt = warpgroup_mma(v_smem, do_s.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                lse2 = lse_ring.index(slot).load(s_layout)  # (1, BLOCK_M)
                row, hq, in_own = _step(i, n_blocks, n_own, own_lo, read_lo, hk, REP, BLOCK_M)
                rows = gl.expand_dims(row + offs_m, 0)
                lower = gl.where(in_own, key_rows, r0)
                if FUSE_DQ:  # keys past the segment are other tokens' (a prompt block's readers would see them)
                    lower = gl.where(key_rows < seg_end, lower, 2147483647)
                lower = gl.expand_dims(lower, 1)
                upper = gl.where(in_own, seg_end, r1)
                st = warpgroup_mma_wait(num_outstanding=1, deps=[st])
                # P^T while dP^T is on the tensor cores
                p = gl.where((rows >= lower) & (rows < upper), gl.exp2(st * qk_scale - lse2), 0.0)
                dv = warpgroup_mma(gl.convert_layout(p.to(dtype), a_layout), do_s, dv, is_async=True)
                dpt = warpgroup_mma_wait(num_outstanding=1, deps=[dpt])
                # dS^T while dV is on the tensor cores
                delta = delta_ring.index(slot).load(s_layout)
                ds = (p * (dpt - delta)).to(dtype)
                dk = warpgroup_mma(gl.convert_layout(ds, a_layout), q_s, dk, is_async=True)
                if FUSE_DQ:
                    ds_smem.store(ds)
                    fence_async_shared()
                    tma.store_wait(0)  # the previous step's dQ tile has been read from dq_smem
                    block_barrier()  # both warpgroups' key rows of dS^T are in place
                    dv = warpgroup_mma_wait(num_outstanding=1, deps=[dv])  # P^T's registers free before dQ's
                    # a column slice at a time (fewer live registers), each stored while the next runs
                    dq = warpgroup_mma(ds_smem.permute((1, 0)), k_smem.slice(0, cols, dim=1), dq_zero,
                                       use_acc=False, is_async=True)
                    for h in gl.static_range(1, DQ_PARTS + 1):
                        dq, dk = warpgroup_mma_wait(num_outstanding=0, deps=[dq, dk])
                        if h < DQ_PARTS:
                            dq_next = warpgroup_mma(ds_smem.permute((1, 0)), k_smem.slice(h * cols, cols, dim=1),
                                                    dq_zero, use_acc=False, is_async=True)
                        dq_smem.slice((h - 1) * cols, cols, dim=1).store(dq)
                        if h < DQ_PARTS:
                            dq = dq_next
                    fence_async_shared()
                else:
                    dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=[dv, dk])
                block_barrier()  # every warpgroup is done with the slot before it is refilled
                if FUSE_DQ:  # and dq_smem is whole: add it to dQ while the next step runs
                    tma_add(dq_desc, [row, hq * DIM], dq_smem)

            for s in gl.static_range(STAGES + 1):
                mbarrier.invalidate(bars.index(s))
            if FUSE_DQ:
                tma.store_wait(0)

            _store_keys(dk * sm_scale, krow, DK, WSK, ws_row, nz, seg_end, hk, nheads_k, DIM, BLOCK_N, acc_layout)
            _store_keys(dv, krow, DV, WSV, ws_row, nz, seg_end, hk, nheads_k, DIM, BLOCK_N, acc_layout)


# dQ's product in column slices, per head dim. Two at d = 128 were measured best when a whole 64 x 128
# tile spilled registers; with hidden_zero neither spills (one slice not timed yet).
DQ_PARTS = {64: 1, 128: 2}


def supported(o, q) -> bool:
    """Whether the Gluon dK/dV applies to a call (``o``: the launcher's options)."""
    return on_hopper(q) and o.tma and o.dim == o.head_dim and o.dim in (64, 128) and not o.has_softcap and o.elem == 2


def stat_desc(t, block_m: int):
    """LSE (log2 units) or delta, (nheads, t4) fp32, in boxes of (1, block_m)."""
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    return TensorDescriptor(t, list(t.shape), [t.stride(0), 1], [1, block_m], layout)


def dq_desc(t, block_m: int, cols: int):
    """The fp32 dQ accumulator (T, H, d) seen as (T, H * d), in boxes of (block_m, cols)."""
    layout = gl.NVMMASharedLayout.get_default_for([block_m, cols], gl.float32)
    return TensorDescriptor(t, [t.shape[0], t.shape[1] * t.shape[2]], [t.stride(0), 1], [block_m, cols], layout)


def order_flag(head_major, device) -> torch.Tensor:
    """The program-order flag of the warp-specialised dK/dV kernels: a (1,) int32 tensor on ``device``,
    non-zero for kv head major. ``head_major`` is such a tensor already (``schedule.head_major_flag``, made
    on the device from the layout) or a bool."""
    if isinstance(head_major, torch.Tensor):
        if head_major.shape != (1,) or head_major.dtype != torch.int32 or head_major.device != torch.device(device):
            raise ValueError(f"head_major: expected a bool or a (1,) int32 tensor on {device}, got "
                             f"{tuple(head_major.shape)} {head_major.dtype} on {head_major.device}")
        return head_major
    return torch.full((1,), int(bool(head_major)), dtype=torch.int32, device=device)


def dkdv_args(q, k, v, dout, lse2, delta, dk, dv, wsk, wsv, table, cu_seqlens, nheads_k, qk_scale, sm_scale,
              dq_acc=None, block_m: int = 64, block_n: int = 128, dq_cols: int | None = None, head_major=False):
    """The launch arguments of the warp-specialised dK/dV kernels (``gluon_dkdv_ws``, ``gluon_split256``),
    in order (dq_desc only with dq_acc; head_major as ``order_flag`` takes it)."""
    descs = [desc(q, block_m), desc(k, block_n), desc(v, block_n), desc(dout, block_m), stat_desc(lse2, block_m),
             stat_desc(delta, block_m)]
    if dq_acc is not None:
        descs.append(dq_desc(dq_acc, block_m, dq_cols or q.shape[2]))
    return [*descs, dk, dv, wsk, wsv, table, cu_seqlens, order_flag(head_major, q.device), table.shape[1], nheads_k,
            qk_scale, sm_scale]


def dkdv_signature(dim: int, block_m: int, block_n: int, dtype: str = "bf16", dq_cols: int | None = None) -> dict:
    """``gluon_compat.compile_for_sm90``'s signature of those arguments (dq_desc when dq_cols is given)."""
    stat = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    sig = dict(q_desc=tile_sig(dtype, block_m, dim), do_desc=tile_sig(dtype, block_m, dim),
               k_desc=tile_sig(dtype, block_n, dim), v_desc=tile_sig(dtype, block_n, dim),
               lse_desc=f"tensordesc<fp32[1, {block_m}],{stat!r}>",
               delta_desc=f"tensordesc<fp32[1, {block_m}],{stat!r}>",
               DK=f"*{dtype}", DV=f"*{dtype}", WSK="*fp32", WSV="*fp32", ITEMS="*i32", CU="*i32",
               ORDER="*i32", n_items="i32", nheads_k="i32", qk_scale="fp32", sm_scale="fp32")
    if dq_cols is not None:
        layout = gl.NVMMASharedLayout.get_default_for([block_m, dq_cols], gl.float32)
        sig["dq_desc"] = f"tensordesc<fp32[{block_m}, {dq_cols}],{layout!r}>"
    return sig


def run(q, k, v, dout, lse2, delta, dk, dv, wsk, wsv, table, cu_seqlens, nheads_k, rep, qk_scale, sm_scale,
        dq_acc=None, block_m: int = 64, block_n: int = 128, stages: int = 2, num_warps: int = 8,
        dq_parts: int | None = None, hide_descriptors: bool = True):
    """Launch the Gluon dK/dV. lse2 / delta: (nheads, t4) fp32, t4 a multiple of 4, LSE in log2 units.
    dq_acc: an fp32 tensor like q to add the unscaled dQ into (zeroed by the caller), or None.
    hide_descriptors=False builds the kernel without ``hidden_zero`` (to time the difference)."""
    n_items = table.shape[1]
    q_desc = desc(q, block_m)
    return dkdv_rows_gluon_kernel[(n_items * nheads_k,)](
        q_desc, desc(k, block_n), desc(v, block_n), desc(dout, block_m), stat_desc(lse2, block_m),
        stat_desc(delta, block_m), q_desc if dq_acc is None else desc(dq_acc, block_m), dk, dv, wsk, wsv, table,
        cu_seqlens, n_items, nheads_k, qk_scale, sm_scale, REP=rep, DIM=q.shape[2], BLOCK_M=block_m, BLOCK_N=block_n,
        STAGES=stages, FUSE_DQ=dq_acc is not None, DQ_PARTS=dq_parts or DQ_PARTS.get(q.shape[2], 1),
        num_warps=num_warps, HIDE_DESC=hide_descriptors,
    )


def compile_for_sm90(dim: int = 128, block_m: int = 64, block_n: int = 128, num_warps: int = 8, stages: int = 2,
                     rep: int = 4, dtype: str = "bf16", fuse_dq: bool = False, dq_parts: int = 2,
                     hide_descriptors: bool = True):
    """Compile the kernel for sm_90 without a GPU (the CPU tests' check that it lowers)."""
    sig = dkdv_signature(dim, block_m, block_n, dtype)
    sig["dq_desc"] = tile_sig("fp32" if fuse_dq else dtype, block_m, dim)  # a placeholder (q) without dQ
    const = dict(REP=rep, DIM=dim, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages, FUSE_DQ=fuse_dq, DQ_PARTS=dq_parts,
                 num_warps=num_warps, HIDE_DESC=hide_descriptors)
    return _compile(dkdv_rows_gluon_kernel, sig, const, num_warps)


__all__ = ["AVAILABLE", "compile_for_sm90", "dkdv_args", "dkdv_signature", "run", "supported"]
