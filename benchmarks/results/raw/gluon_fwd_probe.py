"""Probe (not shipped): the packed-layout forward in Gluon with FA3-style intra-warpgroup overlap (S_j issued,
P_{j-1} V_{j-1} issued, softmax of S_j while PV runs). No window / softcap; d = 64 / 128."""
import math
import os
import traceback

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

_tma_load = getattr(tma, "async_load", None) or getattr(tma, "async_copy_global_to_shared")
_bar = getattr(gl, "thread_barrier", None) or getattr(gl, "barrier")


@gluon.jit
def _krow(b, n_c, ctx_start, seg_start, BLOCK_N: gl.constexpr):
    return gl.where(b < n_c, ctx_start + b * BLOCK_N, seg_start + (b - n_c) * BLOCK_N)


@gluon.jit
def fwd_gluon_kernel(q_desc, k_desc, v_desc, O, LSE, TILES, CU, CTX_START, CTX_LEN, n_tiles, total_q, nheads, qk_scale,
                     REP: gl.constexpr, DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     num_warps: gl.constexpr):
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    pid = gl.program_id(0)
    tile = pid // nheads
    h = pid % nheads
    seg = gl.load(TILES + tile)
    mb = gl.load(TILES + n_tiles + tile)
    if seg >= 0:
        seg_start = gl.load(CU + seg)
        seg_len = gl.load(CU + seg + 1) - seg_start
        ctx_start = gl.load(CTX_START + seg)
        ctx_len = gl.load(CTX_LEN + seg)
        hk = h // REP
        n_c = gl.cdiv(ctx_len, BLOCK_N)
        n = n_c + gl.cdiv(gl.minimum(seg_len, (mb + 1) * BLOCK_M), BLOCK_N)
        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, DIM], q_desc.layout)
        k_ring = gl.allocate_shared_memory(dtype, [2, BLOCK_N, DIM], k_desc.layout)
        v_ring = gl.allocate_shared_memory(dtype, [2, BLOCK_N, DIM], v_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [5, 1], mbarrier.MBarrierLayout())  # K x2, V x2, Q
        for i in gl.static_range(5):
            mbarrier.init(bars.index(i), count=1)
        kb: gl.constexpr = k_desc.block_type.nbytes
        mbarrier.expect(bars.index(4), q_desc.block_type.nbytes)
        _tma_load(q_desc, [seg_start + mb * BLOCK_M, h * DIM], bars.index(4), q_smem)
        mbarrier.expect(bars.index(0), kb)
        _tma_load(k_desc, [_krow(0, n_c, ctx_start, seg_start, BLOCK_N), hk * DIM], bars.index(0), k_ring.index(0))
        mbarrier.expect(bars.index(2), kb)
        _tma_load(v_desc, [_krow(0, n_c, ctx_start, seg_start, BLOCK_N), hk * DIM], bars.index(2), v_ring.index(0))
        if n > 1:
            mbarrier.expect(bars.index(1), kb)
            _tma_load(k_desc, [_krow(1, n_c, ctx_start, seg_start, BLOCK_N), hk * DIM], bars.index(1), k_ring.index(1))

        offs_m = mb * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        qpos = gl.expand_dims(ctx_len + offs_m, 1)
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        mbarrier.wait(bars.index(4), 0)
        mbarrier.wait(bars.index(0), 0)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        s = warpgroup_mma(q_smem, k_ring.index(0).permute((1, 0)), s_zero, use_acc=False)
        kidx = gl.expand_dims(offs_n, 0)
        vis = (kidx < gl.where(0 < n_c, ctx_len, seg_len)) & (gl.where(0 < n_c, 0, ctx_len) + kidx <= qpos)
        s = gl.where(vis, s * qk_scale, float("-inf"))
        m_i = gl.max(s, 1)
        p = gl.exp2(s - gl.expand_dims(m_i, 1))
        l_i = gl.sum(p, 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        acc = gl.zeros([BLOCK_M, DIM], gl.float32, o_layout)
        _bar()
        if n > 2:
            mbarrier.expect(bars.index(0), kb)
            _tma_load(k_desc, [_krow(2, n_c, ctx_start, seg_start, BLOCK_N), hk * DIM], bars.index(0), k_ring.index(0))
        if n > 1:
            mbarrier.expect(bars.index(3), kb)
            _tma_load(v_desc, [_krow(1, n_c, ctx_start, seg_start, BLOCK_N), hk * DIM], bars.index(3), v_ring.index(1))
        for j in range(1, n):
            ks = j % 2
            vs = (j - 1) % 2
            mbarrier.wait(bars.index(ks), (j // 2) & 1)
            s = warpgroup_mma(q_smem, k_ring.index(ks).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.wait(bars.index(2 + vs), ((j - 1) // 2) & 1)
            acc = warpgroup_mma(p_op, v_ring.index(vs), acc, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=[s])
            in_c = j < n_c
            kidx = gl.expand_dims(gl.where(in_c, j, j - n_c) * BLOCK_N + offs_n, 0)
            vis = (kidx < gl.where(in_c, ctx_len, seg_len)) & (gl.where(in_c, 0, ctx_len) + kidx <= qpos)
            s = gl.where(vis, s * qk_scale, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 1))
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s - gl.expand_dims(m_new, 1))
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            _bar()
            if j + 2 < n:
                mbarrier.expect(bars.index(ks), kb)
                _tma_load(k_desc, [_krow(j + 2, n_c, ctx_start, seg_start, BLOCK_N), hk * DIM], bars.index(ks), k_ring.index(ks))
            if j + 1 < n:
                mbarrier.expect(bars.index(2 + vs), kb)
                _tma_load(v_desc, [_krow(j + 1, n_c, ctx_start, seg_start, BLOCK_N), hk * DIM], bars.index(2 + vs), v_ring.index(vs))
        vs = (n - 1) % 2
        mbarrier.wait(bars.index(2 + vs), ((n - 1) // 2) & 1)
        acc = warpgroup_mma(p_op, v_ring.index(vs), acc)
        for i in gl.static_range(5):
            mbarrier.invalidate(bars.index(i))
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        acc = acc / gl.expand_dims(l_o, 1)
        rows = mb * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
        cols = gl.arange(0, DIM, layout=gl.SliceLayout(0, o_layout))
        ptrs = O + (seg_start + gl.expand_dims(rows, 1)).to(gl.int64) * (nheads * DIM) + h * DIM + gl.expand_dims(cols, 0)
        gl.store(ptrs, acc.to(dtype), mask=gl.expand_dims(rows < seg_len, 1))
        lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
        gl.store(LSE + h.to(gl.int64) * total_q + seg_start + offs_m, lse, mask=offs_m < seg_len)


def gluon_forward(q, k, v, meta, scale, block_m=128, block_n=128, num_warps=8):
    from dualkv.core.backends.triton import schedule
    T, H, d = q.shape
    gdt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16

    def desc(t, rows):
        lay = gl.NVMMASharedLayout.get_default_for([rows, d], gdt)
        return TensorDescriptor(t, [t.shape[0], t.shape[1] * d], [t.stride(0), 1], [rows, d], lay)

    out = torch.empty_like(q)
    lse = torch.empty((H, T), dtype=torch.float32, device=q.device)
    tiles = schedule.query_tiles(meta, T, block_m, None)
    n_tiles = tiles.shape[1]
    fwd_gluon_kernel[(n_tiles * H,)](desc(q, block_m), desc(k, block_n), desc(v, block_n), out, lse, tiles, meta.cu_seqlens,
                                     meta.seg_ctx_start, meta.seg_ctx_len, n_tiles, T, H, scale * 1.4426950408889634,
                                     REP=H // k.shape[1], DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)
    return out, lse


if __name__ == "__main__":
    from triton.testing import do_bench
    from dualkv.core.backends.triton import launcher
    from benchmarks.tune_triton import make_case
    launcher._ensure_allocator()
    BN = int(os.environ.get("BN", 128))
    for c in [(3, 200, 77, 8, 2, 128, False), (2, 129, 63, 4, 4, 64, False), (5, 1000, 333, 8, 1, 128, False),
              (28, 4096, 2048, 32, 8, 128, True), (16, 32768, 2048, 32, 8, 128, True), (8, 16384, 512, 32, 8, 128, True)]:
        N, P, R, H, Hkv, d, t = c
        try:
            meta, q, k, v, do = make_case(N, P, R, H, Hkv, d)
            scale = 1 / math.sqrt(d)
            ro, rl = launcher.forward(q, k, v, None, None, meta, scale, None, None)
            go, gl_ = gluon_forward(q, k, v, meta, scale, block_n=BN)
            torch.cuda.synchronize()
            line = f"N={N} P={P} R={R} d={d}: max|dO| {(ro.float()-go.float()).abs().max().item():.3g} max|dLSE| {(rl-gl_).abs().max().item():.3g}"
            if t:
                a = do_bench(lambda: launcher.forward(q, k, v, None, None, meta, scale, None, None), rep=300)
                b = do_bench(lambda: gluon_forward(q, k, v, meta, scale, block_n=BN), rep=300)
                line += f"; triton {a:.2f} ms, gluon {b:.2f} ms ({a/b:.3f}x)"
            print(line, flush=True)
        except Exception:
            print("case", c, "failed"); traceback.print_exc(limit=2)
