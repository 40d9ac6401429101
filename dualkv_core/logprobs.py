"""Log-probs of response tokens from packed logits, and a memory-lean path straight from hidden states.

The first token of every response is predicted by its group's LAST PROMPT token; the rest by the
previous response token (``PackedLayout.logprob_index``). Results come back as (B, R_max) rows.

``linear_logprobs`` fuses the LM head with the log-softmax: logits are formed ``chunk_size`` rows at
a time (LM-head matmul in the weights' dtype; ``impl="torch"`` then reduces an fp32 copy, the Triton
kernels read them in that dtype), reduced to the target log-prob, the log-sum-exp and optionally the
entropy, and dropped; backward recomputes each chunk. Peak memory is O(chunk_size * V) instead of
O(n * V). Per row, with l = h W^T, c = cap * tanh(l / cap) (or
c = l without a cap), z = c / temperature and p = softmax(z)::

    logprob = z[target] - logsumexp(z)           d/dz = onehot(target) - p
    entropy = logsumexp(z) - sum(p * z)          d/dz = -p * (z - sum(p * z))
"""

from __future__ import annotations

import math
import os

import torch

__all__ = ["gather_logprobs", "response_logprobs_from_logits", "logprobs_from_logits", "linear_logprobs", "LOGPROB_IMPLS",
           "resolve_logprobs_impl"]

# Rows per chunk so that the one (chunk, V) block of logits a chunk holds stays near 256 MiB: fp32 for
# impl="torch", the weights' dtype for "triton" (twice the rows in bf16: half as many passes of the
# weight gradient's fp32 (V, D) accumulator, each 2.5 GB of traffic at qwen3's vocabulary).
_CHUNK_BYTES = 1 << 28


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits in float32 (float64 stays), divided by the sampling temperature."""
    z = logits.to(_acc_dtype(logits.dtype))
    return z if temperature == 1.0 else z / temperature


def gather_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits (n, V), targets (n,) -> log p(target) (n,) in float32 (float64 for float64 logits);
    no (n, V) log-softmax is kept."""
    z = _tempered(logits, temperature)
    return z.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)


def logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    """logits (n, V), targets (n,) -> (log p(target), entropy), both (n,) float32 (float64 for float64
    logits): the plain path."""
    logp = torch.log_softmax(_tempered(logits, temperature), dim=-1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def response_logprobs_from_logits(logits: torch.Tensor, layout, temperature: float = 1.0) -> torch.Tensor:
    """logits (T, V) over the packed layout -> (B, R_max) float32 log-probs, zero-padded."""
    if layout.input_ids is None:
        raise ValueError("layout: expected a layout carrying input_ids (from_groups / from_rows), got one built from lengths only")
    if logits.dim() != 2 or logits.shape[0] != layout.total_tokens:
        raise ValueError(f"logits: expected shape ({layout.total_tokens}, vocab), got {tuple(logits.shape)}")
    src, tgt = layout.logprob_index()
    return layout.unpack_logprobs(gather_logprobs(logits[src], layout.input_ids[tgt], temperature))


# --------------------------------------------------------------------------------------- lean path

def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _scaled_logits(h_cD, weight_VD, temperature, softcap):
    """z (c, V) in fp32 (fp64 for fp64 inputs) and the capped logits' tanh (softcap derivative) or None."""
    z = torch.nn.functional.linear(h_cD, weight_VD).to(_acc_dtype(h_cD.dtype))
    t = None
    if softcap is not None:
        t = torch.tanh(z / softcap)
        z = t * softcap
    if temperature != 1.0:
        z = z / temperature
    return z, t


class _LinearLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_nD, weight_VD, targets_n, temperature, softcap, chunk, want_entropy, impl):
        n, acc = hidden_nD.shape[0], _acc_dtype(hidden_nD.dtype)
        lp_n = hidden_nD.new_empty(n, dtype=acc)
        ent_n = hidden_nD.new_empty(n, dtype=acc) if want_entropy else None
        stats = None
        if impl == "triton":  # lse and mean_z per row, so that backward needs no reduction
            from .backends.triton import logprob_kernel

            stats = hidden_nD.new_empty(2, n, dtype=torch.float32)
        for s in range(0, n, chunk):
            if stats is not None:
                logits = torch.nn.functional.linear(hidden_nD[s:s + chunk], weight_VD)
                lp, ent, stats[0, s:s + chunk], stats[1, s:s + chunk] = logprob_kernel.forward(
                    logits, targets_n[s:s + chunk], temperature, softcap)
                lp_n[s:s + chunk] = lp
                if want_entropy:
                    ent_n[s:s + chunk] = ent
                continue
            z, _ = _scaled_logits(hidden_nD[s:s + chunk], weight_VD, temperature, softcap)
            lse = torch.logsumexp(z, dim=-1)
            lp_n[s:s + chunk] = z.gather(-1, targets_n[s:s + chunk, None]).squeeze(-1) - lse
            if want_entropy:  # H = lse - sum_v p_v z_v, as a row-wise dot (no extra (c, V) block)
                ent_n[s:s + chunk] = lse - torch.linalg.vecdot(torch.softmax(z, dim=-1), z)
        ctx.save_for_backward(hidden_nD, weight_VD, targets_n, stats)
        ctx.options = (temperature, softcap, chunk)
        ctx.set_materialize_grads(False)
        return lp_n, ent_n

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden_nD, weight_VD, targets_n, stats = ctx.saved_tensors
        temperature, softcap, chunk = ctx.options
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden_nD, memory_format=torch.contiguous_format) if need_h else None
        acc = _acc_dtype(hidden_nD.dtype)
        grad_w = torch.zeros(weight_VD.shape, dtype=acc, device=weight_VD.device) if need_w else None
        if stats is not None:
            from .backends.triton import logprob_kernel

            # the kernel reads fp32 rows; a sum's gradient arrives expanded (stride 0): one copy, not one a chunk
            g_lp = None if g_lp is None else g_lp.float().contiguous()
            g_ent = None if g_ent is None else g_ent.float().contiguous()
        for s in range(0, hidden_nD.shape[0], chunk):
            h_cD = hidden_nD[s:s + chunk]
            if stats is not None:
                rows = slice(s, s + chunk)
                dl = logprob_kernel.backward_(
                    torch.nn.functional.linear(h_cD, weight_VD), targets_n[rows],
                    None if g_lp is None else g_lp[rows],
                    None if g_ent is None else g_ent[rows],
                    stats[0, rows], stats[1, rows], temperature, softcap)
            else:
                z, t = _scaled_logits(h_cD, weight_VD, temperature, softcap)
                dz = _dlogits(z, t, g_lp, g_ent, targets_n[s:s + chunk], s, chunk, temperature)
                dl = dz.to(weight_VD.dtype)
                del z, dz, t
            if need_h:
                torch.mm(dl, weight_VD, out=grad_h[s:s + chunk])
            if need_w:
                _add_weight_grad(grad_w, dl, h_cD)
        if need_w:
            grad_w = grad_w.to(weight_VD.dtype)
        return grad_h, grad_w, None, None, None, None, None, None


