"""A native crash in any process of a multi-host scenario leaves its evidence in the test's output.

Issue 32: the tree fail-over scenario once ended with exit -11 (a segfault in the trainer)
and nothing else; no stack, no child's log. Now every process of a scenario runs with
``PYTHONFAULTHANDLER=1`` (each thread's Python stack on SIGSEGV, SIGBUS, SIGABRT, SIGFPE,
SIGILL), a scenario lists each child that ended by such a signal with its log's tail, and a
scenario that crashes itself is reported with the signal's name and every child's log.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _netns import run_scenario

pytestmark = pytest.mark.slow  # ~20 s each: a session of simulated hosts, Python and torch started twice

SEGFAULT = "Fatal Python error: Segmentation fault"


@pytest.mark.timeout(120)
def test_a_child_that_segfaults_is_named_with_its_threads_stacks(tmp_path: Path) -> None:
    result = run_scenario("crash_report.py", str(tmp_path), "child", timeout_s=100)
    (name,) = result["crashed"]
    report = result["crashed"][name]
    assert name == "h1crash" and report.startswith("rc=-11 (SIGSEGV)"), report
    assert SEGFAULT in report and "in string_at" in report, report  # the crashing thread's stack
    assert 'File "<string>", line 1 in <module>' in report, report  # and the main thread's


@pytest.mark.timeout(120)
def test_a_trainer_that_segfaults_fails_the_test_with_its_stack_and_every_childs_log(tmp_path: Path) -> None:
    with pytest.raises(pytest.fail.Exception) as failed:
        run_scenario("crash_report.py", str(tmp_path), "trainer", timeout_s=100)
    text = str(failed.value)
    assert text.startswith("scenario crash_report.py exited -11 (SIGSEGV); output tail:"), text
    trainer, _, child = text.partition("--- h1crash.log:")
    assert SEGFAULT in trainer and "in string_at" in trainer and "in scenario" in trainer, trainer  # both threads
    assert SEGFAULT in child and 'File "<string>", line 1 in <module>' in child, child
