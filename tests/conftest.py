"""Shared test setup: the `device` fixture of the op tests, and the rule that skips `gpu` tests without CUDA.

A test that takes `device` runs once on "cpu" and once on "cuda"; the cuda case is marked `gpu` (so
`pytest -m gpu`, and benchmarks/gpu_check.sh, run it on a GPU machine). Every `gpu`-marked test, here or in
tests/ops/test_gpu_*.py, is skipped with the reason `CUDA_MISSING` where torch.cuda.is_available() is false, as the marker's
declaration in pyproject.toml says.
"""

from __future__ import annotations

import pytest
import torch

CUDA_MISSING = "needs a CUDA device: torch.cuda.is_available() is False"


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> str:
    """The device an op test runs on: "cpu", and "cuda" (marked `gpu`)."""
    return request.param


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip, with the reason, every `gpu`-marked test where there is no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=CUDA_MISSING)
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
