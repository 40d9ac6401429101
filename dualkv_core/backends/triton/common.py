"""Jit helpers shared by the forward and backward kernels: block ranges, masks and scores.

Vocabulary. A *region* is a run of keys ``x in [0, n)`` stored in rows ``row0 + x`` of a K/V
tensor, at logical positions ``off + x`` (context keys: ``off = 0``; a segment's own keys:
``off = ctx_len``). A query at logical position ``qpos`` sees key position ``kpos`` iff
``kpos <= qpos`` and (with a window W) ``qpos - kpos < W``.

Loops walk a region in blocks from a start ``lo``: ``n_front`` blocks that need the element mask
(the window's edge), then ``n_full`` blocks that are visible for every row of the tile (no mask at
all: the fast path, where prompt blocks of a response tile live), then ``n_back`` masked blocks
(causal diagonal, ragged tail). For a response tile over its prompt without a window that is
``[full, full, ..., full, tail]``::

    keys ->   ctx block 0 | ctx block 1 | ... | ctx tail | own 0 | own diag
    tile  [   full        | full        | ... | masked   | full  | masked  ]
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def split_blocks(lo_any, lo_all, hi_any, hi_all, BLOCK: tl.constexpr):
    """Walk [lo_any, hi_any) in BLOCK steps, unmasked wherever a block lies inside [lo_all, hi_all).

    ``lo_any``/``hi_any`` bound the partners any row can see, ``lo_all``/``hi_all`` those every row
    sees. Returns (lo, n_front, n_full, n_back): the first block starts at ``lo``; the n_front and
    n_back blocks need the element mask, the n_full blocks in between do not.
    """
    lo = lo_any
    hi = tl.maximum(hi_any, lo)
    full_lo = tl.minimum(tl.maximum(lo_all, lo), hi)
    n_front = tl.cdiv(full_lo - lo, BLOCK)
    start_full = lo + n_front * BLOCK
    n_full = tl.maximum(hi_all - start_full, 0) // BLOCK
    n_back = tl.cdiv(tl.maximum(hi - start_full - n_full * BLOCK, 0), BLOCK)
    return lo, n_front, n_full, n_back


@triton.jit
def key_blocks(n_keys, off, qmin, qmax, window, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Key blocks of a region (keys x at ``off + x``) for query positions in [qmin, qmax]."""
    hi_any = tl.minimum(n_keys, qmax - off + 1)
    hi_all = tl.minimum(n_keys, qmin - off + 1)
    if HAS_WINDOW:
        lo_any = tl.maximum(qmin - window + 1 - off, 0)
        lo_all = tl.maximum(qmax - window + 1 - off, 0)
    else:
        lo_any = hi_any * 0
        lo_all = hi_any * 0
    return split_blocks(lo_any, lo_all, hi_any, hi_all, BLOCK_N)


