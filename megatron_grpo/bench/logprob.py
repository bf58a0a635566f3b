"""Kernel benchmark: `megatron-grpo bench logprob [--quick] [--device cpu|cuda] [--out DIR]`.

In one run, for each setup (TP size, dtype, T x V_local per rank), it times forward and forward+backward of the
fused op (default and in-place backward modes), the plain-torch kernels, naive torch (TP=1), and the optional
peers, Megatron-Core's `vocab_parallel_cross_entropy` and TE's `parallel_cross_entropy`, where they import (a
missing peer is reported as missing). Every method gets a fresh clone of the same logits in the layout it
documents, made outside the timed region. On CPU it also times the in-place exp mode
(`inplace_backward="exp"`) and names the instruction set of the CPU kernels. It reports medians, peak extra
memory, ratios against the peers, and two figures against a copy's memory bandwidth: the fused kernels alone (one
rank's forward and out-of-place backward kernels called directly; on CUDA replayed back to back in a CUDA graph) and
the whole op per call. The ranks run in child processes; the parent never waits on them without a timeout.

It also times the op per call at small shapes against `log_softmax` + `gather` (`floor.py`: TP 1, fp32, one
thread, interleaved in one process), where what a call costs is the path around the kernels.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from megatron_grpo.bench.floor import floor_report, per_call_floor
from megatron_grpo.bench.measure import (
    DEFAULT_OUT,
    OUT_HELP,
    copy_bandwidth_bytes_per_s,
    grouped_bar_plot,
    machine_description,
    median_seconds,
    peak_extra_bytes,
    run_ranks,
    write_results,
)
from megatron_grpo.ops import VocabShard, vocab_parallel_logprobs
from megatron_grpo.ops.core.backends import cpu_kernel_isa
from megatron_grpo.runner.helptext import DefaultsHelpFormatter

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Setup:
    tp: int
    dtype: str
    tokens: int
    v_local: int


@dataclass
class Result:
    setup: Setup
    method: str
    forward_ms: float
    forward_backward_ms: float
    peak_extra_mib: float        # above the live inputs, during forward+backward
    gradient_mib: float          # the size of a fresh gradient (0 when written in place)
    kernel_forward_ms: float | None = None   # "fused" only: one rank's forward kernel alone
    kernel_backward_ms: float | None = None  # and its out-of-place backward kernel alone


# The layouts the methods document for their logits: ours and naive torch take [tokens, V_local]; Megatron's
# vocab_parallel_cross_entropy documents [sequence, batch, V_local]; TE's parallel_cross_entropy [batch, sequence,
# V_local]. The benchmark feeds each its own (batch 1), as a fresh leaf, and takes the gradient with
# torch.autograd.grad: what the layer below the logits would receive. (`.backward()` into a leaf would add
# autograd's accumulate-into-.grad step, which copies any gradient still referenced elsewhere, e.g. Megatron's,
# written into its input's own buffer: a whole extra [T, V] copy that no training step pays.)


@dataclass(frozen=True)
class Method:
    """One benchmarked method: `run(logits, targets, group)` -> per-token logprobs shaped like `targets`, with
    `logits` laid out as `layout` documents."""

    run: Callable[[torch.Tensor, torch.Tensor, "dist.ProcessGroup | None"], torch.Tensor]
    layout: str = "tokens"


def shape_for(layout: str, tokens: int) -> tuple[int, ...]:
    """The batch shape of `tokens` tokens in a layout (batch size 1 for the 3-D ones)."""
    return {"tokens": (tokens,), "sbv": (tokens, 1), "bsv": (1, tokens)}[layout]


def fused(x, targets, group):
    return vocab_parallel_logprobs(x, targets, shard=VocabShard(group=group), check_inputs=False)


def fused_inplace(x, targets, group):
    return vocab_parallel_logprobs(x, targets, shard=VocabShard(group=group), check_inputs=False, inplace_backward=True)


def fused_exp(x, targets, group):
    return vocab_parallel_logprobs(x, targets, shard=VocabShard(group=group), check_inputs=False,
                                   inplace_backward="exp")


def torch_kernels(x, targets, group):
    return vocab_parallel_logprobs(x, targets, shard=VocabShard(group=group), check_inputs=False,
                                   implementation="torch")


def naive_torch(x, targets, group):
    return torch.log_softmax(x.float(), dim=-1).gather(-1, targets[..., None]).squeeze(-1)


# Optional peers: each loader returns the method, or raises with the reason it is not available here. A peer that
# fails to load is reported as missing, never as a crash. Fused linear+logprob peers (which take hidden states
# and the output weight instead of logits) would need their own setup and are not benchmarked yet.
def load_megatron(device: torch.device, tp: int) -> Method:
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    def megatron_cross_entropy(x, targets, group):
        return -vocab_parallel_cross_entropy(x, targets)  # its TP group: parallel_state, set up by _rank_main

    return Method(megatron_cross_entropy, layout="sbv")


def load_transformer_engine(device: torch.device, tp: int) -> Method:
    if device.type != "cuda":
        raise RuntimeError("TE's parallel_cross_entropy runs on CUDA only")
    from transformer_engine.pytorch.cross_entropy import parallel_cross_entropy

    def te_cross_entropy(x, targets, group):
        return -parallel_cross_entropy(x, targets, 0.0, False, group)

    return Method(te_cross_entropy, layout="bsv")


MEGATRON = "megatron vocab_parallel_cross_entropy"
FUSED_EXP = "fused (inplace_backward='exp')"
IN_PLACE_METHODS = ("fused (inplace_backward)", FUSED_EXP)
OPTIONAL_PEERS: dict[str, Callable[[torch.device, int], Method]] = {
    MEGATRON: load_megatron,
    "te parallel_cross_entropy": load_transformer_engine,
}


def methods_for(setup: Setup, device: torch.device) -> tuple[dict[str, Method], dict[str, str]]:
    """The methods to time for a setup, and the optional peers that are missing here, each with its reason."""
    methods = {
        "fused": Method(fused),
        "fused (inplace_backward)": Method(fused_inplace),
        "torch kernels": Method(torch_kernels),
    }
    if device.type == "cpu":  # the exp mode has CPU kernels only
        methods[FUSED_EXP] = Method(fused_exp)
    if setup.tp == 1:
        methods["naive torch"] = Method(naive_torch)
    missing = {}
    for name, load in OPTIONAL_PEERS.items():
        try:
            methods[name] = load(device, setup.tp)
        except Exception as exc:  # noqa: BLE001 - any failure means "not available on this machine"
            missing[name] = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return methods, missing


def fused_kernels_ms(logits: torch.Tensor, targets: torch.Tensor, device: torch.device, repeats: int
                     ) -> tuple[float, float]:
    """One rank's fused kernels alone, without the op around them or a collective: the TP 1 forward kernel
    (`logprob_forward`, which writes the outputs) and the out-of-place backward kernel (`logprob_backward` into a
    gradient buffer of its own), in ms per call. On CUDA, replays of back-to-back launches captured in a CUDA graph
    (`roofline.graph_ms`); on the CPU, the median of direct calls."""
    ops = torch.ops.megatron_grpo
    rows, cols = logits.shape
    _, _, lse, _ = ops.logprob_forward(logits, targets, 0, cols, False, None, 1.0)
    ones, grad = torch.ones(rows, device=device), torch.empty_like(logits)

    def forward():
        ops.logprob_forward(logits, targets, 0, cols, False, None, 1.0)

    def backward():
        ops.logprob_backward(logits, targets, 0, cols, lse, None, ones, None, grad, None, 1.0)

    if device.type == "cuda":
        from megatron_grpo.bench.roofline import graph_ms

        return graph_ms(forward), graph_ms(backward)
    return tuple(1e3 * median_seconds(lambda _, run=run: run(), lambda: None, device, repeats)
                 for run in (forward, backward))


def benchmark_setup(setup: Setup, device: torch.device, group, repeats: int) -> tuple[list[Result], dict[str, str]]:
    """Times every available method on one setup; also returns the missing peers and why."""
    rank = 0 if group is None else dist.get_rank(group)
    dtype = DTYPES[setup.dtype]
    gen = torch.Generator(device="cpu").manual_seed(1234 + rank)
    logits = (torch.randn(setup.tokens, setup.v_local, generator=gen) * 3).to(device=device, dtype=dtype)
    full_vocab = setup.v_local * setup.tp
    targets = torch.randint(0, full_vocab, (setup.tokens,), generator=torch.Generator().manual_seed(7)).to(device)
    methods, missing = methods_for(setup, device)
    results = []
    for name, method in methods.items():
        batch = shape_for(method.layout, setup.tokens)
        shaped_logits = logits.reshape(*batch, setup.v_local)
        shaped_targets = targets.reshape(batch)
        grad_out = torch.ones(batch, device=device)

        def fresh():
            return shaped_logits.clone().requires_grad_(True)

        def forward(x):
            method.run(x, shaped_targets, group)

        def forward_backward(x):
            torch.autograd.grad(method.run(x, shaped_targets, group), x, grad_out)

        fwd = median_seconds(forward, fresh, device, repeats)
        fwd_bwd = median_seconds(forward_backward, fresh, device, repeats)
        peak = peak_extra_bytes(forward_backward, fresh, device)
        in_place = name in IN_PLACE_METHODS
        kernels = fused_kernels_ms(logits, targets, device, repeats) if name == "fused" else (None, None)
        results.append(Result(
            setup=setup, method=name, forward_ms=1e3 * fwd, forward_backward_ms=1e3 * fwd_bwd,
            peak_extra_mib=peak / 2**20, gradient_mib=0.0 if in_place else logits.nbytes / 2**20,
            kernel_forward_ms=kernels[0], kernel_backward_ms=kernels[1],
        ))
    return results, missing


def _run_setups(device: torch.device, group, setups: list[Setup], repeats: int) -> tuple[list[dict], dict[str, str]]:
    """The body of one TP rank: every setup of its TP size, in order."""
    results, missing = [], {}
    for setup in setups:
        setup_results, setup_missing = benchmark_setup(setup, device, group, repeats)
        results += [asdict(r) for r in setup_results]
        missing.update(setup_missing)
    return results, missing


def run_tp(tp: int, setups: list[Setup], device_type: str, repeats: int,
           timeout_s: float = 3600.0, verbose: bool = False) -> tuple[list[dict], dict[str, str]]:
    """Runs the setups on `tp` fresh processes (a gloo or NCCL group, even for TP=1): results and missing peers."""
    work = functools.partial(_run_setups, setups=setups, repeats=repeats)
    return run_ranks(tp, work, device_type, timeout_s, name="bench logprob", verbose=verbose)


def speedup(peer_ms: float | None, ms: float) -> str:
    return "-" if peer_ms is None else f"{peer_ms / ms:.2f}x"


def report(results: list[dict], device: torch.device, bandwidth: float, repeats: int, quick: bool,
           missing: dict[str, str] | None = None, command: str | None = None, floor: list[dict] | None = None,
           floor_rounds: int = 0) -> str:
    """The Markdown report. Any method may be absent (a peer missing here shows as "-" in its ratio column)."""
    command = command or f"python -m megatron_grpo bench logprob --device {device.type}{' --quick' if quick else ''}"
    lines = [
        f"# Logprob kernel benchmark ({device.type}{', quick' if quick else ''})",
        "",
        f"- date: {datetime.date.today().isoformat()}",
        f"- machine: {machine_description(device)}",
        *([f"- CPU kernels: {cpu_kernel_isa()} build"] if device.type == "cpu" else []),
        f"- command: `{command}`",
        f"- median of {repeats} runs after a warm-up; each method gets a fresh clone of the same logits in the "
        "layout it documents ([T, V] for ours and naive torch, [s, b, V] for Megatron, [b, s, V] for TE, batch 1), "
        "made outside the timed region; forward+backward takes the gradient with torch.autograd.grad for an "
        "upstream gradient of ones.",
        f"- memory roof: a large copy moves {bandwidth / 1e9:.1f} GB/s (read + write).",
        "- peak extra: resident memory above the live inputs during forward+backward; 'beyond input+grad' "
        "subtracts the gradient the method must return (0 for in-place), as a percentage of the logits' size.",
    ]
    lines += [f"- not measured: {name}: {why}" for name, why in sorted((missing or {}).items())]
    lines.append("")
    setups = sorted({tuple(r["setup"].values()) for r in results})
    for tp, dtype, tokens, v_local in setups:
        rows = [r for r in results if tuple(r["setup"].values()) == (tp, dtype, tokens, v_local)]
        by_name = {r["method"]: r for r in rows}
        logits_mib = tokens * v_local * (4 if dtype == "fp32" else 2) / 2**20
        lines += [
            f"## TP={tp}, {dtype}, T={tokens} x V_local={v_local} per rank (logits {logits_mib:.0f} MiB per rank)",
            "",
        ]
        if "fused" in by_name:
            fused = by_name["fused"]
            nbytes = tokens * v_local * (4 if dtype == "fp32" else 2)
            achieved = tp * nbytes / (fused["forward_ms"] / 1e3)
            lines += [f"The op per call: the fused forward reads {achieved / 1e9:.1f} GB/s over all ranks, "
                      f"{100 * achieved / bandwidth:.0f}% of the copy roof."]
            if fused.get("kernel_forward_ms"):
                kernel_fwd, kernel_bwd = fused["kernel_forward_ms"], fused["kernel_backward_ms"]
                how = "CUDA-graph replays" if device.type == "cuda" else "direct calls"
                lines += [f"The kernels alone (one rank's, {how}, no collective): forward {kernel_fwd:.2f} ms, "
                          f"{100 * nbytes / (kernel_fwd / 1e3) / bandwidth:.0f}% of the copy roof; backward "
                          f"{kernel_bwd:.2f} ms (reads and writes the logits' bytes), "
                          f"{100 * 2 * nbytes / (kernel_bwd / 1e3) / bandwidth:.0f}%."]
            lines.append("")
        lines += [
            "| method | forward ms | fwd+bwd ms | fwd+bwd vs megatron | fwd+bwd vs naive | peak extra MiB | "
            "beyond input+grad |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        megatron = by_name.get(MEGATRON, {}).get("forward_backward_ms")
        naive = by_name.get("naive torch", {}).get("forward_backward_ms")
        for r in rows:
            beyond = max(r["peak_extra_mib"] - r["gradient_mib"], 0.0)
            lines.append(
                f"| {r['method']} | {r['forward_ms']:.1f} | {r['forward_backward_ms']:.1f} | "
                f"{speedup(megatron, r['forward_backward_ms'])} | {speedup(naive, r['forward_backward_ms'])} | "
                f"{max(r['peak_extra_mib'], 0.0):.0f} | {100 * beyond / logits_mib:.1f}% |"
            )
        lines.append("")
    if floor:
        lines += floor_report(floor, floor_rounds)
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    setups = sorted({tuple(r["setup"].values()) for r in results})
    methods = list(dict.fromkeys(r["method"] for r in results))
    times = {(r["method"], tuple(r["setup"].values())): r["forward_backward_ms"] for r in results}
    series = {method: [times.get((method, setup)) for setup in setups] for method in methods}
    grouped_bar_plot([f"TP={s[0]} {s[1]}\n{s[2]}x{s[3]}" for s in setups], series,
                     "forward+backward, ms (median)", path)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megatron-grpo bench logprob", description=__doc__.split("\n\n")[0],
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the ranks run: cpu (gloo) or cuda (NCCL, one GPU per rank)")
    parser.add_argument("--quick", action="store_true",
                        help="small shapes (T=1024, V_local=4096), 3 runs; writes logprob_<device>_quick.*")
    parser.add_argument("--tp", type=int, nargs="+", default=None,
                        help="tensor-parallel sizes (default: 1 and 2; on CUDA, 2 only with two GPUs)")
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"],
                        help="dtypes of the logits")
    parser.add_argument("--tokens", type=int, default=8192, help="rows T of logits per rank (ignored with --quick)")
    parser.add_argument("--v-local", type=int, default=32768,
                        help="vocab columns per rank (ignored with --quick)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per method (default: 5; 3 with --quick)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=OUT_HELP)
    parser.add_argument("--timeout", type=float, default=3600.0,
                        help="seconds to wait for each TP size's ranks before giving up")
    parser.add_argument("--verbose", action="store_true", help="show Megatron-Core's notices, filtered by default")
    parser.add_argument("--floor-rounds", type=int, default=None,
                        help="interleaved rounds of the per-call rows at small shapes (default 15; 7 with --quick); "
                             "0 leaves them out")
    args = parser.parse_args(argv)
    tokens, v_local = (1024, 4096) if args.quick else (args.tokens, args.v_local)
    repeats = args.repeats if args.repeats is not None else (3 if args.quick else 5)
    device = torch.device(args.device)
    results, missing = [], {}
    tp_sizes = args.tp or ([1, 2] if args.device == "cpu" or torch.cuda.device_count() >= 2 else [1])
    for tp in tp_sizes:
        setups = [Setup(tp=tp, dtype=d, tokens=tokens, v_local=v_local) for d in args.dtypes]
        tp_results, tp_missing = run_tp(tp, setups, args.device, repeats, args.timeout, verbose=args.verbose)
        results += tp_results
        missing.update(tp_missing)
    for name, why in missing.items():
        print(f"bench logprob: {name} not measured: {why}", file=sys.stderr)
    bandwidth = copy_bandwidth_bytes_per_s(device, 2**30 if not args.quick else 2**27, repeats)
    floor_rounds = args.floor_rounds if args.floor_rounds is not None else (7 if args.quick else 15)
    floor = [asdict(r) for r in per_call_floor(device, floor_rounds)] if floor_rounds > 0 else []
    command = "megatron-grpo bench logprob " + " ".join(argv) if argv else None
    text = report(results, device, bandwidth, repeats, args.quick, missing, command, floor, floor_rounds)
    stem = f"logprob_{args.device}{'_quick' if args.quick else ''}"
    write_results(args.out, stem, text, {"missing_peers": missing, "results": results, "per_call_floor": floor},
                  lambda path: plot(results, path), alt="forward+backward time")
    print(text)
    print(f"wrote {args.out / (stem + '.md')}")
    return 0
