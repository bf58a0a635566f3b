"""`ClippedPGLossConfig`: the `loss_fn:` section, strict whether built from YAML or from keyword arguments.

Both sections here are `StrictSection`s, so `ClippedPGLossConfig(**yaml_cfg["loss_fn"])`,
`ClippedPGLossConfig.from_mapping(...)` and the config loader all take the one validation path of
`megatron_grpo.strict_config`: every unknown key, every wrongly typed value and every cross-field conflict is one
`ConfigError` naming `loss_fn.<key>`. Every key has a default, NeMo-RL's code default where NeMo-RL has the key
(its `ClippedPGLossConfig`, `nemo_rl/algorithms/loss/loss_functions.py`), so a script passes only what it changes:
`ClippedPGLossConfig(ratio_clip_max=0.28)`. Never imports torch.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal, get_args

from megatron_grpo.strict_config import StrictSection

LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
KLType = Literal["k1", "k2", "k3"]
TruncationType = Literal["tis", "icepop", "seq-mask-tis"]
SequenceWeight = Literal["product", "geometric_mean"]
# Where the loss can take prev without a pass (`megatron_grpo.loss.prev_approximation`): the generation logprobs (verl's
# bypass), or AReaL's log-linear / linear interpolation between them and curr.detach().
ApproximationMethod = Literal["generation", "loglinear", "linear"]
APPROXIMATIONS: tuple[str, ...] = get_args(ApproximationMethod)


@dataclasses.dataclass(frozen=True, init=False)
class TruncatedImportanceSamplingConfig(StrictSection):
    """Truncation of the importance-sampling weights `exp(prev - generation)`.

    - `tis`: token weights clamped to `[ratio_min, ratio_max]`; a null `ratio_min` means 0, as in NeMo-RL.
    - `icepop`: tokens whose weight lies outside `[ratio_min, ratio_max]` get weight 0.
    - `seq-mask-tis`: sequences whose geometric-mean weight lies outside `[ratio_min, ratio_max]` get weight 0;
      kept sequences keep their untruncated token weights.
    """

    SECTION: ClassVar[str] = "loss_fn.truncated_importance_sampling"

    # NeMo-RL's truncated_importance_sampling_type / _ratio_min / _ratio: all null by default (no truncation)
    type: TruncationType | None = None
    ratio_min: float | None = None
    ratio_max: float | None = None

    def conflicts(self) -> list[str]:
        """The bounds' own ranges; what the truncation type needs is checked by `ClippedPGLossConfig`."""
        problems = []
        if self.ratio_min is not None and self.ratio_min < 0:
            problems.append(f"{self.key('ratio_min')}: must be >= 0, got {self.ratio_min}")
        if self.ratio_max is not None and self.ratio_max <= 0:
            problems.append(f"{self.key('ratio_max')}: must be > 0, got {self.ratio_max}")
        if self.ratio_min is not None and self.ratio_max is not None and self.ratio_min > self.ratio_max:
            problems.append(f"{self.key('ratio_min')} and {self.key('ratio_max')}: "
                            f"ratio_min {self.ratio_min} > ratio_max {self.ratio_max}")
        return problems


