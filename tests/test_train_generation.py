"""Sampling with transformers' generate on our weights; the generation rollout source."""

import pytest
import torch

from dualkv.core import PackedLayout
from dualkv.models import build_model, preset_hf_config
from dualkv.train.arithmetic import ArithmeticTask
from dualkv.train.generation import HFSampler, split_responses
from dualkv.train.sources import GenerationConfig, GenerationRolloutSource, step_generator


pytestmark = pytest.mark.usefixtures("one_thread")


def test_split_responses_hand_case():
    gen = torch.tensor([[5, 2, 0, 0], [2, 0, 0, 0], [4, 4, 4, 4], [7, 8, 2, 9]])
    assert [r.tolist() for r in split_responses(gen, eos_id=2)] == [[5, 2], [2], [4, 4, 4, 4], [7, 8, 2]]


@pytest.fixture(scope="module")
def policy():
    tok = ArithmeticTask().tokenizer
    hf = preset_hf_config("tiny-qwen3")
    hf.update(vocab_size=tok.vocab_size, pad_token_id=tok.pad_id, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)
    return build_model(hf, seed=0)


def test_sampler_follows_the_policy(policy):
    task = ArithmeticTask()
    tok = task.tokenizer
    sampler = HFSampler(policy, eos_id=tok.eos_id, pad_id=tok.pad_id)
    with pytest.raises(ValueError, match="call sync"):
        sampler.sample([torch.tensor([1, 3])], 2, 3, 1.0, seed=0)
    sampler.sync()
    prompts = [p.prompt_ids for p in task.sample(3, torch.Generator().manual_seed(0))]
    a = sampler.sample(prompts, 4, 5, 1.0, seed=11)
    b = sampler.sample(prompts, 4, 5, 1.0, seed=11)
    c = sampler.sample(prompts, 4, 5, 1.0, seed=12)
    assert len(a) == 3 and all(len(rs) == 4 for rs in a)
    assert all(1 <= r.numel() <= 5 for rs in a for r in rs)
    assert all(r[-1] == tok.eos_id or r.numel() == 5 for rs in a for r in rs)  # cut after eos or at the limit
    assert all(torch.equal(x, y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))  # a function of the seed
    assert not all(torch.equal(x, y) for xs, ys in zip(a, c) for x, y in zip(xs, ys))
    # The sampling model computes the same log-probs as the policy on the packed layout.
    layout = PackedLayout.from_groups(list(zip(prompts, a)))
    ours = policy.response_logprobs(layout)
    rows = [(p, r) for p, rs in zip(prompts, a) for r in rs]
    for i, (p, r) in enumerate(rows):
        ids = torch.cat([p, r])[None]
        logits = sampler.hf_model(input_ids=ids).logits[0].float()
        theirs = torch.log_softmax(logits[p.numel() - 1:-1], -1).gather(-1, r[:, None]).squeeze(-1)
        torch.testing.assert_close(ours[i, : r.numel()], theirs, rtol=1e-5, atol=1e-5)
    # After an update of the policy, sync copies the new weights.
    with torch.no_grad():
        policy.lm_head.weight.add_(0.5)
    sampler.sync()
    assert torch.equal(sampler.hf_model.lm_head.weight, policy.lm_head.weight)


def test_generation_source_scores_with_the_task(policy):
    task = ArithmeticTask()
    sampler = HFSampler(policy, eos_id=task.tokenizer.eos_id, pad_id=task.tokenizer.pad_id)
    sampler.sync()
    src = GenerationRolloutSource(task, sampler, GenerationConfig(num_groups=3, n=4, max_new_tokens=3, seed=5))
    batch = src.rollouts(2)
    again = src.rollouts(2)
    assert batch.num_groups == 3 and batch.num_rows == 12
    problems = task.sample(3, step_generator(5, 2))
    for g, prob in zip(batch.groups, problems):
        assert torch.equal(g.prompt_ids, prob.prompt_ids)
        assert g.rewards.tolist() == [task.reward(prob, r) for r in g.response_ids]
    assert all(torch.equal(x, y) for g, h in zip(batch.groups, again.groups) for x, y in zip(g.response_ids, h.response_ids))
