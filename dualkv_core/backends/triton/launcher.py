"""Thin launchers: argument preparation, allocation, schedules and grids for the Triton kernels.

No host synchronisation: schedules are built on the device with sizes bounded from shapes
(``schedule.py``); nothing reads device metadata back.
"""

from __future__ import annotations

import math
import os

import torch
import triton

from . import configs, gluon_dkdv, gluon_dkdv_ws, gluon_fwd, gluon_split256, schedule
from .bwd_kernel import dkdv_kernel, dkdv_rows_kernel, dq_kernel, preprocess_kernel, reduce_kernel, scale_cast_kernel
from .common import LOG2E
from .configs import KernelConfig
from .fwd_kernel import fwd_kernel

MAX_WINDOW = 1 << 30  # logical positions stay below this; a wider window is no window
MAX_TMA_HEAD_DIM = 256  # a copy-engine box holds at most 256 elements per dimension


def tma_supported(*tensors: torch.Tensor) -> bool:
    """Tensor descriptors apply: Hopper or newer (or the interpreter), each tensor a (rows, heads * dim)
    matrix (heads contiguous in a row) with 16-byte aligned base and row stride."""
    t0 = tensors[0]
    if os.environ.get("DUALKV_TRITON_TMA", "1") == "0":
        return False
    if configs.padded_head_dim(t0.shape[-1]) > MAX_TMA_HEAD_DIM:
        return False
    if t0.is_cuda and torch.cuda.get_device_capability(t0.device)[0] < 9:
        return False
    for t in tensors:
        e = t.element_size()
        if t.data_ptr() % 16 or t.stride(2) != 1 or t.stride(1) != t.shape[2] or (t.stride(0) * e) % 16:
            return False
    return True


def _ensure_allocator() -> None:
    """Descriptors made inside a kernel need a scratch buffer per launch from Triton's allocator (a
    context variable, so each thread asks); torch's caching allocator serves it unless the caller
    set one."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 elsewhere: the interpreter runs one program at a time)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _warp_specialise(o: "_Opts", k_ctx) -> bool:
    """Whether the forward / dQ may take their warp-specialised single loop: descriptors, context keys
    in k / v, and not at d = 192, where zeroing Q's padding keeps a second 128 x 256 copy of it in
    shared memory beside the K / V ring (262 KB)."""
    padded_wide = o.dim != o.head_dim and o.head_dim >= 256
    return o.tma and k_ctx is None and not padded_wide and configs.warp_specialize_enabled()


def _desc(t: torch.Tensor, rows: int, head_dim: int):
    """A descriptor over (rows, heads, dim) seen as (rows, heads * dim), copying (rows, head_dim) boxes."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, [t.shape[0], t.shape[1] * t.shape[2]], [t.stride(0), 1], [rows, head_dim])


class _Opts:
    """Scalars and compile-time switches shared by every kernel of one call."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, scale: float, window, softcap, tma: bool):
        self.tma = tma
        self.rep = q.shape[1] // k.shape[1]
        self.dim = q.shape[2]
        self.head_dim = configs.padded_head_dim(self.dim)
        self.elem = q.element_size()
        self.has_window = window is not None and window < MAX_WINDOW
        self.window = int(window) if self.has_window else 0
        self.has_softcap = softcap is not None
        self.scale = float(scale)
        self.qk_scale = self.scale * LOG2E
        self.cap_log2 = float(softcap) * LOG2E if softcap else 0.0
        self.pre_cap = self.scale / float(softcap) if softcap else 0.0
        self.dot_prec = "ieee" if q.dtype == torch.float32 else "tf32"
        self.on_cuda = q.is_cuda
        self.smem_limit = configs.device_smem_limit(q.device) if q.is_cuda else configs.SMEM_LIMIT

    def constexprs(self) -> dict:
        return dict(REP=self.rep, DIM=self.dim, HEAD_DIM=self.head_dim, HAS_WINDOW=self.has_window,
                    HAS_SOFTCAP=self.has_softcap, DOT_PREC=self.dot_prec, TMA=self.tma)

    def key(self, meta, total_q: int, extra=()) -> tuple:
        S = meta.cu_seqlens.numel() - 1
        C = meta.ctx_key_start.numel()
        regime = configs.regime(total_q, S, C)
        return (self.dot_prec, self.tma, self.rep, regime, self.has_window, self.has_softcap, *extra)

    def tiles(self, rows: int, *tensors):
        """The kernel's view of q-like / k-like tensors: descriptors with ``rows``-row boxes, or themselves."""
        return [_desc(t, rows, self.head_dim) if self.tma else t for t in tensors]


