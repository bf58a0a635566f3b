"""Top-p's fused kernels (csrc/top_p.h: the value histogram, the boundary bin's candidates, the radix passes; on one
rank the whole search in one call, elsewhere staged) against their plain-torch twin (`filtering._select_top_p`): the
same threshold, bit for bit, on one rank (over TP 2: in test_top_p_pieces.py), for
fp32, bf16 and fp16 logits, with a temperature, a top-k floor, exact ties, a flat row and a NaN row; also when a
row's candidates overflow the compact buffer and are read again from the logits. The fused path reads nothing back
to the host. (Both sum their float64 masses in another order; on these inputs no cumulative mass lies within an ulp
of its target, so the thresholds agree exactly.)"""

from __future__ import annotations

import pytest
import torch
from logprob_reference import filtered_keep_mask
from test_cpu_kernels import ISAS, restore_isa  # noqa: F401  (the fixture the ISA tests use)
from test_host_syncs import CountSyncs

from megatron_grpo.ops.core import filtering
from megatron_grpo.ops.core.backends import FusedKernels, TorchKernels, extension_status, set_cpu_kernel_isa
from megatron_grpo.ops.distribution import SamplingDistribution

pytestmark = pytest.mark.skipif(not extension_status()[0], reason=extension_status()[1])

ROWS, VOCAB = 11, 333


def logits_case(dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(ROWS, VOCAB, generator=gen) * 3
    logits[:, ::5] = (logits[:, ::5] * 2).round() / 2  # exact ties, some at the boundary
    logits[4] = 0.25  # a flat row: every logit is a candidate of the boundary bin
    logits[7, 100:200] = -float("inf")  # masked logits
    logits[9, 17] = float("nan")  # a poisoned row keeps everything (threshold NaN on both paths)
    return logits.to(dtype)


def thresholds(logits, distribution):
    """The twin's threshold, the fused kernels' (on one rank: the whole search in one call), and the fused kernels'
    staged search (as over TP ranks: the stages' kernels, the choices in torch)."""
    twin, fused = [filtering.kept_threshold(logits, distribution, true_vocab_size=VOCAB, kernels=kernels)
                   for kernels in (TorchKernels(), FusedKernels())]
    with pytest.MonkeyPatch.context() as staged:
        staged.setattr(filtering, "searches_in_one_call", lambda *args: False)
        stages = filtering.kept_threshold(logits, distribution, true_vocab_size=VOCAB, kernels=FusedKernels())
    assert torch.equal(fused.nan_to_num(), stages.nan_to_num()) and torch.equal(fused.isnan(), stages.isnan())
    return twin, fused


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, 0.9), (0.7, None, 0.3), (1.3, 40, 0.8),
                                                     (1.0, None, 0.999)])
@pytest.mark.usefixtures("restore_isa")
def test_the_fused_threshold_is_the_twins(isa, dtype, temperature, top_k, top_p):
    """In each instruction-set build of the CPU kernels."""
    assert set_cpu_kernel_isa(isa) == isa
    logits = logits_case(dtype, seed=int(100 * top_p))
    distribution = SamplingDistribution.of_sampling(temperature, top_k=top_k, top_p=top_p)
    twin, fused = thresholds(logits, distribution)
    assert torch.equal(twin.isnan(), fused.isnan())
    assert torch.equal(twin.nan_to_num(), fused.nan_to_num())
    if dtype == torch.float32 and temperature == 1.0:  # the sorting reference of NeMo-RL's rule
        clean = torch.arange(ROWS) != 9
        expected = filtered_keep_mask(logits[clean], top_k, top_p)
        assert torch.equal(logits[clean] >= fused[clean, None], expected)


def test_rows_beyond_the_compact_buffer_are_read_again_from_the_logits(monkeypatch):
    logits = logits_case(torch.float32, seed=5)
    distribution = SamplingDistribution(top_p=0.6)
    whole_buffer = thresholds(logits, distribution)[1]
    monkeypatch.setattr(filtering, "CANDIDATE_CAPACITY", 2)  # the flat row and the ties overflow it
    twin, fused = thresholds(logits, distribution)
    assert torch.equal(fused.nan_to_num(), whole_buffer.nan_to_num())
    assert torch.equal(fused.nan_to_num(), twin.nan_to_num())


def test_the_fused_search_reads_nothing_back():
    logits = logits_case(torch.bfloat16, seed=6)
    with CountSyncs() as syncs:
        filtering.kept_threshold(logits, SamplingDistribution(top_k=50, top_p=0.9), true_vocab_size=VOCAB,
                                 kernels=FusedKernels())
    assert syncs.counts.total() == 0, syncs.counts
    with CountSyncs() as twin_syncs:
        filtering.kept_threshold(logits, SamplingDistribution(top_p=0.9), true_vocab_size=VOCAB,
                                 kernels=TorchKernels())
    assert twin_syncs.counts["nonzero"] == 1  # the twin gathers the candidates: one sync per piece


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("scale, with_floor", [(1.0, False), (1 / 0.7, True)])
@pytest.mark.usefixtures("restore_isa")
def test_the_value_histogram_is_the_float64_sums_of_its_masses(isa, dtype, scale, with_floor):
    """Each bin holds the sum of exp(z - shift) over its kept logits (bins, z and z - shift rounded as the twin
    rounds them), within the rounding of a float64 sum of `VOCAB` positive terms each within 1 ulp: (VOCAB + 1) ulps
    of the bin, in each instruction-set build. `VOCAB` = 333 leaves a short last block in both."""
    assert set_cpu_kernel_isa(isa) == isa
    logits = logits_case(dtype, seed=8)
    z = logits.float() * scale if scale != 1.0 else logits.float()
    shift = torch.where(torch.isfinite(z.amax(-1)), z.amax(-1), 0.0)
    floor = z.topk(40, dim=-1).values[:, -1].contiguous() if with_floor else None
    hist = torch.ops.megatron_grpo.top_p_value_histogram(logits, shift, floor, scale)
    centered = z - shift[:, None]
    bins = (centered * -filtering.VALUE_BINS_PER_NAT).nan_to_num(nan=filtering.VALUE_BINS - 1).clamp(
        0, filtering.VALUE_BINS - 1).long()
    mass = centered.double().exp()
    if floor is not None:
        mass = mass.masked_fill(z < floor[:, None], 0.0)
    reference = torch.zeros(ROWS, filtering.VALUE_BINS, dtype=torch.float64).scatter_add_(1, bins, mass)
    bound = (VOCAB + 1) * torch.finfo(torch.float64).eps * reference.abs()
    clean = torch.arange(ROWS) != 9  # the NaN row: NaN in its NaN's bin, as in the reference
    assert bool(((hist - reference)[clean].abs() <= bound[clean]).all())
    assert torch.equal(hist[9].isnan(), reference[9].isnan())
