"""Every period, lease, backstop and poll of the job, derived from the user's settings in
one place (:func:`timing`) and passed down as one :class:`Timing`.

A component reads its waits from the ``Timing`` it is given, never from a constant of its
own, so changing the heartbeat period (or any other derived value) is a change to this
file alone. Left out on purpose: the spin granularities of one process's own waits (a
ring's wait for a free slot, a segment claim's retry, the experience channel's poll), which
depend on no setting and ask nothing of the store or of another process.

Longer than 60 lines: `timing` is one docstring that says what each value is and why, then one call.
"""

from __future__ import annotations

from dataclasses import dataclass

_PIN_LEASE_MAX_S = 5.0
_POLL_FLOOR_S = 0.05  # no derived per-host period of the relay runs faster than a receiver's relay loop


@dataclass(frozen=True, kw_only=True)
class Timing:
    """What :func:`timing` derives; see its docstring for each value and why."""

    # The settings it was derived from.
    heartbeat_s: float
    heartbeat_timeout_s: float
    timeout_s: float
    # Beats and liveness checks.
    beat_s: float
    hosted_beat_s: float
    mates_flush_s: float
    board_beat_s: float
    leader_check_s: float
    member_check_s: float
    store_lost_retry_s: float
    # Leases.
    pin_lease_s: float
    host_ring_lease_s: float
    pin_renew_s: float
    # Backstops: a value read at least this often, whatever the signals that say when else.
    backstop_s: float
    hosted_backstop_s: float
    lead_backstop_s: float
    leader_record_backstop_s: float
    bell_backstop_s: float
    bell_wait_s: float
    gone_backstop_s: float
    follow_all_s: float
    relay_linger_s: float
    # Polls of the store (or of in-memory state fed by it).
    fleet_poll_s: float
    fleet_idle_poll_s: float
    wait_poll_s: float
    idle_poll_s: float
    verify_poll_s: float
    seek_poll_s: float
    relay_poll_s: float
    membership_refresh_s: float


def timing(*, heartbeat_timeout_s: float, timeout_s: float, heartbeat_s: float = 0.5) -> Timing:
    """Derive every period, lease, backstop and poll from the settings.

    Args:
        heartbeat_timeout_s: the sender's: a receiver silent this long is gone. A receiver
            learns it from the sender's record (0 until then: the derived beats fall back to
            ``heartbeat_s``).
        timeout_s: the sender's bound on every wait for a receiver (a receiver's own on its
            side; on a relay host the sender's, which bounds every hop).
        heartbeat_s: a receiver's own heartbeat period (the sender side has none).

    Beats and liveness checks (``hbt`` is ``heartbeat_timeout_s``):

    - ``beat_s = heartbeat_s``: a receiver bumps ``member/<rid>/hb`` this often.
    - ``hosted_beat_s = max(heartbeat_s, hbt / 4)``: on a relay host (the host-mates judge
      their leader by its board, the leader writes its host's beats): four beats per
      ``hbt``, never faster than the receiver's own.
    - ``mates_flush_s = hbt / 4``: the leader passes its host-mates' notes (beats,
      acknowledgements) to the store at most this often (a new acknowledgement sooner).
    - ``board_beat_s = max(0.05, hbt / 8)``: the leader touches its board this often; its
      age is the leader's heartbeat on the host (eight per ``hbt``).
    - ``leader_check_s = max(0.05, hbt / 8)``: a host-mate reads its leader's gone key and
      heartbeat on the store this often (every receiver of every host runs this loop).
    - ``member_check_s = min(1, hbt / 4)``: the sender reads its receivers' heartbeats.
    - ``store_lost_retry_s = min(1, heartbeat_s)``: a receiver whose store stopped
      answering tries again this often.

    Leases: ``pin_lease_s = min(timeout_s, hbt, 5)``, the sender's ring (and a sharded
    rank's): a same-host reader that makes no progress this long no longer holds its slot.
    ``host_ring_lease_s = min(timeout_s, hbt)``: a relay leader's host ring, read by its
    host-mates only (no 5 s cap). ``pin_renew_s = 0.05``:
    a lent slot's pin is renewed this often, far inside either lease (at least a quarter of it
    for any ``timeout_s`` >= 0.2 s).

    Backstops: ``backstop_s = 5`` (a receiver reads every record, news or not);
    ``hosted_backstop_s = 120`` (the same on a relay host: the board carries the sender
    pointer, the close and ``latest``); ``lead_backstop_s = 60`` (a relay leader's watcher,
    woken by its bell and each version); ``leader_record_backstop_s = max(120, hbt)`` (a
    host-mate reads its leader's record from the store while the host says it is live);
    ``bell_backstop_s = 30`` (a leader's bell rings itself) and ``bell_wait_s = 60`` (one
    wait's bound); ``gone_backstop_s = 120`` (the sender reads each receiver's gone key;
    ``members/gone`` says when else); ``follow_all_s = 30`` (a send plane reads every live
    receiver's link number; ``links/asked`` says when else); ``relay_linger_s = timeout_s +
    hbt``: the sender deletes what dead leaders and replaced chains left after this long.

    Polls: ``fleet_poll_s = 0.002`` / ``fleet_idle_poll_s = 0.02`` (a fleet's thread, with
    and without an open round); ``wait_poll_s = 0.05`` (``update()``'s waits look again, in
    memory); a receiver's watcher reads ``news`` every ``idle_poll_s = 0.1`` following a
    sender, ``verify_poll_s = 0.005`` with verify, ``seek_poll_s = 0.05`` before it follows
    one, ``relay_poll_s = 1`` as a relay host-mate, or as a leader whose sender left;
    ``membership_refresh_s = 0.05``: the sender's membership is read again at most this
    often.
    """
    hbt = heartbeat_timeout_s
    return Timing(
        heartbeat_s=heartbeat_s, heartbeat_timeout_s=hbt, timeout_s=timeout_s,
        beat_s=heartbeat_s, hosted_beat_s=max(heartbeat_s, hbt / 4), mates_flush_s=hbt / 4,
        board_beat_s=max(_POLL_FLOOR_S, hbt / 8), leader_check_s=max(_POLL_FLOOR_S, hbt / 8),
        member_check_s=min(1.0, hbt / 4), store_lost_retry_s=min(1.0, heartbeat_s),
        pin_lease_s=min(timeout_s, hbt, _PIN_LEASE_MAX_S), host_ring_lease_s=min(timeout_s, hbt), pin_renew_s=0.05,
        backstop_s=5.0, hosted_backstop_s=120.0, lead_backstop_s=60.0, leader_record_backstop_s=max(120.0, hbt),
        bell_backstop_s=30.0, bell_wait_s=60.0, gone_backstop_s=120.0, follow_all_s=30.0,
        relay_linger_s=timeout_s + hbt, fleet_poll_s=0.002, fleet_idle_poll_s=0.02, wait_poll_s=0.05,
        idle_poll_s=0.1, verify_poll_s=0.005, seek_poll_s=0.05, relay_poll_s=1.0, membership_refresh_s=0.05,
    )  # fmt: skip
