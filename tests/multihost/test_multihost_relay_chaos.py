"""Relay chaos on simulated hosts (issue 21): leaders and host-mates SIGKILLed and SIGSTOPped
at random through 100+ pushes with deltas on. See ``relay_chaos.py`` for the scenario.

Reduced scale by default (3 hosts x 2 receivers, 100 pushes); the full run (4 hosts x 2
receivers, 300 pushes) is

    WSYNC_CHAOS_FULL=1 .venv/bin/python -m pytest -s tests/multihost/test_multihost_relay_chaos.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from _netns import run_scenario

FULL = os.environ.get("WSYNC_CHAOS_FULL") == "1"
HOSTS, PER_HOST, PUSHES = (4, 2, 300) if FULL else (3, 2, 100)
pytestmark = [pytest.mark.slow, pytest.mark.chaos]


@pytest.mark.timeout(1500 if FULL else 400)
@pytest.mark.parametrize("cross_host", ["relay", "tree"])
def test_relay_chaos_no_torn_version_everyone_current_store_bounded(tmp_path: Path, cross_host: str) -> None:
    """``cross_host="relay"`` is the chain at these host counts; ``"tree"``: the two trees, deltas on their edges."""
    result = run_scenario("relay_chaos.py", str(tmp_path), str(HOSTS), str(PER_HOST), str(PUSHES), "21", cross_host,
                          timeout_s=1400 if FULL else 380)  # fmt: skip
    (tmp_path / "scenario.log").write_text(result.pop("_output"))  # the trainer's side, kept for a failure
    counts, actions = result["key_counts"], result["actions"]
    figures = {
        "pushes": result["pushes"], "receivers": HOSTS * PER_HOST,
        "kills": sum("kill" in a for a in actions), "stops": sum("stop" in a for a in actions),
        "applied": result["applied"], "torn": len(result["torn"]), "catch_up_s": round(result["catch_up_s"], 2),
        "keys_max": max(counts), "keys_early": max(counts[: len(counts) // 10]), "keys_settled": result["keys_settled"],
        "relay_keys_settled": result["relay_keys"],
        "run_s": round(result["run_s"], 1),
    }  # fmt: skip
    print("relay chaos:", json.dumps(figures))
    assert result["torn"] == [], result["torn"][:5]  # every applied version bit-exact: 0 torn
    assert figures["kills"] >= 3 and figures["stops"] >= 3, actions
    assert result["applied"] >= PUSHES // 2
    # Every live receiver held the last version within timeout_s of its push. (Once 19.95 s
    # under CI, two waits of timeout_s: the waits that can add up to that, the chain head
    # waiting out a send part-written into a leader the chain had dropped and a hop's group
    # set-up whose peer had left, no longer happen; see docs/relay.md "Failure".)
    assert result["catch_up_s"] <= result["timeout_s"], figures
    assert not set(result["last_report"]["failed"]) & set(result["live"]), result["last_report"]
    # Bounded store: every relay key that names a dead leader or a replaced chain is deleted
    # (only the live chain's remain), and the whole store never doubles from its early size.
    # (A SIGKILLed receiver's own member keys stay until membership forgets it, after 30
    # heartbeat timeouts of silence: a stopped one may come back.)
    assert result["stale_relay_keys"] == [], figures
    assert max(counts) <= 2 * figures["keys_early"], figures


@pytest.mark.timeout(1500 if FULL else 400)
def test_relay_chaos_with_garbage_in_the_store_and_the_leaders_directory(tmp_path: Path) -> None:
    """Issue 32: the trees, SIGKILL/SIGSTOP of leaders and host-mates, and garbage written while
    pushes run into store keys the hosts read and into the leaders' pin directories (odd notes,
    a FIFO, a /dev/zero symlink, a garbled board): 0 torn, everyone current, nothing left
    behind, and no thread of any process dead."""
    result = run_scenario("relay_chaos.py", str(tmp_path), str(HOSTS), str(PER_HOST), str(PUSHES), "32", "tree",
                          "garbage", timeout_s=1400 if FULL else 380)  # fmt: skip
    (tmp_path / "scenario.log").write_text(result.pop("_output"))
    actions = result["actions"]
    figures = {
        "pushes": result["pushes"], "kills": sum("kill" in a for a in actions),
        "stops": sum("stop" in a for a in actions), "garbage": sum("garbage" in a for a in actions),
        "applied": result["applied"], "torn": len(result["torn"]), "catch_up_s": round(result["catch_up_s"], 2),
        "keys_max": max(result["key_counts"]), "keys_settled": result["keys_settled"],
        "segments": len(result["segments"]), "run_s": round(result["run_s"], 1),
    }  # fmt: skip
    print("relay chaos with garbage:", json.dumps(figures))
    assert result["torn"] == [], result["torn"][:5]
    assert figures["garbage"] >= 3 and figures["kills"] + figures["stops"] >= 3, actions
    assert result["applied"] >= PUSHES // 2
    assert result["catch_up_s"] <= result["timeout_s"], figures
    assert not set(result["last_report"]["failed"]) & set(result["live"]), result["last_report"]
    assert result["thread_deaths"] == [], result["thread_deaths"][:5]
    # The trainer's ring and one per host leader, plus what SIGKILLed leaders left for the next to reclaim.
    assert len(result["segments"]) <= 2 * (HOSTS + 1), result["segments"]


@pytest.mark.timeout(1500 if FULL else 420)
def test_relay_chaos_with_the_trainer_killed_and_relaunched_and_garbage(tmp_path: Path) -> None:
    """Issue 32: everything above at once, and the trainer too: a process of its own (the store
    hosted apart, as torchrun's agent or ``lightning-wsync store`` does), SIGKILLed and relaunched
    from the version after its last push (the receivers follow each new sender epoch) or
    SIGSTOPped; leaders and host-mates SIGKILLed/SIGSTOPped; garbage into store keys and the
    leaders' directories. 0 torn, every live receiver on the last version within timeout_s of
    its push, the store's relay keys only the live chain's, /dev/shm bounded, no thread dead."""
    result = run_scenario("relay_chaos.py", str(tmp_path), str(HOSTS), str(PER_HOST), str(PUSHES), "33", "tree",
                          "garbage", "trainer", timeout_s=1400 if FULL else 400)  # fmt: skip
    (tmp_path / "scenario.log").write_text(result.pop("_output"))
    actions = result["actions"]
    figures = {
        "pushes": result["pushes"], "trainer_kills": sum("kill" in a for a in actions if a.get("trainer")),
        "trainer_stops": sum("stop" in a for a in actions if a.get("trainer")), "epochs": result["epochs"],
        "kills": sum("kill" in a for a in actions if not a.get("trainer")),
        "stops": sum("stop" in a for a in actions if not a.get("trainer")),
        "garbage": sum("garbage" in a for a in actions), "applied": result["applied"], "torn": len(result["torn"]),
        "catch_up_s": round(result["catch_up_s"], 2), "keys_max": max(result["key_counts"]),
        "keys_early": max(result["key_counts"][: len(result["key_counts"]) // 10]),
        "keys_settled": result["keys_settled"], "relay_keys_settled": result["relay_keys"],
        "segments": len(result["segments"]), "run_s": round(result["run_s"], 1),
    }  # fmt: skip
    print("relay chaos with the trainer killed:", json.dumps(figures))
    print("store keys every 10 pushes:", result["key_counts"][::10])
    early, settled = result["key_shapes"]
    changed = {k: (early.get(k, 0), settled.get(k, 0)) for k in sorted({*early, *settled})
               if early.get(k) != settled.get(k)}  # fmt: skip
    print("store keys by shape, after 10 pushes -> settled:", changed)
    (tmp_path / "result.json").write_text(json.dumps(result))
    assert result["torn"] == [], result["torn"][:5]
    assert figures["trainer_kills"] >= 1 and len(figures["epochs"]) == figures["trainer_kills"] + 1, (figures, actions)
    assert figures["garbage"] >= 3 and figures["kills"] + figures["stops"] >= 3, actions
    assert result["applied"] >= PUSHES // 2
    assert result["catch_up_s"] <= result["timeout_s"], figures
    assert not set(result["last_report"]["failed"]) & set(result["live"]), result["last_report"]
    assert result["thread_deaths"] == [], result["thread_deaths"][:5]
    assert result["stale_relay_keys"] == [], result["stale_relay_keys"][:10]
    # A killed trainer's relay keys are deleted by its successors (before: ~10 keys more a relaunch).
    assert result["dead_epoch_relay_keys"] == [], result["dead_epoch_relay_keys"][:10]
    # Each new sender epoch writes its own records and retires those two epochs back: at the
    # default scale the store never doubles from its early size (91 of 61, 2 runs; 86 of 62 since
    # killed senders' relay keys and version records are retired). Not checked at the full scale:
    # 193-211 of 80 before that fix (~10 keys more per trainer relaunch); not rerun since.
    if not FULL:
        assert figures["keys_max"] <= 2 * figures["keys_early"], figures
    # The trainer's ring and one per host leader, plus what SIGKILLed leaders and trainers left
    # for the next to reclaim.
    assert len(result["segments"]) <= 2 * (HOSTS + 1), result["segments"]
