"""The per-instruction-set builds of the CPU kernels: which one runs, how to force AVX2, and that the AVX2 and
AVX-512 builds agree with each other and with the float64 anchor where this machine runs both."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch

from logprob_reference import make_case
from megatron_grpo.ops import VocabShard, vocab_parallel_logprobs
from megatron_grpo.ops.backends import cpu_kernel_isa, set_cpu_kernel_isa
from test_logprob_temperature import anchor, check

X86 = platform.machine() in ("x86_64", "AMD64")
needs_x86 = pytest.mark.skipif(not X86, reason="the ISA builds exist on x86-64 only")
needs_avx512 = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512",
                                  reason="torch reports no AVX-512 on this CPU")


@pytest.fixture
def restore_isa():
    yield
    set_cpu_kernel_isa("auto")


@needs_x86
def test_kernels_follow_torchs_cpu_capability():
    expected = {"AVX512": "avx512", "AVX2": "avx2"}[torch.backends.cpu.get_cpu_capability()]
    assert cpu_kernel_isa() == expected


@needs_x86
def test_aten_cpu_capability_avx2_selects_the_avx2_build():
    code = "import torch, megatron_grpo._C; print(torch.ops.megatron_grpo.cpu_kernel_isa())"
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.stdout.strip() == "avx2"


@needs_x86
def test_unknown_isa_is_a_named_error(restore_isa):
    with pytest.raises(RuntimeError, match="cpu kernel ISA sse9 is unknown"):
        set_cpu_kernel_isa("sse9")
    assert set_cpu_kernel_isa("avx2") == "avx2"
    assert cpu_kernel_isa() == "avx2"


def run_all_modes(full, targets, true_vocab, scale):
    """Outputs and gradients of the plain, filtered and exp-mode ops (fused) for one input."""
    gen = torch.Generator().manual_seed(4)
    g_lp, g_h = torch.randn(targets.shape, generator=gen), torch.randn(targets.shape, generator=gen)
    results = []
    for filters, inplace in [({}, False), ({"top_k": 9, "top_p": 0.8}, False), ({}, "exp")]:
        x = full.clone().requires_grad_(True)
        logprob, entropy = vocab_parallel_logprobs(x, targets, shard=VocabShard(true_vocab_size=true_vocab),
                                                   with_entropy=True, implementation="fused", logit_scale=scale,
                                                   inplace_backward=inplace, **filters)
        finite = torch.isfinite(logprob)
        objective = (torch.where(finite, logprob, 0.0) * g_lp).sum()
        if inplace != "exp":
            objective = objective + (entropy * g_h).sum()
        objective.backward()
        results.append((logprob.detach(), entropy.detach(), x.grad, filters, inplace))
    return results, g_lp, g_h


@needs_x86
@needs_avx512
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scale", [1.0, 1 / 0.7])
def test_avx2_and_avx512_builds_agree(dtype, scale, restore_isa):
    rows, padded, true_vocab = 21, 2085, 2050  # tiles, vector steps and a scalar tail
    full, targets = make_case(rows, padded, true_vocab, dtype, seed=8)
    per_isa = {}
    for isa in ("avx2", "avx512"):
        assert set_cpu_kernel_isa(isa) == isa
        per_isa[isa], g_lp, g_h = run_all_modes(full, targets, true_vocab, scale)
    for avx2, avx512 in zip(per_isa["avx2"], per_isa["avx512"]):
        filters, inplace = avx2[3], avx2[4]
        # Same maths, different lane counts: equal up to fp32 summation order (and one rounding of the result).
        torch.testing.assert_close(avx512[0], avx2[0], rtol=0, atol=1e-5, equal_nan=True)
        torch.testing.assert_close(avx512[1], avx2[1], rtol=0, atol=1e-5)
        torch.testing.assert_close(avx512[2].double(), avx2[2].double(), rtol=2 * 2.0**-8 if dtype != torch.float32
                                   else 1e-5, atol=1e-6)
        expected = anchor(full, targets, true_vocab, scale, filters.get("top_k"), filters.get("top_p"), g_lp,
                          None if inplace == "exp" else g_h)
        for name, result in (("avx2", avx2), ("avx512", avx512)):
            check(result[0], result[1], result[2], expected, targets, true_vocab, dtype, f"{name} {filters} {inplace}",
                  roundings=2 if inplace == "exp" and dtype != torch.float32 else 1)


@pytest.mark.parametrize("inplace_backward", [False, "exp"])
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_fast_exp_keeps_a_poisoned_row_nan_in_the_gradient(poison, inplace_backward):
    """The kernels' fast exp maps NaN to a number; a NaN or +inf row must still get a NaN gradient, alone."""
    logits, targets = make_case(6, 300, 300, torch.float32, seed=3, ignore_every=0)
    logits[2, 123] = poison
    x = logits.clone().requires_grad_(True)
    logprob = vocab_parallel_logprobs(x, targets, implementation="fused", inplace_backward=inplace_backward)
    logprob.sum().backward()
    assert bool(torch.isnan(x.grad[2]).any())
    others = torch.arange(6) != 2
    assert bool(torch.isfinite(x.grad[others]).all())
