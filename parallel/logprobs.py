"""Response log-probs under sequence parallelism, without any rank gathering full-vocab logits.

Which rank computes which log-prob: token ``t`` of a response is predicted from *slot* ``t - 1``
(the usual shift), and the rank whose slice holds the slot computes it. For a response's later tokens
the slot's own hidden state is the predictor. For a response's FIRST token the slot is the last token
of the previous response (or, for a group's first response, the last prompt token), and the predictor
is the group's LAST PROMPT TOKEN's hidden state, which may live on another rank::

    packed   p0 p1 p2 | a0 a1 b0 | b1 .. ..        (P=3, responses a, b; sp=3, L=3)
    rank          0   |     1    |     2
    b0's slot is a1 (rank 1) but its predictor is p2 (rank 0)

One all-reduce of a (G, D) tensor (each group's last-prompt hidden state, zero on non-owners) makes
every group's predictor available everywhere, independent of context length. Its backward is an
all-reduce of the gradient, which sums every rank's contribution into the owner's rows.

Each rank then computes logits only for its slots, takes log-probs (and entropies), and a sum over
the SP group of the (sum R,) per-token values (zeros where another rank computed) yields the
(B, R_max) rows on every rank.

Gradient convention: the returned rows are the same on every SP rank and so is the loss built on
them; every rank backpropagates it and the SP ranks' parameter gradients ADD UP to the single-device
gradient (the final sum's backward passes each rank its own entries, no communication).

Shape suffixes: T packed tokens, L tokens per rank, D hidden size, G groups, V vocab, n this rank's
log-prob slots, N all response tokens (sum R), B rows, R longest response.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dualkv.core.layout import to_device

from .groups import as_process_group, group_size
from .sequence import SequenceShard, shard_sequence

__all__ = [
    "all_reduce_sum",
    "share_last_prompt_hidden",
    "LogprobPlan",
    "plan_logprobs",
    "LogprobHead",
    "logits_head",
    "linear_head",
    "model_head",
    "logprobs_from_hidden",
    "sp_hidden_states",
    "sp_response_logprobs",
    "sp_router_stats",
]


# ---------------------------------------------------------------- collectives with autograd
class _AllReduceSum(torch.autograd.Function):
    """y = sum over ranks of x; every rank's loss depends on y, so dL/dx = sum over ranks of dL/dy."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        y = x.clone()
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        grad_x = grad_y.contiguous().clone()
        dist.all_reduce(grad_x, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad_x, None


class _SumOfReplicatedLoss(torch.autograd.Function):
    """y = sum over ranks of x, for a loss that is the SAME on every rank: dL/dx = dL/dy, locally."""

    @staticmethod
    def forward(ctx, x, group):
        y = x.clone()
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        return grad_y, None


def all_reduce_sum(x: torch.Tensor, sp_group) -> torch.Tensor:
    """Differentiable sum over the SP group; backward sums the gradients of every rank (each rank's
    own loss may use the result)."""
    if group_size(sp_group) == 1:
        return x
    return _AllReduceSum.apply(x, as_process_group(sp_group))


# ---------------------------------------------------------------- the last-prompt-token hidden state
def share_last_prompt_hidden(hidden_LD: torch.Tensor, layout, shard: SequenceShard, sp_group) -> torch.Tensor:
    """(L, D) this rank's hidden states -> (G, D) every group's last-prompt-token hidden state, on all ranks.

    One (G, D) all-reduce: the owner of group g's last prompt token contributes its row, the others
    zeros. Backward: the gradient of row g, summed over all ranks, reaches the owner's token."""
    if hidden_LD.dim() != 2 or hidden_LD.shape[0] != shard.local_tokens:
        raise ValueError(
            f"hidden: expected ({shard.local_tokens}, D) (this rank's slice), got {tuple(hidden_LD.shape)}"
        )
    last_G = layout.group_last_prompt_token.to(hidden_LD.device)
    owned_G = (last_G >= shard.start) & (last_G < shard.end)
    rows_GD = hidden_LD[(last_G - shard.start).clamp(0, shard.local_tokens - 1)]
    mine_GD = torch.where(owned_G[:, None], rows_GD, torch.zeros_like(rows_GD))
    return all_reduce_sum(mine_GD, sp_group)


# ---------------------------------------------------------------- which rank computes which log-prob
@dataclass(frozen=True)
class LogprobPlan:
    """This rank's log-prob slots, in ``layout.logprob_index()`` order restricted to the rank.

    item (n,) int64: position of each local slot in the (N,) ``logprob_index`` order.
    source (n,) int64: row of ``cat([hidden_LD, last_prompt_GD])`` that predicts it.
    target (n,) int64: packed position of the predicted token (its id is ``layout.input_ids[target]``).
    """

    item: torch.Tensor
    source: torch.Tensor
    target: torch.Tensor


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layout -> {(rank, size): plan}


def plan_logprobs(layout, shard: SequenceShard) -> LogprobPlan:
    """Plan this rank's slots from the layout's host lengths (no device synchronisation)."""
    if shard.total_tokens != layout.total_tokens:
        raise ValueError(f"shard: expected a shard of T={layout.total_tokens} tokens, got T={shard.total_tokens}")
    cache = _PLANS.setdefault(layout, {})
    key = (shard.rank, shard.size)
    if key not in cache:
        lens_B = torch.tensor(layout.row_lens)
        starts_B = torch.tensor(layout.row_starts)
        within_N = torch.arange(int(lens_B.sum())) - torch.repeat_interleave(torch.cumsum(lens_B, 0) - lens_B, lens_B)
        target_N = torch.repeat_interleave(starts_B, lens_B) + within_N
        slot_N = target_N - 1
        group_N = torch.repeat_interleave(torch.tensor(layout.row_group), lens_B)
        source_N = torch.where(within_N == 0, shard.local_tokens + group_N, slot_N - shard.start)
        item = ((slot_N >= shard.start) & (slot_N < shard.end)).nonzero().squeeze(1)
        dev = layout.device
        cache[key] = LogprobPlan(item=to_device(item, dev), source=to_device(source_N[item], dev),
                                 target=to_device(target_N[item], dev))
    return cache[key]


# ---------------------------------------------------------------- log-probs
class LogprobHead:
    """``head(hidden (n, D), targets (n,), temperature, return_entropy) -> (logprobs (n,), entropy (n,) | None)``.

    Build one with ``logits_head``, ``linear_head`` or ``model_head``."""

    def __init__(self, fn, name: str):
        self.fn, self.name = fn, name

    def __call__(self, hidden_nD, targets_n, temperature, return_entropy):
        return self.fn(hidden_nD, targets_n, temperature, return_entropy)

    def __repr__(self) -> str:
        return f"LogprobHead({self.name})"


def logits_head(compute_logits) -> LogprobHead:
    """Log-prob head from a ``(n, D) -> (n, V)`` logits function (materialises (n, V) fp32)."""
    if not callable(compute_logits):
        raise ValueError(f"compute_logits: expected a callable (n, D) -> (n, V), got {type(compute_logits).__name__}")

    def run(hidden_nD, targets_n, temperature, return_entropy):
        z_nV = compute_logits(hidden_nD).float()
        if temperature != 1.0:
            z_nV = z_nV / temperature
        logp_nV = torch.log_softmax(z_nV, dim=-1)
        lp_n = logp_nV.gather(-1, targets_n[:, None]).squeeze(-1)
        return lp_n, (-(logp_nV.exp() * logp_nV).sum(-1) if return_entropy else None)

    return LogprobHead(run, "logits")


def linear_head(weight_VD, softcap=None, chunk_size=None, impl=None) -> LogprobHead:
    """Memory-lean log-prob head of an LM-head weight (``dualkv.core.logprobs.linear_logprobs``, with
    its ``impl``): logits in chunks, recomputed in backward, never (n, V) fp32 at once."""
    from dualkv.core.logprobs import linear_logprobs

    def run(hidden_nD, targets_n, temperature, return_entropy):
        return linear_logprobs(hidden_nD, weight_VD, targets_n, temperature=temperature, softcap=softcap,
                               return_entropy=return_entropy, chunk_size=chunk_size, impl=impl)

    return LogprobHead(run, "linear")


def model_head(model, chunk_size=None):
    """The lean head for a ``dualkv.models.CausalLM`` (bias-free ``lm_head`` + ``config.final_logit_softcap``,
    its ``logprobs_impl``), else ``logits_head(model.compute_logits)``."""
    lm_head, config = getattr(model, "lm_head", None), getattr(model, "config", None)
    if isinstance(lm_head, torch.nn.Linear) and lm_head.bias is None and hasattr(config, "final_logit_softcap"):
        return linear_head(lm_head.weight, config.final_logit_softcap, chunk_size, getattr(model, "logprobs_impl", None))
    return logits_head(model.compute_logits)


def logprobs_from_hidden(
    head,
    hidden_LD: torch.Tensor,
    layout,
    sp_group,
    temperature: float = 1.0,
    return_entropy: bool = False,
):
    """This rank's hidden states -> (B, R_max) response log-probs on every SP rank.

    Args:
        head: a ``LogprobHead``: ``logits_head(compute_logits)``, ``linear_head(weight, softcap)`` or
            ``model_head(model)``.
        hidden_LD: (L, D) final hidden states of this rank's slice (``shard_sequence``).
        layout: the whole micro-batch's ``PackedLayout`` (with input_ids).
        sp_group: SP process group, 1-D DeviceMesh, or None (single device).
    Returns logprobs (B, R_max) float32 zero-padded [, entropy (B, R_max)]; identical on every SP rank.
    """
    if layout.input_ids is None:
        raise ValueError("layout: expected a layout carrying input_ids (from_groups / from_rows), got one built from lengths only")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature: expected a positive number, got {temperature!r}")
    if not isinstance(head, LogprobHead):
        raise ValueError(f"head: expected a LogprobHead (logits_head / linear_head / model_head), got {type(head).__name__}")
    shard = shard_sequence(layout, sp_group)
    last_GD = share_last_prompt_hidden(hidden_LD, layout, shard, sp_group)
    plan = plan_logprobs(layout, shard)
    source_nD = torch.cat([hidden_LD, last_GD])[plan.source]
    lp_n, ent_n = head(source_nD, layout.input_ids[plan.target], float(temperature), return_entropy)
    values_nc = torch.stack([lp_n, ent_n], dim=1) if return_entropy else lp_n[:, None]
    values_Nc = values_nc.new_zeros(sum(layout.row_lens), values_nc.shape[1]).index_put((plan.item,), values_nc)
    if shard.size > 1:
        values_Nc = _SumOfReplicatedLoss.apply(values_Nc, as_process_group(sp_group))
    rows_BRc = layout.unpack_logprobs(values_Nc)
    return (rows_BRc[..., 0], rows_BRc[..., 1]) if return_entropy else rows_BRc[..., 0]


def sp_hidden_states(model, layout, sp_group, *, pad_id: int = 0) -> torch.Tensor:
    """(L, D) final hidden states of this rank's slice: ``model.hidden_states`` on the slice's tokens
    and positions (with ``token_offset`` where the model takes it, for MoE router statistics)."""
    from .parallelize import check_parallelized

    check_parallelized(model, sp_group)
    shard = shard_sequence(layout, sp_group)
    kwargs = {"token_offset": shard.start} if _takes_token_offset(model) else {}
    return model.hidden_states(shard.input_ids(layout, pad_id), shard.position_ids(layout), layout, **kwargs)


def _takes_token_offset(model) -> bool:
    try:
        return "token_offset" in inspect.signature(model.hidden_states).parameters
    except (TypeError, ValueError):
        return False


def sp_response_logprobs(model, layout, sp_group, temperature: float = 1.0, return_entropy: bool = False, *,
                         pad_id: int = 0, chunk_size: int | None = None):
    """Response log-probs of a ``dualkv.models`` causal LM under Ulysses sequence parallelism.

    Every rank of ``sp_group`` calls this with the SAME ``layout`` (the whole micro-batch); each runs
    the model on its slice only. The model must have been prepared with
    ``parallelize_sequence(model, sp_group)`` (not needed when the group has one rank or is None).

    Returns (B, R_max) float32 log-probs (and entropies if ``return_entropy``), zero-padded, the same
    on every SP rank; backward through a loss on them gives each rank its share of the parameter
    gradients, and the SP ranks' shares add up to the single-device gradient. MoE models: the
    router statistics the model keeps are this rank's; ``sp_router_stats`` sums them over the group.
    """
    hidden_LD = sp_hidden_states(model, layout, sp_group, pad_id=pad_id)
    return logprobs_from_hidden(model_head(model, chunk_size), hidden_LD, layout, sp_group, temperature, return_entropy)


# ---------------------------------------------------------------- MoE router statistics
def sp_router_stats(stats, sp_group):
    """Per-layer router statistics (NamedTuples of sums, e.g. ``dualkv.models.RouterStats``: every
    field a sum over tokens) summed over the SP group, in one all-reduce.

    The result is the same on every rank, and so is a loss built from it (the load-balancing loss),
    so the backward passes each rank its own share (the SP ranks' gradients add up)."""
    stats = list(stats)
    if not stats or group_size(sp_group) == 1:
        return stats
    flat = [t.float().reshape(-1) for s in stats for t in s]
    summed = _SumOfReplicatedLoss.apply(torch.cat(flat), as_process_group(sp_group))
    pieces, out, i = summed.split([t.numel() for t in flat]), [], 0
    for s in stats:
        fields = []
        for t in s:
            fields.append(pieces[i].reshape(t.shape).to(t.dtype))
            i += 1
        out.append(type(s)(*fields))
    return out
