"""Rollout sources: where each step's ``RolloutBatch`` comes from.

Every source is a pure function of the step number (and its seed; a generating source also of the
policy's current weights), so a resumed run sees exactly the rollouts an uninterrupted run would.

* ``FileRolloutSource``: groups from a JSONL/Parquet file (``rollout_files``), a fixed number per
  step, reshuffled every pass over the file.
* ``SyntheticRolloutSource``: random prompts, responses and 0/1 rewards (speed and equivalence runs).
* ``GenerationRolloutSource``: prompts from a verifiable task, N responses sampled from the current
  policy (``generation``), rewards from the task's verifier.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from .arithmetic import ArithmeticTask
from .rollout import RolloutBatch, RolloutGroup
from .rollout_files import load_rollout_file

__all__ = [
    "RolloutSource",
    "Sampler",
    "FileRolloutSource",
    "SyntheticConfig",
    "SyntheticRolloutSource",
    "GenerationConfig",
    "GenerationRolloutSource",
    "step_generator",
]


def step_generator(seed: int, step: int, stream: int = 0) -> torch.Generator:
    """A CPU generator seeded by (seed, step, stream) alone."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 101 + stream)


class RolloutSource(Protocol):
    def rollouts(self, step: int) -> RolloutBatch: ...


class Sampler(Protocol):
    """Samples ``n`` responses for each prompt from the current policy (see ``generation``)."""

    def sample(self, prompts: list[torch.Tensor], n: int, max_new_tokens: int, temperature: float,
               seed: int) -> list[list[torch.Tensor]]: ...


class FileRolloutSource:
    """``groups_per_step`` groups per step from a rollout file, in a fresh order every pass (epoch)."""

    def __init__(self, path: str | Path, groups_per_step: int, *, shuffle: bool = True, seed: int = 0) -> None:
        self.batch = load_rollout_file(path)
        if groups_per_step < 1 or groups_per_step > self.batch.num_groups:
            raise ValueError(f"groups_per_step: expected 1..{self.batch.num_groups} (the file's number of groups), "
                             f"got {groups_per_step}")
        self.groups_per_step, self.shuffle, self.seed = groups_per_step, shuffle, seed

    def _order(self, epoch: int) -> list[int]:
        n = self.batch.num_groups
        if not self.shuffle:
            return list(range(n))
        return torch.randperm(n, generator=step_generator(self.seed, epoch, stream=1)).tolist()

    def rollouts(self, step: int) -> RolloutBatch:
        n = self.batch.num_groups
        picks = []
        for i in range(step * self.groups_per_step, (step + 1) * self.groups_per_step):
            picks.append(self._order(i // n)[i % n])
        return self.batch.select(picks)


@dataclass(frozen=True)
class SyntheticConfig:
    """Random groups: prompt and response lengths uniform in [min, max], 0/1 rewards."""

    num_groups: int = 4
    n: int = 8
    prompt_len: tuple[int, int] = (16, 64)
    response_len: tuple[int, int] = (4, 32)
    vocab_size: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_groups", "n", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)}")
        for name in ("prompt_len", "response_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name}: expected a range (min, max) with 1 <= min <= max, got {(lo, hi)}")


class SyntheticRolloutSource:
    def __init__(self, cfg: SyntheticConfig) -> None:
        self.cfg = cfg

    def rollouts(self, step: int) -> RolloutBatch:
        c, gen = self.cfg, step_generator(self.cfg.seed, step)

        def length(lo_hi):
            return int(torch.randint(lo_hi[0], lo_hi[1] + 1, (1,), generator=gen))

        groups = []
        for g in range(c.num_groups):
            prompt = torch.randint(0, c.vocab_size, (length(c.prompt_len),), generator=gen)
            responses = [torch.randint(0, c.vocab_size, (length(c.response_len),), generator=gen) for _ in range(c.n)]
            rewards = torch.randint(0, 2, (c.n,), generator=gen).float()
            groups.append(RolloutGroup(prompt, responses, rewards, uid=f"s{step}g{g}"))
        return RolloutBatch(groups, meta={"source": "synthetic"})


@dataclass(frozen=True)
class GenerationConfig:
    num_groups: int = 16
    n: int = 8
    max_new_tokens: int = 4
    temperature: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_groups", "n", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)}")
        if not self.temperature > 0:
            raise ValueError(f"temperature: expected > 0, got {self.temperature}")


class GenerationRolloutSource:
    """Task prompts, N sampled responses each from the live policy, verifier rewards."""

    def __init__(self, task: ArithmeticTask, sampler: Sampler, cfg: GenerationConfig) -> None:
        self.task, self.sampler, self.cfg = task, sampler, cfg

    def rollouts(self, step: int) -> RolloutBatch:
        c = self.cfg
        problems = self.task.sample(c.num_groups, step_generator(c.seed, step))
        seed = int(torch.randint(0, 2**62, (1,), generator=step_generator(c.seed, step, stream=2)))
        responses = self.sampler.sample([p.prompt_ids for p in problems], c.n, c.max_new_tokens, c.temperature, seed)
        groups = []
        for g, (prob, rs) in enumerate(zip(problems, responses)):
            rewards = torch.tensor([self.task.reward(prob, r) for r in rs])
            groups.append(RolloutGroup(prob.prompt_ids, list(rs), rewards, uid=f"s{step}g{g}"))
        return RolloutBatch(groups, meta={"source": "generation"})
