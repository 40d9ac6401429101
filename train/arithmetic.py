"""The built-in verifiable task: integer arithmetic with an exact-answer reward and a tiny tokenizer.

A prompt is a fixed preamble of solved examples (the same for every prompt, like a system prompt)
followed by a question, e.g. ``<bos>1+2=3;4+0=4;3+4=``; the policy answers with digits and ``<eos>``. The reward is 1.0 when the number the response starts with is
exactly the answer (``7<eos>``, or ``7`` cut off by the length limit, or ``7;...``), else 0.0:
verifiable without a reward model, as in RL post-training on maths.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["ArithmeticTokenizer", "ArithmeticConfig", "ArithmeticTask", "Problem"]


class ArithmeticTokenizer:
    """Character-level tokenizer over digits, ``+ - * = ;`` and three special tokens."""

    SPECIAL = ("<pad>", "<bos>", "<eos>")
    CHARS = "0123456789+-*=;"

    def __init__(self) -> None:
        self.tokens = list(self.SPECIAL) + list(self.CHARS)
        self._index = {t: i for i, t in enumerate(self.tokens)}
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def encode(self, text: str, *, bos: bool = False) -> list[int]:
        bad = [c for c in text if c not in self._index]
        if bad:
            raise ValueError(f"text: character {bad[0]!r} is not in the arithmetic vocabulary {self.CHARS!r}")
        return ([self.bos_id] if bos else []) + [self._index[c] for c in text]

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return "".join(self.tokens[i] if 0 <= i < self.vocab_size else "<unk>" for i in ids)


@dataclass(frozen=True)
class ArithmeticConfig:
    """Problems ``a op b`` with operands in [0, max_operand], after a preamble of ``num_shots`` solved
    examples (drawn once with ``preamble_seed``, shared by every prompt)."""

    max_operand: int = 2
    ops: str = "+"
    num_shots: int = 0
    preamble_seed: int = 1234

    def __post_init__(self) -> None:
        if self.max_operand < 1:
            raise ValueError(f"max_operand: expected >= 1, got {self.max_operand}")
        if not self.ops or any(op not in "+-*" for op in self.ops):
            raise ValueError(f"ops: expected a non-empty string over '+-*', got {self.ops!r}")
        if self.num_shots < 0:
            raise ValueError(f"num_shots: expected >= 0, got {self.num_shots}")


@dataclass(frozen=True)
class Problem:
    prompt_ids: torch.Tensor  # (P,) int64
    answer: int
    text: str


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


class ArithmeticTask:
    """Samples problems and scores responses; deterministic given a ``torch.Generator``."""

    def __init__(self, cfg: ArithmeticConfig | None = None) -> None:
        self.cfg = cfg or ArithmeticConfig()
        self.tokenizer = ArithmeticTokenizer()
        gen = torch.Generator().manual_seed(self.cfg.preamble_seed)
        self.preamble = "".join(q + str(ans) + ";" for q, ans in (self._draw(gen) for _ in range(self.cfg.num_shots)))

    @property
    def max_answer_digits(self) -> int:
        m = self.cfg.max_operand
        largest = max(abs(_apply(a, op, b)) for op in self.cfg.ops for a in (0, m) for b in (0, m))
        return len(str(largest)) + ("-" in self.cfg.ops)

    def _draw(self, gen: torch.Generator) -> tuple[str, int]:
        a, b = torch.randint(0, self.cfg.max_operand + 1, (2,), generator=gen).tolist()
        op = self.cfg.ops[int(torch.randint(0, len(self.cfg.ops), (1,), generator=gen))]
        return f"{a}{op}{b}=", _apply(a, op, b)

    def sample(self, num: int, gen: torch.Generator) -> list[Problem]:
        out = []
        for _ in range(num):
            question, answer = self._draw(gen)
            text = self.preamble + question
            ids = torch.tensor(self.tokenizer.encode(text, bos=True), dtype=torch.long)
            out.append(Problem(prompt_ids=ids, answer=answer, text=text))
        return out

    def parse(self, response_ids: Sequence[int] | torch.Tensor) -> int | None:
        """The integer the response starts with (an optional '-' then digits), or None."""
        text = self.tokenizer.decode(response_ids)
        sign = -1 if text.startswith("-") else 1
        digits = ""
        for c in text[1:] if sign < 0 else text:
            if not c.isdigit():
                break
            digits += c
        return sign * int(digits) if digits else None

    def reward(self, problem: Problem, response_ids: Sequence[int] | torch.Tensor) -> float:
        return 1.0 if self.parse(response_ids) == problem.answer else 0.0
