"""megatron-grpo: a Megatron-Core plugin for the GRPO/PPO policy-gradient step.

The face of the plugin: the two logprob ops and the two values they carry, the loss and the logprob-pass planner.
The Megatron layer is `megatron_grpo.megatron`; the GRPO runner (`megatron_grpo.runner`) sits on top and is not
exported here. The names are imported lazily, so `import megatron_grpo` stays cheap and never imports megatron.core.
"""

from __future__ import annotations

from megatron_grpo._lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "ConfigError": "megatron_grpo.strict_config",
    "vocab_parallel_logprobs": "megatron_grpo.ops",
    "vocab_parallel_linear_logprobs": "megatron_grpo.ops",
    "VocabShard": "megatron_grpo.ops",
    "SamplingDistribution": "megatron_grpo.ops",
    "ClippedPGLoss": "megatron_grpo.loss",
    "ClippedPGLossConfig": "megatron_grpo.loss",
    "LogprobPlan": "megatron_grpo.scheduler",
    "PlanInputs": "megatron_grpo.scheduler",
    "plan_logprob_passes": "megatron_grpo.scheduler",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
