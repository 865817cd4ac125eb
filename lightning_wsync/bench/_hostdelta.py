"""``lightning-wsync bench --hosts H --delta``: full versions against deltas through the relay.

::

    lightning-wsync bench --hosts 2 --receivers-per-host 1 --link 700mbit --delta --dtype bfloat16 --lr 1e-6
    lightning-wsync bench --hosts 8 --receivers-per-host 1 --delta --dtype bfloat16 --topology tree --topology chain

Per ``--topology`` (``cross_host``; default ``relay``, the model's pick), the same AdamW
versions (``_steps``; GPT-2-sized unless ``--size-mb`` is given) are pushed,
alternating, by two relay senders on the same simulated hosts and shaped links: one with
``delta="off"``, one with ``delta=--delta-mode``. Per push: the latency (``push()`` until
every receiver applied it), the bytes each hop carried into its host (the host's ``eth0``
received bytes, control traffic included), the trainer's egress, the push report's delta
figures, and whether every receiver holds the version bit-exact (digests).
"""

from __future__ import annotations

import argparse
import statistics

from lightning_wsync.bench._delta import delta_spec, keep_weights
from lightning_wsync.bench._push import PushRun
from lightning_wsync.bench._receivers import Placement
from lightning_wsync.testing.hosts import SimHosts
from lightning_wsync.testing.models import ModelSpec
from lightning_wsync.testing.steps import Trainer

MIB = 2**20


def _pushed(run: PushRun, hosts: SimHosts, version: int, *, warmup: bool = False) -> dict[str, object]:
    """Push ``version`` through ``run``; the sample with the trainer's egress and each hop's bytes."""
    before = [hosts.counters(i) for i in range(hosts.n)]
    sample = run.push(version, warmup=warmup)
    after = [hosts.counters(i) for i in range(hosts.n)]
    return {
        "latency_s": sample.latency_s, "egress_bytes": after[0][0] - before[0][0],
        "hop_bytes": [a[1] - b[1] for a, b in zip(after[1:], before[1:])],  # into host 1, 2, ...: one hop each
        "delta_receivers": sorted(sample.delta_receivers), "delta_bytes": sample.delta_bytes,
        "delta_changed_share": sample.delta_changed_share, "delta_encode_s": sample.delta_encode_s,
        "delta_decode_s": sample.delta_decode_s, "bit_exact": sample.digest_ok and not sample.failed,
        "failed": sample.failed,
    }  # fmt: skip


def measure(args: argparse.Namespace, hosts: SimHosts, placement: list[Placement]) -> dict[str, object]:
    """Per ``--topology`` (default: relay, as the model picks), one warm-up push each (receivers
    hold nothing yet: full), then ``--pushes`` AdamW versions each. The first topology's figures
    are also the result's top level (``pushes``, ``medians``), as with one topology."""
    spec = delta_spec(args.size_mb)
    topologies: dict[str, dict[str, object]] = {}
    full_bytes = 0
    for topology in args.topology or ["relay"]:
        trainer = Trainer(spec, lr=args.lr, seed=args.seed)  # each topology gets the same versions
        full_bytes, topologies[topology] = _measure_topology(args, hosts, placement, trainer, spec, topology)
    first = next(iter(topologies.values()))
    return {"model": {"parameters": spec.numel, "full_bytes": full_bytes, "d_model": spec.d_model,
                      "vocab": spec.vocab, "layers": spec.n_layers},
            **first, "topologies": topologies, "ok": all(bool(t["ok"]) for t in topologies.values())}  # fmt: skip


def _measure_topology(
    args: argparse.Namespace, hosts: SimHosts, placement: list[Placement], trainer: Trainer, spec: ModelSpec,
    topology: str,
) -> tuple[int, dict[str, object]]:  # fmt: skip
    common = {"n_receivers": len(placement), "transport": "auto", "dtype": args.dtype, "bucket_mb": args.bucket_mb,
              "timeout_s": args.timeout_s, "store_host": hosts.address(0), "placement": placement,
              "cross_host": topology, "change": keep_weights}  # fmt: skip
    full = PushRun(trainer.model, spec, sender_options={"delta": "off"}, **common)
    delta = PushRun(trainer.model, spec, sender_options={"delta": args.delta_mode}, **common)
    rows: list[dict[str, object]] = []
    with full, delta:
        assert full.phase is not None
        full_bytes = full.phase.pushed_bytes
        _pushed(full, hosts, 1, warmup=True)
        _pushed(delta, hosts, 1, warmup=True)
        for version in range(2, args.pushes + 2):
            trainer.step()
            got = {}
            for name, run in (("full", full), ("delta", delta)) if version % 2 else (("delta", delta), ("full", full)):
                got[name] = _pushed(run, hosts, version)
            rows.append({"version": version, **got})
    return full_bytes, summarize(rows)


