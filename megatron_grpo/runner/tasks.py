"""The built-in verifiable task: copy or reverse a digit string, then stop.

Everything is generated in code, so nothing is downloaded. A prompt is `<bos> OP d1 .. dn =`, where OP names
the task; the expected answer is the copied or reversed digits followed by `<eos>`. The reward is the fraction
of answer positions the response gets right, so partial answers give the dense signal a random policy needs.

With `min_digits` below `num_digits` the task is ragged: each prompt's length n is drawn from
min_digits..num_digits, so prompts and answers vary in length (the batches sequence packing is for). Prompts and
answers are then right-padded with `<pad>` to the longest, and their own lengths come with them.
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

    prompts: torch.Tensor  # [P, prompt_len] int64, right-padded with <pad> past each prompt's length
    answers: torch.Tensor  # [P, num_digits + 1] int64: the digits, then <eos>, then <pad>
    prompt_lengths: torch.Tensor  # [P] int64: each prompt's own length (n + 3)
    answer_lengths: torch.Tensor  # [P] int64: each answer's own length (n + 1)


class DigitTask:
    """Copy or reverse `num_digits` random digits (or, with `min_digits`, a number of digits drawn uniformly from
    min_digits..num_digits per prompt); the answer always ends with <eos>."""

    def __init__(self, name: str, num_digits: int, tokenizer: DigitTokenizer, min_digits: int | None = None) -> None:
        if name not in TASK_TOKENS:
            raise ValueError(f"task.name: unknown task {name!r}; choose one of {', '.join(TASK_TOKENS)}")
        if num_digits < 1:
            raise ValueError(f"task.num_digits: must be >= 1, got {num_digits}")
        if min_digits is not None and not 1 <= min_digits <= num_digits:
            raise ValueError(f"task.min_digits: must be null or in [1, task.num_digits = {num_digits}], "
                             f"got {min_digits}")
        self.name = name
        self.num_digits = num_digits
        self.min_digits = num_digits if min_digits is None else min_digits
        self.tokenizer = tokenizer

    @property
    def ragged(self) -> bool:
        return self.min_digits < self.num_digits

    @property
    def prompt_length(self) -> int:
        """The longest prompt's length."""
        return self.num_digits + 3  # <bos> OP digits =

    @property
    def answer_length(self) -> int:
        """The longest answer's length."""
        return self.num_digits + 1  # digits <eos>

    def sample(self, num_prompts: int, generator: torch.Generator) -> TaskBatch:
        """Draws `num_prompts` digit strings from `generator` and builds their prompts and answers."""
        tok = self.tokenizer
        digits = torch.randint(0, 10, (num_prompts, self.num_digits), generator=generator)  # digit d has id d

        def column(token_id: int) -> torch.Tensor:
            return torch.full((num_prompts, 1), token_id, dtype=torch.int64)

        task_id = tok.token_id(TASK_TOKENS[self.name])
        if not self.ragged:  # one length: no draw of lengths, so a fixed-length task's prompts never change
            prompts = torch.cat([column(tok.bos_id), column(task_id), digits, column(tok.sep_id)], dim=1)
            answer_digits = digits if self.name == "copy" else digits.flip(1)
            answers = torch.cat([answer_digits, column(tok.eos_id)], dim=1)
            return TaskBatch(prompts=prompts, answers=answers,
                             prompt_lengths=torch.full((num_prompts,), self.prompt_length, dtype=torch.int64),
                             answer_lengths=torch.full((num_prompts,), self.answer_length, dtype=torch.int64))
        counts = torch.randint(self.min_digits, self.num_digits + 1, (num_prompts,), generator=generator)
        prompts = torch.full((num_prompts, self.prompt_length), tok.pad_id, dtype=torch.int64)
        answers = torch.full((num_prompts, self.answer_length), tok.pad_id, dtype=torch.int64)
        for row, count in enumerate(counts.tolist()):
            own = digits[row, :count]
            prompts[row, :count + 3] = torch.cat([own.new_tensor([tok.bos_id, task_id]), own,
                                                  own.new_tensor([tok.sep_id])])
            answers[row, :count + 1] = torch.cat([own if self.name == "copy" else own.flip(0),
                                                  own.new_tensor([tok.eos_id])])
        return TaskBatch(prompts=prompts, answers=answers, prompt_lengths=counts + 3, answer_lengths=counts + 1)


def answer_reward(responses: torch.Tensor, answers: torch.Tensor,
                  answer_lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Fraction of answer positions that `responses` match exactly, per row.

    `responses` is `[N, L]` (padded after <eos>, any L); `answers` is `[N, A]`, row `i`'s answer its first
    `answer_lengths[i]` tokens (`[N]`; None: all A). Positions past the end of a short response count as wrong,
    and tokens past the answer's length are ignored, so stopping early and rambling are both penalised by exactly
    the positions they get wrong.
    """
    if responses.dim() != 2 or answers.dim() != 2 or responses.shape[0] != answers.shape[0]:
        raise ValueError(
            f"answer_reward: responses {tuple(responses.shape)} and answers {tuple(answers.shape)} must be "
            "[N, L] and [N, A] with the same N"
        )
    answer_length = answers.shape[1]
    compared = min(answer_length, responses.shape[1])
    matches = responses[:, :compared] == answers[:, :compared]
    if answer_lengths is None:
        return matches.sum(dim=1).to(torch.float32) / answer_length
    if tuple(answer_lengths.shape) != (answers.shape[0],):
        raise ValueError(f"answer_reward: answer_lengths {tuple(answer_lengths.shape)} must be [N], N = "
                         f"{answers.shape[0]}")
    inside = torch.arange(compared)[None] < answer_lengths[:, None]
    return (matches & inside).sum(dim=1).to(torch.float32) / answer_lengths.to(torch.float32)
