"""Forward kernel: one launch over (query tiles of every segment) x heads.

Program = (tile, head). A tile is BLOCK_M consecutive queries of one segment (a prompt or a
response); tiles come from ``schedule.query_tiles``, heaviest first, padded with ``seg = -1``
entries that exit at once. A response tile reads its context (its group's prompt, rows of ``KC``)
then its own keys causally; a prompt tile has an empty context and reads its own keys causally.
Online softmax in fp32 in the log2 domain; LSE is written as a natural log.

Shapes: Q, O: (total_q, nheads, headdim); K, V: (total_q, nheads_k, headdim); KC, VC: context keys
(total_ctx, nheads_k, headdim), the same tensors as K, V in the packed layout; LSE: (nheads, total_q)
float32; TILES: (2, n_tiles) int32, rows (segment, query block).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import key_blocks, load_block, scores_log2, store_rows, visible, ws_block_scores, ws_key_walk, zero_pad


@triton.jit
def _online_step(acc, m_i, l_i, s, m_use, v, DOT_PREC: tl.constexpr):
    """One key block of the online softmax: rescale by the moved maximum (``m_use``, where the row
    maximum was ``m_i``), add the block's probabilities' row sums and P V. Returns (acc, l_i)."""
    p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    return tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC), l_i


@triton.jit
def _attend(
    acc, m_i, l_i, q, K, V, hk, stride_kt, stride_kh, stride_vt, stride_vh,
    row0, n_keys, off, x_lo, n_blocks, qpos, window, qk_scale, cap_log2, pre_cap,
    BLOCK_N: tl.constexpr, DIM: tl.constexpr, HEAD_DIM: tl.constexpr, MASK: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DOT_PREC: tl.constexpr, TMA: tl.constexpr,
):
    """Online-softmax update over ``n_blocks`` key blocks of one region starting at key ``x_lo``.

    acc: (BLOCK_M, HEAD_DIM) fp32; m_i, l_i: (BLOCK_M,) fp32 running max (log2) and sum;
    q: (BLOCK_M, HEAD_DIM); qpos: (BLOCK_M,) logical query positions; hk: the kv head.
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for b in range(n_blocks):
        x = x_lo + b * BLOCK_N
        inb = (x + offs_n) < n_keys
        k = load_block(K, row0 + x, hk, stride_kt, stride_kh, inb, offs_n, offs_d, DIM, HEAD_DIM, MASK, TMA)
        v = load_block(V, row0 + x, hk, stride_vt, stride_vh, inb, offs_n, offs_d, DIM, HEAD_DIM, MASK, TMA)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        s, _ = scores_log2(qk, qk_scale, cap_log2, pre_cap, HAS_SOFTCAP)
        if MASK:
            kpos = off + x + offs_n
            vis = visible(qpos[:, None], kpos[None, :], window, HAS_WINDOW) & inb[None, :]
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = m_new
        acc, l_i = _online_step(acc, m_i, l_i, s, m_use, v, DOT_PREC)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attend_region(
    acc, m_i, l_i, q, K, V, hk, stride_kt, stride_kh, stride_vt, stride_vh,
    row0, n_keys, off, qpos, qmin, qmax, window, qk_scale, cap_log2, pre_cap,
    BLOCK_N: tl.constexpr, DIM: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DOT_PREC: tl.constexpr, TMA: tl.constexpr,
):
    """All visible key blocks of one region: masked front, unmasked middle, masked back."""
    lo, n_front, n_full, n_back = key_blocks(n_keys, off, qmin, qmax, window, BLOCK_N, HAS_WINDOW)
    if HAS_WINDOW:
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, K, V, hk, stride_kt, stride_kh, stride_vt, stride_vh, row0, n_keys,
                                off, lo, n_front, qpos, window, qk_scale, cap_log2, pre_cap, BLOCK_N, DIM, HEAD_DIM,
                                True, HAS_WINDOW, HAS_SOFTCAP, DOT_PREC, TMA)
    lo = lo + n_front * BLOCK_N
    acc, m_i, l_i = _attend(acc, m_i, l_i, q, K, V, hk, stride_kt, stride_kh, stride_vt, stride_vh, row0, n_keys,
                            off, lo, n_full, qpos, window, qk_scale, cap_log2, pre_cap, BLOCK_N, DIM, HEAD_DIM,
                            False, HAS_WINDOW, HAS_SOFTCAP, DOT_PREC, TMA)
    lo = lo + n_full * BLOCK_N
    acc, m_i, l_i = _attend(acc, m_i, l_i, q, K, V, hk, stride_kt, stride_kh, stride_vt, stride_vh, row0, n_keys,
                            off, lo, n_back, qpos, window, qk_scale, cap_log2, pre_cap, BLOCK_N, DIM, HEAD_DIM,
                            True, HAS_WINDOW, HAS_SOFTCAP, DOT_PREC, TMA)
    return acc, m_i, l_i


