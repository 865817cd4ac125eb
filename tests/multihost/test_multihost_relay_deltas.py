"""Deltas on every relay hop: simulated hosts, real receiver processes, AdamW versions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _netns import run_scenario

pytestmark = pytest.mark.slow
CORRUPT_AT = 4  # tests/multihost/relay_deltas.py: host 2's leader corrupts this version


def _as_delta(receipts: dict[str, Any], host: int, version: int) -> bool:
    """How ``host``'s leader got ``version``: receipts hold [as a delta, bytes on its hop, changed, decode s]."""
    return bool(receipts[str(host)][str(version)][0])


@pytest.mark.timeout(240)
def test_relay_carries_deltas_hop_by_hop_through_corruption_late_host_and_failover(tmp_path: Path) -> None:
    result = run_scenario("relay_deltas.py", str(tmp_path), timeout_s=220)
    reports = {r["version"]: r for r in result["reports"]}
    receipts, full, order = result["receipts"], result["full_bytes"], result["order"]
    first = ["h1r0", "h1r1", "h2r0"]

    # Every version any receiver applied is bit-exact.
    applied = result["applied"]
    assert applied and all(a["exact"] for a in applied), [a for a in applied if not a["exact"]]

    # Nobody holds a base at first: full versions; then deltas on both hops, far below full.
    assert reports[1]["delta_receivers"] == [] and not _as_delta(receipts, 1, 1) and not _as_delta(receipts, 2, 1)
    for version in (2, 3):
        assert reports[version]["delta_receivers"] == first, reports[version]
        assert reports[version]["delta_bytes"] < 0.1 * full, reports[version]
        for host in (1, 2):
            delta, wire_bytes, changed, _ = receipts[str(host)][str(version)]
            assert delta and wire_bytes < 0.1 * full and 0 < changed < 0.2, receipts[str(host)]

    # Host 2's leader rebuilt version 4 with a flipped bit: rejected there, the host keeps version 3.
    bad = reports[CORRUPT_AT]
    assert bad["delivered"] == ["h1r0", "h1r1"], bad
    assert bad["failed"]["h2r0"].startswith(f"rejected version {CORRUPT_AT}: checksum mismatch on the relay"), bad
    assert not [a for a in applied if a["version"] == CORRUPT_AT and a["name"].startswith("h2")]
    # Version 5 reaches host 2 in full (and the hosts behind it in the chain: they get what it got);
    # the hosts before it get a delta. Then deltas everywhere again.
    behind = order[order.index(2) :]
    for host in (1, 2):
        assert _as_delta(receipts, host, 5) == (host not in behind), (order, receipts)
    assert receipts["2"]["5"][1] == full
    assert reports[5]["delta_receivers"] == [n for n in first if int(n[1]) not in behind], (order, reports[5])
    assert reports[6]["delta_receivers"] == first

    # The late host got version 6 in full (rebuilt by the leader before it), then deltas.
    assert not _as_delta(receipts, 3, 6) and receipts["3"]["6"][1] == full
    assert _as_delta(receipts, 3, 7)
    assert reports[7]["delta_receivers"] == sorted(first + ["h3r0"]), reports[7]

    # Host 1's leader was killed: its host-mate leads, gets a full version, then deltas.
    live = sorted(set(first + ["h3r0"]) - {result["killed"]})
    for version in (8, 9):
        assert reports[version]["delivered"] == live and reports[version]["delta_receivers"] == live, reports[version]
    assert {a["name"] for a in applied if a["version"] == 9} == set(live)
    assert not receipts["1'"]["7"][0] and receipts["1'"]["7"][1] == full
    assert _as_delta(receipts, 1, 8) and _as_delta(receipts, 1, 9)
