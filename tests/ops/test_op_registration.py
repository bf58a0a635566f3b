"""How `megatron_grpo::vocab_parallel_logprobs` is registered, and the kernels that write its outputs.

- The compiled extension defines the op's schema and its C++ autograd kernel (csrc/logprob_op.cpp); Python registers
  the implementation and the fake kernel (`ops.core.custom_op.define_op`), and checks that the two schemas agree.
  Without the extension, Python defines the same op with an autograd kernel of its own: a fresh interpreter with
  `megatron_grpo._C` hidden runs forward, backward, no_grad, kept sets replayed and `torch.library.opcheck`'s
  autograd checks there.
- Under `no_grad` (or with logits that need no gradient) a call builds no autograd node.
- The combine kernel (C++) against the plain-torch combine, on partials with every edge case: ignored rows, ranks
  without valid columns (m = -inf, d = 0), NaN and +inf rows.
- The out-of-place backward's buffer has the row stride the fake kernel reports (C++ and Python agree).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from megatron_grpo.ops import vocab_parallel_logprobs
from megatron_grpo.ops.core.alignment import gradient_row_stride
from megatron_grpo.ops.core.backends import extension_status
from megatron_grpo.ops.core.partials import combine_partials
from megatron_grpo.ops.vocab_parallel import _backward_op, _logprobs_op

REPO = Path(__file__).resolve().parents[2]
needs_extension = pytest.mark.skipif(not extension_status()[0], reason=extension_status()[1])
SCHEMAS = {
    "megatron_grpo::vocab_parallel_logprobs":
        "(Tensor logits, Tensor targets, int? start_index, int? true_vocab_size, str group_name, float logit_scale, "
        "int? top_k, float? top_p, bool with_entropy, bool check_inputs, str implementation, "
        "Tensor? kept_offsets=None, Tensor? kept_ids=None, bool kept_next_token=False) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
}


@needs_extension
def test_the_compiled_schema_is_the_python_one_and_autograd_is_cpp():
    for op in (_logprobs_op, _backward_op):
        assert op._schema.name.startswith("megatron_grpo::")
    # define_op raised at import if they differed; here, one of them spelled out
    name = "megatron_grpo::vocab_parallel_logprobs"
    assert str(_logprobs_op._schema) == str(torch._C.parse_schema(name + SCHEMAS[name]))
    assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "Autograd")
    logits = torch.randn(3, 11, requires_grad=True)
    out = vocab_parallel_logprobs(logits, torch.tensor([1, -1, 4]))
    assert type(out.grad_fn).__name__ == "CppFunction"  # the C++ node (the Python kernel's is a BackwardCFunction)


def test_no_grad_builds_no_autograd_node():
    logits, targets = torch.randn(4, 9, requires_grad=True), torch.tensor([0, 3, -1, 8])
    with torch.no_grad():
        logprob, entropy = vocab_parallel_logprobs(logits, targets, with_entropy=True)
    assert logprob.grad_fn is None and entropy.grad_fn is None and not logprob.requires_grad
    logprob = vocab_parallel_logprobs(logits.detach(), targets)
    assert logprob.grad_fn is None and not logprob.requires_grad


WITHOUT_EXTENSION = textwrap.dedent("""
    import sys
    sys.modules["megatron_grpo._C"] = None  # as where the extension is not built: its import fails
    import warnings
    import torch
    from megatron_grpo.ops import vocab_parallel_logprobs
    from megatron_grpo.ops.core.backends import extension_status
    from megatron_grpo.ops.vocab_parallel import _logprobs_op
    assert not extension_status()[0], extension_status()
    name = "megatron_grpo::vocab_parallel_logprobs"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "Autograd")
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 13, generator=gen) * 2).requires_grad_(True)
    targets = torch.tensor([0, 12, -1, 5, 7, 3])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one-time fallback warning
        logprob, entropy = vocab_parallel_logprobs(logits, targets, with_entropy=True)
    assert type(logprob.grad_fn).__name__ == "vocab_parallel_logprobs_autogradBackward", type(logprob.grad_fn)
    (logprob.sum() + 0.5 * entropy.sum()).backward()
    x = logits.detach().double().requires_grad_(True)
    log_p = torch.log_softmax(x, -1)
    ref = torch.where(targets >= 0, log_p.gather(1, targets.clamp(min=0)[:, None])[:, 0], 0.0)
    ref_entropy = torch.where(targets >= 0, -(log_p.exp() * log_p).sum(-1), 0.0)
    (ref.sum() + 0.5 * ref_entropy.sum()).backward()
    torch.testing.assert_close(logprob.double(), ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(entropy.double(), ref_entropy, rtol=0, atol=1e-5)
    torch.testing.assert_close(logits.grad.double(), x.grad, rtol=0, atol=1e-6)
    with torch.no_grad():
        assert vocab_parallel_logprobs(logits, targets).grad_fn is None
    # Kept sets replayed through this autograd kernel: each row's target and two other ids, against float64
    from megatron_grpo.ops import KeptSet, SamplingDistribution
    ids = torch.stack([targets, (targets + 3) % 13, (targets + 7) % 13], 1).sort(dim=1).values
    trained = targets >= 0  # an ignored row holds no set
    kept = KeptSet(torch.cat([torch.zeros(1, dtype=torch.int64), (3 * trained).cumsum(0)]), ids[trained].reshape(-1))
    logits.grad = None
    logprob = vocab_parallel_logprobs(logits, targets, distribution=SamplingDistribution(replay_kept_set=True),
                                      kept_set=kept)
    logprob.sum().backward()
    x = logits.detach().double().requires_grad_(True)
    at = (ids == targets[:, None]).long().argmax(1, keepdim=True)
    ref = torch.where(trained, torch.log_softmax(x.gather(1, ids.clamp(min=0)), -1).gather(1, at)[:, 0], 0.0)
    ref.sum().backward()
    torch.testing.assert_close(logprob.double(), ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(logits.grad.double(), x.grad, rtol=0, atol=1e-6)
    args = (logits.detach().requires_grad_(True), targets, None, 13, "", 1.0, 4, None, True, True, "auto")
    # The checks of what this path registers itself (the schema and fake kernel are test_compile.py's, for both)
    results = torch.library.opcheck(_logprobs_op, args,
                                    test_utils=("test_autograd_registration", "test_aot_dispatch_dynamic"))
    assert set(results.values()) == {"SUCCESS"}, results
    print("ok")
""")


def test_without_the_extension_python_defines_the_op_and_its_autograd():
    done = subprocess.run([sys.executable, "-c", WITHOUT_EXTENSION], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr


def edge_partials(world: int, rows: int, with_entropy: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    k = 4 if with_entropy else 3
    m = torch.randn(world, rows, generator=gen) * 5
    d = torch.rand(world, rows, generator=gen) * 100 + 1
    target = torch.where(torch.rand(world, rows, generator=gen) < 1 / world, m - torch.rand(world, rows, generator=gen),
                         torch.full((world, rows), float("-inf")))
    parts = [m, d, target] + ([torch.randn(world, rows, generator=gen) * 10] if with_entropy else [])
    gathered = torch.stack(parts, dim=-1).contiguous()
    gathered[0, 1, :2] = torch.tensor([float("-inf"), 0.0])  # a rank without valid columns
    if with_entropy:
        gathered[0, 1, 3] = 0.0
    gathered[:, 2, 0] = float("nan")  # a poisoned row
    gathered[-1, 3, 1] = float("nan")
    gathered[:, 4, :2] = torch.tensor([float("-inf"), 0.0])  # every rank empty
    targets = torch.randint(0, 100, (rows,), generator=gen)
    targets[5] = -1
    gathered[:, 5, :3] = torch.tensor([0.0, 1.0, float("-inf")])  # an ignored row's placeholders
    assert gathered.shape[-1] == k
    return gathered, targets


@needs_extension
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_the_combine_kernel_is_the_torch_combine(world, with_entropy):
    """The same operations in the same order (sums over up to 8 ranks: the fp32 order may differ by a few ulps of
    the largest term; the outputs are O(10), so 1e-5 absolute)."""
    gathered, targets = edge_partials(world, 40, with_entropy, seed=world)
    fused = torch.ops.megatron_grpo.logprob_combine(gathered, targets, with_entropy)
    reference = combine_partials(gathered, targets, with_entropy)
    for name, got, want in zip(("logprob", "entropy", "lse", "mean_x"), fused, reference):
        assert got.shape == want.shape, name
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5, equal_nan=True, msg=name)
    assert torch.equal(fused[0][5], torch.tensor(0.0))  # the ignored row


@needs_extension
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_fused_forward_is_the_combine_of_its_own_partials(dtype):
    """TP 1: the forward kernel's outputs are the combine of the partials the TP > 1 path all-gathers."""
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(9, 300, generator=gen) * 4).to(dtype)
    targets = torch.randint(0, 290, (9,), generator=gen)
    targets[2] = -1
    ops = torch.ops.megatron_grpo
    for with_entropy in (False, True):
        fused = ops.logprob_forward(logits, targets, 0, 290, with_entropy, None, 1.3)
        partials = ops.logprob_partials(logits, targets, 0, 290, with_entropy, None, 1.3)
        combined = ops.logprob_combine(partials.unsqueeze(0).contiguous(), targets, with_entropy)
        for got, want in zip(fused, combined):
            assert torch.equal(got, want)


@needs_extension
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_the_gradient_buffer_has_the_row_stride_the_fake_kernel_reports(dtype):
    base = torch.randn(5 * 70 + 11).to(dtype)
    for offset, stride, rows, cols in [(0, 70, 5, 70), (3, 70, 5, 61), (1, 67, 5, 64), (7, 70, 1, 9), (0, 9, 0, 9)]:
        logits = base.as_strided((rows, cols), (stride, 1), offset)
        stride_cpp = torch.ops.megatron_grpo.gradient_row_stride(logits)
        assert stride_cpp == gradient_row_stride(logits), (offset, stride, rows, cols)
        lse = torch.zeros(rows)
        grad = torch.ops.megatron_grpo.logprob_gradient(logits, torch.zeros(rows, dtype=torch.long), 0, cols, lse,
                                                        None, None, torch.ones(rows), None, None, 1.0)
        assert grad.shape == logits.shape and (rows <= 1 or grad.stride(0) == stride_cpp)
        if rows:
            element = logits.element_size()
            assert (grad.data_ptr() - logits.data_ptr()) % 16 == 0 or 16 % element
