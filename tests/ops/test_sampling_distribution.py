"""`SamplingDistribution`: built once from the sampling settings, checked once (every bad field a ValueError naming
it), its unfiltered form for the KL, and importable without torch (a config reader's)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from megatron_grpo.ops.distribution import SamplingDistribution


def test_of_sampling_is_one_over_the_temperature():
    distribution = SamplingDistribution.of_sampling(0.8, top_k=5, top_p=0.9)
    assert distribution == SamplingDistribution(logit_scale=1 / 0.8, top_k=5, top_p=0.9)
    assert SamplingDistribution.of_sampling() == SamplingDistribution()
    assert SamplingDistribution.of_sampling(2).logit_scale == 0.5 and isinstance(SamplingDistribution(2).logit_scale,
                                                                                float)


def test_filtered_and_unfiltered():
    assert not SamplingDistribution().filtered
    assert not SamplingDistribution(top_p=1.0).filtered  # p = 1 keeps everything
    assert SamplingDistribution(top_k=10**6).filtered  # a filter is set; whether it drops a token depends on V
    assert not SamplingDistribution(top_k=10**6).active(50) and SamplingDistribution(top_k=49).active(50)
    tempered = SamplingDistribution.of_sampling(0.5, top_k=3, top_p=0.7)
    assert tempered.unfiltered() == SamplingDistribution(logit_scale=2.0)


@pytest.mark.parametrize("kwargs, message", [
    ({"top_k": 0}, "top_k must be None or an int >= 1, got 0"),
    ({"top_k": 2.5}, "top_k must be None or an int >= 1"),
    ({"top_k": True}, "top_k must be None or an int >= 1"),
    ({"top_p": 0.0}, r"top_p must be None or a number in \(0, 1\], got 0.0"),
    ({"top_p": 1.5}, r"top_p must be None or a number in \(0, 1\]"),
    ({"top_p": math.nan}, r"top_p must be None or a number in \(0, 1\]"),
    *[({"logit_scale": scale}, r"logit_scale must be a finite number > 0 \(1 / temperature\)")
      for scale in (0.0, -0.5, math.nan, math.inf, True, "2", None)],
])
def test_bad_fields_are_named_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingDistribution(**kwargs)


@pytest.mark.parametrize("temperature", [0, -1.0, math.inf, math.nan, "1", None])
def test_bad_temperature_is_a_named_error(temperature):
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        SamplingDistribution.of_sampling(temperature)


def test_importing_it_imports_no_torch():
    code = ("import sys; from megatron_grpo.ops.distribution import SamplingDistribution; "
            "SamplingDistribution.of_sampling(0.7, 5, 0.9); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
