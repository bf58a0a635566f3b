"""The GRPO runner: task and reward, TP rollouts, group advantages, checkpoints, reporting and the training loop.

`runner.main` is `python -m megatron_grpo train`; `loop` reaches Megatron through `megatron_grpo.megatron` and
`checkpoint` imports `megatron.core.dist_checkpointing` (the one direct import left outside that package), both only
after the runner has validated its input.
"""
