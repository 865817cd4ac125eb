"""Key building (lightning_wsync._control.keys): every key matches its table row, and no two differ only by accident."""

from __future__ import annotations

import re

import pytest
import torch.distributed as dist

from lightning_wsync._control import keys
from lightning_wsync._control.store import Control


def _table_rows() -> list[re.Pattern[str]]:
    """The key column of the module docstring's table, as patterns (``<name>``: a path part,
    ``<hostkey>``: 16 hex digits, any other ``<x>``: a number)."""
    lines = (keys.__doc__ or "").splitlines()
    rules = [i for i, line in enumerate(lines) if line.startswith("=====")]
    body = lines[rules[1] + 1 : rules[2]]  # between the header's rule and the closing one
    firsts = [line.split()[0] for line in body if line and not line.startswith(" ")]
    parts = {"<name>": "[^/]+", "<group>": "[^/]+", "<who>": "(?:sender|r[0-9]+)", "<hostkey>": "[0-9a-f]{16}"}
    return [re.compile(re.sub(r"<[a-z]+>", lambda m: parts.get(m[0], "[0-9]+"), first)) for first in firsts]


def _built() -> dict[str, str]:
    prefix = keys.link_prefix(3, 7, 2)
    hop = keys.relay_hop_prefix(3, 4, 7)
    return {
        "RUN": keys.RUN,
        "SENDER_EPOCH": keys.SENDER_EPOCH,
        "SENDER_CURRENT": keys.SENDER_CURRENT,
        "LATEST": keys.LATEST,
        "NEWS": keys.NEWS,
        "LINKS_ASKED": keys.LINKS_ASKED,
        "MEMBERS_NEXT": keys.MEMBERS_NEXT,
        "MEMBERS_LOW": keys.MEMBERS_LOW,
        "MEMBERS_GONE": keys.MEMBERS_GONE,
        "sender_record": keys.sender_record(3),
        "manifest": keys.manifest(3),
        "shards": keys.shards(3),
        "shard_written": keys.shard_written(3, 1),
        "shard_sums": keys.shard_sums(3, 1),
        "closed": keys.closed(3),
        "version_record": keys.version_record(12),
        "version_sums": keys.version_sums(12),
        "member": keys.member(7),
        "member_heartbeat": keys.member_heartbeat(7),
        "member_gone": keys.member_gone(7),
        "member_state": keys.member_state(7),
        "member_link": keys.member_link(7),
        "member_fleet": keys.member_fleet(7),
        "fleet_round": keys.fleet_round("rollout"),
        "fleet_switch": keys.fleet_switch("rollout"),
        "link_prefix": prefix,
        "relay_leader": keys.relay_leader(3, "node-1/boot"),
        "relay_chain": keys.relay_chain(3),
        "relay_broken": keys.relay_broken(3, 7),
        "relay_moved": keys.relay_moved(3),
        "relay_bell": keys.relay_bell(3, 7),
        "relay_hop_prefix": hop,
        "relay_received": keys.relay_received(3, 7),
        "relay_stream_leaders": keys.relay_stream_leaders(keys.relay_stream(3, 1)),
        "relay_stream_alone": keys.relay_stream_alone(keys.relay_stream(3, 1)),
        "channel_queue": keys.channel_queue("experience"),
        "nixl_agent": keys.nixl_agent(3, "r7"),
    }


def test_every_key_built_has_a_row_in_the_table_and_every_row_a_builder():
    rows = _table_rows()
    assert len(rows) == 37, [r.pattern for r in rows]
    unmatched_rows = set(range(len(rows)))
    for name, key in _built().items():
        hits = [i for i, row in enumerate(rows) if row.fullmatch(key)]
        assert len(hits) == 1, f"{name} -> {key!r} matches rows {[rows[i].pattern for i in hits]}"
        unmatched_rows -= set(hits)
    assert not unmatched_rows, [rows[i].pattern for i in sorted(unmatched_rows)]


