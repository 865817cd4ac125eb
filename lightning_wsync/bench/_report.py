"""Turning the measurements into medians, ratios, target checks, JSON and a table."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from lightning_wsync.bench._bounds import BoundSamples
from lightning_wsync.bench._push import PushPhase

# (key, description, limit, higher_is_better); the project's goals (stated for 1 GiB, N=4).
# With a cast (--dtype) the snapshot must read the float32 bytes, so the stall and the
# latency are held to bounds that include the same cast (gather, shm_cast), and the
# latency must shrink with the bytes: at most 1.15x the byte ratio of the float32 push.
_LATENCY_SLACK = 1.15
_TARGETS: tuple[tuple[str, str, float, bool], ...] = (
    ("latency_to_shm_bound", "push latency / shared-memory bound", _LATENCY_SLACK, False),
    ("latency_to_shm_cast_bound", "push latency / shared-memory bound with the cast", _LATENCY_SLACK, False),
    ("latency_to_fp32", "push latency / the same push without the cast", _LATENCY_SLACK, False),  # x bytes ratio
    ("stall_to_memcpy", "trainer stall / one memcpy", 1.2, False),
    ("stall_to_gather", "trainer stall / the cast gathered into one buffer", 1.2, False),
    ("sender_memory_to_pushed", "sender peak extra memory / pushed bytes (two snapshot slots)", 2.0, False),
    # A receiver maps the sender's shared ring (counted once, at the sender): its own cost is the rest.
    ("receiver_memory_to_model", "receiver peak extra memory, shared ring aside / model (worst)", 1.0, False),
    ("gloo_throughput_to_tcp", "gloo throughput / loopback TCP", 0.8, True),
)
# Memory goals are about buffer copies; a process's fixed overhead (store connections,
# thread stacks: a few MiB) is allowed on top of 1x the model, and shown as such.
MEMORY_ALLOWANCE_BYTES = 32 * 2**20
_SHM_TRANSPORTS = ("auto", "shm")


def median(values: list[float]) -> float | None:
    """The median, or None for no values."""
    return statistics.median(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


@dataclass(frozen=True)
class Summary:
    """Medians of the timed pushes and bounds, their ratios, the goals checked, and correctness."""

    medians: dict[str, float | None]
    ratios: dict[str, float | None]
    targets: list[dict[str, object]]
    ok: bool
    problems: list[str]


def summarize(
    phase: PushPhase, bounds: BoundSamples, *, transport: str, n_receivers: int, model_bytes: int,
    reference: PushPhase | None = None,
) -> Summary:
    """``reference``: the same pushes without the cast, when the measured ones cast."""
    timed = [s for s in phase.samples if not s.warmup]
    ref_timed = [] if reference is None else [s for s in reference.samples if not s.warmup]
    casts = reference is not None
    report_latencies = [s.report_latency_s for s in timed if s.report_latency_s is not None]
    medians: dict[str, float | None] = {
        "stall_s": median([s.stall_s for s in timed]),
        "core_stall_s": median([s.core_stall_s for s in timed]),
        "latency_s": median([s.latency_s for s in timed]),
        "report_latency_s": median(report_latencies),
        **{k: median(v) for k, v in bounds.to_json().items()},
        "fp32_stall_s": median([s.stall_s for s in ref_timed]),
        "fp32_latency_s": median([s.latency_s for s in ref_timed]),
    }
    nbytes = phase.pushed_bytes
    worst_receiver = max((max(0, m.peak_rss - m.shmem) for m in phase.receiver_memory.values()), default=None)
    ratios: dict[str, float | None] = {
        "stall_to_memcpy": _ratio(medians["stall_s"], medians["memcpy_s"]),
        "stall_to_gather": _ratio(medians["stall_s"], medians["gather_s"]),
        "latency_to_shm_bound": _ratio(medians["latency_s"], medians["shm_s"]),
        "latency_to_shm_cast_bound": _ratio(medians["latency_s"], medians["shm_cast_s"]),
        "latency_to_fp32": _ratio(medians["latency_s"], medians["fp32_latency_s"]),
        "stall_to_fp32": _ratio(medians["stall_s"], medians["fp32_stall_s"]),
        "bytes_to_fp32": None if reference is None else _ratio(float(nbytes), float(reference.pushed_bytes)),
        "latency_to_tcp_bound": _ratio(medians["latency_s"], medians["tcp_s"]),
        "gloo_throughput_to_tcp": _ratio(medians["tcp_s"], medians["latency_s"]),
        "sender_memory_to_pushed": None
        if phase.sender_memory is None
        else _ratio(float(phase.sender_memory.peak_rss), float(nbytes)),
        "receiver_memory_to_model": None
        if worst_receiver is None
        else _ratio(float(worst_receiver), float(model_bytes)),
        "pushed_gbps": _ratio(n_receivers * nbytes / 1e9, medians["latency_s"]),
        "tcp_gbps_per_pair": _ratio(n_receivers * nbytes / 1e9, medians["tcp_s"]),
    }
    relevant = {
        "latency_to_shm_bound": transport in _SHM_TRANSPORTS and not casts,
        "latency_to_shm_cast_bound": transport in _SHM_TRANSPORTS and casts,
        "latency_to_fp32": casts,
        "stall_to_memcpy": not casts,
        "stall_to_gather": casts,
        "gloo_throughput_to_tcp": transport == "gloo",
    }
    targets = _targets(ratios, relevant, nbytes=nbytes, model_bytes=model_bytes)
    problems = _problems(phase, reference, n_receivers)
    return Summary(medians=medians, ratios=ratios, targets=targets, ok=not problems, problems=problems)


def _targets(
    ratios: dict[str, float | None], relevant: dict[str, bool], *, nbytes: int, model_bytes: int
) -> list[dict[str, object]]:
    """The project's goals that apply to this run, each with its value, limit and verdict."""
    targets: list[dict[str, object]] = []
    for key, what, limit, higher in _TARGETS:
        value = ratios[key]
        if value is None or not relevant.get(key, True):
            continue
        if key == "latency_to_fp32":
            bytes_ratio = ratios["bytes_to_fp32"]
            assert bytes_ratio is not None
            limit *= bytes_ratio
        allowance = 0.0
        if key.endswith("memory_to_model") or key.endswith("memory_to_pushed"):
            allowance = MEMORY_ALLOWANCE_BYTES / (model_bytes if key.endswith("model") else nbytes)
        targets.append({"name": key, "what": what, "value": value, "limit": limit, "allowance": allowance,
                        "met": value >= limit if higher else value <= limit + allowance})  # fmt: skip
    return targets


