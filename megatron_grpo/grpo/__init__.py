"""The GRPO runner: task and reward, TP rollouts, group advantages, checkpoints, reporting and the training loop.

`runner.main` is `python -m megatron_grpo train`; `loop` and `checkpoint` reach Megatron only through
`megatron_grpo.megatron` (no module here imports megatron.core), and only after the runner has validated its input.
"""
