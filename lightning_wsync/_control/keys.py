"""Every name lightning_wsync shares with other processes: store keys and environment variables.

Keys of a job live under ``wsync/<job>/`` (:func:`job_prefix`; :class:`~lightning_wsync._control.Control`
adds it). Keys that a wait depends on carry the version, sender epoch or link
number in their name, so a key written for one version can never satisfy a wait for
another. Only ``latest``, ``sender/current``, the fleet's ``round`` and ``switch`` and the relay's
``leader`` and ``chain`` records are overwritten (read by value, never waited on). JSON
records are signed with the job's secret when one is set;
counters and ``1`` markers cannot be, and only say "look again", never what to trust.

Longer than 300 lines: the table below is the one list of every key, kept beside its builders.

==============================  ======  =========================================================
key (under ``wsync/<job>/``)    kind    what
==============================  ======  =========================================================
run                             text    this run's random id, bound into every MAC (first signer sets it)
sender/epoch                    count   each WeightSender takes the next epoch
sender/current                  JSON    ``{epoch}`` of the newest sender
sender/<epoch>                  JSON    sender record (host, pid, transport, backend, shm, addr,
                                        relay, heartbeat_timeout_s, timeout_s)
layout/<epoch>                  JSON    the manifest: tensor table and buckets of that epoch
shards/<epoch>                  JSON    a sharded sender's plan: each trainer rank's pieces and the
                                        shared-memory segment of its ring
shards/<epoch>/wrote/<rank>     text    the newest version trainer rank <rank> (relaying, rank > 0)
                                        wrote its share of (overwritten; read by value by rank 0)
shards/<epoch>/sums/<rank>      JSON    ``{version, sums}``: the bucket checksums of the newest share
                                        trainer rank <rank> wrote, when on another host than rank 0
                                        (overwritten): rank 0 publishes them in ``v/<version>/sums``
latest                          JSON    ``{version, epoch}`` of the newest published version
news                            count   bumped by the sender after each change receivers follow (a
                                        version, a sender epoch, closed): an idle watcher reads it alone
links/asked                     count   bumped by a receiver after it asks for a new network link
                                        (``member/<rid>/net``): the sender reads it alone while idle
v/<version>                     JSON    ``{version, epoch}`` of a published version (newest few)
v/<version>/sums                JSON    ``{version, sums}`` bucket checksums (when a receiver verifies)
closed/<epoch>                  JSON    ``{final}``, set by WeightSender.close(); final=False when
                                        the sender left without finishing (exception, SIGTERM)
members/next                    count   each WeightReceiver takes the next rid
members/low                     JSON    every rid below it is gone and its keys deleted
members/gone                    count   bumped by a receiver after it writes ``member/<rid>/gone``:
                                        the sender reads the ``gone`` keys when it moves
member/<rid>                    JSON    member record (name, host, pid, PID namespace, verify)
member/<rid>/hb                 count   heartbeat
member/<rid>/gone               JSON    ``true``, set by WeightReceiver.close()
member/<rid>/state              JSON    ``{acked, rejected: {version, reason}}``: newest version
                                        held, last rejection (the old ``{error: [v, r]}`` decodes)
member/<rid>/net                count   link number: the receiver's newest network link
member/<rid>/fleet              JSON    ``{group, round, staged, holding}``: a fleet member's
                                        newest round seen and the version it staged
fleet/<group>/round             JSON    ``{round, version, rids}``: the group's newest round
                                        (overwritten by the next; read by value)
fleet/<group>/switch            JSON    ``{switches: [{round, version, rids, excluded, at}]}``:
                                        the group's newest few switches (overwritten)
pg/<epoch>/<rid>/<link>/        prefix  one sender-receiver link: gloo's rendezvous keys ``0/0``,
                                        ``0/1``; ``ready/<n>`` (receiver: ready for send n, what
                                        it holds), ``ann/<n>`` (sender: version of send n)
relay/<epoch>/leader/<hostkey>  JSON    ``{rid, pid, pidns, term, shm, ready}`` of the host's leader
                                        (pidns: its PID namespace; ready: its segment exists;
                                        hostkey: sha256 of the host id, 16 hex digits); replaced by
                                        compare-and-set, and like a dead leader's when unreadable
relay/<epoch>/chain             JSON    ``{number, rids, tree}``: the relay's number, leader rids, and
                                        whether they form two trees rather than a chain
relay/<epoch>/broken/<rid>      text    ``1``: the hop into leader rid failed
relay/<epoch>/moved             count   bumped when a host's leader changes or a hop breaks: the
                                        sender reads the leader records and ``broken`` keys when it
                                        moves (and every few seconds), not at every step
relay/<epoch>/bell/<rid>        text    leader rid's doorbell: written by whoever changes what it
                                        serves (a new chain, a takeover of its host, its own close);
                                        it waits on it (one blocking wait) and deletes it on waking
relay/<epoch>/pg/<chain>/<rid>/ prefix  one relay hop: ``joined/<rank>`` (``1``: joining; ``taken``: the
                                        peer committed to the group; ``gone``: withdrawn), ``ready/<n>``
                                        (downstream leader: what it holds), gloo's keys;
                                        ``.../pg/<chain>/t<k>/<rid>/`` in tree k of a tree topology
relay/<epoch>/received/<rid>    JSON    how leader rid got its last few versions (delta or full,
                                        bytes, decode seconds), for push reports
relay/<stream>/leaders          JSON    ``{leaders: {rid: host}}``: the live host leaders of a sharded
                                        sender's stream (below), written by trainer rank 0 for the
                                        stream of each rank > 0 (overwritten; read by value)
relay/<stream>/alone            JSON    ``{leaders: {rid: host}}``: receivers that cannot map their
                                        host's ring of the stream and lead a host of their own in it
                                        (``relay.alone``); compare-and-set by them, read by rank 0
nixl/<epoch>/agent/<who>        JSON    a NIXL agent's metadata and registered regions (who:
                                        ``sender``, or ``r<rid>`` for a receiver); the NIXL plane's
                                        (docs/nixl.md), deleted by its writer when it closes
channel/<name>/queue            queue   experience items, MAC-prefixed when a secret is set
==============================  ======  =========================================================

A sharded sender's trainer rank r relays its share as a relay of its own (a *stream*): every
``relay/<epoch>/`` key above, under the stream number 2**40 + epoch * 4096 + r
(:func:`relay_stream`) in place of the epoch.

Deleted so the store stays bounded (see :mod:`lightning_wsync._push.membership`): a gone
receiver's ``member/<rid>*`` and ``pg/*/<rid>/*`` keys, a link's gloo keys once the link
is in use or replaced, its ``ready/<n>``/``ann/<n>`` keys when either end leaves it,
``v/<version>*`` beyond the newest few (a new sender: every one up to the last version), and
the records of sender epochs two or more behind the current one. The relay's keys (see
:mod:`lightning_wsync._planes.relay.tidy`):
each side of a hop deletes its ``relay/<epoch>/pg/...`` keys when it leaves; a closing
leader deletes its leader record and ``received`` key; the sender deletes, by the store's list of
keys, every key of the hops of chains replaced more than ``timeout_s + heartbeat_timeout_s`` ago
(a ``ready/<n>`` note a side left, whatever its ``n``, and again at each later such deletion what a
side stopped meanwhile wrote back), the ``received``,
``broken`` and ``bell`` keys of leaders that left the chain, the leader records of hosts with no live
leader for that long, and the ``chain`` key when it closes. What a SIGKILLed sender's epoch left
under ``relay/<epoch>/`` (and its streams'), its successors delete by the store's list of keys
(:mod:`lightning_wsync._control.retire`): that epoch's once its leaders are done with it (the dead
sender's ``timeout_s + heartbeat_timeout_s`` after the successor started), older ones at once.

Outside any job, the rendezvous backend keeps on the shared store
``wsync.rdzv/<job>/<role>/launch`` (count: the role's launch number n; the inner run
id is ``<job>.<role>.l<n>``),
``wsync.rdzv/<job>/agents`` (count: agents using the store) and torch's own
``torch.rendezvous.<run id>`` (the signed rendezvous state); on each round's store the
agent writes ``WSYNC_BOOTSTRAP`` and keeps torchrun's keys under ``wsync.agent/``.
"""

