"""Public attention functions: what models and users call.

``dualkv_attention`` runs the DualKV rule over a packed layout; ``flash_attn_dualkv_varlen_func``
keeps the seed paper's signature (queries of the decoded responses against one shared context held
in its own K/V tensors: two physically disjoint KV regions, no copy).
"""

from __future__ import annotations

import torch

from .backends import get_backend, resolve_backend, split_backend
from .ops import attention_fwd
from .reference import AttnMeta
from .validation import check_attention_inputs, check_options, check_qkv

__all__ = ["dualkv_attention", "flash_attn_dualkv_varlen_func"]


@torch.compiler.assume_constant_result
def _backend_name(backend: str, is_cuda: bool, head_dim: int, low_precision: bool, longest_prompt: int | None,
                  plain_packed: bool) -> str:
    """Resolved per (backend, device kind, head dim, fp16 / bf16 or not, longest prompt if known, packed
    layout without window or softcap); constant under torch.compile."""
    dtype = torch.bfloat16 if low_precision else torch.float32
    return resolve_backend(backend, "cuda" if is_cuda else "cpu", head_dim=head_dim, dtype=dtype,
                           longest_prompt=longest_prompt, plain_packed=plain_packed)


def _run(q, k, v, k_ctx, v_ctx, meta, scale, window, softcap, deterministic, backend, longest_prompt=None):
    """``longest_prompt``: the host's count of the longest prompt's keys, for ``auto``; the callers leave it
    out under torch.compile, where reading it would make a graph per prompt length."""
    plain_packed = k_ctx is None and window is None and softcap is None
    name = _backend_name(backend, q.is_cuda, int(q.shape[-1]), q.dtype in (torch.float16, torch.bfloat16),
                         longest_prompt, plain_packed)
    if not torch.compiler.is_compiling():
        for part in dict.fromkeys(split_backend(name)):
            get_backend(part).check_supported(q, k, v, window, softcap)
    return attention_fwd(
        q, k, v, k_ctx, v_ctx, list(meta), scale, -1 if window is None else window,
        0.0 if softcap is None else softcap, deterministic, name,
    )


def dualkv_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout,
    *,
    softmax_scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    deterministic: bool = False,
    return_lse: bool = False,
    backend: str = "auto",
):
    """Attention over the packed P + N*R layout: each prompt once, its responses after it.

    Args:
        q: (T, nheads, headdim); k, v: (T, nheads_k, headdim), nheads % nheads_k == 0 (GQA/MQA).
        layout: the ``PackedLayout`` of this micro-batch (on q's device).
        softmax_scale: default 1/sqrt(headdim).
        window: sliding window on LOGICAL positions: a query at position i sees keys at positions
            j with i - j < window (a response's window can reach back into its prompt's tail).
        softcap: if set, scores become ``softcap * tanh(scores / softcap)`` (Gemma style).
        deterministic: bit-identical gradients run to run (kernel backends may then be slower;
            see the backend's docstring for what the default costs).
        return_lse: also return lse (nheads, T) float32 (not differentiable).
        backend: "auto" (on CUDA tensors Triton when available; in fp16 / bf16, where the built
            CUDA extension runs the Hopper wgmma kernels, what measured faster: at head dims 64, 128,
            192 and 512 the CUDA backend (its warp-specialised forward at 64 / 128), at 128 from
            prompts of 16K keys its forward with Triton's backward ("cuda+triton"; not under
            torch.compile, which keeps one choice per head dim); at 256 that pair; with a window or
            softcap, where Triton's fast backward does not run, the CUDA backend instead of the pair;
            at 512 on an sm_90 GPU whose wgmma backward is switched off, Triton's forward with the
            CUDA backward; the CUDA backward adds the prompt's gradients (and on sm_90 at head dim
            128 dQ) with fp32 atomics by default, as the Triton backward adds dQ on sm_90 at head
            dim 128, so those gradients are bit-identical run to run only with
            ``deterministic=True``; on CPU the reference),
            "reference", "triton", "cuda", or a forward+backward pair such as "triton+cuda".

    Returns out (T, nheads, headdim), or (out, lse).

    Mask of one group with P = 3 and two responses a, b of 2 tokens (x = attended)::

             p0 p1 p2 a0 a1 b0 b1
        p0 [ x  .  .  .  .  .  .  ]
        p2 [ x  x  x  .  .  .  .  ]
        a1 [ x  x  x  x  x  .  .  ]
        b0 [ x  x  x  .  .  x  .  ]
    """
    scale, window, softcap = check_attention_inputs(q, k, v, layout, softmax_scale, window, softcap)
    longest = None if torch.compiler.is_compiling() else layout.max_ctx_len
    out, lse = _run(q, k, v, None, None, AttnMeta.from_layout(layout), scale, window, softcap, deterministic, backend,
                    longest)
    return (out, lse) if return_lse else out


