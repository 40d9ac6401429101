"""dualkv.parallel pieces that need no process group: slicing, the K/V head mapping, the log-prob
plan, argument checks. (Multi-rank behaviour: test_parallel_sp.py.)"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from dualkv.core import PackedLayout
from dualkv.parallel import (
    SequenceShard,
    UlyssesAttention,
    gather_sequence,
    kv_replication_factor,
    pad_to_multiple,
    plan_logprobs,
    replicate_kv_heads,
    shard_sequence,
    ulysses_attention,
)
from dualkv.parallel.groups import as_process_group
from helpers import count_calls


def _layout(prompts, responses):
    return PackedLayout.from_lengths(prompts, responses)


# ---------------------------------------------------------------- slicing
@pytest.mark.parametrize("T, sp", [(10, 4), (12, 4), (1, 8), (9, 8), (97, 2), (7, 1)])
def test_shards_cover_the_sequence_once_with_padding_at_the_end(T, sp):
    x_T = torch.arange(T) + 100
    shards = [SequenceShard.build(T, r, sp) for r in range(sp)]
    L = -(-T // sp)
    assert all(s.local_tokens == L and s.padded_tokens == sp * L for s in shards)
    joined = torch.cat([s.slice(x_T, pad_value=-1) for s in shards])
    assert torch.equal(joined[:T], x_T)
    assert torch.equal(joined[T:], torch.full((sp * L - T,), -1))
    assert sum(s.num_valid for s in shards) == T
    assert [int(shards[0].owner(t)) for t in range(T)] == [t // L for t in range(T)]


def test_shard_slices_input_and_positions_of_the_layout():
    lay = PackedLayout.from_groups([(torch.tensor([5, 6, 7]), [torch.tensor([8, 9]), torch.tensor([10])])])
    s = shard_sequence(lay, rank=1, size=4)  # T = 6, L = 2
    assert s.input_ids(lay).tolist() == [7, 8]
    assert s.position_ids(lay).tolist() == [2, 3]
    last = shard_sequence(lay, rank=3, size=4)
    assert last.num_valid == 0 and last.input_ids(lay, pad_id=3).tolist() == [3, 3]
    assert shard_sequence(lay, None).local_tokens == 6


def test_pad_to_multiple():
    x = torch.ones(5, 2)
    assert pad_to_multiple(x, 4).shape == (8, 2) and pad_to_multiple(x, 4)[5:].abs().sum() == 0
    assert pad_to_multiple(x, 5) is x


def test_gather_sequence_single_device_drops_padding():
    s = SequenceShard.build(5, 0, 1)
    assert torch.equal(gather_sequence(torch.arange(5), s), torch.arange(5))


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: SequenceShard.build(10, 4, 4), "rank: expected an int in \\[0, 4\\)"),
        (lambda: SequenceShard.build(10, 0, 0), "size: expected the SP group size"),
        (lambda: SequenceShard.build(10, 0, 4).slice(torch.zeros(9)), "x: expected a tensor of 10 packed tokens"),
        (lambda: shard_sequence(_layout([2], [[1]]), rank=0), "rank, size: expected both or neither"),
        (lambda: pad_to_multiple(torch.zeros(3), 0), "multiple: expected an int >= 1"),
        (lambda: as_process_group("sp"), "sp_group: expected None"),
        (lambda: UlyssesAttention(None, attn_fn=3), "attn_fn: expected a callable"),
        (lambda: gather_sequence(torch.zeros(3), SequenceShard.build(5, 0, 1)), "x: expected 5 tokens"),
    ],
)
def test_bad_arguments_raise_clear_value_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---------------------------------------------------------------- K/V heads per rank
def _kv_head_seen_by_query_head(H, K, sp):
    """For every query head, the ORIGINAL kv head it reads after replication + Ulysses head split."""
    f = kv_replication_factor(H, K, sp)
    ids_1K1 = torch.arange(K, dtype=torch.float64).view(1, K, 1)
    kv_ids = replicate_kv_heads(ids_1K1, f).view(-1)  # original id of each replicated head
    h, k = H // sp, K * f // sp
    seen = []
    for r in range(sp):
        local = kv_ids[r * k : (r + 1) * k]
        seen += [int(local[j // (h // k)]) for j in range(h)]  # local GQA: query j reads kv j // (h/k)
    return seen


@pytest.mark.parametrize(
    "H, K, sp", [(8, 2, 2), (8, 2, 4), (8, 2, 8), (8, 1, 8), (8, 8, 4), (6, 3, 2), (12, 3, 4), (12, 4, 6), (16, 4, 8)]
)
def test_every_query_head_gets_its_own_kv_head(H, K, sp):
    assert _kv_head_seen_by_query_head(H, K, sp) == [q // (H // K) for q in range(H)]


def test_a_tiled_kv_repeat_would_give_query_heads_the_wrong_kv_heads():
    H, K, sp = 8, 2, 4
    f = kv_replication_factor(H, K, sp)
    assert f == 2
    ids = torch.arange(K).view(1, K, 1).repeat(1, f, 1).view(-1)  # tiled: kv0 kv1 kv0 kv1
    h, k = H // sp, K * f // sp
    seen = [int(ids[r * k : (r + 1) * k][j // (h // k)]) for r in range(sp) for j in range(h)]
    assert seen != [q // (H // K) for q in range(H)]


@pytest.mark.parametrize(
    "H, K, sp, match",
    [(8, 2, 3, "sp: expected the SP size to divide the number of query heads \\(8\\)"), (8, 3, 2, "num_kv_heads: expected a divisor")],
)
def test_head_counts_that_do_not_divide_raise(H, K, sp, match):
    with pytest.raises(ValueError, match=match):
        kv_replication_factor(H, K, sp)


def test_single_device_ulysses_is_the_plain_op_and_checks_the_slice_length():
    lay = _layout([3, 2], [[2, 1], [4]])
    q = torch.randn(lay.total_tokens, 4, 8, dtype=torch.float64)
    k, v = torch.randn(2, lay.total_tokens, 2, 8, dtype=torch.float64)
    from dualkv.core import dualkv_attention

    torch.testing.assert_close(ulysses_attention(q, k, v, lay, None), dualkv_attention(q, k, v, lay), rtol=0, atol=0)
    with pytest.raises(ValueError, match="q/k/v: expected this rank's slice of ceil\\(T=12 / sp=1\\) = 12 tokens"):
        ulysses_attention(q[:5], k[:5], v[:5], lay, None)


# ---------------------------------------------------------------- which rank computes which log-prob
def _random_layout(rng: random.Random):
    G = rng.randint(1, 4)
    prompts = [rng.randint(1, 9) for _ in range(G)]
    responses = [[rng.randint(1, 6) for _ in range(rng.randint(1, 4))] for _ in range(G)]
    return _layout(prompts, responses)


@pytest.mark.parametrize("seed", range(6))
def test_logprob_plans_split_every_token_exactly_once_with_the_right_predictor(seed):
    rng = random.Random(seed)
    lay = _random_layout(rng)
    src, tgt = lay.logprob_index()
    first = torch.zeros_like(tgt, dtype=torch.bool)
    first[torch.cumsum(torch.tensor([0] + lay.row_lens[:-1]), 0)] = True
    for sp in (1, 2, 3, 4, 8):
        seen = torch.zeros(tgt.numel(), dtype=torch.long)
        for r in range(sp):
            shard = shard_sequence(lay, rank=r, size=sp)
            plan = plan_logprobs(lay, shard)
            seen[plan.item] += 1
            assert torch.equal(plan.target, tgt[plan.item])
            slot = plan.target - 1
            assert bool(((slot >= shard.start) & (slot < shard.end)).all())
            # later tokens: the slot itself; first tokens: the group's last prompt token (row L + g)
            is_first = first[plan.item]
            assert torch.equal(plan.source[~is_first] + shard.start, src[plan.item][~is_first])
            groups = plan.source[is_first] - shard.local_tokens
            assert torch.equal(lay.group_last_prompt_token[groups], src[plan.item][is_first])
        assert bool((seen == 1).all()), f"sp={sp}: every response token is planned on exactly one rank"


def test_plan_finds_first_tokens_whose_slot_is_on_another_rank_than_the_prompt():
    lay = _layout([3], [[2, 2]])  # p0 p1 p2 | a0 a1 b0 | b1 .  .   (sp = 3, L = 3)
    plans = [plan_logprobs(lay, shard_sequence(lay, rank=r, size=3)) for r in range(3)]
    b0 = 2  # logprob_index order: a0 a1 b0 b1
    assert b0 in plans[1].item.tolist()  # b0's slot a1 is on rank 1 ...
    i = plans[1].item.tolist().index(b0)
    assert int(plans[1].source[i]) == 3 + 0  # ... but its predictor is row L + group 0 (p2, owned by rank 0)


@pytest.mark.parametrize("H,K,sp", list(itertools.product([8], [1, 2, 4, 8], [1, 2, 4, 8])))
def test_kv_replication_factor_is_minimal(H, K, sp):
    f = kv_replication_factor(H, K, sp)
    assert (K * f) % sp == 0 and H % (K * f) == 0
    assert all((K * g) % sp for g in range(1, f))


def test_mesh_needs_an_initialised_process_group():
    import torch.distributed as dist

    from dualkv.parallel import init_sp_mesh

    if dist.is_initialized():
        pytest.skip("a default process group exists in this test process")
    with pytest.raises(ValueError, match="torch.distributed: expected an initialised default process group"):
        init_sp_mesh(2)


def test_model_head_follows_the_models_logprobs_impl(monkeypatch):
    """The SP log-prob head of a dualkv model reduces its logits the way the model's own head does
    (``CausalLM.logprobs_impl``)."""
    pytest.importorskip("triton")
    import dualkv.models as M
    from dualkv.core.backends.triton import logprob_kernel
    from dualkv.parallel.logprobs import model_head

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = count_calls(monkeypatch, logprob_kernel, "forward")
    model = M.build_model("tiny-qwen3", seed=0)
    hidden, targets = torch.randn(6, model.config.hidden_size), torch.randint(0, model.config.vocab_size, (6,))
    plain, _ = model_head(model)(hidden, targets, 1.0, False)
    assert not calls
    model.logprobs_impl = "triton"
    fused, _ = model_head(model)(hidden, targets, 1.0, False)
    assert calls
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