from __future__ import annotations

import hashlib

# -- environment ----------------------------------------------------------------------
ENV_STORE = "WSYNC_STORE"  # "host:port" of the shared control-plane TCPStore
ENV_JOB = "WSYNC_JOB"  # the --rdzv-id, shared by the trainer and rollout jobs
ENV_ROLE = "WSYNC_ROLE"  # "trainer" or "rollout"
ENV_SECRET = "WSYNC_SECRET"  # the job's shared secret: signs records and the rendezvous state
ENV_HOST_ID = "WSYNC_HOST_ID"  # overrides the host identity of the same-host decision
ENV_ADDR = "WSYNC_ADDR"  # the address other hosts reach this process at

# -- one job's keys -------------------------------------------------------------------
SENDER_EPOCH = "sender/epoch"
SENDER_CURRENT = "sender/current"
LATEST = "latest"
NEWS = "news"  # a counter: "look again" (see the table), read alone by idle watchers
LINKS_ASKED = "links/asked"  # a counter: some receiver asked for a new network link
MEMBERS_NEXT = "members/next"
MEMBERS_LOW = "members/low"
MEMBERS_GONE = "members/gone"  # a counter: some receiver closed (wrote its gone key)
RUN = "run"  # this run's random id, bound into every MAC (set once, by compare-and-set)


