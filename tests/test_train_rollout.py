"""Rollout batches, rollout files (JSONL / Parquet) and their validation, sources, the arithmetic task."""

import json

import pytest
import torch

from dualkv.train.arithmetic import ArithmeticConfig, ArithmeticTask
from dualkv.train.losses import LossConfig
from dualkv.train.rollout import RolloutBatch, RolloutGroup
from dualkv.train.rollout_files import load_rollout_file, save_rollout_file
from dualkv.train.sources import FileRolloutSource, SyntheticConfig, SyntheticRolloutSource


def _ids(*v):
    return torch.tensor(v, dtype=torch.long)


def _batch(with_logprobs=False):
    groups = []
    for g, (p, rs) in enumerate([([5, 6, 7], [[1], [2, 3], [4, 4, 4]]), ([9], [[8, 8], [7]])]):
        resp = [_ids(*r) for r in rs]
        lp = [-torch.rand(len(r)) for r in rs] if with_logprobs else None
        groups.append(RolloutGroup(_ids(*p), resp, torch.arange(len(rs)).float(), uid=f"q{g}", old_logprobs=lp))
    return RolloutBatch(groups)


def test_batch_sizes_and_rho():
    b = _batch()
    assert (b.num_groups, b.num_rows, b.response_tokens) == (2, 5, 9)
    assert b.packed_tokens == (3 + 6) + (1 + 3)
    assert b.replicated_tokens == (3 * 3 + 6) + (2 * 1 + 3)
    assert b.rho == pytest.approx(20 / 13)
    adv = b.with_advantages(LossConfig())
    assert torch.allclose(adv.groups[1].advantages, torch.tensor([-1.0, 1.0]) / 2**0.5, atol=1e-5)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
@pytest.mark.parametrize("per_response", [True, False])
def test_file_round_trip(tmp_path, suffix, per_response):
    if suffix == ".parquet":
        pytest.importorskip("pyarrow")
    b = _batch(with_logprobs=True)
    path = save_rollout_file(b, tmp_path / f"r{suffix}", per_response=per_response)
    back = load_rollout_file(path)
    assert back.num_groups == 2 and [g.uid for g in back.groups] == ["q0", "q1"]
    for g0, g1 in zip(b.groups, back.groups):
        assert torch.equal(g0.prompt_ids, g1.prompt_ids) and torch.equal(g0.rewards, g1.rewards)
        assert all(torch.equal(x, y) for x, y in zip(g0.response_ids, g1.response_ids))
        assert all(torch.allclose(x, y) for x, y in zip(g0.old_logprobs, g1.old_logprobs))