@triton.jit
def query_blocks(i_lo, i_hi, off_q, kmin, kmax, window, BLOCK_M: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Query blocks of a segment slice (queries i in [i_lo, i_hi) at ``off_q + i``) for keys at [kmin, kmax]."""
    lo_any = tl.maximum(i_lo, kmin - off_q)
    lo_all = tl.maximum(i_lo, kmax - off_q)
    if HAS_WINDOW:
        hi_any = tl.minimum(i_hi, kmax + window - off_q)
        hi_all = tl.minimum(i_hi, kmin + window - off_q)
    else:
        hi_any = i_hi
        hi_all = i_hi
    return split_blocks(lo_any, lo_all, hi_any, hi_all, BLOCK_M)


@triton.jit
def ws_key_walk(ctx_len, seg_len, q_lo, q_end, window, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """The key blocks of a query tile (queries ``[q_lo, q_end)`` of a segment) as ONE range, for the
    single-loop kernels that Triton's Hopper pass warp-specialises (it leaves a kernel with several
    loops, or a branch inside its loop, as it is): context blocks ``c0 ..`` (``n_c`` of them), then
    own blocks ``o0 ..`` up to the tile's last query; blocks wholly behind the window of its first
    query are skipped. Returns (c0, n_c, o0, n_blocks)."""
    n_ctx = tl.cdiv(ctx_len, BLOCK_N)
    n_own = tl.cdiv(tl.minimum(seg_len, q_end), BLOCK_N)
    c0 = n_ctx * 0
    o0 = n_own * 0
    if HAS_WINDOW:
        first = tl.maximum(ctx_len + q_lo - window + 1, 0)  # first key position any row sees
        c0 = tl.minimum(first // BLOCK_N, n_ctx)
        o0 = tl.minimum(tl.maximum(first - ctx_len, 0) // BLOCK_N, n_own)
    n_c = n_ctx - c0
    return c0, n_c, o0, n_c + n_own - o0


@triton.jit
def ws_block_scores(b, c0, n_c, o0, q, K, V, hk, ctx_start, ctx_len, seg_start, seg_len, offs_m, window, qk_scale,
                    cap_log2, pre_cap, BLOCK_N: tl.constexpr, DIM: tl.constexpr, HAS_WINDOW: tl.constexpr,
                    HAS_SOFTCAP: tl.constexpr, DOT_PREC: tl.constexpr):
    """Block ``b`` of ``ws_key_walk``: its K and V tiles (descriptors over the packed layout, context
    rows being rows of K / V), the scores (``scores_log2``: s and t) and which keys each query row sees
    (key j of the block iff lower[r] <= j <= limit[r]), built after the matmul: a mask built before
    the loads would be held in registers across them. Returns (k, v, s, t, visible)."""
    in_ctx = b < n_c
    x = tl.where(in_ctx, c0 + b, o0 + b - n_c) * BLOCK_N  # first key of the block inside its region
    row = tl.where(in_ctx, ctx_start, seg_start) + x
    k = K.load([row, hk * DIM])
    v = V.load([row, hk * DIM])
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    s, t = scores_log2(qk, qk_scale, cap_log2, pre_cap, HAS_SOFTCAP)
    offs_n = tl.arange(0, BLOCK_N)
    limit = tl.where(in_ctx, ctx_len - 1 - x, tl.minimum(offs_m, seg_len - 1) - x)
    vis = offs_n[None, :] <= limit[:, None]
    if HAS_WINDOW:
        lower = ctx_len + offs_m - window + 1 - (tl.where(in_ctx, 0, ctx_len) + x)
        vis = vis & (offs_n[None, :] >= lower[:, None])
    return k, v, s, t, vis


@triton.jit
def visible(qpos, kpos, window, HAS_WINDOW: tl.constexpr):
    """(M, N) bool: causal and (optionally) inside the window. qpos: (M, 1), kpos: (1, N)."""
    vis = kpos <= qpos
    if HAS_WINDOW:
        vis = vis & ((qpos - kpos) < window)
    return vis


@triton.jit
def tanh(x):
    """tanh through exp2 (saturates cleanly to +-1 for large |x|)."""
    return 1.0 - 2.0 / (tl.math.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)


@triton.jit
def scores_log2(qk, qk_scale, cap_log2, pre_cap, HAS_SOFTCAP: tl.constexpr):
    """Scores in the log2 domain: qk * scale * log2(e), or cap * log2(e) * tanh(qk * scale / cap).

    Returns (s, t) with t = tanh(...) for the softcap's derivative (t is s when there is none).
    """
    if HAS_SOFTCAP:
        t = tanh(qk * pre_cap)
        return t * cap_log2, t
    else:
        s = qk * qk_scale
        return s, s


@triton.jit
def load_rows(ptrs, row_ok, offs_d, DIM: tl.constexpr, HEAD_DIM: tl.constexpr, ROW_MASK: tl.constexpr):
    """Load a (rows, HEAD_DIM) tile; rows masked by ``row_ok`` when ROW_MASK, columns past the real
    head dim DIM (< HEAD_DIM, the power of two the kernel works in) read as zeros."""
    if ROW_MASK:
        if DIM == HEAD_DIM:
            return tl.load(ptrs, mask=row_ok[:, None], other=0.0)
        else:
            return tl.load(ptrs, mask=row_ok[:, None] & (offs_d < DIM)[None, :], other=0.0)
    else:
        if DIM == HEAD_DIM:
            return tl.load(ptrs)
        else:
            return tl.load(ptrs, mask=(offs_d < DIM)[None, :], other=0.0)


@triton.jit
def store_rows(ptrs, value, row_ok, offs_d, DIM: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Store a (rows, HEAD_DIM) tile, rows masked by ``row_ok``, columns past DIM dropped."""
    if DIM == HEAD_DIM:
        tl.store(ptrs, value, mask=row_ok[:, None])
    else:
        tl.store(ptrs, value, mask=row_ok[:, None] & (offs_d < DIM)[None, :])


@triton.jit
def load_block(X, row, head, stride_t, stride_h, row_ok, offs_r, offs_d,
               DIM: tl.constexpr, HEAD_DIM: tl.constexpr, ROW_MASK: tl.constexpr, TMA: tl.constexpr):
    """(BLOCK, HEAD_DIM) tile: rows ``row + offs_r`` of ``head`` of a (rows, heads, DIM) tensor.

    With TMA, X is a 2-D tensor descriptor over (rows, heads * DIM) with block (BLOCK, HEAD_DIM):
    the copy engine reads the tile; rows past the tensor come back as zeros, rows inside it but past
    ``row_ok`` are read as they are (callers mask their scores), and when DIM < HEAD_DIM the columns
    past DIM belong to the next head (callers zero them where it matters: ``zero_pad``).
    Otherwise X is a pointer; rows are masked by ``row_ok`` when ROW_MASK, padded columns are zero.
    """
    if TMA:
        return X.load([row, head * DIM])
    else:
        ptrs = X + row.to(tl.int64) * stride_t + head * stride_h + (offs_r[:, None] * stride_t + offs_d[None, :])
        return load_rows(ptrs, row_ok, offs_d, DIM, HEAD_DIM, ROW_MASK)


@triton.jit
def zero_pad(x, offs_d, DIM: tl.constexpr, HEAD_DIM: tl.constexpr, TMA: tl.constexpr):
    """Zero the columns past the real head dim of a tile read through TMA (no-op otherwise)."""
    if TMA and DIM != HEAD_DIM:
        return tl.where((offs_d < DIM)[None, :], x, 0.0)
    else:
        return x
