"""Megatron-Core's known notices are filtered by their exact text; any other warning, and all of them with
--verbose, still show; nothing is set in the environment."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings

import pytest
from grpo_workers.launch import REPO, job_env

from megatron_grpo.megatron.notices import (
    CPU_ONLY_WARNINGS,
    KNOWN_LOG_RECORDS,
    KNOWN_WARNINGS,
    megatron_summary,
    quiet_megatron_notices,
)


def _shown(verbose: bool, cuda_available: bool, messages: list[tuple[type, str]]) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_megatron_notices(verbose=verbose, cuda_available=cuda_available)
        for category, text in messages:
            warnings.warn(text, category)
    return [str(warning.message) for warning in caught]


def test_known_warnings_are_filtered_and_others_still_show():
    environment = dict(os.environ)
    unknown = [(UserWarning, "Apex is not installed. Falling back to Torch Norm, and something new"),
               (FutureWarning, "a deprecation nobody listed"), (UserWarning, "apex is not installed. falling back")]
    shown = _shown(False, False, [*KNOWN_WARNINGS, *CPU_ONLY_WARNINGS, *unknown])
    assert shown == [text for _, text in unknown]  # a changed text is not the listed one
    assert dict(os.environ) == environment


def test_the_cuda_hint_shows_where_there_is_cuda_and_verbose_shows_everything():
    assert _shown(False, True, list(CPU_ONLY_WARNINGS)) == [text for _, text in CPU_ONLY_WARNINGS]
    every = [*KNOWN_WARNINGS, *CPU_ONLY_WARNINGS]
    assert _shown(True, False, every) == [text for _, text in every]


def test_known_log_records_are_dropped_by_exact_text(caplog):
    name, (text, *_rest) = next(iter(KNOWN_LOG_RECORDS.items()))
    logger = logging.getLogger(name)
    quiet_megatron_notices()
    quiet_megatron_notices()  # installing twice adds one filter
    assert len(logger.filters) == 1
    with caplog.at_level(logging.WARNING, logger=name):
        logger.warning(text)
        logger.warning(text + " and more")
    assert [record.getMessage() for record in caplog.records] == [text + " and more"]


@pytest.mark.parametrize(("cuda_available", "installed", "expected"), [
    (False, set(), None),
    (True, set(), "TE and Apex not found: local kernels"),
    (True, {"transformer_engine"}, "Apex not found: local kernels"),
    (True, {"transformer_engine", "apex"}, None),
])
def test_the_summary_line_is_for_cuda_machines_without_te_or_apex(cuda_available, installed, expected, monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name in installed else None)
    assert megatron_summary(cuda_available=cuda_available) == expected


def test_importing_megatron_core_prints_nothing_once_quieted():
    """The listed texts are the ones megatron-core emits on import here (a changed text would show again)."""
    code = ("from megatron_grpo.megatron.notices import quiet_megatron_notices; quiet_megatron_notices(); "
            "import megatron_grpo.megatron, megatron.core.optimizer, megatron.core.dist_checkpointing; "
            "from megatron_grpo.megatron import build_gpt_model")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                            env=job_env(), timeout=300)
    assert result.returncode == 0, result.stderr
    assert "Warning" not in result.stderr, result.stderr