def job_prefix(job: str) -> str:
    return f"wsync/{job}"


def sender_record(epoch: int) -> str:
    return f"sender/{epoch}"


def manifest(epoch: int) -> str:
    return f"layout/{epoch}"


def shards(epoch: int) -> str:
    return f"shards/{epoch}"


def shard_written(epoch: int, rank: int) -> str:
    return f"shards/{epoch}/wrote/{rank}"


def shard_sums(epoch: int, rank: int) -> str:
    return f"shards/{epoch}/sums/{rank}"


def closed(epoch: int) -> str:
    return f"closed/{epoch}"


def epoch_keys(epoch: int) -> tuple[str, ...]:
    """The records of one sender epoch."""
    return (sender_record(epoch), manifest(epoch), shards(epoch), closed(epoch))


def version_record(version: int) -> str:
    return f"v/{version}"


def version_sums(version: int) -> str:
    return f"v/{version}/sums"


def version_keys(version: int) -> tuple[str, ...]:
    return (version_record(version), version_sums(version))


def member(rid: int) -> str:
    return f"member/{rid}"


def member_heartbeat(rid: int) -> str:
    return f"member/{rid}/hb"


def member_gone(rid: int) -> str:
    return f"member/{rid}/gone"


def member_state(rid: int) -> str:
    return f"member/{rid}/state"


def member_link(rid: int) -> str:
    """Counter: the link number of receiver ``rid``'s newest network link."""
    return f"member/{rid}/net"


def member_fleet(rid: int) -> str:
    """A fleet member's newest round seen and the version it staged."""
    return f"member/{rid}/fleet"


def member_keys(rid: int) -> tuple[str, ...]:
    """Every key receiver ``rid`` writes outside its links."""
    return (member(rid), member_heartbeat(rid), member_state(rid), member_gone(rid), member_link(rid),
            member_fleet(rid))  # fmt: skip


def fleet_round(group: str) -> str:
    return f"fleet/{group}/round"


def fleet_switch(group: str) -> str:
    return f"fleet/{group}/switch"


def link_prefix(epoch: int, rid: int, link: int) -> str:
    """Prefix of one sender-receiver link (``link``: its link number)."""
    return f"pg/{epoch}/{rid}/{link}/"


def group_keys(prefix: str) -> tuple[str, ...]:
    """The keys gloo's rendezvous writes under a two-rank group's ``prefix``.

    ``PrefixStore`` joins its prefix and a key with a ``/`` of its own, so under a prefix
    that ends in ``/`` they are ``<prefix>/0/<rank>``.
    """
    return (prefix + "/0/0", prefix + "/0/1")


def ready(prefix: str, n: int) -> str:
    """Receiver to sender: ready for send ``n`` of a link (or hop), and what it holds."""
    return f"{prefix}ready/{n}"


def announcement(prefix: str, n: int) -> str:
    """Sender to receiver: send ``n`` of a link (or hop) follows."""
    return f"{prefix}ann/{n}"


