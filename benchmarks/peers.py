"""Peers of DualKV attention, built from PyTorch alone, registered as harness providers.

Benchmarks only: nothing here is a product code path. Every peer is checked against
``dualkv.core.reference_attention`` by ``harness.validate_provider`` before it is timed.

Providers (one prompt group: prompt p of P tokens, responses r of N*R tokens, packed as [p | r])::

    fa2-replicated            FA2 varlen over the N-replicated layout (N sequences of P + R), GQA native
    cudnn-replicated          cuDNN SDPA over the replicated layout, (N, H, P+R, d), K/V expanded to H heads
    sdpa-efficient-replicated memory-efficient SDPA over the replicated layout, K/V expanded (any head dim)
    flex-packed               FlexAttention over the packed layout with a shared-prompt block mask,
                              compiled once per shape (the compile cache is reset between shapes)
    fa2-cascade               three FA2 pieces over the packed layout, merged by LSE
    cudnn-cascade             cuDNN SDPA for pieces 1 and 2 (K/V expanded), FA2 varlen for piece 3

The cascades (x = attended; piece 1 = prompt causal, 2 = responses -> prompt dense, 3 = responses
self, causal per response)::

             p0 p1 p2 a0 a1 b0 b1
        p0 [ 1  .  .  .  .  .  .  ]
        p1 [ 1  1  .  .  .  .  .  ]
        p2 [ 1  1  1  .  .  .  .  ]
        a0 [ 2  2  2  3  .  .  .  ]
        a1 [ 2  2  2  3  3  .  .  ]
        b0 [ 2  2  2  .  .  3  .  ]
        b1 [ 2  2  2  .  .  3  3  ]

Response rows merge pieces 2 and 3: ``lse = logaddexp(lse2, lse3)``, ``out = o2*exp(lse2 - lse) +
o3*exp(lse3 - lse)``. Backward: each piece's own backward kernel given the MERGED out and lse (the
softmax over the union of both key sets is then exact); prompt dK/dV = piece 1's + piece 2's.

Facts used: FA2 varlen is ``torch.ops.aten._flash_attention_forward/_backward`` on (total, H, d) with
GQA native and an fp32 lse of (H, total_q); cuDNN is ``torch.ops.aten._scaled_dot_product_cudnn_attention``
/``_backward`` on (B, H, S, d) with K/V expanded to H heads and an lse of (B, H, S[, 1]). Both
backwards take the out and lse you pass in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .harness import Provider, register

__all__ = ["FA2Piece", "CudnnPiece", "cascade_attention"]


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    """(S, H, d) -> a (1, H, S, d) view (BSHD memory, as cuDNN accepts)."""
    return x.unsqueeze(0).transpose(1, 2)


def _thd(x: torch.Tensor) -> torch.Tensor:
    """(1, H, S, d) -> a (S, H, d) view."""
    return x[0].transpose(0, 1)


def _expand_heads(x: torch.Tensor, rep: int) -> torch.Tensor:
    """(S, H_kv, d) -> (S, H_kv*rep, d), head h reading kv head h // rep (GQA), materialised."""
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def _fold_heads(dx: torch.Tensor, rep: int, dtype: torch.dtype) -> torch.Tensor:
    """Gradient of ``_expand_heads``: sum each kv head's ``rep`` query heads, in fp32."""
    if rep == 1:
        return dx.to(dtype)
    S, H, d = dx.shape
    return dx.float().view(S, H // rep, rep, d).sum(2).to(dtype)


# ---------------------------------------------------------------------------------------- pieces
@dataclass
class FA2Piece:
    """FA2 varlen: queries (total_q, H, d) against keys (total_k, H_kv, d), sequences by cu_seqlens.

    ``causal`` is bottom-right aligned when a sequence has fewer queries than keys (FA2's rule)."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    causal: bool
    scale: float

    def fwd(self, q, k, v):
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, self.cu_q, self.cu_k, self.max_q, self.max_k, 0.0, self.causal, False, scale=self.scale
        )
        return out, lse, (rng, unused)

    def bwd(self, dout, q, k, v, out, lse, state):
        rng, unused = state
        return torch.ops.aten._flash_attention_backward(
            dout, q, k, v, out, lse, self.cu_q, self.cu_k, self.max_q, self.max_k, 0.0, self.causal, rng, unused,
            scale=self.scale,
        )


@dataclass
class CudnnPiece:
    """cuDNN SDPA, one sequence: q (S_q, H, d), k/v (S_k, H, d) already expanded to H heads.

    Returns out as (S_q, H, d) and lse as (H, S_q) fp32, like ``FA2Piece``."""

    causal: bool
    scale: float

    def fwd(self, q, k, v):
        out, lse, cu_q, cu_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            _bhsd(q), _bhsd(k), _bhsd(v), None, True, 0.0, self.causal, False, scale=self.scale
        )
        return _thd(out), lse.reshape(q.shape[1], q.shape[0]), (lse.shape, seed, offset, cu_q, cu_k, max_q, max_k)

    def bwd(self, dout, q, k, v, out, lse, state):
        lse_shape, seed, offset, cu_q, cu_k, max_q, max_k = state
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse.reshape(lse_shape).contiguous(),
            seed, offset, None, cu_q, cu_k, max_q, max_k, 0.0, self.causal, scale=self.scale,
        )
        return _thd(dq), _thd(dk), _thd(dv)


@dataclass
class CascadePlan:
    """The three pieces of one group; ``expand`` = pieces 1 and 2 take prompt K/V expanded to H heads."""

    P: int
    rep: int
    prompt: object
    cross: object
    own: FA2Piece
    expand: bool


def _merge(o_a, lse_a, o_b, lse_b, dtype):
    """Two partial softmaxes over disjoint key sets -> the softmax over their union."""
    lse = torch.logaddexp(lse_a, lse_b)  # (H, S)
    w_a = torch.exp(lse_a - lse).t().unsqueeze(-1)  # (S, H, 1)
    w_b = torch.exp(lse_b - lse).t().unsqueeze(-1)
    return (o_a.float() * w_a + o_b.float() * w_b).to(dtype), lse.contiguous()


class _Cascade(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: CascadePlan):
        P, rep = plan.P, plan.rep
        kc, vc = (_expand_heads(k[:P], rep), _expand_heads(v[:P], rep)) if plan.expand else (k[:P], v[:P])
        out_p, lse_p, st_p = plan.prompt.fwd(q[:P], kc, vc)
        o_x, lse_x, st_x = plan.cross.fwd(q[P:], kc, vc)
        o_s, lse_s, st_s = plan.own.fwd(q[P:], k[P:], v[P:])
        out_r, lse_r = _merge(o_x, lse_x, o_s, lse_s, q.dtype)
        out = torch.cat([out_p.to(q.dtype), out_r])
        ctx.save_for_backward(q, k, v, kc, vc, out, lse_p.contiguous(), lse_r)
        ctx.plan, ctx.states = plan, (st_p, st_x, st_s)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, kc, vc, out, lse_p, lse_r = ctx.saved_tensors
        plan, (st_p, st_x, st_s) = ctx.plan, ctx.states
        P, rep = plan.P, plan.rep
        dout = dout.contiguous()
        dq_p, dkc_p, dvc_p = plan.prompt.bwd(dout[:P], q[:P], kc, vc, out[:P], lse_p, st_p)
        dq_x, dkc_x, dvc_x = plan.cross.bwd(dout[P:], q[P:], kc, vc, out[P:], lse_r, st_x)
        dq_s, dk_s, dv_s = plan.own.bwd(dout[P:], q[P:], k[P:], v[P:], out[P:], lse_r, st_s)
        if plan.expand:
            dk_p = _fold_heads(dkc_p.float() + dkc_x.float(), rep, k.dtype)
            dv_p = _fold_heads(dvc_p.float() + dvc_x.float(), rep, v.dtype)
        else:
            dk_p, dv_p = dkc_p + dkc_x, dvc_p + dvc_x
        dq = torch.cat([dq_p, dq_x + dq_s])
        return dq, torch.cat([dk_p, dk_s]), torch.cat([dv_p, dv_s]), None


def cascade_attention(q, k, v, plan: CascadePlan) -> torch.Tensor:
    """q: (T, H, d), k, v: (T, H_kv, d) of ONE group packed as [prompt | responses] -> out (T, H, d)."""
    return _Cascade.apply(q, k, v, plan)


def _i32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


# -------------------------------------------------------------------------------------- providers
def _need_cuda(cfg, device, max_d=256) -> str | None:
    if device.type != "cuda":
        return "needs a CUDA device"
    if cfg.dtype not in ("bfloat16", "float16"):
        return "needs fp16 or bf16 inputs"
    if cfg.d > max_d or cfg.d % 8:
        return f"FA2 supports head dims up to {max_d} (multiples of 8), got d={cfg.d}"
    return None


class _Replicated(Provider):
    """Inputs are the N-replicated copies (prompt copied into every row), built untimed."""

    replicated = True

    def __init__(self, cfg, layout, device):
        super().__init__(cfg, layout, device)
        self.index, self.cu = layout.replicated_index()
        inverse = torch.empty(layout.total_tokens, dtype=torch.long, device=device)
        inverse[self.index] = torch.arange(self.index.numel(), device=device)  # any copy of a prompt token
        self.inverse = inverse
        self.rows = layout.num_rows
        self.max_len = max(cfg.P + r for r in layout.row_lens)

    def gather(self, x):
        return x.index_select(0, self.index)

    def to_packed(self, out):
        return out.index_select(0, self.inverse)

    def _rows(self, x):
        """(N*S, h, d) replicated tokens -> (N, h, S, d) view (configs have every row of one length S)."""
        return x.view(self.rows, -1, *x.shape[1:]).transpose(1, 2)


class _FA2Varlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, piece: FA2Piece):
        out, lse, state = piece.fwd(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.piece, ctx.state = piece, state
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return (*ctx.piece.bwd(dout.contiguous(), q, k, v, out, lse, ctx.state), None)


@register("fa2-replicated")
class FA2Replicated(_Replicated):
    plan_tflops = 300.0

    @classmethod
    def unsupported(cls, cfg, device):
        return _need_cuda(cfg, device)

    def __init__(self, cfg, layout, device):
        super().__init__(cfg, layout, device)
        self.piece = FA2Piece(self.cu, self.cu, self.max_len, self.max_len, True, self.scale)

    def forward(self, q, k, v):
        return _FA2Varlen.apply(q, k, v, self.piece)


class _CudnnDense(torch.autograd.Function):
    """cuDNN SDPA on (B, H, S, d) views, K/V already expanded; lse and state kept for backward."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float):
        out, lse, cu_q, cu_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale
        )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (seed, offset, cu_q, cu_k, max_q, max_k, causal, scale)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        seed, offset, cu_q, cu_k, max_q, max_k, causal, scale = ctx.args
        dout = dout if dout.stride() == out.stride() else torch.empty_like(out).copy_(dout)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse, seed, offset, None, cu_q, cu_k, max_q, max_k, 0.0, causal, scale=scale
        )
        return dq, dk, dv, None, None


