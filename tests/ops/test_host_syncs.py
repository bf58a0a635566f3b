"""Where the fused paths read values back to the host (a sync on a GPU), counted on the CPU with a torch-function mode:
`nonzero`, `tolist`, `item` and a tensor's truth value.

- `vocab_parallel_linear_logprobs` gathers the trained rows (`nonzero`) only where some row is ignored: with
  `check_inputs=True` and every row trained, the target check's one sync says so and no `nonzero` runs.
- The loss-fused path syncs a fixed number of times per call, however many chunks it cuts: its chunk loop reads
  nothing back (top-p's threshold search aside, which reads its candidates back once per piece of 1/16 of a chunk).
- `check_inputs=False` removes the checks of values: the loss then reads nothing back per call;
  `check_batch_values` does those checks once, naming a bad key.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from _loss_inputs import batch_for_logits, loss_config
from torch._library.custom_ops import OPDEFS
from torch.overrides import TorchFunctionMode

from megatron_grpo.loss import ClippedPGLoss, check_batch_values, count_valid
from megatron_grpo.ops import SamplingDistribution, VocabShard, vocab_parallel_linear_logprobs, vocab_parallel_logprobs
from megatron_grpo.ops.core.custom_op import IMPLEMENTATIONS

SYNCS = {torch.Tensor.nonzero: "nonzero", torch.nonzero: "nonzero", torch.Tensor.tolist: "tolist",
         torch.Tensor.item: "item", torch.Tensor.__bool__: "bool", torch.Tensor.__int__: "int",
         torch.Tensor.__float__: "float"}


def _implementation(func):
    """The Python body of one of the project's `torch.library` ops (`custom_op`'s or `define_op`'s), else None."""
    name = getattr(func, "_qualified_op_name", None) or getattr(getattr(func, "_schema", None), "name", "")
    if not name.startswith("megatron_grpo::"):
        return None
    if name in OPDEFS:
        return OPDEFS[name]._init_fn
    return IMPLEMENTATIONS.get(name)


class CountSyncs(TorchFunctionMode):
    """Counts the host syncs of a forward, inside the project's `torch.library` ops too: a mode sees an op as one
    call, so their Python bodies run here under the mode (forward only: autograd does not record them)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in SYNCS:
            self.counts[SYNCS[func]] += 1
        implementation = _implementation(func)
        if implementation is not None:
            with self:
                return implementation(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def problem(rows: int = 40, hidden_size: int = 8, vocab: int = 29):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(rows, hidden_size, generator=gen), torch.randn(32, hidden_size, generator=gen),
            torch.randint(0, vocab, (rows,), generator=gen))


def test_trained_rows_are_gathered_only_where_some_row_is_ignored():
    hidden, weight, targets = problem()
    shard = VocabShard(true_vocab_size=29)
    with CountSyncs() as all_trained:
        vocab_parallel_linear_logprobs(hidden, weight, targets, shard=shard)
    ignored = targets.clone()
    ignored[3] = -1
    with CountSyncs() as some_ignored:
        vocab_parallel_linear_logprobs(hidden, weight, ignored, shard=shard)
    with CountSyncs() as unchecked:
        vocab_parallel_linear_logprobs(hidden, weight, targets, shard=shard, check_inputs=False)
    assert all_trained.counts == Counter(tolist=1)  # the target check, which also says that no row is ignored
    assert some_ignored.counts == Counter(tolist=1, nonzero=1)
    assert unchecked.counts == Counter(nonzero=1)  # not known without a look: gathered (none ignored, as it finds)


@pytest.mark.parametrize("chunk_rows", [None, 3, 1])
@pytest.mark.parametrize("setting", ["closed form", "top-k", "whole sequences"])
def test_the_loss_fused_path_syncs_per_call_not_per_chunk(chunk_rows, setting):
    """The chunk loop reads nothing back: the call's syncs are the same however many chunks it cuts."""
    gen = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(6, 9, 8, generator=gen), torch.randn(32, 8, generator=gen)
    batch = batch_for_logits(hidden @ weight.t(), 29, seed=2)
    tokens, seqs = count_valid(batch)
    gspo = {"sequence_level_importance_ratio": True, "loss_agg_mode": "seq-mean-token-mean"}
    loss_fn = ClippedPGLoss(loss_config(**(gspo if setting == "whole sequences" else {})))
    distribution = SamplingDistribution(top_k=5) if setting == "top-k" else None
    call = {"global_valid_tokens": tokens, "global_valid_seqs": seqs, "shard": VocabShard(true_vocab_size=29),
            "chunk_rows": chunk_rows, "distribution": distribution}
    with CountSyncs() as checked:
        loss_fn.on_hidden_states(hidden, weight, batch, **call)
    with CountSyncs() as unchecked:
        loss_fn.on_hidden_states(hidden, weight, batch, check_inputs=False, **call)
    # The trained rows (nonzero) and whether each chunk's rows are consecutive (tolist); for whole-sequence chunks
    # also the rows per sequence (tolist). Checked, once: finite advantages (bool; the rewards are not read by this
    # config), the global counts against the microbatch (tolist) and the target ids (tolist).
    per_call = Counter(tolist=2 if setting == "whole sequences" else 1, nonzero=1)
    assert unchecked.counts == per_call
    assert checked.counts == per_call + Counter(tolist=2, bool=1)