@dataclasses.dataclass(frozen=True, init=False)
class ClippedPGLossConfig(StrictSection):
    """Every option of `ClippedPGLoss`, each with its default (docs/loss.md has the table); the `loss_fn:` section
    of `configs/grpo_tiny_cpu.yaml` names them all."""

    SECTION: ClassVar[str] = "loss_fn"

    # Defaults: NeMo-RL's (ClippedPGLossConfig) where it has the key; the others say whose they are.
    ratio_clip_min: float = 0.2  # the ratio is clipped to [1 - ratio_clip_min, 1 + ratio_clip_max]
    ratio_clip_max: float = 0.2  # DAPO's clip-higher sets it above ratio_clip_min (e.g. 0.28)
    ratio_clip_c: float | None = None  # dual clipping for A < 0; null = off
    disable_ppo_ratio: bool = False  # REINFORCE / RLOO: -A curr
    loss_agg_mode: LossAggMode = "token-mean"  # NeMo-RL's token_level_loss: true; verl's default too
    max_response_length: int | None = None  # the constant of seq-mean-token-sum-norm (verl's); null = unset
    sequence_level_importance_ratio: bool = False  # GSPO (NeMo-RL's sequence_level_importance_ratios)
    sequence_level_importance_weight: SequenceWeight = "product"  # GSPO's IS weight, as NeMo-RL and verl weight it
    reference_policy_kl_penalty: float = 0.01  # > 0 puts a KL to the reference policy in the loss (or the reward)
    reference_policy_kl_type: KLType = "k3"
    kl_input_clamp_value: float | None = 20.0  # NeMo-RL's calculate_kl: clamp of log r; null = no clamp
    kl_output_clamp_value: float | None = 10.0  # ...and of the weighted KL; null = no clamp
    kl_in_sequence_reward: bool = False  # ours (not NeMo-RL's use_kl_in_reward): the KL in each sequence's reward
    use_on_policy_kl_approximation: bool = False
    use_importance_sampling_correction: bool = False
    truncated_importance_sampling: TruncatedImportanceSamplingConfig = dataclasses.field(
        default_factory=TruncatedImportanceSamplingConfig)
    force_on_policy_ratio: bool = False
    use_cispo: bool = False
    positive_example_nll_weight: float = 0.0  # VAPO's NLL weight; 0 = off
    entropy_coef: float = 0.0  # entropy bonus (verl's entropy_coeff); 0 = off

    @property
    def kl_in_loss(self) -> bool:
        """Whether the loss itself carries the reference-policy KL term."""
        return self.reference_policy_kl_penalty > 0 and not self.kl_in_sequence_reward

    def conflicts(self) -> list[str]:
        """Every contradictory combination of fields, each naming the `loss_fn.<key>`s involved."""
        return [
            *self._clipping_conflicts(),
            *self._aggregation_conflicts(),
            *self._kl_conflicts(),
            *self._importance_sampling_conflicts(),
            *self._option_conflicts(),
        ]

    def _clipping_conflicts(self) -> list[str]:
        problems = []
        if not 0 <= self.ratio_clip_min < 1:
            problems.append(f"loss_fn.ratio_clip_min: must be in [0, 1) (the ratio's lower bound 1 - ratio_clip_min "
                            f"is then in (0, 1]), got {self.ratio_clip_min}")
        if self.ratio_clip_max < 0:
            problems.append(f"loss_fn.ratio_clip_max: must be >= 0, got {self.ratio_clip_max}")
        if self.ratio_clip_c is not None and self.ratio_clip_c <= 1:
            problems.append(f"loss_fn.ratio_clip_c: dual clipping needs a value > 1 (or null), got {self.ratio_clip_c}")
        if self.force_on_policy_ratio and self.disable_ppo_ratio:
            problems.append(
                "loss_fn.force_on_policy_ratio and loss_fn.disable_ppo_ratio: a forced ratio of 1 needs the ratio "
                "that disable_ppo_ratio removes; set at most one"
            )
        if self.sequence_level_importance_ratio and self.disable_ppo_ratio:
            problems.append(
                "loss_fn.sequence_level_importance_ratio and loss_fn.disable_ppo_ratio: GSPO's sequence ratio needs "
                "the ratio that disable_ppo_ratio removes; set at most one"
            )
        return problems

    def _aggregation_conflicts(self) -> list[str]:
        problems = []
        if self.sequence_level_importance_ratio and self.loss_agg_mode == "token-mean":
            problems.append(
                "loss_fn.sequence_level_importance_ratio and loss_fn.loss_agg_mode: GSPO needs a seq-mean-* "
                "loss_agg_mode, got token-mean"
            )
        if self.loss_agg_mode == "seq-mean-token-sum-norm" and self.max_response_length is None:
            problems.append(
                "loss_fn.max_response_length and loss_fn.loss_agg_mode: seq-mean-token-sum-norm divides by "
                "max_response_length, which is null"
            )
        if self.max_response_length is not None and self.max_response_length <= 0:
            problems.append(f"loss_fn.max_response_length: must be > 0 (or null), got {self.max_response_length}")
        return problems

    def _kl_conflicts(self) -> list[str]:
        problems = []
        if self.reference_policy_kl_penalty < 0:
            problems.append(
                f"loss_fn.reference_policy_kl_penalty: must be >= 0, got {self.reference_policy_kl_penalty}"
            )
        for key in ("kl_input_clamp_value", "kl_output_clamp_value"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                problems.append(f"loss_fn.{key}: must be > 0 (or null), got {value}")
        if self.use_on_policy_kl_approximation and self.kl_in_sequence_reward:
            problems.append(
                "loss_fn.use_on_policy_kl_approximation and loss_fn.kl_in_sequence_reward: the approximation weights "
                "the KL term of the loss, which kl_in_sequence_reward removes; set at most one"
            )
        return problems

    def _importance_sampling_conflicts(self) -> list[str]:
        tis = self.truncated_importance_sampling
        problems = []
        if tis.type is not None and not self.use_importance_sampling_correction:
            problems.append(
                "loss_fn.truncated_importance_sampling.type and loss_fn.use_importance_sampling_correction: "
                f"truncation {tis.type!r} needs the importance-sampling correction, which is off"
            )
        if tis.type is not None and tis.ratio_max is None:
            problems.append(f"loss_fn.truncated_importance_sampling.ratio_max: {tis.type!r} needs it, got null")
        if tis.type in ("icepop", "seq-mask-tis") and tis.ratio_min is None:
            problems.append(f"loss_fn.truncated_importance_sampling.ratio_min: {tis.type!r} needs it, got null")
        if tis.type == "seq-mask-tis" and self.sequence_level_importance_ratio:
            problems.append(
                "loss_fn.truncated_importance_sampling.type and loss_fn.sequence_level_importance_ratio: "
                "seq-mask-tis masks sequences but keeps token-level weights, which GSPO's sequence weights replace; "
                "set at most one"
            )
        if self.sequence_level_importance_weight != "product" and not self.sequence_level_importance_ratio:
            problems.append(
                "loss_fn.sequence_level_importance_weight and loss_fn.sequence_level_importance_ratio: "
                f"{self.sequence_level_importance_weight!r} only applies to GSPO's sequence-level weights, which are "
                "off"
            )
        return problems

    def _option_conflicts(self) -> list[str]:
        """CISPO's clipped, detached token ratio cannot be combined with what removes or replaces it (as NeMo-RL);
        VAPO's NLL weight must not be negative."""
        problems = []
        if self.positive_example_nll_weight < 0:
            problems.append(
                f"loss_fn.positive_example_nll_weight: must be >= 0, got {self.positive_example_nll_weight}"
            )
        if not self.use_cispo:
            return problems
        clashes = {
            "disable_ppo_ratio": (self.disable_ppo_ratio, "CISPO needs the ratio that disable_ppo_ratio removes"),
            "force_on_policy_ratio": (self.force_on_policy_ratio, "a forced ratio of 1 removes the clipped weight"),
            "sequence_level_importance_ratio": (
                self.sequence_level_importance_ratio, "CISPO weights tokens, not sequences"
            ),
            "ratio_clip_c": (self.ratio_clip_c is not None, "dual clipping would overwrite the CISPO term"),
            "loss_agg_mode": (self.loss_agg_mode != "token-mean", "CISPO is a token-level loss: use token-mean"),
        }
        return problems + [
            f"loss_fn.use_cispo and loss_fn.{key}: {reason}" for key, (clash, reason) in clashes.items() if clash
        ]
