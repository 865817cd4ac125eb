"""Fixtures for the rendezvous tests (helpers live in ``_rdzv_helpers``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ._rdzv_helpers import Events, Jobs


@pytest.fixture
def jobs(tmp_path: Path) -> Iterator[Jobs]:
    launched = Jobs(tmp_path)
    try:
        yield launched
    finally:
        launched.kill_all()


@pytest.fixture
def events(tmp_path: Path, jobs: Jobs) -> Events:
    return Events(tmp_path / "events.jsonl", jobs)
