"""GRPO in a Megatron-LM `pretrain_gpt.py`-style script: its own `get_batch` and `forward_step`, Megatron's schedule.

    torchrun --nproc-per-node 2 examples/megatron_forward_step.py --steps 5

A Megatron-LM training script hands `get_forward_backward_func()` a `forward_step(data_iterator, model)` that
returns `(output_tensor, partial(loss_func, ...))`. Here that function gets its microbatch with `get_batch`, as
`pretrain_gpt.py` does, and hands it to the forward step megatron_grpo builds for the optimizer step
(`make_forward_step` with `ClippedPGLoss` and the logprob plan): the model's vocab-parallel logits go straight
into the loss, normalised over the whole step, and the schedule's division by the number of microbatches and
DDP's average over the data-parallel ranks are undone. The rest of the loop is the script's: the prev pass when
the plan asks for it, the token counts, zeroing, clipping and the optimizer step.

The setup, the model and the synthetic rollout are `examples/megatron_training_loop.py`'s, which runs the same
step through `train_step`; at the same seed the two print the same numbers.
"""

from __future__ import annotations

import os
import sys
from functools import partial
from typing import Iterator

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling example: setup, model and rollout
import megatron_training_loop as setup  # noqa: E402  (filters Megatron's known notices before importing it)
from megatron.core import parallel_state  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402

from megatron_grpo.loss import ClippedPGLoss, aggregate_metrics, count_valid  # noqa: E402
from megatron_grpo.megatron import (  # noqa: E402
    AdamOverMainGrad,  # noqa: E402
    clip_grad_norm,
    compute_logprobs,
    make_forward_step,
    vocab_shard_of,
    wrap_in_ddp,
)

parse_args = setup.parse_args  # the same arguments


def get_batch(data_iterator: Iterator[dict[str, torch.Tensor]], device: torch.device) -> dict[str, torch.Tensor]:
    """`pretrain_gpt.py`'s get_batch: the next microbatch, on this rank's device (the TP ranks read the same one)."""
    return {key: value.to(device) for key, value in next(data_iterator).items()}


def forward_step(data_iterator, model, *, grpo_forward_step, device: torch.device):
    """Megatron-LM's forward step: `(output_tensor, loss_func)`, `loss_func(output_tensor)` giving the loss and its
    metrics. `grpo_forward_step` (`make_forward_step`'s) runs the model on the batch and binds the loss to it."""
    batch = get_batch(data_iterator, device)
    output_tensor, loss_func = grpo_forward_step(iter([batch]), model)
    return output_tensor, loss_func


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = setup.initialize(args.tensor_model_parallel_size, args.seed)
    model = setup.build_model(args.tensor_model_parallel_size, device)
    vocab = vocab_shard_of(model, setup.VOCAB)
    model = wrap_in_ddp(model)
    optimizer = AdamOverMainGrad(model.parameters(), lr=setup.LR, weight_decay=0.0)
    loss_fn = ClippedPGLoss(setup.LOSS_CONFIG)
    plan = setup.plan_for(model, args.steps)
    if dist.get_rank() == 0:
        print("logprob plan:\n" + "\n".join(f"  - {reason}" for reason in plan.reasons), flush=True)
    dp_group = parallel_state.get_data_parallel_group()
    micro_batch = setup.MICRO_BATCH

    batch = setup.synthetic_rollout(args.seed, device)
    batch["generation_logprobs"] = compute_logprobs(model, batch, micro_batch_size=micro_batch, vocab=vocab)
    counts = torch.stack(count_valid(batch))  # the loss normalises by the trained tokens and sequences of the step
    if dp_group.size() > 1:
        dist.all_reduce(counts, group=dp_group)
    rows = batch["input_ids"].shape[0]
    for step in range(1, args.steps + 1):
        if plan.compute_prev_logprobs:  # the prev policy: these weights, before this step's update
            batch["prev_logprobs"] = compute_logprobs(model, batch, micro_batch_size=micro_batch, vocab=vocab)
        microbatches = [{key: value[i:i + micro_batch] for key, value in batch.items()}
                        for i in range(0, rows, micro_batch)]
        grpo_forward_step = make_forward_step(loss_fn, plan, num_microbatches=len(microbatches),
                                              global_valid_tokens=counts[0], global_valid_seqs=counts[1], vocab=vocab)
        model.zero_grad_buffer()  # DDP's main_grad buffers (the optimizer leaves no .grad behind)
        model.train()
        per_microbatch = get_forward_backward_func()(
            forward_step_func=partial(forward_step, grpo_forward_step=grpo_forward_step, device=device),
            data_iterator=iter(microbatches), model=model, num_microbatches=len(microbatches),
            seq_length=batch["input_ids"].shape[1], micro_batch_size=micro_batch, forward_only=False,
        )  # ends in Megatron's finalize_model_grads: the DP all-reduce of the gradients
        grad_norm = clip_grad_norm(model, setup.CLIP_GRAD)  # over the model-parallel model, TP duplicates once
        optimizer.step()
        metrics = aggregate_metrics(per_microbatch, group=dp_group if dp_group.size() > 1 else None,
                                    aggregation=loss_fn.metric_aggregation)
        setup.print_step(step, {**metrics, "grad_norm": grad_norm}, plan.compute_prev_logprobs)

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