def flash_attn_dualkv_varlen_func(
    q: torch.Tensor,
    k_context: torch.Tensor,
    v_context: torch.Tensor,
    k_decoded: torch.Tensor,
    v_decoded: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k_decoded: torch.Tensor,
    max_seqlen_q: int,
    context_seqlen: int,
    max_seqlen_k_decoded: int,
    softmax_scale: float | None = None,
    causal: bool = True,
    *,
    window: int | None = None,
    softcap: float | None = None,
    deterministic: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """The seed paper's signature: N decoded sequences attending one shared context.

    Args:
        q: (total_q, nheads, headdim), the decoded tokens' queries, sequences packed back to back.
        k_context, v_context: (context_seqlen, nheads_k, headdim), the shared prompt's K/V (read in
            place, never copied).
        k_decoded, v_decoded: (total_q, nheads_k, headdim), the decoded tokens' own K/V.
        cu_seqlens_q, cu_seqlens_k_decoded: (N+1,) int32, equal (self-attention of the decoded part).
        max_seqlen_q, max_seqlen_k_decoded: longest decoded sequence.
        context_seqlen: P.
        causal: must be True (the decoded part is causal; the context is fully visible).
    Returns out (total_q, nheads, headdim). Gradients reach k_context/v_context summed over every
    decoded sequence.
    """
    if not causal:
        raise ValueError("causal: expected True; DualKV attention is causal within each decoded sequence")
    check_qkv(q, k_decoded, v_decoded, k_name="k_decoded", v_name="v_decoded")
    check_qkv(q, k_context, v_context, k_name="k_context", v_name="v_context", same_tokens=False)
    if k_context.shape[0] != context_seqlen:
        raise ValueError(f"context_seqlen: expected k_context.shape[0] ({k_context.shape[0]}), got {context_seqlen}")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k_decoded", cu_seqlens_k_decoded)):
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 2 or cu.dtype != torch.int32:
            raise ValueError(f"{name}: expected a (N+1,) int32 tensor, got {getattr(cu, 'shape', cu)!r}")
        if cu.device != q.device:
            raise ValueError(f"{name}: expected device {q.device}, got {cu.device}")
    not_equal = "cu_seqlens_k_decoded: expected it to equal cu_seqlens_q (decoded queries attend their own keys)"
    if cu_seqlens_q.shape != cu_seqlens_k_decoded.shape:
        raise ValueError(not_equal)
    # the value checks read the device once (three reads would be three host syncs a layer)
    first, last, differ = torch.stack([cu_seqlens_q[0], cu_seqlens_q[-1],
                                       (cu_seqlens_q != cu_seqlens_k_decoded).any().int()]).tolist()
    if differ:
        raise ValueError(not_equal)
    if last != q.shape[0] or first != 0:
        raise ValueError(f"cu_seqlens_q: expected to run from 0 to total_q={q.shape[0]}, got {[first, last]}")
    scale, window, softcap = check_options(q.shape[2], softmax_scale, window, softcap)
    n = cu_seqlens_q.numel() - 1
    i32 = dict(dtype=torch.int32, device=q.device)
    meta = AttnMeta(
        cu_seqlens=cu_seqlens_q,
        seg_ctx_start=torch.zeros(n, **i32),
        seg_ctx_len=torch.full((n,), context_seqlen, **i32),
        ctx_key_start=torch.zeros(1, **i32),
        ctx_key_len=torch.full((1,), context_seqlen, **i32),
        ctx_reader_start=torch.zeros(1, **i32),
        ctx_reader_end=torch.full((1,), q.shape[0], **i32),
    )
    longest = None if torch.compiler.is_compiling() else int(context_seqlen)
    out, _ = _run(q, k_decoded, v_decoded, k_context, v_context, meta, scale, window, softcap, deterministic, backend,
                  longest)
    return out