def joined(prefix: str, rank: int) -> str:
    """A relay hop's side ``rank`` is there (see :func:`~lightning_wsync._planes.relay.hops.join_hop`)."""
    return f"{prefix}joined/{rank}"


def host_key(host: str) -> str:
    """A host identity as a key part (hashed: host ids contain '/')."""
    return hashlib.sha256(host.encode()).hexdigest()[:16]


def relay_leader(epoch: int, host: str) -> str:
    return f"relay/{epoch}/leader/{host_key(host)}"


def relay_chain(epoch: int) -> str:
    return f"relay/{epoch}/chain"


def relay_broken(epoch: int, rid: int) -> str:
    return f"relay/{epoch}/broken/{rid}"


# -- the NIXL plane (hook: lightning_wsync._planes.nixl) --
def nixl_agent(epoch: int, who: str) -> str:
    """A NIXL agent's record: ``who`` is ``sender`` or ``r<rid>``."""
    return f"nixl/{epoch}/agent/{who}"


def relay_moved(epoch: int) -> str:
    return f"relay/{epoch}/moved"


def relay_bell(epoch: int, rid: int) -> str:
    return f"relay/{epoch}/bell/{rid}"


def relay_hops(epoch: int) -> str:
    """Prefix of every relay hop of ``epoch``, each chain's under ``<chain>/`` (:func:`relay_hop_prefix`)."""
    return f"relay/{epoch}/pg/"


def relay_hop_prefix(epoch: int, chain: int, rid: int, tree: int | None = None) -> str:
    """Prefix of the relay hop into leader ``rid`` (``chain``: the chain number; ``tree``: which
    of a tree topology's two trees, None for a chain)."""
    return f"relay/{epoch}/pg/{chain}/{rid}/" if tree is None else f"relay/{epoch}/pg/{chain}/t{tree}/{rid}/"


STREAM_RANKS = 4096  # trainer ranks a sharded sender may relay from (each its own stream)
_STREAM_BASE = 1 << 40  # above any sender epoch: a stream's relay keys never meet an epoch's


def relay_stream(epoch: int, rank: int) -> int:
    """The relay namespace of trainer rank ``rank``'s share in sender epoch ``epoch`` (a sharded push):
    used wherever the relay takes an epoch (keys, the trailer's MAC, segment names)."""
    if not 0 <= rank < STREAM_RANKS:
        raise ValueError(f"relay_stream: rank={rank!r} must be in [0, {STREAM_RANKS})")
    return _STREAM_BASE + epoch * STREAM_RANKS + rank


def relay_owner(number: int) -> int:
    """The sender epoch whose relay namespace ``number`` is: the epoch itself, or a stream's (:func:`relay_stream`)."""
    return number if number < _STREAM_BASE else (number - _STREAM_BASE) // STREAM_RANKS


def relay_stream_leaders(stream: int) -> str:
    return f"relay/{stream}/leaders"


def relay_stream_alone(stream: int) -> str:
    """The receivers that receive a stream as a host of their own (they cannot map their host's ring of it)."""
    return f"relay/{stream}/alone"


def relay_received(epoch: int, rid: int) -> str:
    """How leader ``rid`` got its last few versions (delta or full, bytes, decode time): push reports."""
    return f"relay/{epoch}/received/{rid}"


def channel_queue(name: str) -> str:
    return f"channel/{name}/queue"


# -- the rendezvous backend's keys -------------------------------------------------------
ROUND_BOOTSTRAP = "WSYNC_BOOTSTRAP"  # written by each round's rank 0 on the round-scoped store
AGENT_PREFIX = "wsync.agent"  # torchrun's agent keys on the round's store, apart from the workers' "default_pg/"


def rdzv_launch(job: str, role: str) -> str:
    """Counter: the role's launch number (bumped when a relaunch finds the last one closed)."""
    return f"wsync.rdzv/{job}/{role}/launch"


def rdzv_agents(job: str) -> str:
    return f"wsync.rdzv/{job}/agents"


def rdzv_state(run_id: str) -> str:
    """Where torch's C10d backend keeps a run's rendezvous state."""
    return "torch.rendezvous." + run_id