def _add_weight_grad(grad_w, dl, h_cD) -> None:
    """grad_w (V, D, fp32) += dl^T h for one chunk.

    For fp16 / bf16 chunks on CUDA the GEMM accumulates into grad_w itself (beta = 1, fp32 output):
    no (V, D) product in the chunk's dtype is written and then added (at a 151936-token vocabulary that
    add took 2.6x the GEMM's own time on an H200), and each chunk's product is not rounded to bf16
    before it is summed. Elsewhere (CPU, fp32 / fp64): product, then add.
    """
    if dl.is_cuda and dl.dtype != grad_w.dtype and dl.dtype in (torch.float16, torch.bfloat16):
        torch.addmm(grad_w, dl.t(), h_cD, out_dtype=grad_w.dtype, out=grad_w)
    else:
        grad_w += dl.t() @ h_cD


def _dlogits(z, t, g_lp, g_ent, targets_c, s, chunk, temperature):
    """d loss / d (capped, unscaled) logits of one chunk, in place in two (c, V) fp32 blocks.

    With p = softmax(z): d/dz of g*lp is g*(onehot - p); of g_ent*H it is -g_ent*p*(z - <p, z>).
    So dz = p * (-g - g_ent*(z - <p, z>)) + g*onehot, built in p's buffer with z as scratch.
    """
    p = torch.softmax(z, dim=-1)
    g = None if g_lp is None else g_lp[s:s + chunk].to(z.dtype)
    if g_ent is not None:
        mean_z = torch.linalg.vecdot(p, z)[:, None]
        z.sub_(mean_z).mul_(-g_ent[s:s + chunk].to(z.dtype)[:, None])
        if g is not None:
            z.sub_(g[:, None])
        dz = p.mul_(z)
    elif g is not None:
        dz = p.mul_(-g[:, None])
    else:
        return p.zero_()
    if g is not None:
        dz.scatter_add_(-1, targets_c[:, None], g[:, None])
    if temperature != 1.0:
        dz.div_(temperature)
    if t is not None:  # through cap*tanh(l/cap): times (1 - tanh^2)
        dz.mul_(t.square_().neg_().add_(1.0))
    return dz


