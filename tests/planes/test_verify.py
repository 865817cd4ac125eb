"""The one message format and the one trailer check every hop uses (direct links and relay hops)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_wsync._control.manifest import build_manifest, checksum
from lightning_wsync._control.store import Control
from lightning_wsync._planes.wire import DELTA, FULL, Arrival, Header, pieces, signed_trailer, to_int64, verify


def _setup():
    layout = build_manifest({k: torch.zeros(1000) for k in "abc"}, None, 4096)
    buffer = torch.arange(layout.total_bytes, dtype=torch.int64).to(torch.uint8)
    sums = [checksum(buffer, a, b) for a, b in layout.buckets]
    return layout, [to_int64(s) for s in sums], sums


def _trailer(ctl: Control, sums: list[int] | None, *, intact: bool = True, seq: int = 6) -> list[int]:
    return signed_trailer(ctl, 2, 5, 9, seq, sums, intact=intact, buckets=3).tolist()


def test_header_round_trips_and_refuses_what_does_not_fit_the_layout():
    header = Header(9, 6, 12000, 3, DELTA)
    assert Header.unpack(header.tensor()) == header
    header.check(12000, 7, 3)
    Header(9, 6, 12000, 7, FULL).check(12000, 7, 3)
    for bad in (Header(9, 6, 12001, 3, DELTA), Header(9, 6, 12000, 3, FULL), Header(9, 6, 12000, 7, 2)):
        with pytest.raises(RuntimeError, match=r"version 9: layout mismatch .* expected 12000 bytes, 7 pieces"):
            bad.check(12000, 7, 3)


def test_pieces_cover_every_bucket_once_in_order():
    assert pieces([(0, 5), (5, 12)], 4) == [(0, 4, 0), (4, 5, 0), (5, 9, 1), (9, 12, 1)]


@pytest.mark.parametrize("secret", [None, b"k"])
def test_verify_checks_sequence_then_signature_then_delta_then_checksums(secret):
    layout, words, sums = _setup()
    assert len(layout.buckets) == 3
    ctl = Control(dist.HashStore(), "j", secret)

    def run(trailer: list[int], got_sums: list[int] | None = words, error: str | None = None, where: str = ""):
        return verify(ctl, layout, epoch=2, rid=5, got=Arrival(9, 6, trailer, got_sums, error), where=where)

    good = _trailer(ctl, sums)
    assert run(good) == (True, None, sums)
    assert run(good, None) == (True, None, None)  # a CUDA buffer: nothing to hash here
    # overwritten during its send: dropped without a rejection, whatever else is wrong
    assert run(_trailer(ctl, sums, intact=False), error="bad") == (False, None, None)
    assert run(_trailer(ctl, None)) == (False, None, None)
    if secret is not None:
        forged = _trailer(Control(dist.HashStore(), "j", b"other"), sums)
        assert run(forged, error="bad", where=" on the relay") == (
            False, "trailer not signed with this job's secret on the relay (secret= / WSYNC_SECRET)", None)
    assert run(good, error="base 3 not held") == (
        False, "delta not applied (base 3 not held); the next version comes in full", None)
    flipped = words[:1] + [words[1] ^ 1] + words[2:]
    verdict = run(good, flipped, where=" on the relay")
    assert not verdict.accepted and verdict.reason is not None
    a, b = layout.buckets[1]
    assert verdict.reason == f"checksum mismatch on the relay in 1 bucket(s), first bytes [{a}, {b})"
    with pytest.raises(RuntimeError, match="a trailer of 3 words"):
        run(good[:3])