def test_records_without_uid_group_by_prompt(tmp_path):
    path = tmp_path / "r.jsonl"
    rows = [{"prompt_ids": [1, 2], "response_ids": [3], "reward": 1},
            {"prompt_ids": [4], "response_ids": [5, 6], "reward": 0},
            {"prompt_ids": [1, 2], "response_ids": [7], "reward": 0.5}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    b = load_rollout_file(path)
    assert [g.num_responses for g in b.groups] == [2, 1]
    assert b.groups[0].rewards.tolist() == [1.0, 0.5]


def _write(tmp_path, rows, name="bad.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


GOOD = {"uid": "a", "prompt_ids": [1, 2], "response_ids": [3, 4], "reward": 1.0}


@pytest.mark.parametrize(
    "rows, message",
    [
        ([{k: v for k, v in GOOD.items() if k != "reward"}], r"bad.jsonl:1: missing field 'reward'"),
        ([{k: v for k, v in GOOD.items() if k != "prompt_ids"}], r":1: missing field 'prompt_ids'"),
        ([{"uid": "a", "prompt_ids": [1]}], r":1: missing field 'response_ids'.*or 'responses'"),
        ([GOOD, {**GOOD, "prompt_ids": [1, 9]}], r":2: prompt_ids differ from those of .*:1 although both have uid 'a'"),
        ([GOOD, {**GOOD, "response_ids": []}], r":2 response_ids: expected at least 1 token, got an empty list"),
        ([{**GOOD, "prompt_ids": []}], r":1 prompt_ids: expected at least 1 token"),
        ([{**GOOD, "response_ids": [1, -3]}], r"response_ids: expected non-negative integer token ids, got -3"),
        ([{**GOOD, "response_ids": [1, 2.5]}], r"response_ids: expected non-negative integer token ids, got 2.5"),
        ([{**GOOD, "reward": "high"}], r":1 reward: expected a finite number, got 'high'"),
        ([{**GOOD, "reward": float("nan")}], r":1 reward: expected a finite number"),
        ([{**GOOD, "old_logprobs": [-0.1]}], r":1 old_logprobs: expected 2 values, got 1"),
        ([GOOD, {**GOOD, "old_logprobs": [-0.1, -0.2]}], r"old_logprobs: given for 1 of the group's 2 responses"),
        ([GOOD, {k: v for k, v in GOOD.items() if k != "uid"}], r":2: field 'uid' is missing here"),
        (["{not json"], r":1: not valid JSON"),
        (["[1, 2]"], r":1: expected a JSON object"),
        ([GOOD, {"uid": "b", "prompt_ids": [1], "responses": [[1]], "rewards": [1]}], r":2: a per-group record in a file of per-response"),
        ([{"prompt_ids": [1], "responses": [[1], [2]], "rewards": [1]}], r":1 rewards: expected 2 values, got 1"),
        ([{"prompt_ids": [1], "responses": [], "rewards": []}], r":1 responses: expected a non-empty list"),
        ([{"prompt_ids": [1], "responses": [[1], []], "rewards": [1, 0]}], r":1 responses\[1\]: expected at least 1 token"),
    ],
)
def test_bad_rollout_files_are_rejected(tmp_path, rows, message):
    with pytest.raises(ValueError, match=message):
        load_rollout_file(_write(tmp_path, rows))


def test_bad_files_parquet_and_paths(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([GOOD, {**GOOD, "prompt_ids": [7, 7]}]), path)
    with pytest.raises(ValueError, match=r"bad.parquet row 1: prompt_ids differ .* uid 'a'"):
        load_rollout_file(path)
    with pytest.raises(ValueError, match="does not exist"):
        load_rollout_file(tmp_path / "missing.jsonl")
    (tmp_path / "r.csv").write_text("x\n")
    with pytest.raises(ValueError, match="expected a .jsonl or .parquet"):
        load_rollout_file(tmp_path / "r.csv")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no records"):
        load_rollout_file(tmp_path / "empty.jsonl")


def test_vocab_and_group_checks():
    b = _batch()
    with pytest.raises(ValueError, match=r"group 'q0' prompt_ids: token id 7 is outside the model's vocabulary \(vocab_size=7\)"):
        b.check_vocab(7)
    b.check_vocab(10)
    with pytest.raises(ValueError, match="rewards: expected a \\(2,\\) tensor"):
        RolloutGroup(_ids(1), [_ids(2), _ids(3)], torch.tensor([1.0]))
    with pytest.raises(ValueError, match="response_ids\\[1\\]: expected at least 1 token"):
        RolloutGroup(_ids(1), [_ids(2), _ids()], torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match="old_logprobs: given for some groups but missing for group 'q1'"):
        RolloutBatch([_batch(True).groups[0], _batch().groups[1]])


def test_from_rows_checks_prompts():
    ids = torch.tensor([[0, 5, 6, 1, 2], [0, 5, 6, 3, 0], [7, 8, 9, 4, 4]])
    attn = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    resp = torch.tensor([[1, 1], [1, 0], [1, 1]])
    b = RolloutBatch.from_rows(ids, attn, resp, ["x", "x", "y"], torch.tensor([1.0, 0.0, 1.0]))
    assert [g.response_lens for g in b.groups] == [[2, 1], [2]]
    with pytest.raises(ValueError, match="rows 0 and 2 share uid 'x' but their prompts differ"):
        RolloutBatch.from_rows(ids, attn, resp, ["x", "y", "x"], torch.zeros(3))


def test_file_source_cycles_deterministically(tmp_path):
    groups = [RolloutGroup(_ids(g + 1), [_ids(1), _ids(2)], torch.tensor([0.0, 1.0]), uid=g) for g in range(5)]
    path = save_rollout_file(RolloutBatch(groups), tmp_path / "r.jsonl")
    src = FileRolloutSource(path, groups_per_step=2, seed=3)
    uids = [g.uid for s in range(5) for g in src.rollouts(s).groups]
    assert sorted(uids[:5]) == list(range(5)) and sorted(uids[5:]) == list(range(5))  # every group once per epoch
    assert [g.uid for g in FileRolloutSource(path, 2, seed=3).rollouts(3).groups] == uids[6:8]
    with pytest.raises(ValueError, match="groups_per_step: expected 1..5"):
        FileRolloutSource(path, groups_per_step=6)


def test_synthetic_source_is_a_function_of_the_step():
    cfg = SyntheticConfig(num_groups=3, n=4, prompt_len=(2, 9), response_len=(1, 5), vocab_size=50, seed=1)
    a, b = SyntheticRolloutSource(cfg).rollouts(7), SyntheticRolloutSource(cfg).rollouts(7)
    assert all(torch.equal(x.prompt_ids, y.prompt_ids) for x, y in zip(a.groups, b.groups))
    assert a.num_rows == 12 and all(1 <= n <= 5 for g in a.groups for n in g.response_lens)
    c = SyntheticRolloutSource(cfg).rollouts(8)
    assert not all(torch.equal(x.prompt_ids, y.prompt_ids) for x, y in zip(a.groups, c.groups))
    with pytest.raises(ValueError, match="prompt_len"):
        SyntheticConfig(prompt_len=(5, 2))


def test_arithmetic_task_reward_is_exact():
    task = ArithmeticTask(ArithmeticConfig(max_operand=9, ops="+-*", num_shots=2))
    tok = task.tokenizer
    probs = task.sample(50, torch.Generator().manual_seed(0))
    assert len({p.text.rsplit(";", 1)[0] for p in probs}) == 1  # one preamble shared by every prompt
    for shot in task.preamble.split(";")[:-1]:
        q, a = shot.split("=")
        assert eval(q) == int(a)  # the preamble's examples are solved correctly
    for p in probs:
        text = tok.decode(p.prompt_ids)
        assert text.startswith("<bos>") and text.endswith("=") and text.count(";") == 2
        question = text.split(";")[-1][:-1]
        assert p.answer == eval(question)  # the prompt's question and the answer agree
        good = tok.encode(str(p.answer)) + [tok.eos_id]
        assert task.reward(p, good) == 1.0
        assert task.reward(p, tok.encode(str(p.answer))) == 1.0  # cut off by the length limit
        assert task.reward(p, tok.encode(str(p.answer) + "1")) == 0.0  # a different number
        assert task.reward(p, [tok.eos_id] + good) == 0.0
    assert task.parse(tok.encode("-12;3")) == -12 and task.parse(tok.encode("+1")) is None
    with pytest.raises(ValueError, match="character 'x'"):
        tok.encode("1x2")