def _check_lean_inputs(hidden, weight, targets, temperature, softcap, chunk_size):
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2:
        raise ValueError(f"hidden: expected a (n, D) tensor, got {getattr(hidden, 'shape', type(hidden).__name__)}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight: expected a (V, D={hidden.shape[1]}) tensor, got {getattr(weight, 'shape', type(weight).__name__)}")
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise ValueError(f"weight: expected hidden's dtype/device ({hidden.dtype}, {hidden.device}), got ({weight.dtype}, {weight.device})")
    if not isinstance(targets, torch.Tensor) or targets.shape != hidden.shape[:1] or targets.is_floating_point():
        raise ValueError(f"targets: expected ({hidden.shape[0]},) integer token ids, got {getattr(targets, 'shape', type(targets).__name__)}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature: expected a finite positive number, got {temperature!r}")
    if softcap is not None and not (isinstance(softcap, (int, float)) and math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap: expected None or a finite positive number, got {softcap!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size: expected None or an int >= 1, got {chunk_size!r}")


LOGPROB_IMPLS = ("auto", "torch", "triton")


def resolve_logprobs_impl(impl: str | None, hidden: torch.Tensor) -> str:
    """What reduces the log-prob head's chunks of logits for ``hidden``: ``"torch"`` or ``"triton"``.

    ``impl`` None reads ``DUALKV_LOGPROBS_IMPL`` (default ``"auto"``). ``"auto"`` takes Triton for fp16 /
    bf16 hidden states on a CUDA device where Triton runs (1.33-1.86x the PyTorch ops' forward + backward
    on an H200, benchmarks/results/logprobs_h200.md), else PyTorch. ``"triton"`` asked for where it
    cannot run is an error naming the argument (or the variable)."""
    source = "impl"
    if impl is None:
        impl, source = os.environ.get("DUALKV_LOGPROBS_IMPL", "auto"), "DUALKV_LOGPROBS_IMPL"
    if impl not in LOGPROB_IMPLS:
        raise ValueError(f"{source}: expected one of {LOGPROB_IMPLS}, got {impl!r}")
    if impl == "torch":
        return impl
    from .backends import triton as triton_backend

    if impl == "auto":
        fast = hidden.is_cuda and hidden.dtype in (torch.float16, torch.bfloat16)
        return "triton" if fast and triton_backend.is_available() else "torch"
    if not triton_backend.is_available():
        raise ValueError(f"{source}: 'triton' cannot run here: {triton_backend.unavailable_reason()}")
    triton_backend.check_tensor("hidden", hidden, "the triton log-prob kernels")
    return impl


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    softcap: float | None = None,
    return_entropy: bool = False,
    chunk_size: int | None = None,
    impl: str | None = None,
):
    """Log-probs (and entropies) of ``targets`` under ``softmax(cap(hidden @ weight.T) / temperature)``.

    Args:
        hidden: (n, D) final hidden states of the predicting tokens.
        weight: (V, D) LM-head weight (same dtype and device as hidden).
        targets: (n,) token ids.
        temperature: logits are divided by it after the softcap.
        softcap: final-logit softcap ``cap * tanh(l / cap)`` or None.
        return_entropy: also return the entropy of each row's distribution.
        chunk_size: rows per chunk; default keeps the chunk's one (chunk, V) block of logits near
            256 MiB: fp32 with ``impl="torch"``, the weights' dtype with the Triton kernels (twice
            the rows in bf16).
        impl: how each chunk's logits are reduced: ``"torch"`` (PyTorch ops on an fp32 copy),
            ``"triton"`` (one Triton kernel per direction over the logits in the weights' dtype,
            keeping each row's log-sum-exp and mean logit for backward; fp16 / bf16 / fp32 on CUDA,
            fp16 / fp32 under ``TRITON_INTERPRET=1``) or ``"auto"`` (Triton for fp16 / bf16 on CUDA,
            else PyTorch: ``resolve_logprobs_impl``). None reads ``DUALKV_LOGPROBS_IMPL`` (default
            ``"auto"``).
    Returns ``(logprobs (n,), entropy (n,) or None)``, float32 (float64 for float64 inputs),
    differentiable with respect to hidden and weight (the weight gradient is accumulated over the
    chunks in one fp32 (V, D) buffer and cast once).
    """
    _check_lean_inputs(hidden, weight, targets, temperature, softcap, chunk_size)
    impl = resolve_logprobs_impl(impl, hidden)
    block_bytes = weight.element_size() if impl == "triton" else torch.finfo(_acc_dtype(weight.dtype)).bits // 8
    chunk = chunk_size or max(1, _CHUNK_BYTES // (weight.shape[0] * block_bytes))
    if hidden.shape[0] == 0:
        # no rows (e.g. a sequence-parallel rank whose slice predicts no response token): keep the graph
        # connected to hidden and weight, so every rank's backward reaches the same parameters
        empty = hidden.new_zeros(0, dtype=_acc_dtype(hidden.dtype)) + (hidden.sum() + weight.sum()) * 0
        return empty, (empty.clone() if return_entropy else None)
    return _LinearLogProbs.apply(hidden, weight, targets.long(), float(temperature),
                                 None if softcap is None else float(softcap), chunk, return_entropy, impl)
