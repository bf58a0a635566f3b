"""`SamplingDistribution`: the token distribution the rollouts sample from and training trains,
`softmax(logit_scale * logits)` restricted to what top-k and then top-p keep (`filtering` has the exact rule), or, with
`replay_kept_set`, to the rollout engine's own kept set of each token (`KeptSet`, per-token data the batch carries).

One value, checked once where it is built and carried unchanged, like `VocabShard`, from the sampling settings down
to the kernels: the sampler, the ops, `ClippedPGLoss` and the Megatron step all take it. `logit_scale` is
1 / temperature (`of_sampling` is the one place that divides). The KL to the (unfiltered) reference reads
`unfiltered()`: the same scale without the filter.

This module imports nothing (not torch), so a config reader can build and check one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class SamplingDistribution:
    """`softmax(logit_scale * logits)` over the tokens that `top_k` (None = off) and then `top_p` (None or 1 =
    off) keep. The default is the plain softmax of the logits.

    `replay_kept_set`: over the tokens the rollout engine kept when it sampled each token instead (the ops'
    `kept_set=`, the batch's `kept_set_*` keys): the filter is not recomputed from the training logits, which differ
    from the engine's (older weights, another precision, other kernels). `top_k` / `top_p` stay the sampler's
    settings, which the kept-set metrics compare the replayed set with.

    `logit_scale` is a finite number > 0, `top_k` an int >= 1, `top_p` a number in (0, 1], `replay_kept_set` a
    bool; anything else is a ValueError naming the field.
    """

    logit_scale: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    replay_kept_set: bool = False

    def __post_init__(self) -> None:
        problems = self.problems(logit_scale=self.logit_scale, top_k=self.top_k, top_p=self.top_p,
                                 replay_kept_set=self.replay_kept_set)
        if problems:
            raise ValueError("; ".join(f"{name} {problem}" for name, problem in problems.items()))
        object.__setattr__(self, "logit_scale", float(self.logit_scale))
        if self.top_p is not None:
            object.__setattr__(self, "top_p", float(self.top_p))

    @classmethod
    def of_sampling(cls, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                    replay_kept_set: bool = False) -> SamplingDistribution:
        """The distribution a sampler with this temperature, top-k and top-p draws from (`replay_kept_set`: its
        support replayed from the engine's kept sets, see the class docstring)."""
        problems = cls.problems(temperature=temperature, top_k=top_k, top_p=top_p, replay_kept_set=replay_kept_set)
        if problems:
            raise ValueError("; ".join(f"{name} {problem}" for name, problem in problems.items()))
        return cls(logit_scale=1.0 / temperature, top_k=top_k, top_p=top_p, replay_kept_set=replay_kept_set)

    @staticmethod
    def problems(**settings: object) -> dict[str, str]:
        """What is wrong with these settings (any of `logit_scale`, `temperature`, `top_k`, `top_p`,
        `replay_kept_set`), by name: the one owner of the rules, which a config reports under its own keys. Empty
        when they make a distribution."""
        rules = {
            "logit_scale": (_positive_number, "must be a finite number > 0 (1 / temperature)"),
            "temperature": (_positive_number, "must be a finite number > 0"),
            "top_k": (lambda k: k is None or (_integer(k) and k >= 1), "must be None or an int >= 1"),
            "top_p": (lambda p: p is None or (_number(p) and 0.0 < float(p) <= 1.0),
                      "must be None or a number in (0, 1]"),
            "replay_kept_set": (lambda replay: isinstance(replay, bool), "must be a bool"),
        }
        return {name: f"{rules[name][1]}, got {value!r}" for name, value in settings.items()
                if not rules[name][0](value)}

    @property
    def filtered(self) -> bool:
        """Whether a filter is set or a kept set replayed (either may still keep every token: see `active`)."""
        return self.top_k is not None or self.uses_top_p() or self.replay_kept_set

    @property
    def recomputes_filter(self) -> bool:
        """Whether the ops find the kept tokens themselves from the logits (top-k / top-p, not replayed)."""
        return (self.top_k is not None or self.uses_top_p()) and not self.replay_kept_set

    def unfiltered(self) -> SamplingDistribution:
        """The same scale without top-k / top-p or replay: the distribution the KL to the reference reads."""
        return replace(self, top_k=None, top_p=None, replay_kept_set=False)

    def recomputed(self) -> SamplingDistribution:
        """The same distribution with its filter recomputed from the logits, not replayed."""
        return replace(self, replay_kept_set=False)

    def replayed(self) -> SamplingDistribution:
        """The same distribution over the engine's kept sets (`replay_kept_set`)."""
        return replace(self, replay_kept_set=True)

    def restricts(self, true_vocab_size: int) -> bool:
        """Whether the trained distribution can keep fewer tokens than the unfiltered one of a row of
        `true_vocab_size` tokens: a replayed kept set, or an active recomputed filter (`active`)."""
        return self.replay_kept_set or self.active(true_vocab_size)

    def active(self, true_vocab_size: int) -> bool:
        """Whether the recomputed filter (top-k / top-p) can drop a token of a row of `true_vocab_size` tokens."""
        return self.uses_top_k(true_vocab_size) or self.uses_top_p()

    def uses_top_k(self, true_vocab_size: int) -> bool:
        return self.top_k is not None and self.top_k < true_vocab_size

    def uses_top_p(self) -> bool:
        return self.top_p is not None and self.top_p < 1.0


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_number(value: object) -> bool:
    return _number(value) and math.isfinite(value) and value > 0