def _kv_strides(k, v, kc, vc) -> list[int]:
    return [k.stride(0), k.stride(1), v.stride(0), v.stride(1), kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1)]


def forward(q, k, v, k_ctx, v_ctx, meta, softmax_scale, window, softcap, config: KernelConfig | None = None,
            tma: bool | None = None):
    """out (total_q, nheads, headdim) in q's dtype, lse (nheads, total_q) float32.

    q: (total_q, nheads, headdim); k, v: (total_q, nheads_k, headdim); k_ctx, v_ctx:
    (total_ctx, nheads_k, headdim) or None (context keys are rows of k, v).
    """
    T, H, _ = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((H, T), dtype=torch.float32, device=q.device)
    if T == 0:
        return out, lse
    kc = k if k_ctx is None else k_ctx
    vc = v if v_ctx is None else v_ctx
    o = _Opts(q, k, softmax_scale, window, softcap, tma_supported(q, k, v, kc, vc) if tma is None else tma)
    if (config is None and configs.gluon_fwd_enabled() and out.is_contiguous()
            and gluon_fwd.supported(o, q, k_ctx is not None)):
        gluon_fwd.run(q, k, v, out, lse, meta, o.qk_scale)  # Hopper, d = 64 / 128, no window or softcap
        return out, lse
    ws_ok = _warp_specialise(o, k_ctx)

    def run(cfg: KernelConfig):
        tiles = schedule.query_tiles(meta, T, cfg.block_m, window if o.has_window else None)
        n_tiles = tiles.shape[1]
        ws = cfg.warp_specialize and ws_ok
        if ws:
            _ensure_allocator()
        # a warp-specialised kernel makes its own descriptors
        qkv = [q, k, v, kc, vc] if ws else [*o.tiles(cfg.block_m, q), *o.tiles(cfg.block_n, k, v, kc, vc)]
        fwd_kernel[(n_tiles * H,)](
            *qkv, out, lse, tiles, meta.cu_seqlens, meta.seg_ctx_start, meta.seg_ctx_len,
            n_tiles, T, H, o.qk_scale, o.cap_log2, o.pre_cap, o.window,
            q.stride(0), q.stride(1), *_kv_strides(k, v, kc, vc), out.stride(0), out.stride(1),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, WS=ws, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, **o.constexprs(),
        )

    configs.launch("fwd", o.key(meta, T), o.dim, o.elem, o.on_cuda, run, warp_specialize=ws_ok,
                   smem_limit=o.smem_limit, config=config)
    return out, lse


def backward(dout, q, k, v, k_ctx, v_ctx, out, lse, meta, softmax_scale, window, softcap, deterministic,
             dkdv_config: KernelConfig | None = None, dq_config: KernelConfig | None = None,
             tma: bool | None = None, split_rows: int | None = None, atomic_dq: bool | None = None):
    """dq (like q), dk, dv (like k, v), dk_ctx, dv_ctx (like k_ctx, v_ctx; None when k_ctx is None).

    Context gradients are summed over every reading query in fp32 and cast once. dQ comes from a
    query-parallel kernel (bit-identical run to run) or, with ``atomic_dq=True`` (never with
    ``deterministic``), is added in fp32 inside the dK/dV kernel; None: ``configs.atomic_dq_default``
    (added inside where the warp-specialised Gluon dK/dV runs, sm_90 at d = 128).
    ``split_rows``: a context key block's readers are split over programs of about this many rows; None:
    ``schedule.balanced_split_rows`` where dQ is added in the dK/dV kernel without a window (splits only
    as far as the balance over the SMs needs), else ``schedule.SPLIT_ROWS``.
    """
    if deterministic:
        atomic_dq = False
    bwd = Backward(dout, q, k, v, k_ctx, v_ctx, out, lse, meta, softmax_scale, window, softcap, atomic_dq, tma,
                   split_rows)
    if q.shape[0] > 0:
        bwd.run(dkdv_config, dq_config)
    return bwd.results()


