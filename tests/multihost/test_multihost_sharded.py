"""A sharded push across simulated hosts: a trainer of 2 ranks on 2 hosts, receivers on 4 others.

Each trainer rank relays only its own share (a relay chain per rank); every rollout host
receives each byte once and assembles whole versions, never a mix (docs/sharded.md).

Two scenario runs serve the four tests (one set-up of hosts and receivers each, shared by
module-scoped fixtures): full pushes then deltas, and rank 1 SIGKILLed then SIGSTOPped, each
phase under a sender epoch of its own (``sharded_across_hosts.py``). The tests of one run share an
``xdist_group``: ``pytest -n 2 --dist loadgroup`` runs them in one worker, so each run happens once.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from _netns import run_scenario

pytestmark = pytest.mark.slow


def _exact(result: dict[str, Any]) -> None:
    applied = result["applied"]
    assert applied and all(a["exact"] for a in applied), [a for a in applied if not a["exact"]]


@pytest.fixture(scope="module")
def egress_then_delta(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_scenario("sharded_across_hosts.py", str(tmp_path_factory.mktemp("egress")), "egress+delta", "16",
                        timeout_s=220)  # fmt: skip


@pytest.fixture(scope="module")
def kill_then_stop(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_scenario("sharded_across_hosts.py", str(tmp_path_factory.mktemp("kill")), "kill+stop", "16",
                        timeout_s=220)  # fmt: skip


@pytest.mark.xdist_group("sharded-egress")
@pytest.mark.timeout(240)
def test_each_trainer_host_sends_only_its_share_and_every_receiver_is_bit_exact(egress_then_delta) -> None:
    result, phase = egress_then_delta, egress_then_delta["egress"]
    print(json.dumps({"share_bytes": result["share_bytes"], "model_bytes": result["model_bytes"], **phase}))
    _exact(result)
    model, (share0, share1) = result["model_bytes"], result["share_bytes"]
    assert share0 + share1 == model and abs(share0 - share1) < 0.05 * model
    assert phase["versions"] == [1, 2, 3, 4]
    for version in phase["versions"]:
        assert {a["name"] for a in result["applied"] if a["version"] == version} == set(result["names"]), version
    tx, rx = phase["tx_per_push"], phase["rx_per_push"]
    # Each trainer host sends its rank's share once per push (plus the control plane: host 0 serves the store).
    assert share0 <= tx[0] < share0 + 0.1 * model, tx
    assert share1 <= tx[1] < share1 + 0.1 * model, tx
    # Each rollout host receives every byte once, and forwards it at most once.
    for host in (2, 3, 4, 5):
        assert model <= rx[host] < 1.1 * model, rx
        assert tx[host] < 1.1 * model, tx


@pytest.mark.xdist_group("sharded-egress")
@pytest.mark.timeout(240)
def test_each_rank_sends_its_shares_delta_and_every_receiver_is_bit_exact(egress_then_delta) -> None:
    """delta="always" on both ranks, a sparse step per version: every stream carries its share as a delta."""
    result, phase = egress_then_delta, egress_then_delta["delta"]
    print(json.dumps({"share_bytes": result["share_bytes"], "model_bytes": result["model_bytes"], **phase}))
    _exact(result)
    assert phase["versions"] == [5, 6, 7, 8]
    for version in phase["versions"]:
        assert {a["name"] for a in result["applied"] if a["version"] == version} == set(result["names"]), version
    model, tx, rx = result["model_bytes"], phase["tx_per_push"], phase["rx_per_push"]
    # 2% of every tensor changed: each trainer host sends a delta of its share, well under the share
    # itself (the full push sends each share whole, see the test above); each rollout host receives
    # both shares' deltas once.
    assert tx[0] < 0.25 * model and tx[1] < 0.25 * model, tx
    for host in (2, 3, 4, 5):
        assert rx[host] < 0.25 * model, rx


@pytest.mark.xdist_group("sharded-kill")
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["kill", "stop"])
def test_a_rank_killed_mid_share_is_applied_nowhere_and_receivers_follow_the_relaunch(kill_then_stop, mode) -> None:
    """Rank 1 SIGKILLed, or SIGSTOPped (a stall past every timeout), while its share of a version is on the wire:
    applied nowhere, nor the next (rank 0's share alone), whose push report names rank 1 for every receiver."""
    result, phase = kill_then_stop, kill_then_stop[mode]
    print(json.dumps(phase))
    killed = phase["killed"]
    assert killed["signal"] == {"kill": "SIGKILL", "stop": "SIGSTOP"}[mode]
    assert 0.3 * killed["share_bytes"] <= killed["sent_bytes"] < killed["share_bytes"], killed  # mid-share
    # Neither rank 0's share of the version cut off nor of the next (rank 0 alone) was applied anywhere, nor a mix.
    assert phase["partial_applied"] == []
    _exact(result)
    first, relaunched = {"kill": (1, 5), "stop": (6, 10)}[mode]
    assert tuple(phase["partial"]) == (first + 2, first + 3) and phase["relaunched"] == relaunched
    # The push reports: every receiver failed both versions; the one rank 1 never began names it for each.
    failed = phase["failed"]
    assert set(failed) == {str(first + 2), str(first + 3)}, failed
    assert all(set(reasons) == set(result["names"]) for reasons in failed.values()), failed
    assert all(f"trainer rank 1 did not complete its share of version {first + 3}" in reason
               for reason in failed[str(first + 3)].values()), failed  # fmt: skip
    versions = {a["version"] for a in result["applied"] if first <= a["version"] <= relaunched}
    assert versions == {first, first + 1, relaunched}
    assert {a["name"] for a in result["applied"] if a["version"] == relaunched} == set(result["names"])
