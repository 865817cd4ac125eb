"""The one timing object: every derived value, as the modules used to compute them."""

from __future__ import annotations

import pytest

from lightning_wsync._control.timing import timing


@pytest.mark.parametrize("hbt", [0.2, 2.0, 10.0, 600.0])
def test_derived_values(hbt: float) -> None:
    t = timing(heartbeat_timeout_s=hbt, timeout_s=30.0, heartbeat_s=0.5)
    assert t.beat_s == 0.5
    assert t.hosted_beat_s == max(0.5, hbt / 4)
    assert t.mates_flush_s == hbt / 4
    assert t.board_beat_s == t.leader_check_s == max(0.05, hbt / 8)
    assert t.member_check_s == min(1.0, hbt / 4)
    assert t.pin_lease_s == min(30.0, hbt, 5.0)
    assert t.host_ring_lease_s == min(30.0, hbt)
    assert t.leader_record_backstop_s == max(120.0, hbt)
    assert t.relay_linger_s == 30.0 + hbt
    assert t.store_lost_retry_s == 0.5


def test_receiver_before_a_sender_is_known() -> None:
    """A receiver derives its timing with no sender yet (heartbeat_timeout_s=0): it beats at its own pace."""
    t = timing(heartbeat_timeout_s=0.0, timeout_s=30.0, heartbeat_s=2.0)
    assert t.beat_s == t.hosted_beat_s == 2.0
    assert t.store_lost_retry_s == 1.0