def test_keys_carry_their_arguments_and_never_collide():
    built = list(_built().values())
    assert len(set(built)) == len(built)
    assert keys.version_record(1) != keys.version_record(11)
    assert keys.link_prefix(1, 2, 3) == "pg/1/2/3/"
    assert keys.link_prefix(1, 2, 3) != keys.link_prefix(1, 23, 3)
    assert keys.group_keys(keys.link_prefix(1, 2, 3)) == ("pg/1/2/3//0/0", "pg/1/2/3//0/1")  # PrefixStore adds a /
    assert keys.ready("pg/1/2/3/", 5) == "pg/1/2/3/ready/5"
    assert keys.announcement("pg/1/2/3/", 5) == "pg/1/2/3/ann/5"
    assert keys.joined(keys.relay_hop_prefix(1, 2, 3), 0) == "relay/1/pg/2/3/joined/0"


def test_relay_streams_never_meet_an_epoch_or_each_other():
    streams = {keys.relay_stream(e, r) for e in (1, 2, 10**6) for r in (0, 1, keys.STREAM_RANKS - 1)}
    assert len(streams) == 9 and min(streams) > 10**9
    assert keys.relay_chain(keys.relay_stream(3, 1)) == f"relay/{2**40 + 3 * 4096 + 1}/chain"
    with pytest.raises(ValueError, match=r"rank=4096 must be in \[0, 4096\)"):
        keys.relay_stream(3, keys.STREAM_RANKS)


def test_grouped_keys_are_the_single_keys():
    assert keys.member_keys(4) == (
        keys.member(4), keys.member_heartbeat(4), keys.member_state(4), keys.member_gone(4), keys.member_link(4),
        keys.member_fleet(4),
    )  # fmt: skip
    assert keys.version_keys(9) == (keys.version_record(9), keys.version_sums(9))
    assert keys.epoch_keys(2) == (keys.sender_record(2), keys.manifest(2), keys.shards(2), keys.closed(2))


def test_host_key_hides_the_slash_of_a_host_id():
    key = keys.host_key("node-1/0f3a-boot-id")
    assert re.fullmatch(r"[0-9a-f]{16}", key)
    assert key != keys.host_key("node-2/0f3a-boot-id")


@pytest.mark.parametrize("job", ["exp1", "a.b-c_d"])
def test_control_puts_every_key_under_the_job_prefix(job):
    store = dist.HashStore()
    Control(store, job).set_text(keys.LATEST, "x")
    assert keys.job_prefix(job) == f"wsync/{job}"
    assert store.get(f"wsync/{job}/latest") == b"x"


def test_rendezvous_keys():
    assert keys.rdzv_launch("exp1", "trainer") == "wsync.rdzv/exp1/trainer/launch"
    assert keys.rdzv_agents("exp1") == "wsync.rdzv/exp1/agents"
    assert keys.rdzv_state("exp1.trainer.e0") == "torch.rendezvous.exp1.trainer.e0"


def test_retiring_an_old_sharded_epoch_takes_every_ranks_note_with_it():
    """A rank SIGKILLed mid-run never deletes ``shards/<epoch>/wrote/<rank>``: the sender two
    epochs later retires it with the epoch's records (the plan says how many ranks there were)."""
    from lightning_wsync._control.records import ShardsRecord
    from lightning_wsync._control.retire import retire_old_epochs
    from lightning_wsync._control.shards import Piece, ShardPlan

    ctl = Control(dist.HashStore(), "j")
    pieces = ((Piece(0, 0, 4),), (Piece(0, 4, 8),), (Piece(1, 0, 4),))
    plan = ShardPlan(pieces, bucket_bytes=1 << 20).with_segments(["s0", "s1", "s2"])
    ctl.put(keys.shards(1), ShardsRecord(plan))
    for rank in range(3):
        ctl.set_text(keys.shard_written(1, rank), "7")
        ctl.set_json(keys.shard_sums(1, rank), {"version": 7, "sums": [1]})
    ctl.set_text(keys.shard_written(2, 0), "9")  # the epoch before the current one stays
    retire_old_epochs(ctl, 3, None)
    assert [ctl.has(keys.shard_written(1, r)) for r in range(3)] == [False, False, False]
    assert [ctl.has(keys.shard_sums(1, r)) for r in range(3)] == [False, False, False]
    assert not ctl.has(keys.shards(1)) and ctl.get_text(keys.shard_written(2, 0)) == "9"