@register("cudnn-replicated")
class CudnnReplicated(_Replicated):
    plan_tflops = 450.0

    @classmethod
    def unsupported(cls, cfg, device):
        if device.type != "cuda" or cfg.dtype not in ("bfloat16", "float16"):
            return "needs a CUDA device and fp16/bf16 inputs"
        return None

    def forward(self, q, k, v):
        rep = self.cfg.H // self.cfg.H_kv
        k, v = _expand_heads(k, rep), _expand_heads(v, rep)  # autograd folds dK/dV back
        out = _CudnnDense.apply(self._rows(q), self._rows(k), self._rows(v), True, self.scale)
        return out.transpose(1, 2).reshape(q.shape)


@register("sdpa-efficient-replicated")
class EfficientReplicated(_Replicated):
    """Memory-efficient SDPA (any head dim) over the replicated layout; the only peer at d=512."""

    plan_tflops = 60.0

    @classmethod
    def unsupported(cls, cfg, device):
        return None if device.type == "cuda" else "needs a CUDA device"

    def forward(self, q, k, v):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        rep = self.cfg.H // self.cfg.H_kv
        k, v = _expand_heads(k, rep), _expand_heads(v, rep)
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            out = F.scaled_dot_product_attention(self._rows(q), self._rows(k), self._rows(v), is_causal=True, scale=self.scale)
        return out.transpose(1, 2).reshape(q.shape)


