"""Routed experts: routers, the expert computation (grouped GEMM or a gather loop), load-balancing loss.

Shape legend: T tokens, D hidden, E experts, k experts per token (top-k), F expert intermediate
size, n = T * k routed (token, expert) pairs.

Expert weights are stored fused, as transformers holds them in memory: ``gate_up_proj (E, 2F, D)``
(gate rows first, then up rows) and ``down_proj (E, D, F)``. The routed pairs are sorted by expert
once; the grouped path then runs two grouped GEMMs (``torch.nn.functional.grouped_mm`` /
``torch._grouped_mm``) over the contiguous groups (no host sync), the loop path one GEMM pair per
expert that received tokens. Each token's k weighted outputs are summed in fp32 in slot order (no
atomics: deterministic). Every MoE layer sees the packed tokens only (P + N*R), never the
replicated N*(P+R).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .config import MoEConfig
from .layers import RMSNorm, activation_fn, gated_activation

__all__ = [
    "Experts",
    "SoftmaxTopKRouter",
    "Gemma4Router",
    "RouterStats",
    "router_stats",
    "load_balancing_loss",
    "grouped_mm_available",
    "MOE_BACKENDS",
]

MOE_BACKENDS = ("auto", "grouped", "loop")


class RouterStats(NamedTuple):
    """Per-layer load-balancing statistics, sums over tokens weighted by ``token_weight``.

    prob_sum_E: sum_t w_t * p_t (differentiable), count_E: sum_t w_t * [expert chosen for t],
    total: sum_t w_t (a 0-d float32 tensor). Sums, so ranks of a sequence-parallel group can
    all-reduce them before ``load_balancing_loss``.
    """

    prob_sum_E: torch.Tensor
    count_E: torch.Tensor
    total: torch.Tensor


def router_stats(probs_TE: torch.Tensor, idx_Tk: torch.Tensor, token_weight_T: torch.Tensor) -> RouterStats:
    """Statistics of one layer from its router probabilities (T, E), choices (T, k), token weights (T,)."""
    w_T = token_weight_T.float()
    E = probs_TE.shape[-1]
    count_E = torch.zeros(E, dtype=torch.float32, device=probs_TE.device)
    count_E.scatter_add_(0, idx_Tk.reshape(-1), w_T.repeat_interleave(idx_Tk.shape[1]))
    prob_sum_E = (probs_TE.float() * w_T[:, None]).sum(0)
    return RouterStats(prob_sum_E, count_E, w_T.sum())


def load_balancing_loss(stats: list[RouterStats]) -> torch.Tensor:
    """Switch-Transformer balance loss over all MoE layers, as transformers computes it.

    E * sum_e f_e * P_e with f_e = (routed count of e) / (tokens) and P_e = (summed router
    probability of e) / (tokens), both summed over layers before normalising.
    """
    if not stats:
        raise ValueError("stats: expected the router statistics of at least one MoE layer, got none")
    prob = torch.stack([s.prob_sum_E for s in stats]).sum(0)
    count = torch.stack([s.count_E for s in stats]).sum(0)
    total = torch.stack([s.total for s in stats]).sum()
    return (count / total * (prob / total)).sum() * prob.shape[0]


# --------------------------------------------------------------------------------------- routers

class SoftmaxTopKRouter(nn.Module):
    """Qwen3-MoE router: logits = x W^T, p = softmax(logits) in fp32, top-k, optional renormalisation.

    Returns probs_TE (fp32), idx_Tk, weight_Tk (in the logits' dtype).
    """

    def __init__(self, cfg: MoEConfig, hidden_size: int):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, hidden_size))

    def forward(self, x_TD: torch.Tensor):
        logits_TE = F.linear(x_TD, self.weight)
        probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
        top_Tk, idx_Tk = torch.topk(probs_TE, self.cfg.top_k, dim=-1)
        if self.cfg.norm_topk_prob:
            top_Tk = top_Tk / top_Tk.sum(dim=-1, keepdim=True)
        return probs_TE, idx_Tk, top_Tk.to(logits_TE.dtype)


class Gemma4Router(nn.Module):
    """Gemma-4 router: scale-free RMSNorm, times a learned scale and hidden**-0.5, linear, softmax
    (fp32), top-k, renormalised, times a learned per-expert scale. Weights stay fp32."""

    def __init__(self, cfg: MoEConfig, hidden_size: int, norm_eps: float):
        super().__init__()
        self.cfg = cfg
        self.root_size = hidden_size ** -0.5
        self.norm = RMSNorm(hidden_size, norm_eps, "gemma4", with_scale=False)
        self.proj = nn.Linear(hidden_size, cfg.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.num_experts))

    def forward(self, x_TD: torch.Tensor):
        h_TD = self.norm(x_TD) * self.scale * self.root_size
        probs_TE = torch.softmax(self.proj(h_TD), dim=-1, dtype=torch.float32)
        top_Tk, idx_Tk = torch.topk(probs_TE, self.cfg.top_k, dim=-1)
        top_Tk = top_Tk / top_Tk.sum(dim=-1, keepdim=True)
        return probs_TE, idx_Tk, top_Tk * self.per_expert_scale[idx_Tk]


# --------------------------------------------------------------------------------------- experts

def _grouped_mm_fn():
    """``torch.nn.functional.grouped_mm`` (torch >= 2.10) or ``torch._grouped_mm``, or None."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm_available(x: torch.Tensor) -> bool:
    """Grouped GEMM for this tensor: CUDA, bf16, compute capability >= 9.0 (>= 8.0 with the public
    ``torch.nn.functional.grouped_mm``)."""
    if _grouped_mm_fn() is None or not x.is_cuda or x.dtype != torch.bfloat16:
        return False
    need = (8, 0) if hasattr(F, "grouped_mm") else (9, 0)
    return torch.cuda.get_device_capability(x.device) >= need


class Experts(nn.Module):
    """E gated-MLP experts with fused weights; ``forward(x_TD, idx_Tk, weight_Tk)`` -> out_TD.

    backend: ``grouped`` (``torch._grouped_mm``), ``loop`` (one GEMM pair per expert with tokens),
    ``auto`` (grouped where ``grouped_mm_available``, else loop).
    """

    def __init__(self, cfg: MoEConfig, hidden_size: int):
        super().__init__()
        self.cfg = cfg
        E, Fi = cfg.num_experts, cfg.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * Fi, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(E, hidden_size, Fi))
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)
        activation_fn(cfg.activation)  # checks the name
        self.activation = cfg.activation
        self.backend = "auto"

    def _glu(self, h_n2F: torch.Tensor) -> torch.Tensor:
        gate_nF, up_nF = h_n2F.chunk(2, dim=-1)
        return gated_activation(gate_nF, up_nF, self.activation)

    def _grouped(self, x_nD: torch.Tensor, ends_E: torch.Tensor) -> torch.Tensor:
        grouped_mm = _grouped_mm_fn()
        if grouped_mm is None:
            raise RuntimeError("backend 'grouped' needs torch.nn.functional.grouped_mm or torch._grouped_mm (torch >= 2.8)")
        offs_E = ends_E.to(torch.int32)
        h_n2F = grouped_mm(x_nD, self.gate_up_proj.transpose(-2, -1), offs=offs_E)
        return grouped_mm(self._glu(h_n2F), self.down_proj.transpose(-2, -1), offs=offs_E)

    def _loop(self, x_nD: torch.Tensor, ends_E: torch.Tensor) -> torch.Tensor:
        outs, start = [], 0
        counts_E = torch.diff(ends_E, prepend=ends_E.new_zeros(1))
        for e, c in enumerate(counts_E.tolist()):  # one host sync per layer: the loop needs the counts
            if c:
                h_c2F = F.linear(x_nD[start:start + c], self.gate_up_proj[e])
                outs.append(F.linear(self._glu(h_c2F), self.down_proj[e]))
                start += c
        return torch.cat(outs)

    def forward(self, x_TD: torch.Tensor, idx_Tk: torch.Tensor, weight_Tk: torch.Tensor) -> torch.Tensor:
        if self.backend not in MOE_BACKENDS:
            raise ValueError(f"backend: expected one of {MOE_BACKENDS}, got {self.backend!r}")
        k = idx_Tk.shape[1]
        flat_n = idx_Tk.reshape(-1)
        order_n = torch.argsort(flat_n, stable=True)
        token_n = order_n // k
        # where each expert's rows end in expert order; bincount would read its input's maximum on the host
        experts_E = torch.arange(self.cfg.num_experts, device=flat_n.device, dtype=flat_n.dtype)
        ends_E = torch.searchsorted(flat_n[order_n], experts_E, right=True)
        use_grouped = self.backend == "grouped" or (self.backend == "auto" and grouped_mm_available(x_TD))
        x_nD = x_TD[token_n]
        y_nD = self._grouped(x_nD, ends_E) if use_grouped else self._loop(x_nD, ends_E)
        # back to (token, slot) order, weight, and sum each token's k outputs in fp32: no atomics
        y_TkD = y_nD.new_empty(y_nD.shape).index_copy(0, order_n, y_nD).view(*idx_Tk.shape, -1)
        y_TkD = (y_TkD * weight_Tk[..., None]).to(x_TD.dtype)
        return y_TkD.float().sum(1).to(x_TD.dtype)
