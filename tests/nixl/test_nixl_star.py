"""transport='nixl' through real processes: receivers on other (simulated) hosts READ the ring."""

from __future__ import annotations

import pytest
from _nixl_workers import remote_receiver_main
from _spawn import CTX
from _workers import Inbox, build, collect, digest, mutate

from lightning_wsync import WeightSender
from lightning_wsync._planes.nixl.agent import unusable

pytestmark = [pytest.mark.timeout(240), pytest.mark.skipif(unusable() is not None, reason=f"{unusable()}")]


def start(children, store, job, name, spec, results, **options):
    p = CTX.Process(target=remote_receiver_main, args=(store, job, name, spec, results.queue(name), options),
                    daemon=True)
    p.start()
    children.track(p.pid)
    return p


@pytest.mark.parametrize("transport,cross_host", [("nixl", "star"), ("auto", "star")])
def test_every_version_bit_exact_over_nixl(children, port, transport, cross_host):
    spec = ("mixed", 0)
    model = build(spec)
    results = Inbox(CTX)
    store = f"127.0.0.1:{port}"
    names = {"r0", "r1"}
    with WeightSender(model, store=store, job="nx", transport=transport, cross_host=cross_host,
                      timeout_s=20) as sender:
        procs = [start(children, store, "nx", n, spec, results) for n in sorted(names)]
        collect(results, "ready", names, timeout_s=120)
        for version in range(1, 6):
            mutate(model, version)
            want = digest(model)
            report = sender.push(version).wait(timeout_s=60)
            assert sorted(report.delivered) == sorted(names), report
            got = collect(results, "version", names, timeout_s=60)
            assert {n: (m[2], m[3]) for n, m in got.items()} == {n: (version, want) for n in names}
            assert all(m[5].startswith("NIXL") for m in got.values()), got
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
