"""Micro-batches by packed-token budget, dp balancing, layouts for both packings."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dualkv.train.batching import (
    balance_groups,
    build_micro_batch,
    group_tokens,
    pack_micro_batches,
    plan_micro_batches,
)
from dualkv.train.rollout import RolloutBatch, RolloutGroup


def _batch(shapes, seed=0):
    """shapes: [(P, [R, ...]), ...] -> a batch with random tokens and rewards."""
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for g, (p, rs) in enumerate(shapes):
        groups.append(RolloutGroup(
            torch.randint(0, 50, (p,), generator=gen),
            [torch.randint(0, 50, (r,), generator=gen) for r in rs],
            torch.rand(len(rs), generator=gen), uid=g,
            old_logprobs=[-torch.rand(r, generator=gen) for r in rs]))
    return RolloutBatch(groups)


def test_group_tokens_by_packing():
    g = _batch([(10, [2, 3, 4])]).groups[0]
    assert group_tokens(g, "dualkv") == 10 + 9
    assert group_tokens(g, "replicated") == 30 + 9
    with pytest.raises(ValueError, match="packing"):
        group_tokens(g, "padded")


def test_packed_budget_fits_groups_the_replicated_budget_cannot():
    # 4 groups of P=100, N=4, R=10: packed 140 tokens, replicated 440 tokens each.
    b = _batch([(100, [10] * 4)] * 4)
    (packed,) = plan_micro_batches(b, "dualkv", token_budget=300)
    (replicated,) = plan_micro_batches(b, "replicated", token_budget=300)
    assert [m.groups for m in packed] == [(0, 1), (2, 3)] and all(m.tokens == 280 for m in packed)
    assert len(replicated) == 4 and all(m.tokens == 440 for m in replicated)  # oversized: one group each


def test_balance_groups_hand_case():
    # LPT: 9 -> r0, 7 -> r1, 6 -> r2, 5 -> r2 (6 least), 4 -> r1 (7), 3 -> r0 (9)... loads 12, 11, 11
    assert balance_groups([9, 7, 6, 5, 4, 3], 3) == [[0, 5], [1, 4], [2, 3]]
    assert balance_groups([1, 2], 3) == [[1], [0], []]
    with pytest.raises(ValueError, match="num_ranks"):
        balance_groups([1, 2], 0)


def test_pack_micro_batches_hand_case():
    assert pack_micro_batches([0, 1, 2, 3, 4], [6, 5, 4, 3, 12], token_budget=10) == [[4], [0, 2], [1, 3]]
    with pytest.raises(ValueError, match="token_budget"):
        pack_micro_batches([0], [1], 0)


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(1, 40), st.lists(st.integers(1, 20), min_size=1, max_size=6)), min_size=1, max_size=14),
    budget=st.integers(10, 200),
    dp=st.integers(1, 4),
    packing=st.sampled_from(["dualkv", "replicated"]),
)
def test_plan_invariants(shapes, budget, dp, packing):
    b = _batch(shapes)
    plans = plan_micro_batches(b, packing, budget, dp)
    costs = [group_tokens(g, packing) for g in b.groups]
    assert len(plans) == dp and len({len(p) for p in plans}) == 1  # same number of passes everywhere
    real = [i for p in plans for m in p if not m.padding for i in m.groups]
    assert sorted(real) == list(range(len(shapes)))  # every group exactly once, never split
    for p in plans:
        assert any(not m.padding for m in p) or len(shapes) < dp  # a rank idles only without enough groups
        for m in p:
            assert m.tokens == sum(costs[i] for i in m.groups)
            assert m.tokens <= budget or len(m.groups) == 1  # only a lone oversized group may exceed
    loads = [sum(m.tokens for m in p if not m.padding) for p in plans]
    assert max(loads) - min(loads) <= max(costs)  # LPT bound


@settings(max_examples=40, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(1, 40), st.lists(st.integers(1, 20), min_size=1, max_size=6)), min_size=1, max_size=10),
    budgets=st.tuples(st.integers(1, 200), st.integers(1, 400)),
    dp=st.integers(1, 4),
)
def test_every_budget_gives_a_rank_the_same_groups(shapes, budgets, dp):
    """The no-grad passes may take another budget than the update: each rank's plan under either one
    reads the same groups (padding micro-batches included), so the passes fill what the update reads."""
    b = _batch(shapes)
    one, other = (plan_micro_batches(b, "dualkv", budget, dp) for budget in budgets)
    for p, q in zip(one, other):
        assert {i for m in p for i in m.groups} == {i for m in q for i in m.groups}


def test_padding_micro_batches_keep_ranks_in_step():
    # rank 0 gets the big group (2 micro-batches are impossible for one group) -> rank 1 splits or pads
    b = _batch([(50, [10] * 4), (5, [2]), (5, [2]), (5, [2])])
    plans = plan_micro_batches(b, "dualkv", token_budget=20, dp_size=2)
    assert [len(p) for p in plans] == [2, 2]
    assert [m.groups for m in plans[0]] == [(0,), (0,)] and [m.padding for m in plans[0]] == [False, True]
    assert sorted(i for m in plans[1] for i in m.groups) == [1, 2, 3] and not any(m.padding for m in plans[1])


def test_layouts_of_both_packings_hold_the_same_rows():
    b = _batch([(7, [3, 1, 5]), (2, [4, 2])])
    plan = plan_micro_batches(b, "dualkv", token_budget=1000)[0]
    d = build_micro_batch(b.groups, plan[0], "dualkv", "cpu")
    r = build_micro_batch(b.groups, plan[0], "replicated", "cpu")
    assert d.layout.num_groups == 2 and r.layout.num_groups == 5
    assert d.tokens == 7 + 9 + 2 + 6 and r.tokens == 3 * 7 + 9 + 2 * 2 + 6
    assert torch.equal(d.mask, r.mask) and torch.equal(d.old_logprobs, r.old_logprobs)
    # row b's response tokens are the same in both layouts
    for lay in (d.layout, r.layout):
        _, tgt = lay.logprob_index()
        assert lay.input_ids[tgt].tolist() == [t for g in b.groups for resp in g.response_ids for t in resp.tolist()]
    assert d.old_logprobs[0, :3].tolist() == b.groups[0].old_logprobs[0].tolist() and d.old_logprobs[1, 1:].eq(0).all()
