"""Megatron-Core's Mixture-of-Experts code without CUDA: each of `cpu_support`'s MoE workarounds (items 5-9 of its
docstring) checked on two gloo ranks, with what happens without it where that can be shown cheaply. One job."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import run_on_ranks

VOCAB, ROWS, SEQ = 13, 4, 6


def cpu_support_checks(rank: int, world_size: int) -> dict:
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.tensor_parallel import mappings
    from megatron.core.tensor_parallel import random as tensor_parallel_random
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    from megatron_grpo.megatron import (
        GPTModelParams,
        ParallelParams,
        build_gpt_model,
        destroy_parallel,
        init_parallel,
        model_forward,
    )
    from megatron_grpo.megatron.cpu_support import _CpuStream
    from megatron_grpo.megatron.moe_losses import clear_aux_losses

    layout = init_parallel(ParallelParams(expert_model_parallel_size=2))  # DP 2, EP 2
    outcome = {"layout": (layout.dp_size, layout.ep_size)}
    try:
        # 5: the router's gating GEMM, forward and backward, by the torch branch
        inp, weight = torch.randn(5, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
        moe_utils.router_gating_linear(inp, weight, None, torch.float32).square().sum().backward()
        expected_inp, expected_weight = inp.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
        (expected_inp @ expected_weight.T).square().sum().backward()
        outcome["gating"] = (torch.allclose(inp.grad, expected_inp.grad),
                             torch.allclose(weight.grad, expected_weight.grad), moe_utils.te_general_gemm is None)

        # 6 and 7: an EP 2 model on the alltoall dispatcher (its class-wide stream, numpy split sizes), forward and
        # backward with the auxiliary losses on
        outcome["dispatcher_stream"] = isinstance(token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream,
                                                  _CpuStream)
        sizes = torch.tensor([2, 3])
        outcome["split_sizes"] = (type(token_dispatcher.maybe_move_tensor_to_cpu(sizes, as_numpy=True)).__name__,
                                  type(moe_utils.maybe_move_tensor_to_cpu(sizes, as_numpy=True)).__name__)
        params = GPTModelParams(num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32,
                                max_position_embeddings=SEQ, hidden_dropout=0.0, attention_dropout=0.0,
                                make_vocab_size_divisible_by=8, add_bias_linear=False, num_moe_experts=4,
                                moe_aux_loss_coeff=0.1, moe_token_dispatcher_type="alltoall")
        model = build_gpt_model(params, VOCAB)
        ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(rank))
        try:
            model_forward(model, ids).square().mean().backward()
        finally:  # outside a schedule Megatron's backward leaves a 0-d aux-loss scale, whose later copy_ of the
            # schedule's [1]-shaped one fails, and its tracker sized for this one layer: the next test in this rank
            # process finds both as they were
            moe_utils.MoEAuxLossAutoScaler.main_loss_backward_scale = None
            clear_aux_losses()
        experts = [param for name, param in model.named_parameters() if "experts" in name]
        outcome["expert_grads"] = (len(experts), all(param.grad is not None and param.grad.abs().sum() > 0
                                                     for param in experts))

        # 8: uneven all-gather and reduce-scatter over a gloo group (the expert-TP ones of EP x ETP)
        group = parallel_state.get_data_parallel_group()
        mine = torch.full((2 + rank, 3), float(rank + 1))
        gathered = mappings._gather_along_first_dim(mine, group, output_split_sizes=[2, 3])
        outcome["gathered"] = gathered
        whole = torch.arange(15, dtype=torch.float32).view(5, 3) * (rank + 1)
        outcome["scattered"] = mappings._reduce_scatter_along_first_dim(whole, group, input_split_sizes=[2, 3])
        try:
            dist.all_gather([torch.empty(2, 3), torch.empty(3, 3)], mine, group=group)
            outcome["gloo_uneven"] = "ran"
        except RuntimeError as err:
            outcome["gloo_uneven"] = str(err)

        # 9: activation recompute: the dropout mask of the recomputed forward is the first forward's
        def layer(x):
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return torch.nn.functional.dropout(x * 2, p=0.5, training=True)

        x = torch.randn(64, requires_grad=True)
        torch.manual_seed(3)
        tensor_parallel.checkpoint(layer, False, x).sum().backward()
        recomputed = x.grad.clone()
        x.grad = None
        torch.manual_seed(3)
        layer(x).sum().backward()
        outcome["recompute"] = (torch.equal(recomputed, x.grad), bool((x.grad == 0).any()))
        try:
            tensor_parallel_random._get_cuda_rng_state()
            outcome["cuda_rng_state"] = "ran"
        except (AssertionError, RuntimeError) as err:
            outcome["cuda_rng_state"] = type(err).__name__
        return outcome
    finally:
        destroy_parallel()


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_on_ranks(2, cpu_support_checks)


def test_layout_is_ep2_over_dp2(ranks):
    assert [rank["layout"] for rank in ranks] == [(2, 2), (2, 2)]


def test_the_router_gating_gemm_runs_on_torch_without_transformer_engine(ranks):
    for rank in ranks:
        assert rank["gating"] == (True, True, True)


def test_the_alltoall_dispatcher_runs_an_expert_parallel_model_forward_and_backward(ranks):
    for rank in ranks:
        assert rank["dispatcher_stream"]
        assert rank["split_sizes"] == ("ndarray", "Tensor")  # Megatron's helper leaves CPU split sizes as tensors
        assert rank["expert_grads"] == (4, True)  # fc1 and fc2 of each of this rank's 2 of the 4 experts


def test_uneven_gathers_and_reduce_scatters_run_on_gloo(ranks):
    expected = torch.cat([torch.full((2, 3), 1.0), torch.full((3, 3), 2.0)])
    summed = torch.arange(15, dtype=torch.float32).view(5, 3) * 3
    for rank, result in enumerate(ranks):
        assert torch.equal(result["gathered"], expected)
        assert torch.equal(result["scattered"], summed[:2] if rank == 0 else summed[2:])
        assert result["gloo_uneven"] != "ran"  # gloo itself refuses tensors of unequal sizes


def test_activation_recompute_restores_the_rng_without_cuda(ranks):
    for rank in ranks:
        assert rank["recompute"] == (True, True)  # the same dropout mask, and dropout did drop
        assert rank["cuda_rng_state"] != "ran"  # Megatron's own state helper needs CUDA

