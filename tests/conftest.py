"""Shared test setup: the `device` fixture of the op tests, and the rule that skips `gpu` tests without CUDA.

A test that takes `device` runs once on "cpu" and once on "cuda"; the cuda case is marked `gpu` (so
`pytest -m gpu`, and benchmarks/gpu_check.sh, run it on a GPU machine). Every `gpu`-marked test, here or in
tests/ops/test_gpu_*.py, is skipped with the reason `CUDA_MISSING` where torch.cuda.is_available() is false, as the
marker's declaration in pyproject.toml says.
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA_MISSING = "needs a CUDA device: torch.cuda.is_available() is False"

# Under pytest-xdist (`make test`), the workers share the cores: each takes its share of torch's threads, so that
# two workers' OpenMP threads do not outnumber the cores and spin against each other (the rank processes that
# tests start take one thread each, tests/_dist.py).
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> str:
    """The device an op test runs on: "cpu", and "cuda" (marked `gpu`)."""
    return request.param


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the files with end-to-end (`slow`) tests first, and skip, with the reason, every `gpu`-marked test where
    there is no CUDA device."""
    _slow_files_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=CUDA_MISSING)
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def _slow_files_first(items: list[pytest.Item]) -> None:
    """The files holding `slow` tests (minutes of jobs each) before the others, each file's tests together and in
    their order. `make test` hands files to its pytest-xdist workers in this order as they free up: the long files
    start first and the short ones fill in after, instead of a long file starting last and running alone."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: the collection order otherwise