@triton.jit
def _attend_ws(
    acc, m_i, l_i, q, K, V, hk, ctx_start, ctx_len, seg_start, seg_len, offs_m, q_lo, q_end, window, qk_scale,
    cap_log2, pre_cap, BLOCK_N: tl.constexpr, DIM: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Every key block of a tile in ONE warp-specialised loop (``ws_key_walk``): Triton's Hopper pass
    splits it into a TMA producer and two consumer warpgroups. There is no unmasked fast path: a
    branch to one would turn the specialisation off, so every block is masked.

    K, V: descriptors over (rows, heads_k * DIM) holding the context rows too (the packed layout).
    The tile's queries are ``offs_m`` (indices inside the segment, in [q_lo, q_end)).
    """
    c0, n_c, o0, n_blocks = ws_key_walk(ctx_len, seg_len, q_lo, q_end, window, BLOCK_N, HAS_WINDOW)
    for b in tl.range(n_blocks, warp_specialize=True):
        k, v, s, _, vis = ws_block_scores(b, c0, n_c, o0, q, K, V, hk, ctx_start, ctx_len, seg_start, seg_len, offs_m,
                                          window, qk_scale, cap_log2, pre_cap, BLOCK_N, DIM, HAS_WINDOW, HAS_SOFTCAP,
                                          DOT_PREC)
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if HAS_WINDOW:
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows whose window starts later
        else:
            m_use = m_new  # finite: a row sees a key in its first block
        acc, l_i = _online_step(acc, m_i, l_i, s, m_use, v, DOT_PREC)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["n_tiles", "total_q", "window"])
def fwd_kernel(
    Q, K, V, KC, VC, O, LSE, TILES, CU, CTX_START, CTX_LEN,
    n_tiles, total_q, nheads, qk_scale, cap_log2, pre_cap, window,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kct, stride_kch, stride_vct, stride_vch, stride_ot, stride_oh,
    REP: tl.constexpr, DIM: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DOT_PREC: tl.constexpr, TMA: tl.constexpr,
    WS: tl.constexpr = False,
):
    """Q, K, V, KC, VC are pointers, or (with TMA) 2-D tensor descriptors over (rows, heads * DIM).
    With WS (the packed layout: KC / VC are K / V) they are pointers that the kernel wraps
    in descriptors itself: the warp-specialised loop re-blocks them for its two consumer warpgroups,
    which a descriptor made on the host does not allow."""
    if WS:
        nk = (nheads // REP) * DIM
        Q = tl.make_tensor_descriptor(Q, [total_q, nheads * DIM], [stride_qt, 1], [BLOCK_M, HEAD_DIM])
        K = tl.make_tensor_descriptor(K, [total_q, nk], [stride_kt, 1], [BLOCK_N, HEAD_DIM])
        V = tl.make_tensor_descriptor(V, [total_q, nk], [stride_vt, 1], [BLOCK_N, HEAD_DIM])
    pid = tl.program_id(0)
    tile = pid // nheads
    h = pid % nheads  # heads are the fast axis: a tile's heads run together and share K/V in L2
    seg = tl.load(TILES + tile)
    mb = tl.load(TILES + n_tiles + tile)
    if not WS:
        if seg < 0:
            return
    else:  # no early exit (the warp-specialising pass takes no branch out of the kernel): a padding
        live = seg >= 0  # entry runs as an empty segment 0 tile that reads and writes nothing
        seg = tl.where(live, seg, 0)
        mb = tl.where(live, mb, 0)
    seg_start = tl.load(CU + seg)
    seg_len = tl.load(CU + seg + 1) - seg_start
    ctx_start = tl.load(CTX_START + seg)
    ctx_len = tl.load(CTX_LEN + seg)
    if WS:
        seg_len = tl.where(live, seg_len, 0)
        ctx_len = tl.where(live, ctx_len, 0)
    hk = h // REP

    offs_r = tl.arange(0, BLOCK_M)
    offs_m = mb * BLOCK_M + offs_r  # query index inside the segment
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < seg_len
    q = load_block(Q, seg_start + mb * BLOCK_M, h, stride_qt, stride_qh, row_ok, offs_r, offs_d,
                   DIM, HEAD_DIM, True, TMA)
    q = zero_pad(q, offs_d, DIM, HEAD_DIM, TMA)  # then padded key columns never count
    qpos = ctx_len + offs_m
    qmin = ctx_len + mb * BLOCK_M
    qmax = ctx_len + tl.minimum(seg_len, mb * BLOCK_M + BLOCK_M) - 1

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if WS:
        acc, m_i, l_i = _attend_ws(acc, m_i, l_i, q, K, V, hk, ctx_start, ctx_len, seg_start, seg_len, offs_m,
                                   mb * BLOCK_M, mb * BLOCK_M + BLOCK_M, window, qk_scale, cap_log2, pre_cap,
                                   BLOCK_N, DIM, HAS_WINDOW, HAS_SOFTCAP, DOT_PREC)
    else:
        if ctx_len > 0:
            acc, m_i, l_i = _attend_region(
                acc, m_i, l_i, q, KC, VC, hk, stride_kct, stride_kch, stride_vct, stride_vch,
                ctx_start, ctx_len, 0, qpos, qmin, qmax, window, qk_scale, cap_log2, pre_cap,
                BLOCK_N, DIM, HEAD_DIM, HAS_WINDOW, HAS_SOFTCAP, DOT_PREC, TMA)
        acc, m_i, l_i = _attend_region(
            acc, m_i, l_i, q, K, V, hk, stride_kt, stride_kh, stride_vt, stride_vh,
            seg_start, seg_len, ctx_len, qpos, qmin, qmax, window, qk_scale, cap_log2, pre_cap,
            BLOCK_N, DIM, HEAD_DIM, HAS_WINDOW, HAS_SOFTCAP, DOT_PREC, TMA)

    l_safe = tl.where(row_ok, l_i, 1.0)
    out = acc / l_safe[:, None]
    rows = (seg_start + offs_m).to(tl.int64)
    store_rows(O + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :], out.to(O.dtype.element_ty),
               row_ok, offs_d, DIM, HEAD_DIM)
    lse = (m_i + tl.math.log2(l_safe)) * 0.6931471805599453
    tl.store(LSE + h.to(tl.int64) * total_q + seg_start + offs_m, lse, mask=row_ok)
