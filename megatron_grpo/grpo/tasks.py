"""The built-in verifiable task: copy or reverse a digit string, then stop.

Everything is generated in code, so nothing is downloaded. A prompt is `<bos> OP d1 .. dn =`, where OP names
the task; the expected answer is the copied or reversed digits followed by `<eos>`. The reward is the fraction
of answer positions the response gets right, so partial answers give the dense signal a random policy needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DIGITS = tuple(str(d) for d in range(10))
SPECIAL_TOKENS = ("<bos>", "=", "<eos>", "<pad>")
TASK_TOKENS = {"copy": "C", "reverse": "R"}


class DigitTokenizer:
    """A fixed 16-token vocabulary: ten digits, four special tokens and one token per task."""

    def __init__(self) -> None:
        self.tokens: tuple[str, ...] = DIGITS + SPECIAL_TOKENS + tuple(TASK_TOKENS.values())
        self._ids = {token: index for index, token in enumerate(self.tokens)}
        self.bos_id = self._ids["<bos>"]
        self.sep_id = self._ids["="]
        self.eos_id = self._ids["<eos>"]
        self.pad_id = self._ids["<pad>"]

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def token_id(self, token: str) -> int:
        return self._ids[token]

    def decode(self, ids: list[int]) -> str:
        """Renders token ids as text; special tokens keep their names so a reader can see where a response ends."""
        return " ".join(self.tokens[i] for i in ids)


@dataclass(frozen=True)
class TaskBatch:
    """Prompts and the answers a perfect policy would give, one row per prompt."""

    prompts: torch.Tensor  # [P, prompt_len] int64
    answers: torch.Tensor  # [P, num_digits + 1] int64: the digits, then <eos>


class DigitTask:
    """Copy or reverse `num_digits` random digits; the answer always ends with <eos>."""

    def __init__(self, name: str, num_digits: int, tokenizer: DigitTokenizer) -> None:
        if name not in TASK_TOKENS:
            raise ValueError(f"task.name: unknown task {name!r}; choose one of {', '.join(TASK_TOKENS)}")
        if num_digits < 1:
            raise ValueError(f"task.num_digits: must be >= 1, got {num_digits}")
        self.name = name
        self.num_digits = num_digits
        self.tokenizer = tokenizer

    @property
    def prompt_length(self) -> int:
        return self.num_digits + 3  # <bos> OP digits =

    @property
    def answer_length(self) -> int:
        return self.num_digits + 1  # digits <eos>

    def sample(self, num_prompts: int, generator: torch.Generator) -> TaskBatch:
        """Draws `num_prompts` digit strings from `generator` and builds their prompts and answers."""
        tok = self.tokenizer
        digits = torch.randint(0, 10, (num_prompts, self.num_digits), generator=generator)  # digit d has id d

        def column(token_id: int) -> torch.Tensor:
            return torch.full((num_prompts, 1), token_id, dtype=torch.int64)

        task_id = tok.token_id(TASK_TOKENS[self.name])
        prompts = torch.cat([column(tok.bos_id), column(task_id), digits, column(tok.sep_id)], dim=1)
        answer_digits = digits if self.name == "copy" else digits.flip(1)
        answers = torch.cat([answer_digits, column(tok.eos_id)], dim=1)
        return TaskBatch(prompts=prompts, answers=answers)


def answer_reward(responses: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """Fraction of answer positions that `responses` match exactly, per row.

    `responses` is `[N, L]` (padded after <eos>, any L); `answers` is `[N, A]`. Positions past the end of a
    short response count as wrong, and tokens past the answer's length are ignored, so stopping early and
    rambling are both penalised by exactly the positions they get wrong.
    """
    if responses.dim() != 2 or answers.dim() != 2 or responses.shape[0] != answers.shape[0]:
        raise ValueError(
            f"answer_reward: responses {tuple(responses.shape)} and answers {tuple(answers.shape)} must be "
            "[N, L] and [N, A] with the same N"
        )
    answer_length = answers.shape[1]
    compared = min(answer_length, responses.shape[1])
    correct = (responses[:, :compared] == answers[:, :compared]).sum(dim=1)
    return correct.to(torch.float32) / answer_length
