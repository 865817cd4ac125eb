"""The callback's push decision, as a pure function (the side effects stay in the callback)."""

from __future__ import annotations

import pytest

from lightning_wsync.callback import _should_push


@pytest.mark.parametrize(
    ("step", "floor", "restored", "published", "pushes", "pushed"),
    [
        (5, None, None, None, 0, True),  # nothing seen yet
        (5, 4, None, 4, 3, True),  # above every version seen
        (4, 4, None, 4, 3, False),  # the version was pushed already
        (3, 4, None, 4, 3, False),  # versions must increase
        (4, 4, 4, None, 0, True),  # resumed at the checkpoint's pushed step, on a fresh store: republished
        (4, 4, 4, 4, 0, False),  # ... but not when the store holds it
        (4, 4, 4, None, 1, False),  # ... and only before this run's first push
        (3, 4, 4, None, 0, False),  # ... and only at that step
    ],
)
def test_should_push(step: int, floor: int | None, restored: int | None, published: int | None, pushes: int,
                     pushed: bool) -> None:  # fmt: skip
    assert _should_push(step=step, floor=floor, restored=restored, published=published, pushes=pushes) is pushed
