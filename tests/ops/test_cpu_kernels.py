"""The per-instruction-set builds of the CPU kernels: which one runs, how to force AVX2, and that each build (AVX2,
and AVX-512 where this CPU has it) matches the float64 anchor, in one process, whatever build the rest of the suite
runs. Where the CPU lacks AVX-512 the AVX-512 case is skipped, and the skip names what the CPU lacks."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys

import pytest
import torch
from logprob_reference import make_case
from test_logprob_temperature import anchor, check

from megatron_grpo.ops import SamplingDistribution, VocabShard, vocab_parallel_logprobs
from megatron_grpo.ops.core.backends import cpu_kernel_isa, cpu_kernel_status, extension_status, set_cpu_kernel_isa

X86 = platform.machine() in ("x86_64", "AMD64")
needs_x86 = pytest.mark.skipif(not X86, reason="the ISA builds exist on x86-64 only")
AVX512_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq")  # what the AVX-512 build needs (csrc/logprob_cpu.cpp)


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return {flag for line in cpuinfo if line.startswith("flags") for flag in line.split(":", 1)[1].split()}
    except OSError:
        return set()


def why_isa_cannot_run(isa: str) -> str | None:
    """None where the fused kernels of `isa` run on this machine; else why not, for the skip's reason."""
    if not X86:
        return "the ISA builds exist on x86-64 only"
    loaded, reason = extension_status()
    if not loaded:
        return reason
    usable, reason = cpu_kernel_status()
    if not usable:
        return f"the fused CPU kernels are refused here: {reason}"
    try:
        set_cpu_kernel_isa(isa)
    except RuntimeError as err:
        missing = [flag for flag in AVX512_FLAGS if flag not in cpu_flags()] if isa == "avx512" else []
        why = f"the CPU lacks {', '.join(missing)}" if missing else str(err).splitlines()[0]
        return f"the {isa} build is not runnable on this CPU: {why}"
    finally:
        set_cpu_kernel_isa("auto")
    return None


CANNOT_RUN = {isa: why_isa_cannot_run(isa) for isa in ("avx2", "avx512")}
needs_fused_cpu_kernels = pytest.mark.skipif(not cpu_kernel_status()[0],
                                             reason=f"the fused CPU kernels are refused here: {cpu_kernel_status()[1]}")
ISAS = [pytest.param(isa, marks=pytest.mark.skipif(why is not None, reason=str(why)))
        for isa, why in CANNOT_RUN.items()]
needs_avx512 = pytest.mark.skipif(CANNOT_RUN["avx512"] is not None, reason=str(CANNOT_RUN["avx512"]))


@pytest.fixture
def restore_isa():
    yield
    set_cpu_kernel_isa("auto")


@needs_x86
def test_kernels_follow_torchs_cpu_capability():
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX512", "AVX2"):  # a CPU without AVX2, or ATEN_CPU_CAPABILITY=default
        assert not cpu_kernel_status()[0]  # the fused CPU kernels are refused, as torch runs none of its vector ones
        return
    assert cpu_kernel_isa() == {"AVX512": "avx512", "AVX2": "avx2"}[capability]


@needs_x86
def test_aten_cpu_capability_avx2_selects_the_avx2_build():
    code = "import torch, megatron_grpo._C; print(torch.ops.megatron_grpo.cpu_kernel_isa())"
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
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
                                                   with_entropy=True, implementation="fused",
                                                   distribution=SamplingDistribution(logit_scale=scale, **filters),
                                                   inplace_backward=inplace)
        finite = torch.isfinite(logprob)
        objective = (torch.where(finite, logprob, 0.0) * g_lp).sum()
        if inplace != "exp":
            objective = objective + (entropy * g_h).sum()
        objective.backward()
        results.append((logprob.detach(), entropy.detach(), x.grad, filters, inplace))
    return results, g_lp, g_h


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scale", [1.0, 1 / 0.7])
def test_each_isa_build_matches_the_float64_anchor(isa, dtype, scale, restore_isa):
    """Plain, filtered and exp-mode ops, forward and backward, of one build against the float64 anchor, within the
    anchor tolerances of test_logprob_temperature (which hold for any lane count: they bound the exp's 3 ulps and
    the fp32 sums, not one build's rounding)."""
    rows, padded, true_vocab = 21, 2085, 2050  # tiles, vector steps and a scalar tail
    full, targets = make_case(rows, padded, true_vocab, dtype, seed=8)
    assert set_cpu_kernel_isa(isa) == isa
    results, g_lp, g_h = run_all_modes(full, targets, true_vocab, scale)
    for logprob, entropy, grad, filters, inplace in results:
        expected = anchor(full, targets, true_vocab, scale, filters.get("top_k"), filters.get("top_p"), g_lp,
                          None if inplace == "exp" else g_h)
        check(logprob, entropy, grad, expected, targets, true_vocab, dtype, f"{isa} {filters} {inplace}",
              roundings=2 if inplace == "exp" and dtype != torch.float32 else 1)


