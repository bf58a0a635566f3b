"""Process lifetime: children forked by a rank die with it, and a signal that stops a rank gets one sentence (or
none), never a traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from grpo_workers.launch import REPO

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def _python(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))


def test_a_process_forked_by_a_rank_dies_when_the_rank_is_killed():
    rank = _python("""
        import multiprocessing, time
        from megatron_grpo.runner.lifetime import bind_forked_children, die_with_parent
        bind_forked_children()
        child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,))
        child.start()
        print(child.pid, flush=True)
        time.sleep(600)
    """)
    try:
        child = psutil.Process(int(rank.stdout.readline()))
        assert child.is_running()
        rank.kill()  # SIGKILL: the rank runs no clean-up at all
        rank.wait(timeout=10)
        child.wait(timeout=10)  # raises psutil.TimeoutExpired if the child outlives the rank
    finally:
        rank.kill()


@pytest.mark.parametrize(("sig", "sentence", "code"), [
    (signal.SIGTERM, "error: rank 0: stopped by torchrun (SIGTERM)", 4),
    (signal.SIGINT, "interrupted at step 3", 130),
    (signal.SIGINT, None, 130),  # a rank that stays quiet
])
def test_a_signal_prints_its_sentence_and_exits_at_once_with_the_given_code(sig, sentence, code):
    rank = _python(f"""
        import signal, time
        from megatron_grpo.runner.lifetime import on_signal
        on_signal(signal.{sig.name}, lambda: {sentence!r}, {code})
        print("ready", flush=True)
        while True:
            time.sleep(0.01)  # Python code runs between the sleeps, as in a training loop
    """)
    try:
        assert rank.stdout.readline() == "ready\n"
        rank.send_signal(sig)
        assert rank.wait(timeout=10) == code
        assert rank.stderr.read() == (f"{sentence}\n" if sentence else "")
    finally:
        rank.kill()


def test_a_forked_child_leaves_the_ranks_signal_handlers_behind():
    """A checkpoint writer forked by rank 0 must not print rank 0's Ctrl-C sentence a second time."""
    rank = _python("""
        import multiprocessing, signal, time
        from megatron_grpo.runner.lifetime import bind_forked_children, on_signal

        def child_main(started):
            started.set()  # the at-fork hooks have run: from now on a signal meets the child's own handlers
            time.sleep(600)

        bind_forked_children()
        on_signal(signal.SIGINT, lambda: "rank's sentence", 130)
        context = multiprocessing.get_context("fork")
        started = context.Event()
        child = context.Process(target=child_main, args=(started,))
        child.start()
        started.wait()
        print(child.pid, flush=True)
        child.join()
        print("child exit code", child.exitcode, flush=True)
        time.sleep(600)
    """)
    try:
        child = psutil.Process(int(rank.stdout.readline()))
        child.send_signal(signal.SIGINT)
        assert rank.stdout.readline() == f"child exit code {-signal.SIGINT}\n"
    finally:
        rank.kill()
        rank.wait(timeout=10)
    assert "rank's sentence" not in rank.stderr.read()


def test_a_process_whose_parent_is_gone_exits_when_it_binds_its_life_to_it():
    """The race of binding: a child whose parent died just before is re-parented and must not live on."""
    started = time.monotonic()
    orphan = _python("""
        import os
        if os.fork():
            os._exit(0)  # the parent leaves at once
        import time
        time.sleep(0.5)
        from megatron_grpo.runner.lifetime import die_with_parent
        die_with_parent()
        print("still alive", flush=True)
    """)
    output, _ = orphan.communicate(timeout=30)
    time.sleep(1.0)
    assert "still alive" not in output and time.monotonic() - started < 30