def test_retiring_old_epochs_takes_their_relay_keys_and_their_streams_with_them(server: dist.TCPStore) -> None:
    """A SIGKILLed sender deletes none of its ``relay/<epoch>/`` keys (issue 32: ~10 a trainer
    relaunch in the chaos runs): a sender two epochs later deletes every one, its sharded
    streams' too, by the store's list; the epoch before it, this job's only, and a key that
    names no epoch stay. A store that cannot list its keys keeps them, without an error."""
    from lightning_wsync._control.retire import retire_old_epochs, retire_relay_keys

    ctl, other = Control(server, "j"), Control(server, "j2")
    old = [keys.relay_chain(1), keys.relay_moved(1), keys.relay_bell(1, 5), keys.relay_leader(1, "h"),
           keys.ready(keys.relay_hop_prefix(1, 9, 5), 41), *keys.group_keys(keys.relay_hop_prefix(1, 9, 5)),
           keys.relay_stream_leaders(keys.relay_stream(1, 3)),
           keys.relay_received(keys.relay_stream(1, 0), 5)]  # fmt: skip
    kept = [keys.relay_chain(2), keys.relay_moved(2), keys.relay_stream_leaders(keys.relay_stream(2, 1)),
            keys.relay_chain(3), "relay/x/chain", "relay/²/chain"]  # fmt: skip
    for key in old + kept:
        ctl.set_text(key, "1")
    other.set_text(keys.relay_chain(1), "1")
    retire_old_epochs(ctl, 3, None)
    assert sorted(ctl.list_keys("relay/") or []) == sorted(kept)
    assert other.list_keys("relay/") == [keys.relay_chain(1)]
    assert retire_relay_keys(ctl, below=3) == 3  # the epoch before, once its leaders are done with it
    assert sorted(ctl.list_keys("relay/") or []) == sorted([keys.relay_chain(3), "relay/x/chain", "relay/²/chain"])
    hashed = Control(dist.HashStore(), "j")
    hashed.set_text(keys.relay_chain(1), "1")
    assert hashed.list_keys("relay/") is None and retire_relay_keys(hashed, below=3) == 0
    assert hashed.has(keys.relay_chain(1))


def test_a_new_sender_retires_every_version_record_its_predecessors_left(server: dist.TCPStore) -> None:
    """A SIGKILLed sender leaves its newest few ``v/<version>`` records (it deletes older ones as it
    pushes, and all but its last when it closes): the next sender deletes every one up to the last
    published version, by the store's list (before: only the last, ~3 more keys a relaunch in the
    chaos runs). A store that cannot list its keys loses the last one only, as before."""
    from lightning_wsync._control.retire import retire_old_epochs

    ctl = Control(server, "j")
    for v in (3, 4, 5, 6):
        ctl.set_text(keys.version_record(v), "{}")
        ctl.set_text(keys.version_sums(v), "{}")
    retire_old_epochs(ctl, 2, 5)
    assert sorted(ctl.list_keys("v/") or []) == [keys.version_record(6), keys.version_sums(6)]
    hashed = Control(dist.HashStore(), "j")
    for v in (4, 5):
        hashed.set_text(keys.version_record(v), "{}")
    retire_old_epochs(hashed, 2, 5)
    assert hashed.has(keys.version_record(4)) and not hashed.has(keys.version_record(5))