class _Cascades(Provider):
    @classmethod
    def unsupported(cls, cfg, device):
        return _need_cuda(cfg, device)

    def _own_piece(self):
        lay, P = self.layout, self.cfg.P
        cu = (lay.cu_seqlens[1:] - P).to(torch.int32)  # one group: responses' own segments
        return FA2Piece(cu, cu, lay.max_response_len, lay.max_response_len, True, self.scale)


@register("fa2-cascade")
class FA2Cascade(_Cascades):
    def __init__(self, cfg, layout, device):
        super().__init__(cfg, layout, device)
        P, NR = cfg.P, layout.total_tokens - cfg.P
        prompt = FA2Piece(_i32([0, P], device), _i32([0, P], device), P, P, True, self.scale)
        cross = FA2Piece(_i32([0, NR], device), _i32([0, P], device), NR, P, False, self.scale)
        self.plan = CascadePlan(P, cfg.H // cfg.H_kv, prompt, cross, self._own_piece(), expand=False)

    def forward(self, q, k, v):
        return cascade_attention(q, k, v, self.plan)


@register("cudnn-cascade")
class CudnnCascade(_Cascades):
    def __init__(self, cfg, layout, device):
        super().__init__(cfg, layout, device)
        self.plan = CascadePlan(cfg.P, cfg.H // cfg.H_kv, CudnnPiece(True, self.scale), CudnnPiece(False, self.scale),
                                self._own_piece(), expand=True)

    def forward(self, q, k, v):
        return cascade_attention(q, k, v, self.plan)


@register("flex-packed")
class FlexPacked(Provider):
    """FlexAttention over the packed layout; the block mask is built (untimed) from the layout.

    Compiled once per shape (``dynamic=False``) after ``torch._dynamo.reset()``, so no shape ever
    meets the recompile limit and falls back to eager (which materialises T x T scores). On a CPU it
    runs eagerly (tiny validation shapes only)."""

    plan_tflops = 250.0

    def __init__(self, cfg, layout, device):
        super().__init__(cfg, layout, device)
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        seg = layout.token_segment.long()
        lo = layout.seg_ctx_start.long()[seg]
        hi = lo + layout.seg_ctx_len.long()[seg]

        def shared_prompt(b, h, q_idx, kv_idx):
            own = (seg[q_idx] == seg[kv_idx]) & (kv_idx <= q_idx)
            return own | ((kv_idx >= lo[q_idx]) & (kv_idx < hi[q_idx]))

        T = layout.total_tokens
        cuda = device.type == "cuda"
        torch._dynamo.reset()
        self.block_mask = create_block_mask(shared_prompt, None, None, T, T, device=device, _compile=cuda)
        self.fn = torch.compile(flex_attention, dynamic=False) if cuda else flex_attention

    @classmethod
    def unsupported(cls, cfg, device):
        return None if device.type == "cuda" else "FlexAttention has no backward on a CPU"

    def forward(self, q, k, v):
        out = self.fn(_bhsd(q), _bhsd(k), _bhsd(v), block_mask=self.block_mask, scale=self.scale, enable_gqa=True)
        return _thd(out)

    def close(self):
        self.block_mask = self.fn = None
        torch._dynamo.reset()
