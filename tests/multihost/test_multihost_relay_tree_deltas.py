"""Deltas on the edges of the relay's two trees: simulated hosts, real receiver processes, AdamW versions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _netns import run_scenario

pytestmark = pytest.mark.slow
KILL_AT, LAST = 4, 7  # tests/multihost/relay_tree_deltas.py


def _receipt(result: dict[str, Any], name: str, version: int) -> tuple[bool, int]:
    """How ``name``'s leader got ``version``: (as a delta on either tree, bytes on its two hops in)."""
    delta, wire_bytes, _, _ = result["receipts"][name][str(version)]
    return bool(delta), int(wire_bytes)


@pytest.mark.timeout(240)
def test_tree_edges_carry_deltas_through_an_inner_leader_killed_and_a_host_restarted(tmp_path: Path) -> None:
    """6 hosts x 1 receiver, bf16 on 100 Mbit/s links, ``cross_host="tree"``, ``delta="always"``."""
    result = run_scenario("relay_tree_deltas.py", str(tmp_path), "6", "100mbit", timeout_s=220)
    names, full, killed = result["names"], result["full_bytes"], result["killed"]
    reports = {r["version"]: r for r in result["reports"]}
    print(json.dumps({k: result[k] for k in ("killed", "after", "reports", "receipts")}, indent=1))
    first = sorted(set(names) - {result["restarted"]}) + [killed["name"]]

    # Every version any receiver applied is bit-exact, and every live receiver applied every version.
    applied = result["applied"]
    assert applied and all(a["exact"] for a in applied), [a for a in applied if not a["exact"]]
    restarted = result["restarted"]
    for version in range(1, LAST + 1):
        want = set(first) if version < KILL_AT else set(first) - {killed["name"]}
        want |= {restarted} if version >= LAST - 1 else set()
        assert {a["name"] for a in applied if a["version"] == version} == want, version

    # Version 1 in full; 2 and 3 as deltas on every edge into every host, far below a full version,
    # and the trainer's link carried far less than a full version per push.
    assert reports[1]["delta_receivers"] == [] and not any(_receipt(result, n, 1)[0] for n in first)
    for version in (2, 3):
        assert reports[version]["delta_receivers"] == sorted(first), reports[version]
        assert reports[version]["delta_bytes"] < 0.1 * full, reports[version]
        assert reports[version]["tx_bytes"] < 0.1 * full, reports[version]
        for name in first:
            delta, wire_bytes = _receipt(result, name, version)
            assert delta and 0 < wire_bytes < 0.1 * full, (name, version, result["receipts"][name])

    # The inner leader was killed with the version on the wire into it; its subtree was
    # re-attached (the trees re-formed without it) and got that version and every later one.
    assert 0 < killed["rx_bytes"] < full and killed["subtree"]
    after = result["after"]
    assert after["tree"] and killed["rid"] not in after["rids"] and len(after["rids"]) == len(first) - 1
    for version in range(KILL_AT, LAST + 1):
        report = reports[version]
        assert set(report["delivered"]) >= set(first) - {killed["name"]}, report
        assert report["latency_s"] is not None and report["latency_s"] <= result["timeout_s"], report
    for name in killed["subtree"]:
        for version in (KILL_AT + 1, LAST - 1, LAST):
            delta, wire_bytes = _receipt(result, name, version)
            assert delta and wire_bytes < 0.1 * full, (name, version, result["receipts"][name])

    # The restarted host got the newest version at once, in full (it holds no base), then deltas.
    assert _receipt(result, restarted, LAST - 1) == (False, full), result["receipts"][restarted]
    delta, wire_bytes = _receipt(result, restarted, LAST)
    assert delta and wire_bytes < 0.1 * full, result["receipts"][restarted]
    assert reports[LAST]["delta_receivers"] == sorted(names), reports[LAST]
