"""The GRPO runner: task and reward, TP rollouts, group advantages, checkpoints, reporting and the training loop.

`runner.main` is `python -m megatron_grpo train`; only `loop` and `checkpoint` import megatron.core, so the
runner validates its input before paying for that import.
"""
