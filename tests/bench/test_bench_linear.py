"""`bench linear` runs end to end at tiny odd shapes, writes its report, and never fails on a candidate that cannot
run (timings are not asserted; the fused op's accuracy against float64 is)."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

import megatron_grpo.bench.linear as linear
from megatron_grpo.bench.linear import (
    CANDIDATES,
    LOSS_FUSED,
    MATERIALISED,
    MATERIALISED_LOSS_INPLACE,
    MEGATRON,
    Candidate,
    Case,
    Step,
    benchmark_case,
    fused_accuracy,
    main,
    make_inputs,
    report,
)
from megatron_grpo.bench.measure import LiveTensorBytes
from megatron_grpo.ops import vocab_parallel_linear_logprobs

CASES = [(tp, dtype, response) for tp in (1, 2) for dtype in ("fp32", "bf16") for response in (100, 25)]
ROW = re.compile(r"^\| (?P<name>[\w+-]+) \| (?P<rest>.*)\|$")


def _sections(text: str) -> dict[str, str]:
    parts = re.split(r"^## ", text, flags=re.MULTILINE)
    return {part.splitlines()[0]: part for part in parts[1:]}


def _ratio(cell: str) -> float:
    assert cell.endswith("x"), cell
    return float(cell[:-1])


@pytest.mark.slow  # the benchmark end to end, in processes of its own
def test_tiny_benchmark_reports_every_candidate_for_every_case(tmp_path):
    assert main(["--quick", "--tp", "1", "2", "--tokens", "50", "--hidden", "12", "--v-local", "97",
                 "--chunk-rows", "7", "--warmup", "0", "--accuracy-rows", "9", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "linear_cpu_quick.md").read_text()
    sections = _sections(text)
    assert (tmp_path / "linear_cpu_quick.png").stat().st_size > 0
    saved = json.loads((tmp_path / "linear_cpu_quick.json").read_text())
    assert len(saved["results"]) == len(CASES)
    for tp, dtype, response in CASES:
        title = f"TP={tp}, {dtype}, T=50 x H=12 x V_local=97, {response}% response rows, fused chunk_rows=7"
        assert f"| {title} | " in sections["Targets"], title
        rows = {m["name"]: m["rest"].split(" | ") for m in map(ROW.match, sections[title].splitlines()) if m}
        for name in CANDIDATES:  # measured, or skipped with a reason
            assert name in rows, f"{name} missing from {title}"
            if rows[name][0].startswith("skipped: "):
                assert len(rows[name][0]) > len("skipped: ") + 5
            else:
                ms, vs_baseline, vs_megatron = float(rows[name][0]), *map(_ratio, rows[name][1:3])
                assert ms > 0 and all(math.isfinite(r) and r > 0 for r in (vs_baseline, vs_megatron))
                assert float(rows[name][3]) >= 0 and float(rows[name][5]) >= 0  # the extra peaks, live and resident
        assert not rows[MATERIALISED][0].startswith("skipped") and not rows[MEGATRON][0].startswith("skipped")
        assert _ratio(rows[MATERIALISED][1]) == 1.0 and _ratio(rows[MEGATRON][2]) == 1.0
        assert _ratio(rows[MATERIALISED_LOSS_INPLACE][1]) == 1.0 and not rows[LOSS_FUSED][0].startswith("skipped")
        if tp > 1:
            assert "no vocab-parallel mode" in rows["cce"][0]
    trained = {(r["case"]["tp"], r["case"]["dtype"], r["case"]["response"]): r["trained_rows"]
               for r in saved["results"]}
    assert trained[(2, "fp32", 1.0)] == 50 and trained[(2, "fp32", 0.25)] == 12  # prompt rows first, 38 of 50
    for result in saved["results"]:
        accuracy = result["accuracy"]
        tolerance = 1e-4 if result["case"]["dtype"] == "fp32" else 0.1  # bf16 rounds the logits themselves
        assert accuracy["rows"] == 9 and accuracy["chunks"] == (8 if result["case"]["response"] == 1.0 else 2)
        assert accuracy["logprob_max_abs"] < tolerance and accuracy["grad_hidden_max_rel"] < tolerance
        assert accuracy["grad_weight_max_rel"] < tolerance
    assert "load average at the start" in text and "interleaved" in text


# fp32: the float64 anchor's tolerances, a logprob within 1e-5 (the exp's 3 ulps and the sums) and a gradient within
# 1e-5 of its largest element (sums over rows or columns whose terms may cancel); bf16 rounds the logits themselves,
# 2^-8 of each, which moves logprobs and p by a few times that
@pytest.mark.parametrize("dtype, tolerance", [("fp32", 1e-5), ("bf16", 0.05)])
def test_accuracy_subsample_is_cut_into_as_many_chunks_as_the_whole_case(monkeypatch, dtype, tolerance):
    seen = []
    op = linear.vocab_parallel_linear_logprobs
    monkeypatch.setattr(linear, "chunk_rows_for", lambda rows, valid_cols, dtype: 40)  # 75 trained rows: 2 chunks
    monkeypatch.setattr(linear, "vocab_parallel_linear_logprobs",
                        lambda *args, **kwargs: seen.append(kwargs["chunk_rows"]) or op(*args, **kwargs))
    case = Case(tp=1, dtype=dtype, tokens=300, hidden=24, v_local=333, response=0.25)
    accuracy = fused_accuracy(case, make_inputs(case, torch.device("cpu"), None), rows=64)
    assert accuracy["rows"] == 64 and accuracy["chunks"] == 2 and seen == [8]  # 16 trained of 64: 2 x 8
    assert 0 < accuracy["logprob_max_abs"] < tolerance
    assert 0 < accuracy["grad_hidden_max_rel"] < tolerance and 0 < accuracy["grad_weight_max_rel"] < tolerance


def _build_broken(case, inputs):
    raise ValueError("this kernel is not built here")


def _build_failing_step(case, inputs):
    def forward(hidden, weight):
        raise RuntimeError("0 active drivers")

    return Step(forward, inputs.upstream)


def test_a_candidate_that_cannot_build_or_run_is_skipped_with_its_error(monkeypatch):
    monkeypatch.setitem(CANDIDATES, "broken", Candidate(_build_broken, "fails to build"))
    monkeypatch.setitem(CANDIDATES, "failing", Candidate(_build_failing_step, "fails when run"))
    case = Case(tp=1, dtype="fp32", tokens=10, hidden=4, v_local=7, response=0.5)
    result = benchmark_case(case, torch.device("cpu"), None, [MATERIALISED, "broken", "failing"], repeats=1,
                            warmup=0, accuracy_rows=0)
    assert [r["candidate"] for r in result["rows"]] == [MATERIALISED]
    assert result["skipped"] == {"broken": "ValueError: this kernel is not built here",
                                 "failing": "RuntimeError: 0 active drivers"}
    assert result["rows"][0]["extra_live_mib"] > 0  # the logits (10 x 7 fp32) and their gradient
    assert result["accuracy"] is None and result["trained_rows"] == 5


def _result(response: float, times: dict[str, float], peaks: dict[str, float]) -> dict:
    case = {"tp": 1, "dtype": "fp32", "tokens": 8, "hidden": 4, "v_local": 16, "response": response}
    rows = [{"candidate": n, "forward_backward_ms": t, "extra_live_mib": peaks[n], "extra_peak_mib": 2 * peaks[n]}
            for n, t in times.items()]
    return {"case": case, "trained_rows": 8, "rows": rows, "skipped": {"liger": "RuntimeError: no GPU"},
            "accuracy": None}


def test_report_ratios_and_target_verdicts():
    results = [
        _result(1.0, {"materialised": 100.0, "fused": 125.0, "fused-main-grad": 120.0, "megatron": 200.0,
                      "materialised-loss": 100.0, "materialised-loss-inplace": 80.0, "loss-fused": 64.0,
                      "loss-fused-main-grad": 100.0},
                {"materialised": 1000.0, "fused": 50.0, "fused-main-grad": 40.0, "megatron": 1500.0,
                 "materialised-loss": 1000.0, "materialised-loss-inplace": 500.0, "loss-fused": 40.0,
                 "loss-fused-main-grad": 60.0}),
        _result(0.25, {"materialised": 100.0, "fused": 50.0}, {"materialised": 1000.0, "fused": 200.0}),
        _result(0.25, {"materialised": 100.0, "fused": 10.0}, {"materialised": 0.5, "fused": 0.0}),
    ]
    text = report(results, torch.device("cpu"), 3, 1, "python -m megatron_grpo bench linear", ("1.0", "2.0"))
    assert "| fused | 125.0 | 0.80x | 1.60x | 50.0 | 5.0% | 100.0 | 5.0% |" in text
    assert "| megatron | 200.0 | 0.50x | 1.00x | 1500.0 | 150.0% | 3000.0 | 150.0% |" in text
    # the loss candidates against the materialised loss step with its in-place backward
    assert "| materialised-loss | 100.0 | 0.80x | 2.00x | 1000.0 | 200.0% | 2000.0 | 200.0% |" in text
    assert "| loss-fused | 64.0 | 1.25x | 3.12x | 40.0 | 8.0% | 80.0 | 8.0% |" in text
    assert "| fused | 50.0 | 2.00x | - | 200.0 | 20.0% | 400.0 | 20.0% |" in text  # no Megatron in this case
    assert "| liger | skipped: RuntimeError: no GPU |" in text
    assert "load average at the start: 1.0; at the end: 2.0" in text
    targets = text.split("## Targets")[1].split("\n## ")[0]
    assert ("| 0.80x (>= 0.75x met) | 5.0% (<= 10% met) | 4.0% (<= 10% met) | 1.25x (>= 1.0x met) | 8.0% (<= 10% met) "
            "| 0.80x (>= 1.0x NOT met) | 12.0% (<= 10% NOT met) |") in targets
    assert "| 2.00x (>= 2.5x NOT met) | 20.0% (<= 10% NOT met) | - | - | - | - | - |" in targets
    assert "| 10.00x (>= 2.5x met) | - (below 1 MiB: not measurable) | - | - | - | - | - |" in targets


def test_live_tensor_bytes_count_storages_alive_at_once_views_once_and_inside_the_projects_ops():
    base = torch.ones(1000)  # alive before: never counted
    with LiveTensorBytes() as live:
        a = torch.empty(1000)  # 4000 bytes
        view = a[10:]  # the same storage
        a.add_(1.0)  # in place: nothing new
        b = base * 2  # 4000 more: the peak
        del a, view
        c = torch.empty(250)  # 1000 bytes, after 4000 were freed
    assert live.peak_bytes == 8000 and live.live_bytes == 5000
    del b, c
    hidden, weight = torch.randn(64, 8), torch.randn(32, 8)
    targets = torch.randint(0, 32, (64,))
    with LiveTensorBytes() as live:
        vocab_parallel_linear_logprobs(hidden, weight, targets, chunk_rows=16, check_inputs=False)
    assert live.peak_bytes >= 16 * 32 * 4  # the op's chunk buffer, inside its torch.library body
    assert live.peak_bytes < 64 * 32 * 4  # never the whole logits


@pytest.mark.parametrize("argv, message", [
    (["--response", "0"], "--response fractions must be in (0, 1], got 0.0"),
    (["--candidates", "nonexistent"], "invalid choice: 'nonexistent'"),
    (["--chunk-rows", "0"], "--chunk-rows must be >= 1, got 0"),
    (["--sequence-length", "0"], "--sequence-length must be >= 1, got 0"),
    (["--top-p", "1.5"], "--top-p must be None or a number in (0, 1], got 1.5"),
])
def test_bad_options_exit_2_with_a_named_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err
