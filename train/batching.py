"""Micro-batches by packed-token budget, balanced over data-parallel ranks; never splitting a group.

A mini-batch (the groups one optimizer step sees) is planned in two steps, identically on every rank
(every rank holds the whole mini-batch, so no communication is needed):

1. groups are spread over the dp ranks by longest-processing-time: largest group first, each to the
   rank with the least work so far (work = the group's token count, ties broken by fewer groups);
2. each rank packs its groups into micro-batches first-fit-decreasing under ``token_budget``; a group
   larger than the budget gets a micro-batch of its own (groups are never split).

FSDP needs every rank to run the same number of forward/backward passes, so ranks with fewer
micro-batches split their multi-group micro-batches (never exceeding the budget) and, if still short,
run *padding* micro-batches: a real group with loss weight 0, so collectives stay in step.

The token count of a group depends on the packing: ``dualkv`` counts P + sum R (the prompt once),
``replicated`` counts sum (P + R) (the prompt in every row). The same planner serves both, and the
layout builder turns a micro-batch into a ``PackedLayout``: for ``replicated``, every response becomes a
group of its own with its own copy of the prompt, so the model runs the identical code on N(P+R)
tokens (the baseline DualKV must equal).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from dualkv.core import PackedLayout
from dualkv.core.layout import to_device

from .rollout import RolloutBatch, RolloutGroup

__all__ = ["Packing", "MicroBatch", "group_tokens", "balance_groups", "pack_micro_batches", "plan_micro_batches",
           "MicroBatchData", "build_micro_batch"]

Packing = Literal["dualkv", "replicated"]
PACKINGS = ("dualkv", "replicated")


def group_tokens(group: RolloutGroup, packing: Packing) -> int:
    """Tokens the model runs for this group under ``packing``."""
    if packing == "dualkv":
        return group.packed_tokens
    if packing == "replicated":
        return group.replicated_tokens
    raise ValueError(f"packing: expected one of {PACKINGS}, got {packing!r}")


@dataclass(frozen=True)
class MicroBatch:
    """Indices of groups in the mini-batch; ``padding`` = run for lockstep only, with loss weight 0."""

    groups: tuple[int, ...]
    tokens: int
    padding: bool = False


def balance_groups(costs: list[int], num_ranks: int) -> list[list[int]]:
    """Longest-processing-time assignment of groups (by cost) to ranks; each rank's list sorted.

    With fewer groups than ranks some ranks get none (they run padding micro-batches only)."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks: expected >= 1, got {num_ranks}")
    load = [0] * num_ranks
    members: list[list[int]] = [[] for _ in range(num_ranks)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(num_ranks), key=lambda r: (load[r], len(members[r]), r))
        load[r] += costs[i]
        members[r].append(i)
    return [sorted(m) for m in members]


def pack_micro_batches(indices: list[int], costs: list[int], token_budget: int) -> list[list[int]]:
    """First-fit-decreasing bins of ``indices`` under ``token_budget`` (oversized groups alone)."""
    if token_budget < 1:
        raise ValueError(f"token_budget: expected >= 1 token per micro-batch, got {token_budget}")
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(indices, key=lambda i: (-costs[i], i)):
        for b, load in enumerate(loads):
            if load + costs[i] <= token_budget:
                bins[b].append(i)
                loads[b] += costs[i]
                break
        else:
            bins.append([i])
            loads.append(costs[i])
    return bins


def _split_to(bins: list[list[int]], costs: list[int], count: int) -> list[list[int]]:
    """Split the heaviest multi-group bins in two (balanced) until there are ``count`` bins or none can split."""
    bins = [list(b) for b in bins]
    while len(bins) < count:
        splittable = [b for b in bins if len(b) > 1]
        if not splittable:
            break
        heavy = max(splittable, key=lambda b: sum(costs[i] for i in b))
        bins.remove(heavy)
        halves: list[list[int]] = [[], []]
        for i in sorted(heavy, key=lambda i: (-costs[i], i)):
            min(halves, key=lambda h: sum(costs[j] for j in h)).append(i)
        bins += halves
    return bins


def plan_micro_batches(batch: RolloutBatch | Sequence[RolloutGroup], packing: Packing, token_budget: int,
                       dp_size: int = 1) -> list[list[MicroBatch]]:
    """Per dp rank, its micro-batches (indices into the batch's groups); every rank gets the same number."""
    groups = batch.groups if isinstance(batch, RolloutBatch) else batch
    costs = [group_tokens(g, packing) for g in groups]
    per_rank = [pack_micro_batches(m, costs, token_budget) for m in balance_groups(costs, dp_size)]
    count = max(len(b) for b in per_rank)
    plans = []
    for bins in per_rank:
        bins = _split_to(bins, costs, count)
        bins.sort(key=lambda b: (-sum(costs[i] for i in b), b))
        mbs = [MicroBatch(tuple(sorted(b)), sum(costs[i] for i in b)) for b in bins]
        mine = [i for b in bins for i in b] or list(range(len(costs)))
        smallest = min(mine, key=lambda i: (costs[i], i))
        mbs += [MicroBatch((smallest,), costs[smallest], padding=True)] * (count - len(mbs))
        plans.append(mbs)
    return plans


@dataclass
class MicroBatchData:
    """Everything one forward needs, on the compute device.

    layout: the micro-batch's ``PackedLayout`` (rows = responses, group by group, in both packings).
    mask: (B, R_max) bool real response tokens; advantages: (B,) float32;
    old_logprobs / ref_logprobs: (B, R_max) float32 from the rollout or an earlier pass, else None;
    weight: 1.0, or 0.0 for a padding micro-batch.
    """

    layout: PackedLayout
    mask: torch.Tensor
    advantages: torch.Tensor | None
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    weight: float
    rows: int
    tokens: int


def _pad_rows(values: list[torch.Tensor], width: int, device) -> torch.Tensor:
    out = torch.zeros(len(values), width, dtype=torch.float32)
    for b, v in enumerate(values):
        out[b, : v.numel()] = v
    return to_device(out, device)


def build_micro_batch(groups: Sequence[RolloutGroup], mb: MicroBatch, packing: Packing,
                      device: torch.device | str) -> MicroBatchData:
    """The layout and per-row tensors of micro-batch ``mb`` (indices into ``groups``, the mini-batch)."""
    groups = [groups[i] for i in mb.groups]
    if packing == "dualkv":
        pairs = [(g.prompt_ids, list(g.response_ids)) for g in groups]
    elif packing == "replicated":
        pairs = [(g.prompt_ids, [r]) for g in groups for r in g.response_ids]
    else:
        raise ValueError(f"packing: expected one of {PACKINGS}, got {packing!r}")
    layout = PackedLayout.from_groups(pairs, device=device)
    width = layout.max_response_len

    def rows_of(name):
        if getattr(groups[0], name) is None:
            return None
        return _pad_rows([v for g in groups for v in getattr(g, name)], width, device)

    adv = None if groups[0].advantages is None else to_device(torch.cat([g.advantages.float() for g in groups]), device)
    return MicroBatchData(layout=layout, mask=layout.response_mask(), advantages=adv,
                          old_logprobs=rows_of("old_logprobs"), ref_logprobs=rows_of("ref_logprobs"),
                          weight=0.0 if mb.padding else 1.0, rows=layout.num_rows, tokens=layout.total_tokens)
