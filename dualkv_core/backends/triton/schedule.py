"""Tile schedules, built on the device from the int32 metadata with a size bound known from shapes.

No host synchronisation: every tensor here has a length computed from ``total_q``, ``S`` (segments)
and ``C`` (context regions), an upper bound of the real count; the surplus entries are marked
invalid (-1) and their programs exit at once. Entries are ordered heaviest first, so the long
programs start early and the short ones fill the tail (the dK/dV items that add dQ themselves order
the blocks nobody reads as context segment by segment instead: ``key_items(by_segment=True)``).
Each public schedule is kept per layout (``plan_cache.planned``): every layer of a micro-batch reads
the first layer's tables.

- ``query_tiles``: (2, n) int32 rows (segment, query block) for the forward and the dQ kernels.
- ``key_items``: (ITEM_ROWS, n) int32 for the dK/dV kernel: one entry per (key block, reader
  split) with the reader query rows of that split. Context key blocks whose readers are many are
  split over several programs (``nsplit``), each writing an fp32 partial that ``reduce`` sums in a
  fixed order: deterministic, and the prompt-block programs stay as short as the others.
- ``head_major_flag``: the dK/dV kernels' program order, chosen from the longest prompt.
- ``balanced_split_rows``: the split size for a dK/dV kernel that adds dQ itself. There, splitting
  costs time: the programs of a prompt's key blocks that walk the same reader rows together add into
  the same dQ tiles while those are in L2, and splits break that up. So a prompt block's readers are
  split only as far as the balance of the work over the GPU needs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .plan_cache import planned

# Rows of the key-item table.
UNIT, BLOCK, SPLIT, NSPLIT, REGION, R0, R1, SEG0, WS_BASE = range(9)
ITEM_ROWS = 9
MAX_SPLITS = 8
SPLIT_ROWS = 4096  # a context key block's readers are split into programs of at least this many rows


def _cdiv(a, b):
    return (a + b - 1) // b


def _sort_heavy_first(cost: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    order = torch.argsort(cost, descending=True, stable=True)
    return table[:, order].contiguous()


def _expand(counts: torch.Tensor, n: int):
    """Entries 0..n-1 over units with ``counts`` entries each: (unit, index within unit, valid)."""
    ends = torch.cumsum(counts.long(), 0)
    idx = torch.arange(n, device=counts.device)
    unit = torch.searchsorted(ends, idx, right=True)
    valid = unit < counts.numel()
    unit = unit.clamp(max=max(counts.numel() - 1, 0))
    local = idx - (ends[unit] - counts[unit].long())
    return unit, local, valid


@planned
def query_tiles(meta, total_q: int, block_m: int, window: int | None) -> torch.Tensor:
    """(2, S + cdiv(total_q, block_m)) int32: (segment, query block), heaviest first, -1 padded."""
    cu = meta.cu_seqlens.long()
    seg_len = cu[1:] - cu[:-1]
    S = seg_len.numel()
    n = S + _cdiv(total_q, block_m)
    seg, mb, valid = _expand(_cdiv(seg_len, block_m), n)
    ctx_len = meta.seg_ctx_len.long()[seg]
    own = torch.minimum(seg_len[seg], (mb + 1) * block_m)
    cost = ctx_len + own
    if window is not None:
        cost = torch.clamp(cost, max=window + block_m)
    cost = torch.where(valid, cost, -1)
    table = torch.stack([torch.where(valid, seg, -1), mb]).to(torch.int32)
    return _sort_heavy_first(cost, table)


class AlignedRows(NamedTuple):
    start: torch.Tensor  # (S,) int32: each segment's first row, a multiple of 4
    rows: torch.Tensor  # (total_q,) int64: where each token's row goes
    width: int  # rows in all, a multiple of 4


@planned
def aligned_rows(meta, total_q: int) -> AlignedRows:
    """Per-token rows with every segment starting at a multiple of 4 (16 bytes of fp32), so that a
    kernel can read a segment's per-row statistics (LSE, delta) through a tensor descriptor, whose
    first element must be 16-byte aligned. Built on the device; the width is bounded from shapes."""
    cu = meta.cu_seqlens.long()
    seg_len = cu[1:] - cu[:-1]
    S = seg_len.numel()
    padded = (seg_len + 3) // 4 * 4
    start = torch.cumsum(padded, 0) - padded
    seg = torch.repeat_interleave(torch.arange(S, device=cu.device), seg_len, output_size=total_q)
    rows = torch.arange(total_q, device=cu.device) - cu[seg] + start[seg]
    return AlignedRows(start.to(torch.int32), rows, _cdiv(total_q + 3 * S, 4) * 4)


class KeyItems(NamedTuple):
    table: torch.Tensor  # (ITEM_ROWS, n) int32
    ws_rows: int  # rows of each fp32 partial workspace (dk, dv)


def _unit_regions(meta, S: int, separate: bool):
    """Region read by each unit's keys: (U,) int64, -1 when nobody reads them as context.

    Units are the S segments (own keys), then, when the context lives in its own tensor, the C
    regions. In the packed layout a region's keys are exactly one segment's rows (the prompt).
    """
    cu = meta.cu_seqlens.long()
    C = meta.ctx_key_start.numel()
    dev = cu.device
    seg_region = torch.full((S,), -1, dtype=torch.long, device=dev)
    if separate:
        return torch.cat([seg_region, torch.arange(C, device=dev)])
    key_start = meta.ctx_key_start.long()
    owner = torch.searchsorted(cu, key_start, right=True) - 1
    owner = owner.clamp(0, max(S - 1, 0))
    aligned = (cu[owner] == key_start) & (cu[owner + 1] - cu[owner] == meta.ctx_key_len.long())
    torch._assert_async(aligned.all(), "dualkv triton: a context region must be exactly one segment's rows")
    seg_region[owner] = torch.arange(C, device=dev)
    return seg_region


def _region_splits(meta, ws_rows: int, split_rows) -> tuple[torch.Tensor, torch.Tensor]:
    """Splits per region (C,) and each region's workspace base row (C,), int64."""
    key_len = meta.ctx_key_len.long()
    readers = (meta.ctx_reader_end - meta.ctx_reader_start).long()
    want = _cdiv(readers, torch.clamp(key_len, min=split_rows))  # an int, or a 0-d tensor kept on the device
    cap = torch.clamp(ws_rows // torch.clamp(key_len.sum(), min=1), min=1, max=MAX_SPLITS)
    nsplit = torch.clamp(torch.minimum(want, cap), min=1)
    used = torch.where(nsplit > 1, nsplit * key_len, 0)
    return nsplit, torch.cumsum(used, 0) - used


@planned
def balanced_split_rows(meta, block_n: int, programs_per_item: int, n_sm: int) -> torch.Tensor:
    """Reader rows per split (a 0-d int64 tensor, on the device) that keep every dK/dV item within half
    of one SM's share of the whole walk: the rows walked by all items (each key block's own rows and,
    for a prompt's blocks, its readers), times the programs per item (kv heads), over the SMs, halved.
    Heavy-first order then keeps the tail short, and prompt blocks split only when they must.

    Measured on an H200 with dQ added in the dK/dV kernel (``benchmarks/results/raw/
    triton_ws_variants_h200_s34.log``): one program per prompt block instead of splits of 4096 rows
    took 0.90x the backward's time at (28, 4K, 2K) and 0.94x at (32, 8K, 2K), within noise elsewhere.
    """
    cu = meta.cu_seqlens.long()
    seg_len = cu[1:] - cu[:-1]
    nblk = _cdiv(seg_len, block_n)
    own = (nblk * seg_len - block_n * nblk * (nblk - 1) // 2).sum()  # block b reads len - b * block_n rows
    readers = (meta.ctx_reader_end - meta.ctx_reader_start).long()
    read = (_cdiv(meta.ctx_key_len.long(), block_n) * readers).sum()
    return (own + read) * programs_per_item // max(2 * n_sm, 1)


@planned
def head_major_flag(meta, head_major: bool | None, min_prompt: int | None) -> torch.Tensor:
    """The program-order flag of the warp-specialised dK/dV kernels, a (1,) int32 tensor on the metadata's
    device (non-zero: kv head major). ``head_major`` True / False sets it; None leaves it to the layout:
    kv head major where the longest prompt (context region) has at least ``min_prompt`` keys, item-major
    where ``min_prompt`` is None or the layout has no prompt. Computed on the device: no synchronisation."""
    dev = meta.ctx_key_len.device
    if head_major is not None or min_prompt is None or meta.ctx_key_len.numel() == 0:
        return torch.full((1,), int(bool(head_major)), dtype=torch.int32, device=dev)
    return (meta.ctx_key_len.amax() >= min_prompt).to(torch.int32).reshape(1)


@planned
def key_items(meta, total_q: int, n_ctx_rows: int, separate: bool, block_n: int,
              window: int | None, split_rows: int | torch.Tensor = SPLIT_ROWS, by_segment: bool = False) -> KeyItems:
    """Work items of the dK/dV kernel: (key block, reader split) of every unit, heaviest first.

    Args:
        total_q: rows of q/k; n_ctx_rows: rows of k_ctx (0 in the packed layout);
        separate: context keys live in k_ctx (their blocks are units of their own, read only by
            readers); otherwise a prompt segment's own block also takes its readers.
        split_rows: aim for at least this many reader rows per split (an int, or a 0-d tensor such as
            ``balanced_split_rows``'s).
        by_segment: the blocks read as context still heaviest first, but then the other blocks segment by
            segment (each segment's blocks together, first block first), not by cost: where dQ is added
            in the dK/dV kernel, a response's blocks then add into the same dQ rows at about the same
            time, while those rows are in L2.
    """
    cu = meta.cu_seqlens.long()
    dev = cu.device
    S = cu.numel() - 1
    C = meta.ctx_key_start.numel()
    ws_rows = max(total_q // 2, 1) if not separate else max(n_ctx_rows * MAX_SPLITS, 1)
    nsplit_c, ws_base_c = _region_splits(meta, ws_rows, split_rows)
    region = _unit_regions(meta, S, separate)
    has_region = region >= 0
    rc = region.clamp(min=0)
    key_len = cu[1:] - cu[:-1]
    if separate:
        key_len = torch.cat([key_len, meta.ctx_key_len.long()])
    nsplit = torch.where(has_region, nsplit_c[rc], 1) if C > 0 else torch.ones_like(key_len)
    nblk = _cdiv(key_len, block_n)
    n_keys_bound = total_q + (n_ctx_rows if separate else 0)
    n = S + (C if separate else 0) + _cdiv(n_keys_bound, block_n) + _cdiv(ws_rows, block_n) + MAX_SPLITS * C
    unit, local, valid = _expand(nblk * nsplit, n)
    z = local % nsplit[unit]
    blk = local // nsplit[unit]
    reg = region[unit]
    # Reader rows of this split (only for units read as context).
    zero = torch.zeros_like(unit)
    if C > 0:
        r_start = meta.ctx_reader_start.long()[rc[unit]]
        r_len = (meta.ctx_reader_end.long() - meta.ctx_reader_start.long())[rc[unit]]
        nz = nsplit[unit]
        r0 = torch.where(reg >= 0, r_start + (z * r_len) // nz, zero)
        r1 = torch.where(reg >= 0, r_start + ((z + 1) * r_len) // nz, zero)
        seg0 = (torch.searchsorted(cu, r0, right=True) - 1).clamp(0, max(S - 1, 0))
        ws_base = torch.where(reg >= 0, ws_base_c[rc[unit]], zero)
    else:
        r0 = r1 = seg0 = ws_base = zero
    own_rows = torch.where(unit < S, key_len[unit] - blk * block_n, 0)
    own_rows = torch.where(z == 0, own_rows, 0)
    if window is not None:
        own_rows = torch.clamp(own_rows, max=window + block_n)
    cost = torch.where(valid, own_rows + (r1 - r0), -1)
    table = torch.stack([torch.where(valid, unit, -1), blk, z, nsplit[unit], reg, r0, r1, seg0, ws_base])
    if not by_segment:
        return KeyItems(_sort_heavy_first(cost, table.to(torch.int32)), ws_rows)
    # blocks read as context heaviest first, then the other blocks segment by segment, then padding
    order_key = torch.where(reg >= 0, -cost, unit * (n + 1) + blk)
    order_key = torch.where(valid, order_key, torch.iinfo(torch.int64).max)
    order = torch.argsort(order_key, stable=True)
    return KeyItems(table.to(torch.int32)[:, order].contiguous(), ws_rows)