def _median(rows: list[dict[str, object]], mode: str, field: str) -> float:
    return statistics.median(float(r[mode][field]) for r in rows)  # type: ignore[index]


def summarize(rows: list[dict[str, object]]) -> dict[str, object]:
    """Medians over the paired pushes: latency, egress and bytes per hop of each, and the latency ratio."""
    medians: dict[str, float] = {}
    for mode in ("full", "delta"):
        medians[f"{mode}_latency_s"] = _median(rows, mode, "latency_s")
        medians[f"{mode}_egress_bytes"] = _median(rows, mode, "egress_bytes")
        medians[f"{mode}_hop_bytes"] = statistics.median(
            b for r in rows for b in r[mode]["hop_bytes"]  # type: ignore[index]
        )
    medians["latency_ratio"] = medians["full_latency_s"] / medians["delta_latency_s"]
    medians["hop_bytes_share"] = medians["delta_hop_bytes"] / medians["full_hop_bytes"]
    ok = all(r[mode]["bit_exact"] for r in rows for mode in ("full", "delta"))  # type: ignore[index]
    return {"pushes": rows, "medians": medians, "ok": ok}


def format_table(result: dict[str, object]) -> str:
    """The human-readable tables of ``bench --hosts --delta``'s result, one per topology."""
    cfg, model, topologies = result["config"], result["model"], result["topologies"]
    assert isinstance(cfg, dict) and isinstance(model, dict) and isinstance(topologies, dict)
    lines = [
        (f"lightning-wsync bench across hosts, deltas through the relay: {cfg['hosts']} rollout hosts x "
         f"{cfg['receivers_per_host']} receivers, links {cfg['link']} (tc tbf), {model['parameters'] / 1e6:.1f}M "
         f"parameters, AdamW lr {cfg['lr']:g}, wire dtype {cfg['dtype'] or 'float32'}, full push "
         f"{model['full_bytes'] / MIB:.1f} MiB, delta={cfg['delta_mode']!r} against delta='off'"),
    ]
    for topology, one in topologies.items():
        lines += ["", f"cross_host={topology!r}:", *_topology_table(one)]
    return "\n".join(lines)


def _topology_table(result: dict[str, object]) -> list[str]:
    med, rows = result["medians"], result["pushes"]
    assert isinstance(med, dict) and isinstance(rows, list)
    lines = [
        "| version | full s | delta s | full / delta | sent as | delta MiB | full hop MiB | delta hop MiB "
        "| full egress MiB | delta egress MiB | bit-exact |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        f, d = r["full"], r["delta"]
        hops = "/".join(f"{b / MIB:.2f}" for b in d["hop_bytes"])
        full_hops = "/".join(f"{b / MIB:.1f}" for b in f["hop_bytes"])
        sent = "-" if d["delta_bytes"] is None else f"{d['delta_bytes'] / MIB:.2f}"
        lines.append(
            f"| {r['version']} | {f['latency_s']:.3f} | {d['latency_s']:.3f} | {f['latency_s'] / d['latency_s']:.2f} | "
            f"{'delta' if d['delta_receivers'] else 'full'} | "
            f"{sent} | {full_hops} | {hops} | "
            f"{f['egress_bytes'] / MIB:.1f} | {d['egress_bytes'] / MIB:.2f} | "
            f"{'yes' if f['bit_exact'] and d['bit_exact'] else 'NO'} |"
        )
    lines += [
        "",
        (f"medians: full push {med['full_latency_s']:.3f} s, delta push {med['delta_latency_s']:.3f} s: "
         f"{med['latency_ratio']:.2f}x lower latency; bytes per hop {med['full_hop_bytes'] / MIB:.1f} MiB full, "
         f"{med['delta_hop_bytes'] / MIB:.2f} MiB delta ({med['hop_bytes_share']:.2%}); trainer egress "
         f"{med['full_egress_bytes'] / MIB:.1f} MiB full, {med['delta_egress_bytes'] / MIB:.2f} MiB delta"),
    ]
    return lines
