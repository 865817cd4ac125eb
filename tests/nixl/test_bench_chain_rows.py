"""`bench --hosts --transport gloo --transport nixl --topology chain`: every transport and topology
measured in turn, alternating round after round, each row the medians with every round's figure
(no processes: the phases are stand-ins, the values what the bench makes of them)."""

from __future__ import annotations

import argparse

import pytest

from lightning_wsync.bench import _hostbench


def _args(**over: object) -> argparse.Namespace:
    args = argparse.Namespace(hosts=4, receivers_per_host=1, link="10gbit", topology=["chain"], rounds=3,
                              transports=["gloo", "nixl"], no_reference=False, size_mb=1.0, seed=0, timeout_s=5.0,
                              dtype=None, bucket_mb=1.0, pushes=1, delta=False, json=False)  # fmt: skip
    vars(args).update(over)
    return args


def test_chain_rows_alternate_and_carry_the_spread(monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[tuple[str, str, int]] = []
    latency = {"gloo": iter([3.0, 1.0, 2.0]), "nixl": iter([0.5, 0.7, 0.6])}

    def phase(model, spec, hosts, args, rate, *, n_hosts, topology, transport="auto"):  # type: ignore[no-untyped-def]
        order.append((transport, topology, n_hosts))
        value = 9.0 if n_hosts == 1 else next(latency[transport])
        return {"transport": transport, "topology": topology, "hosts": n_hosts, "receivers": n_hosts,
                "pushed_bytes": 1 << 20, "latency_s": value, "wire_bound_s": 0.5, "latency_vs_wire_bound": 0.0,
                "cpu_s_per_gb_per_hop": value * 10, "egress_models_per_push": 1.0, "per_hop_overhead_s": 0.0,
                "ok": True}  # fmt: skip

    def raw(hosts, transport, nbytes, reps, timeout_s):  # type: ignore[no-untyped-def]
        assert nbytes == 1 << 20
        return {"transport": transport, "bytes": nbytes, "latency_s": 0.1, "cpu_s_per_gb": 2.0}

    monkeypatch.setattr(_hostbench, "_phase", phase)
    monkeypatch.setattr(_hostbench, "raw_hop", raw)
    monkeypatch.setenv("UCX_TLS", "")  # the bench sets both for NIXL: restored after the test
    monkeypatch.setenv("NIXL_LOG_LEVEL", "WARN")
    result = _hostbench._measure_transports(_args(), object(), 1e10, {})  # type: ignore[arg-type]
    # Alternating: the one-host references first in round one, then gloo and nixl in turn each round.
    assert order == [("gloo", "chain", 1), ("gloo", "chain", 4), ("nixl", "chain", 1), ("nixl", "chain", 4),
                     *[(t, "chain", 4) for t in ("gloo", "nixl")] * 2]  # fmt: skip
    phases = result["phases"]
    assert isinstance(phases, dict) and result["ok"] is True
    assert list(phases) == ["one_host/gloo/chain", "one_host/nixl/chain", "gloo/chain", "nixl/chain"]
    nixl = phases["nixl/chain"]
    assert nixl["transport"] == "nixl" and nixl["topology"] == "chain" and nixl["hosts"] == 4
    assert nixl["latency_s"] == 0.6 and nixl["latency_s_rounds"] == [0.5, 0.7, 0.6]
    assert nixl["cpu_s_per_gb_per_hop"] == pytest.approx(6.0)
    assert nixl["cpu_s_per_gb_per_hop_rounds"] == pytest.approx([5.0, 7.0, 6.0])
    assert nixl["cpu_vs_raw"] == pytest.approx(3.0) and nixl["raw_hop"]["transport"] == "nixl"
    assert nixl["latency_vs_one_host"] == pytest.approx(0.6 / 9.0)
    assert nixl["latency_vs_wire_bound"] == pytest.approx(1.2)
    assert phases["gloo/chain"]["latency_s"] == 2.0 and phases["gloo/chain"]["raw_hop"]["transport"] == "gloo"
    assert result["config"] == {"transports": ["gloo", "nixl"], "topologies": ["chain"], "rounds": 3}
    table = _hostbench.format_table({**result, "config": {**_args().__dict__, "size_mb": 1.0, "cpus": 2}})
    rows = {line.split()[0]: line for line in table.splitlines()[2:] if not line.startswith(" ")}
    assert rows["nixl/chain"].split()[1:4] == ["4", "4", "0.60"] and rows["nixl/chain"].split()[-2:] == ["6.00", "3.00"]
    assert "3 rounds: latency s 0.50 0.70 0.60; CPU s/GB/hop 5.00 7.00 6.00" in table


def test_chain_is_the_relay_over_gloo_and_trees_are_refused() -> None:
    _hostbench.validate(_args(topology=["star", "chain"]))
    with pytest.raises(ValueError, match="--topology \\['tree'\\] with --transport: give star and/or chain"):
        _hostbench.validate(_args(topology=["tree"]))
    with pytest.raises(ValueError, match="--rounds=0 must be >= 1"):
        _hostbench.validate(_args(rounds=0))