class Backward:
    """The backward of one call, launch by launch: ``preprocess``, ``dkdv``, ``dq`` (for timing them apart)."""

    def __init__(self, dout, q, k, v, k_ctx, v_ctx, out, lse, meta, softmax_scale, window, softcap, atomic_dq,
                 tma=None, split_rows=None):
        T, H, d = q.shape
        Hkv = k.shape[1]
        self.separate = k_ctx is not None
        kc = k if k_ctx is None else k_ctx
        vc = v if v_ctx is None else v_ctx
        self.o = _Opts(q, k, softmax_scale, window, softcap,
                       tma_supported(q, k, v, kc, vc, dout) if tma is None else tma)
        self.args = (q, k, v, kc, vc, dout, out, lse, meta)
        self.window = window if self.o.has_window else None
        self.ws_ok = _warp_specialise(self.o, k_ctx)
        # dK/dV's one loop over query rows masks by row bounds alone: descriptors, the packed layout, no
        # window, and (heads x rows) of LSE / delta indexable in 32 bits
        self.rows_dkdv = self.o.tma and not self.separate and not self.o.has_window and H * (T + 3) < 2**31
        self.split_rows = split_rows
        # The warp-specialised Gluon kernels (sm_90): d = 128 dK/dV with dQ fused, d = 256 split by role.
        gluon = configs.gluon_bwd_enabled() and self.rows_dkdv
        ws = gluon and gluon_dkdv_ws.supported(self.o, q)
        self.atomic = configs.atomic_dq_default(ws) if atomic_dq is None else atomic_dq
        self.gluon_ws = ws and self.atomic
        self.gluon_split = gluon and not self.atomic and gluon_split256.supported(self.o, q)  # its own dQ kernel
        dev = q.device
        self.dk = torch.empty((T, Hkv, d), dtype=k.dtype, device=dev)
        self.dv = torch.empty((T, Hkv, d), dtype=v.dtype, device=dev)
        self.dkc = torch.empty(kc.shape, dtype=kc.dtype, device=dev) if self.separate else self.dk
        self.dvc = torch.empty(vc.shape, dtype=vc.dtype, device=dev) if self.separate else self.dv
        self.dq = torch.empty((T, H, d), dtype=q.dtype, device=dev)
        self.delta = torch.empty((H, T), dtype=torch.float32, device=dev)
        self.dq_acc = torch.empty((T, H, d), dtype=torch.float32, device=dev) if self.atomic else self.delta
        if T == 0 and self.separate:
            self.dkc.zero_(), self.dvc.zero_()

    def results(self):
        ctx = (self.dkc, self.dvc) if self.separate else (None, None)
        return self.dq, self.dk, self.dv, *ctx

    def run(self, dkdv_config: KernelConfig | None = None, dq_config: KernelConfig | None = None):
        o, meta, T = self.o, self.args[8], self.args[0].shape[0]
        key = o.key(meta, T, (self.atomic, self.separate))
        kind = ("dkdv_rows_atomic" if self.atomic else "dkdv_rows") if self.rows_dkdv else "dkdv"
        if self.gluon_ws or self.gluon_split:  # the tiles their layouts are written for
            mod = gluon_dkdv_ws if self.gluon_ws else gluon_split256
            dkdv_config = KernelConfig(mod.BLOCK_M, mod.BLOCK_N, 4, 2)
        if not self.atomic:
            self.preprocess()

        def dkdv(cfg: KernelConfig):
            if self.atomic:  # every run (a tuning one, a retried one) adds into a freshly zeroed dQ accumulator
                self.preprocess()
            self.dkdv(cfg)

        configs.launch(kind, key, o.dim, o.elem, o.on_cuda, dkdv, smem_limit=o.smem_limit, config=dkdv_config)
        if self.gluon_split:
            q, k, v, _, _, dout, _, lse, meta = self.args
            gluon_split256.run_dq(q, k, v, dout, self.dq, lse, self.delta, meta, o.qk_scale, o.scale)
        elif not self.atomic:
            configs.launch("dq", key, o.dim, o.elem, o.on_cuda, self.dq_kernel, warp_specialize=self.ws_ok,
                           smem_limit=o.smem_limit, config=dq_config)

    def preprocess(self, block: int = 64):
        """delta = rowsum(dO * O) (and a zeroed dQ accumulator for the atomic path)."""
        out, dout, o = self.args[6], self.args[5], self.o
        T, H, _ = out.shape
        preprocess_kernel[(math.ceil(T / block) * H,)](
            out, dout, self.delta, self.dq_acc, T, H, out.stride(0), out.stride(1), dout.stride(0), dout.stride(1),
            DIM=o.dim, HEAD_DIM=o.head_dim, BLOCK=block, ZERO_DQ=self.atomic, num_warps=4,
        )

    def dkdv(self, cfg: KernelConfig):
        """dK/dV (and the atomic dQ), the fixed-order sum of split partials, the dQ cast."""
        q, k, v, kc, vc, dout, _, lse, meta = self.args
        o, T, Hkv, d = self.o, q.shape[0], k.shape[1], q.shape[2]
        n_ctx_rows = kc.shape[0] if self.separate else 0
        split_rows = self.split_rows
        if split_rows is None:
            split_rows = (schedule.balanced_split_rows(meta, cfg.block_n, Hkv, _sm_count(q.device))
                          if self.atomic and self.window is None else schedule.SPLIT_ROWS)
        items = schedule.key_items(meta, T, n_ctx_rows, self.separate, cfg.block_n, self.window, split_rows,
                                   by_segment=self.atomic)
        n_items = items.table.shape[1]
        wsk = torch.empty((items.ws_rows, Hkv, d), dtype=torch.float32, device=q.device)
        wsv = torch.empty_like(wsk)
        grid = (n_items * Hkv,)
        n_seg = meta.cu_seqlens.numel() - 1
        (self._dkdv_rows if self.rows_dkdv else self._dkdv_segments)(cfg, items.table, wsk, wsv)
        reduce_kernel[grid](
            wsk, wsv, self.dk, self.dv, self.dkc, self.dvc, items.table, meta.cu_seqlens, meta.seg_ctx_len,
            meta.ctx_key_start, meta.ctx_key_len, n_items, n_seg, Hkv,
            DIM=o.dim, HEAD_DIM=o.head_dim, BLOCK_N=cfg.block_n, num_warps=4,
        )
        if self.atomic:
            n = self.dq.numel()
            scale_cast_kernel[(triton.cdiv(n, 4096),)](self.dq_acc, self.dq, n, o.scale, BLOCK=4096, num_warps=4)

    def _head_major(self, min_prompt: int | None) -> torch.Tensor:
        """The Gluon dK/dV's program-order flag: ``DUALKV_TRITON_BWD_HEAD_MAJOR`` where set, else the kernel's
        choice for this layout's longest prompt (``min_prompt``; on the device, no synchronisation)."""
        return schedule.head_major_flag(self.args[8], configs.bwd_head_major(), min_prompt)

    def _dkdv_rows(self, cfg: KernelConfig, table, wsk, wsv):
        """The one-loop dK/dV over query rows (the packed layout on descriptors, no window)."""
        q, k, v, _, _, dout, _, lse, meta = self.args
        o, (T, H), Hkv = self.o, q.shape[:2], k.shape[1]
        _ensure_allocator()
        t4 = -(-T // 4) * 4  # LSE (log2 units) and delta on rows a 1-D descriptor can start at
        lse2 = lse.new_zeros((H, t4))
        torch.mul(lse, LOG2E, out=lse2[:, :T])
        delta = lse.new_zeros((H, t4))
        delta[:, :T] = self.delta
        common = (q, k, v, dout, lse2, delta, self.dk, self.dv, wsk, wsv, table, meta.cu_seqlens, Hkv, o.rep,
                  o.qk_scale, o.scale)
        if self.gluon_ws:
            gluon_dkdv_ws.run(*common, self.dq_acc, cfg.block_m, cfg.block_n,
                              head_major=self._head_major(gluon_dkdv_ws.HEAD_MAJOR_MIN_PROMPT))
            return
        if self.gluon_split:
            gluon_split256.run_dkdv(*common, cfg.block_m, cfg.block_n,
                                    head_major=self._head_major(gluon_split256.HEAD_MAJOR_MIN_PROMPT))
            return
        if configs.gluon_dkdv_enabled() and gluon_dkdv.supported(o, q):
            gluon_dkdv.run(*common, dq_acc=self.dq_acc if self.atomic else None, block_m=cfg.block_m,
                           block_n=cfg.block_n, num_warps=cfg.num_warps)
            return
        dkdv_rows_kernel[(table.shape[1] * Hkv,)](
            q, k, v, dout, lse2, delta, self.dq_acc, self.dk, self.dv, wsk, wsv, table, meta.cu_seqlens,
            table.shape[1], T, t4, Hkv, o.qk_scale, o.cap_log2, o.pre_cap, o.scale,
            q.stride(0), k.stride(0), v.stride(0), dout.stride(0),
            REP=o.rep, DIM=o.dim, HEAD_DIM=o.head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            HAS_SOFTCAP=o.has_softcap, DOT_PREC=o.dot_prec, ATOMIC_DQ=self.atomic,
            DQ_TMA=self.atomic and o.on_cuda,  # the interpreter has no TMA reduce-add
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    def _dkdv_segments(self, cfg: KernelConfig, table, wsk, wsv):
        """The dK/dV kernel with a loop per reader segment: any layout, windows, pointer loads."""
        q, k, v, kc, vc, dout, _, lse, meta = self.args
        o, T, Hkv = self.o, q.shape[0], k.shape[1]
        n_items = table.shape[1]
        dq_tma = self.atomic and o.tma and o.on_cuda  # the interpreter has no TMA reduce-add
        dq_arg = o.tiles(cfg.block_m, self.dq_acc)[0] if dq_tma else self.dq_acc
        n_seg = meta.cu_seqlens.numel() - 1
        dkdv_kernel[(n_items * Hkv,)](
            *o.tiles(cfg.block_m, q), *o.tiles(cfg.block_n, k, v, kc, vc),
            *o.tiles(cfg.block_m, dout), lse, self.delta, dq_arg, self.dk, self.dv, self.dkc, self.dvc, wsk, wsv,
            table, meta.cu_seqlens, meta.seg_ctx_len, meta.ctx_key_start, meta.ctx_key_len,
            n_items, n_seg, T, Hkv, o.qk_scale, o.cap_log2, o.pre_cap, o.scale, o.window,
            q.stride(0), q.stride(1), *_kv_strides(k, v, kc, vc), dout.stride(0), dout.stride(1),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, ATOMIC_DQ=self.atomic, DQ_TMA=dq_tma,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **o.constexprs(),
        )

    def dq_kernel(self, cfg: KernelConfig):
        """dQ, query-parallel, written once in the input dtype."""
        q, k, v, kc, vc, dout, _, lse, meta = self.args
        o, T, H = self.o, q.shape[0], q.shape[1]
        tiles = schedule.query_tiles(meta, T, cfg.block_m, self.window)
        n_tiles = tiles.shape[1]
        dq = self.dq
        ws = cfg.warp_specialize and self.ws_ok
        if ws:  # descriptors made in the kernel; LSE (in log2 units) and delta on 16-byte aligned rows
            _ensure_allocator()
            aligned = schedule.aligned_rows(meta, T)
            lse_arg = lse.new_zeros((H, aligned.width)).index_copy_(1, aligned.rows, lse * LOG2E)
            delta_arg = lse.new_zeros((H, aligned.width)).index_copy_(1, aligned.rows, self.delta)
            pad_start, width, args = aligned.start, aligned.width, [q, k, v, kc, vc, dout]
        else:
            lse_arg, delta_arg, pad_start, width = lse, self.delta, meta.cu_seqlens, T
            args = [*o.tiles(cfg.block_m, q), *o.tiles(cfg.block_n, k, v, kc, vc), *o.tiles(cfg.block_m, dout)]
        dq_kernel[(n_tiles * H,)](
            *args, lse_arg, delta_arg, dq, tiles, meta.cu_seqlens, meta.seg_ctx_start, meta.seg_ctx_len, pad_start,
            n_tiles, T, width, H, o.qk_scale, o.cap_log2, o.pre_cap, o.scale, o.window,
            q.stride(0), q.stride(1), *_kv_strides(k, v, kc, vc), dout.stride(0), dout.stride(1),
            dq.stride(0), dq.stride(1),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, WS=ws, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            **o.constexprs(),
        )