def _problems(phase: PushPhase, reference: PushPhase | None, n_receivers: int) -> list[str]:
    """Every push that failed, missed a receiver or was not applied bit-exact."""
    problems: list[str] = []
    for label, samples in (("", phase.samples), ("float32 ", [] if reference is None else reference.samples)):
        for s in samples:
            what = f"{label}version {s.version}"
            if s.failed:
                problems.append(f"{what}: failed {s.failed}")
            if len(s.delivered) != n_receivers:
                problems.append(f"{what}: delivered to {sorted(s.delivered)}, expected {n_receivers}")
            if not s.digest_ok:
                problems.append(f"{what}: applied {s.applied} or digests differ from the sender's")
    return problems


def format_table(result: dict[str, object]) -> str:
    """The human-readable report of :func:`lightning_wsync.bench.run`'s result."""
    cfg = _d(result["config"])
    model = _d(result["model"])
    med = _d(result["medians"])
    mem = _d(result["memory"])
    n = int(_f(cfg["receivers"]))
    pushed = int(_f(model["pushed_bytes"]))
    model_mib = _mib(int(_f(model["fp32_bytes"])))
    lines = [
        (
            f"lightning-wsync bench: {_mib(pushed)} pushed ({model['tensors']} tensors, fp32 model {model_mib}), "
            f"{n} receiver(s), transport={cfg['transport']}, dtype={cfg['dtype'] or 'as is'}, "
            f"{cfg['pushes']} timed pushes after 2 warm-ups, bounds {cfg['bounds_schedule']}"
            + (f", uncast pushes {cfg['uncast_schedule']}" if cfg.get("uncast_schedule") else "")
            + "; medians"
        ),
        "",
        f"{'what':<48} {'seconds':>9} {'GB/s':>8}",
        f"{'-' * 48} {'-' * 9} {'-' * 8}",
    ]
    rows = [
        ("trainer stall (push() blocks the caller)", "stall_s", pushed),
        ("push latency (push() -> applied everywhere)", "latency_s", n * pushed),
        ("  core's own view (PushReport.latency_s)", "report_latency_s", n * pushed),
        ("bound: one memcpy, 1 thread", "memcpy_s", pushed),
        ("bound: one memcpy, 2 threads", "memcpy_2t_s", pushed),
        ("bound: per-tensor gather into one buffer", "gather_s", pushed),
        (f"bound: shared memory, write + {n} parallel copies", "shm_s", n * pushed),
        ("  of which the write", "shm_write_s", pushed),
        ("bound: the same with the cast as the write", "shm_cast_s", n * pushed),
        (f"bound: loopback TCP, to {n} worker(s) in turn", "tcp_s", n * pushed),
    ]
    if cfg["dtype"]:
        fp32 = int(_f(model["fp32_pushed_bytes"]))
        rows += [
            ("float32 push (no cast): stall", "fp32_stall_s", fp32),
            ("float32 push (no cast): latency", "fp32_latency_s", n * fp32),
        ]
    for label, key, moved in rows:
        value = med.get(key)
        if isinstance(value, (int, float)):
            lines.append(f"{label:<48} {value:>9.4f} {moved / value / 1e9 if value > 0 else 0:>8.2f}")
    lines += _ratio_lines(result)
    lines += _memory_lines(mem, model_mib) + _compare_lines(result) + [_correctness_line(result)]
    return "\n".join(lines)


