"""Triton kernels of the memory-lean log-prob head (``dualkv.core.logprobs.linear_logprobs``,
``impl="triton"``): one pass over a chunk's logits in each direction, where the PyTorch path runs a
chain of fp32 (chunk, V) kernels (upcast, log-sum-exp, softmax, products, downcast).

Per row, with l the LM-head logits (any float dtype, read as fp32), c = cap * tanh(l / cap) (c = l
without a cap) and z = c / temperature:

- forward, one program per row: the row's logits in blocks, keeping per lane an online max m,
  s = sum exp(z - m) and u = sum exp(z - m) (z - m) (centred, so no cancellation); then
  lse = m + log s, logprob = z[target] - lse, mean_z = m + u / s (= sum p z) and entropy =
  log s - u / s (= lse - mean_z). lse and mean_z are kept for backward.
- backward, one program per (row, block of logits): p = exp(z - lse),
  dz = g (onehot(target) - p) - g_ent p (z - mean_z), then dl = dz / temperature, times (1 - tanh^2)
  under a cap, written in the logits' dtype (in place: it feeds the LM-head matmuls next).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import tanh

# Logits per block: wide, since the work is one streaming pass (the CPU tests set a smaller one).
BLOCK_V = 4096


@triton.jit
def _scaled(l, inv_temp, cap, HAS_CAP: tl.constexpr):
    """z = cap * tanh(l / cap) / temperature (l / temperature without a cap) and tanh(l / cap)."""
    if HAS_CAP:
        t = tanh(l / cap)
        return t * cap * inv_temp, t
    else:
        return l * inv_temp, l


@triton.jit
def _logprob_fwd_kernel(L, stride_l, TGT, LP, ENT, LSE, MEANZ, V, inv_temp, cap,
                        HAS_CAP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = L + row * stride_l
    offs = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    u = tl.zeros([BLOCK], tl.float32)  # sum exp(z - m) (z - m): centred on the max, so no cancellation
    for v0 in range(0, V, BLOCK):
        ok = v0 + offs < V
        z, _ = _scaled(tl.load(base + v0 + offs, mask=ok, other=0.0).to(tl.float32), inv_temp, cap, HAS_CAP)
        m_new = tl.where(ok, tl.maximum(m, z), m)
        seen = m_new > float("-inf")  # a lane with no logit yet keeps s = u = 0
        m_ref = tl.where(seen, m_new, 0.0)
        alpha = tl.where(seen, tl.exp(m - m_ref), 1.0)
        shift = tl.where(m > float("-inf"), m - m_ref, 0.0)
        e = tl.where(ok, tl.exp(z - m_ref), 0.0)
        u = alpha * (u + s * shift) + e * (z - m_ref)
        s = alpha * s + e
        m = m_new
    top = tl.max(m, 0)
    live = m > float("-inf")
    w = tl.where(live, tl.exp(m - top), 0.0)
    total = tl.sum(s * w, 0)
    centred = tl.sum(w * (u + s * tl.where(live, m - top, 0.0)), 0) / total  # mean_z - top
    lse = top + tl.log(total)
    mean_z = top + centred
    z_t, _ = _scaled(tl.load(base + tl.load(TGT + row)).to(tl.float32), inv_temp, cap, HAS_CAP)
    tl.store(LP + row, z_t - lse)
    tl.store(ENT + row, tl.log(total) - centred)
    tl.store(LSE + row, lse)
    tl.store(MEANZ + row, mean_z)


@triton.jit
def _logprob_bwd_kernel(L, stride_l, TGT, G_LP, G_ENT, LSE, MEANZ, V, inv_temp, cap,
                        HAS_CAP: tl.constexpr, HAS_G: tl.constexpr, HAS_G_ENT: tl.constexpr,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < V
    ptr = L + row * stride_l + idx
    z, t = _scaled(tl.load(ptr, mask=ok, other=0.0).to(tl.float32), inv_temp, cap, HAS_CAP)
    p = tl.exp(z - tl.load(LSE + row))
    dz = tl.zeros([BLOCK], tl.float32)
    if HAS_G:
        g = tl.load(G_LP + row)
        dz = tl.where(idx == tl.load(TGT + row), g, 0.0) - g * p
    if HAS_G_ENT:
        dz -= tl.load(G_ENT + row) * p * (z - tl.load(MEANZ + row))
    dz *= inv_temp
    if HAS_CAP:
        dz *= 1.0 - t * t
    tl.store(ptr, dz.to(L.dtype.element_ty), mask=ok)


def _check(logits: torch.Tensor, targets: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits: expected a (n, V) tensor with a contiguous last dim, got {tuple(logits.shape)} "
                         f"strides {logits.stride()}")
    if targets.shape != logits.shape[:1] or targets.dtype != torch.long:
        raise ValueError(f"targets: expected ({logits.shape[0]},) int64, got {tuple(targets.shape)} {targets.dtype}")


def _aligned(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t``, or a copy of it where it does not start on a 16-byte boundary.

    Triton compiles one variant of a kernel per pattern of its pointers' 16-byte alignment. The
    per-row vectors handed to these kernels are slices of longer ones (a chunk of the targets, the
    upstream gradients, the saved statistics), whose alignment changes with the chunk's offset and
    the step's token count; copying the few off-boundary ones (a few KB) keeps every call on one
    compiled variant, where a new pattern cost a compile (0.2-0.4 s on an H200) in the middle of a
    training step."""
    return t if t is None or t.data_ptr() % 16 == 0 else t.clone()


def forward(logits: torch.Tensor, targets: torch.Tensor, temperature: float, softcap: float | None):
    """(n, V) logits, (n,) targets -> logprob, entropy, lse, mean_z: four (n,) fp32 tensors (each
    starting on a 16-byte boundary)."""
    _check(logits, targets)
    n, V = logits.shape
    # rows padded to a multiple of 4 floats, so that each of the four starts on a 16-byte boundary
    out = torch.empty(4, -(-n // 4) * 4, dtype=torch.float32, device=logits.device)[:, :n]
    if n:
        targets = _aligned(targets)
        _logprob_fwd_kernel[(n,)](logits, logits.stride(0), targets, out[0], out[1], out[2], out[3], V,
                                  1.0 / temperature, softcap or 1.0, HAS_CAP=softcap is not None,
                                  BLOCK=min(BLOCK_V, triton.next_power_of_2(V)), num_warps=8)
    return out[0], out[1], out[2], out[3]


def backward_(logits: torch.Tensor, targets: torch.Tensor, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None,
              lse: torch.Tensor, mean_z: torch.Tensor, temperature: float, softcap: float | None) -> torch.Tensor:
    """Overwrite ``logits`` with d loss / d logits (same dtype) and return it; g_lp / g_ent: (n,)
    fp32 upstream gradients of the log-probs / entropies, or None where they have none."""
    _check(logits, targets)
    n, V = logits.shape
    if n and (g_lp is not None or g_ent is not None):
        targets, g_lp, g_ent, lse, mean_z = (_aligned(t) for t in (targets, g_lp, g_ent, lse, mean_z))
        blk = min(BLOCK_V, triton.next_power_of_2(V))
        _logprob_bwd_kernel[(n, triton.cdiv(V, blk))](
            logits, logits.stride(0), targets, lse if g_lp is None else g_lp, lse if g_ent is None else g_ent, lse,
            mean_z, V, 1.0 / temperature, softcap or 1.0, HAS_CAP=softcap is not None, HAS_G=g_lp is not None,
            HAS_G_ENT=g_ent is not None, BLOCK=blk, num_warps=8)
    elif n:
        logits.zero_()
    return logits