@needs_avx512
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_avx2_and_avx512_builds_agree(dtype, restore_isa):
    """The same exps (one polynomial) summed with 8 or 16 lanes. Each sum is a chain of at most ~60 roundings here (32
    within a tile, one per tile of 2050 columns, the lanes' merge), so the two orders differ by at most 2 x 60 u =
    7e-6 relative, and lse, logprob and entropy by about that much absolute (1e-5); p = exp(x - lse), so the fp32
    gradient differs by that relative (1e-5), a bf16 one by one rounding into bf16 on each side (2 half-ulps)."""
    full, targets = make_case(21, 2085, 2050, dtype, seed=8)
    per_isa = {}
    for isa in ("avx2", "avx512"):
        assert set_cpu_kernel_isa(isa) == isa
        per_isa[isa], _, _ = run_all_modes(full, targets, 2050, 1 / 0.7)
    for avx2, avx512 in zip(per_isa["avx2"], per_isa["avx512"]):
        torch.testing.assert_close(avx512[0], avx2[0], rtol=0, atol=1e-5, equal_nan=True)
        torch.testing.assert_close(avx512[1], avx2[1], rtol=0, atol=1e-5)
        torch.testing.assert_close(avx512[2].double(), avx2[2].double(), rtol=2 * 2.0**-8 if dtype != torch.float32
                                   else 1e-5, atol=1e-6)


def nan_with_payload() -> float:
    """A quiet NaN whose low mantissa bits are set (not the default NaN): it must poison its row like any NaN."""
    return torch.tensor([0x7FC00123], dtype=torch.int32).view(torch.float32).item()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("inplace_backward", [False, "exp"])
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), nan_with_payload()], ids=["nan", "inf", "nan_payload"])
def test_a_poisoned_row_alone_comes_out_nan(isa, poison, inplace_backward, restore_isa):
    """A NaN or +inf logit makes its row's logprob and gradient NaN, and no other row's: the running maxima may drop a
    NaN, the exponential then carries it."""
    assert set_cpu_kernel_isa(isa) == isa
    logits, targets = make_case(6, 300, 300, torch.float32, seed=3, ignore_every=0)
    for column in (123, 299):  # in a vector step, and in the row's scalar tail
        logits[2, column] = poison
        x = logits.clone().requires_grad_(True)
        logprob = vocab_parallel_logprobs(x, targets, implementation="fused", inplace_backward=inplace_backward)
        logprob.sum().backward()
        others = torch.arange(6) != 2
        assert bool(torch.isnan(logprob[2])) and bool(torch.isnan(x.grad[2]).any())
        assert bool(torch.isfinite(logprob[others]).all()) and bool(torch.isfinite(x.grad[others]).all())


@pytest.mark.parametrize("isa", ISAS)
def test_each_isa_builds_exponential_is_within_3_ulps(isa, restore_isa):
    """The kernels' exponential, seen through the gradient: a row of one logit 0 and 2000 logits z <= -25 has a sum of
    exponentials that rounds to exactly 1 (2000 e^-25 < 2^-25), so lse = 0 and each other logit's gradient is -e^z as
    the kernel computed it. Within 3 ulps of float64's e^z, over z in [-86, -25] (every reduced argument r, and every
    power of two down to 2^-124); -inf gives exactly 0, and below e^-86 (4e-38) the result is 0 or a subnormal
    within 3 ulps of e^z plus half a subnormal step."""
    assert set_cpu_kernel_isa(isa) == isa
    z = torch.empty(2000, dtype=torch.float64).uniform_(-86, -25, generator=torch.Generator().manual_seed(5))
    z[:4] = torch.tensor([float("-inf"), -87.5, -95.0, -103.0], dtype=torch.float64)
    logits = torch.cat([torch.zeros(1, dtype=torch.float64), z]).float()[None].requires_grad_(True)
    logprob = vocab_parallel_logprobs(logits, torch.zeros(1, dtype=torch.long), implementation="fused")
    assert logprob.item() == 0.0  # lse is exactly 0
    (grad,) = torch.autograd.grad(logprob.sum(), logits)
    exp_z = -grad[0, 1:].double()
    expected = torch.exp(logits[0, 1:].detach().double())
    assert exp_z[0].item() == 0.0
    subnormal_error = (exp_z[1:4] - expected[1:4]).abs() - 3 * 2.0**-23 * expected[1:4] - 2.0**-150
    assert bool(((exp_z[1:4] == 0) | (subnormal_error <= 0)).all())
    normal = expected[4:].float()
    ulp = (torch.nextafter(normal, torch.tensor(float("inf"))) - normal).double()
    assert ((exp_z[4:] - expected[4:]).abs() / ulp).max().item() <= 3.0


@needs_x86
def test_a_capability_capped_by_the_environment_names_the_variable(monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    usable, reason = cpu_kernel_status()
    assert not usable
    assert reason.startswith("ATEN_CPU_CAPABILITY=default caps torch's CPU capability at 'DEFAULT'"), reason
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    assert cpu_kernel_status()[1].startswith("this CPU lacks AVX2 (torch reports 'DEFAULT')")


@pytest.mark.skipif(sys.platform != "linux" or shutil.which("readelf") is None, reason="reads the ELF with readelf")
def test_the_extension_shares_torchs_cpp_runtime():
    """setup.py links the libstdc++ that torch loaded: with a static copy of its own, an error torch threw through the
    extension's frames crashed the process (seen on an H200 image, whose g++ linked libstdc++ statically)."""
    import megatron_grpo._C as extension

    needed = subprocess.run(["readelf", "-d", extension.__file__], capture_output=True, text=True, check=True).stdout
    assert "[libstdc++.so.6]" in needed, needed