def _ratio_lines(result: dict[str, object]) -> list[str]:
    """The ratios shown for this run's configuration, with their targets."""
    cfg = _d(result["config"])
    rat = _d(result["ratios"])
    lines = ["", f"{'ratio':<40} {'value':>9} {'target':>16}", f"{'-' * 40} {'-' * 9} {'-' * 16}"]
    targets = {str(_d(t)["name"]): _d(t) for t in _l(result["targets"])}
    shown = ["stall_to_memcpy", "stall_to_gather", "latency_to_shm_bound", "sender_memory_to_pushed",
             "receiver_memory_to_model"]  # fmt: skip
    if cfg["dtype"]:
        shown[3:3] = ["latency_to_shm_cast_bound", "bytes_to_fp32", "latency_to_fp32", "stall_to_fp32"]
    if cfg["transport"] == "gloo":
        shown.insert(3, "gloo_throughput_to_tcp")
    for key in shown:
        value = rat.get(key)
        if not isinstance(value, (int, float)):
            continue
        target = targets.get(key)
        mark = ""
        if target is not None:
            op = ">=" if key == "gloo_throughput_to_tcp" else "<="
            extra = "+32M" if "memory_to" in key else ""
            mark = f"{op}{_f(target['limit']):.3g}{extra} {'ok' if target['met'] else 'MISS'}"
        lines.append(f"{key:<40} {value:>9.3f} {mark:>16}")
    return lines


def _memory_lines(mem: dict[str, object], model_mib: str) -> list[str]:
    lines = ["", f"memory growth (MiB; model {model_mib}): peak resident / private (anon) / shared mapped"]
    sender = _d(mem["sender"])
    lines.append(f"  sender     {_mem(sender)}")
    for name, m in sorted(_d(mem["receivers"]).items()):
        lines.append(f"  {name:<10} {_mem(_d(m))}")
    return lines


def _compare_lines(result: dict[str, object]) -> list[str]:
    lines: list[str] = []
    compare = _d(result.get("compare") or {})
    for name, entry in compare.items():
        e = _d(entry)
        if "skipped" in e:
            lines.append(f"\ncompare {name}: {e['skipped']}")
        else:
            lines.append(
                f"\ncompare {name}: stall {_f(e['stall_s']):.4f} s, latency {_f(e['latency_s']):.4f} s "
                f"(wsync latency / {name}: {_f(e['wsync_latency_ratio']):.3f})"
            )
    return lines


def _correctness_line(result: dict[str, object]) -> str:
    pushes = _l(result["pushes"])
    reference = _l(result.get("fp32_pushes") or [])
    all_ok = bool(result["ok"])
    return (
        f"\ncorrectness: {len(pushes)} pushes{f' (+{len(reference)} without the cast)' if reference else ''}, "
        + (
            "every one applied bit-exact by every receiver"
            if all_ok
            else "PROBLEMS: " + "; ".join(map(str, _l(result["problems"])))
        )
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _mem(m: dict[str, object]) -> str:
    return " / ".join(f"{_f(m[k]) / 2**20:8.1f}" for k in ("peak_rss_bytes", "anon_bytes", "shmem_bytes"))


def _d(x: object) -> dict[str, object]:
    assert isinstance(x, dict)
    return x


def _l(x: object) -> list[object]:
    assert isinstance(x, list)
    return x


def _f(x: object) -> float:
    assert isinstance(x, (int, float))
    return float(x)
