"""A sharded push across simulated hosts: a trainer of 2 ranks on 2 hosts, receivers on 4 others.

Each trainer rank relays only its own share (a relay chain per rank); every rollout host
receives each byte once and assembles whole versions, never a mix (docs/sharded.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _netns import run_scenario

pytestmark = pytest.mark.slow


def _exact(result: dict) -> None:
    applied = result["applied"]
    assert applied and all(a["exact"] for a in applied), [a for a in applied if not a["exact"]]


@pytest.mark.timeout(120)
def test_each_trainer_host_sends_only_its_share_and_every_receiver_is_bit_exact(tmp_path: Path) -> None:
    result = run_scenario("sharded_across_hosts.py", str(tmp_path), "egress", "16", timeout_s=110)
    print(json.dumps({k: result[k] for k in ("share_bytes", "model_bytes", "tx_per_push", "rx_per_push")}))
    _exact(result)
    model, (share0, share1) = result["model_bytes"], result["share_bytes"]
    assert share0 + share1 == model and abs(share0 - share1) < 0.05 * model
    for version in (1, 2, 3, 4):
        assert {a["name"] for a in result["applied"] if a["version"] == version} == set(result["names"]), version
    tx, rx = result["tx_per_push"], result["rx_per_push"]
    # Each trainer host sends its rank's share once per push (plus the control plane: host 0 serves the store).
    assert share0 <= tx[0] < share0 + 0.1 * model, tx
    assert share1 <= tx[1] < share1 + 0.1 * model, tx
    # Each rollout host receives every byte once, and forwards it at most once.
    for host in (2, 3, 4, 5):
        assert model <= rx[host] < 1.1 * model, rx
        assert tx[host] < 1.1 * model, tx


@pytest.mark.timeout(120)
def test_each_rank_sends_its_shares_delta_and_every_receiver_is_bit_exact(tmp_path: Path) -> None:
    """delta="always" on both ranks, a sparse step per version: every stream carries its share as a delta."""
    result = run_scenario("sharded_across_hosts.py", str(tmp_path), "delta", "16", timeout_s=110)
    print(json.dumps({k: result[k] for k in ("share_bytes", "model_bytes", "tx_per_push", "rx_per_push")}))
    _exact(result)
    for version in (1, 2, 3, 4):
        assert {a["name"] for a in result["applied"] if a["version"] == version} == set(result["names"]), version
    model, tx, rx = result["model_bytes"], result["tx_per_push"], result["rx_per_push"]
    # 2% of every tensor changed: each trainer host sends a delta of its share, well under the share
    # itself (the full push sends each share whole, see the test above); each rollout host receives
    # both shares' deltas once.
    assert tx[0] < 0.25 * model and tx[1] < 0.25 * model, tx
    for host in (2, 3, 4, 5):
        assert rx[host] < 0.25 * model, rx


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["kill", "stop"])
def test_a_rank_killed_mid_share_is_applied_nowhere_and_receivers_follow_the_relaunch(tmp_path: Path, mode) -> None:
    """Rank 1 SIGKILLed, or SIGSTOPped (a stall past every timeout), while its share of version 3 is on the wire."""
    result = run_scenario("sharded_across_hosts.py", str(tmp_path), mode, "16", timeout_s=110)
    print(json.dumps({k: result[k] for k in ("killed", "partial_applied")}))
    killed = result["killed"]
    assert killed["signal"] == {"kill": "SIGKILL", "stop": "SIGSTOP"}[mode]
    assert 0.3 * killed["share_bytes"] <= killed["sent_bytes"] < killed["share_bytes"], killed  # mid-share
    assert result["partial_applied"] == []  # neither rank 0's share of 3 nor of 4 was applied anywhere, nor a mix
    _exact(result)
    assert {a["version"] for a in result["applied"]} == {1, 2, 5}
    assert {a["name"] for a in result["applied"] if a["version"] == 5} == set(result["names"])
