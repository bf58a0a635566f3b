"""A minimal GRPO training loop in the style of a Megatron-LM training script, on megatron_grpo's plugin.

    torchrun --nproc-per-node 2 examples/megatron_training_loop.py --steps 5

Top to bottom: Megatron's own setup (process groups, model-parallel RNG, a `GPTModel(...)` from a
`TransformerConfig`, Megatron's DDP), then per step one call of megatron_grpo's `train_step`: the logprob passes
the plan asks for, then Megatron's `get_forward_backward_func()` with `ClippedPGLoss`, and the optimizer step. No
runner, no config file. Gloo on the CPU, NCCL with CUDA; the ranks not used by tensor parallelism are data-parallel.

The rollout is synthetic and made once: prompts with ragged answers, random rewards, GRPO's group-relative
advantages, and the logprobs of the policy that "sampled" it (the initial weights). Every step trains on that
same rollout, as on a stale one, with one optimizer step per use: the prev policy (these weights before the
update) is then the training forward's own, so the plan skips the prev pass, the loss takes prev = curr.detach(),
and truncated importance sampling weights each token by w = exp(curr - generation). The loss, -mean(A * w) since
the ratio to prev is 1, falls as the policy moves toward the answers with positive advantage.

`examples/megatron_forward_step.py` runs the same step with a Megatron-LM `forward_step` of its own.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from megatron_grpo.megatron.notices import quiet_megatron_notices

# Before megatron.core is imported: its known import-time notices (Transformer Engine and Apex missing on the CPU,
# ...) are filtered by their exact text; --verbose shows them.
quiet_megatron_notices(verbose="--verbose" in sys.argv[1:], cuda_available=torch.cuda.is_available())

from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from megatron_grpo.loss import ClippedPGLoss, ClippedPGLossConfig  # noqa: E402
from megatron_grpo.megatron import (  # noqa: E402
    StepConfig,
    apply_cpu_support,
    compute_logprobs,
    padded_vocab_size,
    train_step,
    vocab_shard_of,
    wrap_in_ddp,
)
from megatron_grpo.scheduler import LogprobPlan, PlanInputs, plan_logprob_passes  # noqa: E402

VOCAB, SEQ, PROMPT = 16, 12, 4  # real vocabulary, sequence length, prompt length
PROMPTS, ANSWERS, MICRO_BATCH = 4, 4, 8  # per data-parallel rank: 4 prompts x 4 answers, 2 microbatches
LR, CLIP_GRAD = 1e-3, 1.0
# Only what differs from the defaults (NeMo-RL's): DAPO's clip-higher, no KL, truncated importance sampling.
LOSS_CONFIG = ClippedPGLossConfig(
    ratio_clip_max=0.28, reference_policy_kl_penalty=0.0, use_importance_sampling_correction=True,
    truncated_importance_sampling={"type": "tis", "ratio_max": 2.0},
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="A minimal GRPO training loop on Megatron-Core (run under torchrun).",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=2,
                        help="ranks per tensor-parallel group; the other ranks are data-parallel")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the weights and the synthetic rollout")
    parser.add_argument("--verbose", action="store_true", help="show Megatron-Core's notices, filtered by default")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.tensor_model_parallel_size < 1:
        parser.error("--steps and --tensor-model-parallel-size must be >= 1")
    world_size = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None  # set by torchrun
    if world_size is not None and world_size % args.tensor_model_parallel_size:
        parser.error(f"--tensor-model-parallel-size {args.tensor_model_parallel_size} does not divide the "
                     f"world size {world_size}")
    return args


def initialize(tp: int, seed: int) -> torch.device:
    """torch.distributed from torchrun's environment, then Megatron's groups (PP = 1) and its RNG tracker."""
    on_cpu = apply_cpu_support()  # Megatron-Core without CUDA; a no-op with it
    if not on_cpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend="gloo" if on_cpu else "nccl")  # rank and world from torchrun's environment
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1)
    torch.manual_seed(seed)
    # On the CPU, Megatron's inference tracker: the CUDA RNG tracker needs CUDA (its forks are no-ops there).
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=on_cpu)
    return torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device())


def build_model(tp: int, device: torch.device) -> GPTModel:
    """A tiny GPTModel with vocab-parallel logits, the vocabulary padded as Megatron-LM pads it."""
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, init_method_std=0.1,
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
        params_dtype=torch.float32, pipeline_dtype=torch.float32, use_cpu_initialization=device.type == "cpu",
    )
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=padded_vocab_size(VOCAB, 8, tp), max_sequence_length=SEQ, parallel_output=True,
                     position_embedding_type="learned_absolute")
    return model.to(device)


def plan_for(model: GPTModel, steps: int) -> LogprobPlan:
    """The logprob passes of a step, from the loss's keys and this loop's facts: one optimizer step per use of a
    rollout that is reused every step, so at the last step it is `steps - 1` updates old."""
    rows = PROMPTS * ANSWERS * parallel_state.get_data_parallel_world_size()
    return plan_logprob_passes(PlanInputs.for_loss(
        LOSS_CONFIG, rollout_batch=rows, global_batch=rows, staleness=steps - 1,
        dropout=model.config.hidden_dropout > 0 or model.config.attention_dropout > 0,
    ))


def print_step(step: int, metrics: dict[str, float], prev_pass_ran: bool) -> None:
    if dist.get_rank() == 0:
        print(f"step {step}: loss {metrics['loss']:.6f} grad_norm {metrics['grad_norm']:.4f} "
              f"is_weight {metrics['sampling_importance_ratio']:.4f} "
              f"prev_pass {'ran' if prev_pass_ran else 'skipped'}", flush=True)


def synthetic_rollout(seed: int, device: torch.device) -> dict[str, torch.Tensor]:
    """This data-parallel rank's rollout, keyed as docs/design.md's batch contract: PROMPTS prompts x ANSWERS
    ragged answers, random rewards and the group-relative advantages (r - group mean) / (group std + eps)."""
    gen = torch.Generator().manual_seed(seed + parallel_state.get_data_parallel_rank())
    rows = PROMPTS * ANSWERS
    prompts = torch.randint(0, VOCAB, (PROMPTS, PROMPT), generator=gen).repeat_interleave(ANSWERS, dim=0)
    answers = torch.randint(0, VOCAB, (rows, SEQ - PROMPT), generator=gen)
    lengths = torch.randint(2, SEQ - PROMPT + 1, (rows, 1), generator=gen)
    positions = torch.arange(SEQ)
    rewards = torch.rand(PROMPTS, ANSWERS, generator=gen)
    advantages = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)
    batch = {
        "input_ids": torch.cat([prompts, answers], dim=1),
        "token_mask": ((positions >= PROMPT) & (positions < PROMPT + lengths)).float(),  # trained answer tokens
        "sample_mask": torch.ones(rows),
        "advantages": advantages.flatten(),
    }
    return {key: value.to(device) for key, value in batch.items()}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = initialize(args.tensor_model_parallel_size, args.seed)
    model = build_model(args.tensor_model_parallel_size, device)
    vocab = vocab_shard_of(model, VOCAB)  # which padded-vocab columns this rank holds; ids >= VOCAB are padding
    model = wrap_in_ddp(model)  # Megatron's DDP: main_grad buffers, finalize_model_grads after the last microbatch
    # Torch's AdamW: train_step steps it over DDP's main_grad (Megatron's own optimizer allocates on "cuda").
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    loss_fn = ClippedPGLoss(LOSS_CONFIG)
    plan = plan_for(model, args.steps)
    if dist.get_rank() == 0:
        print("logprob plan:\n" + "\n".join(f"  - {reason}" for reason in plan.reasons), flush=True)
    rows = PROMPTS * ANSWERS * parallel_state.get_data_parallel_world_size()
    step_config = StepConfig(global_batch_size=rows, micro_batch_size=MICRO_BATCH, clip_grad=CLIP_GRAD)

    batch = synthetic_rollout(args.seed, device)
    # the "sampler"'s logprobs: the initial policy's
    batch["generation_logprobs"] = compute_logprobs(model, batch, micro_batch_size=MICRO_BATCH, vocab=vocab)
    for step in range(1, args.steps + 1):
        result = train_step(step_config, model, optimizer, loss_fn, plan, batch, vocab=vocab)
        (metrics,) = result.step_metrics  # one optimizer step per rollout
        print_step(step, metrics, "prev" in result.passes_run)

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
