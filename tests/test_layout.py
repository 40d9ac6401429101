"""The packed layout: builders, metadata invariants, maps back, and its errors."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dualkv.core import PackedLayout
from helpers import padded_rows


def _groups(rng, G, vocab=50):
    out = []
    for _ in range(G):
        p = torch.randint(1, vocab, (rng.randint(1, 9),))
        rs = [torch.randint(1, vocab, (rng.randint(1, 7),)) for _ in range(rng.randint(1, 4))]
        out.append((p, rs))
    return out


def test_from_lengths_metadata():
    layout = PackedLayout.from_lengths([3, 5], [[2, 2], [1, 4, 3]])
    assert layout.total_tokens == 3 + 4 + 5 + 8
    assert layout.replicated_tokens == 2 * 3 + 4 + 3 * 5 + 8
    assert layout.cu_seqlens.tolist() == [0, 3, 5, 7, 12, 13, 17, 20]
    assert layout.cu_seqlens.dtype == torch.int32
    assert layout.seg_ctx_len.tolist() == [0, 3, 3, 0, 5, 5, 5]
    assert layout.seg_ctx_start.tolist() == [0, 0, 0, 7, 7, 7, 7]
    assert layout.ctx_key_start.tolist() == [0, 7] and layout.ctx_key_len.tolist() == [3, 5]
    assert layout.ctx_reader_start.tolist() == [3, 12] and layout.ctx_reader_end.tolist() == [7, 20]
    assert layout.position_ids.tolist() == [0, 1, 2, 3, 4, 3, 4, 0, 1, 2, 3, 4, 5, 5, 6, 7, 8, 5, 6, 7]
    assert layout.group_last_prompt_token.tolist() == [2, 11]
    assert layout.max_seqlen == 5 and layout.max_ctx_len == 5
    src, tgt = layout.logprob_index()
    assert tgt.tolist() == [3, 4, 5, 6, 12, 13, 14, 15, 16, 17, 18, 19]
    assert src.tolist() == [2, 3, 2, 5, 11, 11, 13, 14, 15, 11, 17, 18]
    assert layout.rho == pytest.approx(33 / 20)


def test_single_group_single_response():
    layout = PackedLayout.from_lengths([1], [[1]])
    assert layout.total_tokens == 2 and layout.num_rows == 1
    src, tgt = layout.logprob_index()
    assert src.tolist() == [0] and tgt.tolist() == [1]


def test_from_groups_tokens_and_unpack():
    rng = random.Random(1)
    groups = _groups(rng, 3)
    layout = PackedLayout.from_groups(groups)
    expect = torch.cat([t for p, rs in groups for t in [p, *rs]])
    assert torch.equal(layout.input_ids, expect)
    src, tgt = layout.logprob_index()
    resp = torch.cat([r for _, rs in groups for r in rs])
    assert torch.equal(layout.input_ids[tgt], resp)
    rows = layout.unpack_logprobs(layout.input_ids[tgt].double())
    mask = layout.response_mask()
    for b, r in enumerate(r for _, rs in groups for r in rs):
        assert torch.equal(rows[b, : r.numel()].long(), r)
        assert mask[b].sum() == r.numel() and (rows[b, r.numel():] == 0).all()


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), G=st.integers(1, 4), shuffle=st.booleans())
def test_from_rows_round_trip(seed, G, shuffle):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    groups = _groups(rng, G)
    ids, attn, resp_mask, uid, rows = padded_rows(groups, rng, shuffle=shuffle)
    layout = PackedLayout.from_rows(ids, attn, resp_mask, uid)
    assert layout.num_rows == len(rows)
    assert layout.row_starts == layout.row_start.tolist()  # the host index's starts, rows in any order
    # Packed tokens: group by group in first-appearance order, each prompt once.
    order = list(dict.fromkeys(g for g, _ in rows))
    expect = []
    for g in order:
        expect.append(groups[g][0])
        expect.extend(groups[g][1][i] for gg, i in rows if gg == g)
    assert torch.equal(layout.input_ids, torch.cat(expect))
    # Positions restart at 0 for each prompt and continue at P for each response.
    for g_new, g in enumerate(order):
        start, end = layout.group_range(g_new)
        P = groups[g][0].numel()
        assert layout.position_ids[start: start + P].tolist() == list(range(P))
    # logprob_index in row order; unpack gives the padded rows back.
    src, tgt = layout.logprob_index()
    unpacked = layout.unpack_logprobs(layout.input_ids[tgt])
    for b, (g, i) in enumerate(rows):
        r = groups[g][1][i]
        assert torch.equal(unpacked[b, : r.numel()], r)
        first = src[int(layout.response_mask()[:b].sum())]
        assert first == layout.group_last_prompt_token[order.index(g)]
    # pack_rows maps padded-row values to packed tokens; row_token_index maps back.
    assert torch.equal(layout.pack_rows(ids), layout.input_ids)
    tok = layout.row_token_index
    Lp = ids.shape[1] - resp_mask.shape[1]
    assert torch.equal(layout.input_ids[tok[:, Lp:][resp_mask.bool()]], ids[:, Lp:][resp_mask.bool()])
    # prompt_length form agrees with the response-mask form
    same = PackedLayout.from_rows(ids, attn, uid=uid, prompt_length=Lp)
    assert torch.equal(same.input_ids, layout.input_ids) and torch.equal(same.cu_seqlens, layout.cu_seqlens)


def test_replicated_index_matches_rows():
    rng = random.Random(3)
    groups = _groups(rng, 3)
    layout = PackedLayout.from_groups(groups)
    idx, cu = layout.replicated_index()
    assert cu[-1] == layout.replicated_tokens
    rows = [torch.cat([p, r]) for p, rs in groups for r in rs]
    assert torch.equal(layout.input_ids[idx], torch.cat(rows))
    rsrc, rtgt = layout.replicated_logprob_index()
    src, tgt = layout.logprob_index()
    assert torch.equal(layout.input_ids[idx][rtgt], layout.input_ids[tgt])
    assert torch.equal(layout.input_ids[idx][rsrc], layout.input_ids[src])


def test_to_device_copies_tensors():
    layout = PackedLayout.from_lengths([2], [[1, 2]])
    moved = layout.to("cpu")
    assert moved is not layout and torch.equal(moved.cu_seqlens, layout.cu_seqlens)


def test_mismatched_prompt_tokens_named_by_uid():
    ids = torch.tensor([[5, 6, 7, 1, 0], [5, 9, 7, 2, 3]])
    attn = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    resp = torch.tensor([[1, 0], [1, 1]])
    with pytest.raises(ValueError, match="share uid 'q7'.*prompt tokens differ"):
        PackedLayout.from_rows(ids, attn, resp, ["q7", "q7"])
    PackedLayout.from_rows(ids, attn, resp, ["q7", "q8"])  # different groups: fine


def test_mismatched_prompt_lengths_named_by_uid():
    ids = torch.tensor([[0, 6, 7, 1, 0], [5, 6, 7, 2, 3]])
    attn = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    resp = torch.tensor([[1, 0], [1, 1]])
    with pytest.raises(ValueError, match="share uid 3.*lengths 2 and 3"):
        PackedLayout.from_rows(ids, attn, resp, torch.tensor([3, 3]))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prompt_lens=[], response_lens=[]), "prompt_lens: expected at least one group"),
        (dict(prompt_lens=[3], response_lens=[[1], [2]]), "response_lens: expected one list per group"),
        (dict(prompt_lens=[0], response_lens=[[1]]), r"prompt_lens\[0\]: expected a prompt of at least 1"),
        (dict(prompt_lens=[2], response_lens=[[]]), r"response_lens\[0\]: expected at least one response"),
        (dict(prompt_lens=[2], response_lens=[[3, 0]]), r"response_lens\[0\]\[1\]: expected a response"),
    ],
)
def test_from_lengths_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PackedLayout.from_lengths(**kwargs)


def test_from_rows_errors():
    ids = torch.tensor([[5, 6, 1, 2]])
    attn = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="attention_mask: expected shape"):
        PackedLayout.from_rows(ids, attn[:, :3], torch.ones(1, 2), ["a"])
    with pytest.raises(ValueError, match="uid: expected 1 group ids"):
        PackedLayout.from_rows(ids, attn, torch.ones(1, 2), ["a", "b"])
    with pytest.raises(ValueError, match="response_mask: row 0 has no response tokens"):
        PackedLayout.from_rows(ids, attn, torch.zeros(1, 2), ["a"])
    with pytest.raises(ValueError, match="attention_mask: row 0 has no prompt tokens"):
        PackedLayout.from_rows(ids, attn, torch.ones(1, 4), ["a"])
    with pytest.raises(ValueError, match="response_mask: marks tokens that attention_mask says are padding"):
        PackedLayout.from_rows(ids, torch.tensor([[1, 1, 1, 0]]), torch.ones(1, 2), ["a"])
    with pytest.raises(ValueError, match="give a response_mask or a prompt_length, got neither"):
        PackedLayout.from_rows(ids, attn, None, ["a"])
    with pytest.raises(ValueError, match="input_ids: expected integer token ids"):
        PackedLayout.from_rows(ids.float(), attn, torch.ones(1, 2), ["a"])


def test_from_groups_errors():
    with pytest.raises(ValueError, match="groups: expected at least one"):
        PackedLayout.from_groups([])
    with pytest.raises(ValueError, match=r"groups\[0\] response_ids\[0\]: expected a 1-D tensor"):
        PackedLayout.from_groups([(torch.tensor([1, 2]), [torch.tensor([[1]])])])
    with pytest.raises(ValueError, match=r"groups\[0\] prompt_ids: expected integer token ids"):
        PackedLayout.from_groups([(torch.tensor([1.0]), [torch.tensor([1])])])


def test_unpack_logprobs_checks_length():
    layout = PackedLayout.from_lengths([2], [[1, 2]])
    with pytest.raises(ValueError, match=r"values: expected shape \(3, \.\.\.\)"):
        layout.unpack_logprobs(torch.zeros(4))