def test_the_loss_without_value_checks_reads_nothing_back():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 7, 29, generator=gen)
    batch = batch_for_logits(logits, 29, seed=4)
    tokens, seqs = count_valid(batch)
    with CountSyncs() as unchecked:
        ClippedPGLoss(loss_config())(logits, batch, global_valid_tokens=tokens, global_valid_seqs=seqs,
                                     check_inputs=False)
    assert unchecked.counts == Counter()


@pytest.mark.parametrize("filtered", [False, True])
def test_the_logprob_op_without_checks_reads_nothing_back(filtered):
    """The op's own body runs under the mode (its implementation, not just its dispatch): without the target check,
    neither the kernels nor top-k / top-p's fused search read a value back."""
    from megatron_grpo.ops import SamplingDistribution

    logits, targets = torch.randn(5, 40), torch.tensor([1, 39, -1, 7, 0])
    distribution = SamplingDistribution(top_k=9, top_p=0.8) if filtered else None
    with CountSyncs() as unchecked:
        vocab_parallel_logprobs(logits, targets, distribution=distribution, check_inputs=False, with_entropy=True)
    with CountSyncs() as checked:
        vocab_parallel_logprobs(logits, targets, distribution=distribution, with_entropy=True)
    assert unchecked.counts == Counter()
    assert checked.counts == Counter(tolist=1)  # the target ids' range: one read of min and max


def test_check_batch_values_names_the_bad_key():
    batch = {"input_ids": torch.tensor([[1, 2, 28]]), "advantages": torch.tensor([0.5]),
             "rewards": torch.tensor([1.0])}
    check_batch_values(batch, 29)
    with pytest.raises(ValueError, match=r"batch\['input_ids'\]: contains token id 29, outside the vocab \[0, 29\)"):
        check_batch_values({**batch, "input_ids": torch.tensor([[1, 29]])}, 29)
    with pytest.raises(ValueError, match=r"batch\['input_ids'\]: contains token id -1"):
        check_batch_values({**batch, "input_ids": torch.tensor([[-1, 3]])}, 29)
    with pytest.raises(ValueError, match=r"batch\['advantages'\]: contains NaN or infinite values"):
        check_batch_values({**batch, "advantages": torch.tensor([float("nan")])}, 29)
    with pytest.raises(ValueError, match=r"batch\['rewards'\]: contains NaN or infinite values"):
        check_batch_values({**batch, "rewards": torch.tensor([float("inf")])}, 29)
