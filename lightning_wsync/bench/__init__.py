"""``lightning-wsync bench``: push stall and latency against bounds measured in the same run.

::

    lightning-wsync bench --size-mb 1024 --receivers 4            # table
    lightning-wsync bench --size-mb 64 --transport gloo --json     # machine-readable
    lightning-wsync bench --size-mb 256 --dtype bfloat16 --compare torchrl
    lightning-wsync bench --size-mb 64 --interval-ms 20 --duration-s 10   # pushes at a fixed pace
    lightning-wsync bench --delta --dtype bfloat16 --lr 1e-6   # deltas between AdamW steps
    lightning-wsync bench --trainer-ranks 2 --size-mb 128  # the default (sharded) push vs one rank, DDP and FSDP2
    lightning-wsync bench --gpu --size-mb 1024  # a CUDA module: copy bounds, pushes, a Lightning trainer
    lightning-wsync bench --store-load --store-hosts 4 --receivers-per-host 2  # control-plane requests

The trainer (this process) pushes a transformer-shaped float32 model to receiver processes on
this host: two warm-up pushes (one per snapshot slot), then ``--pushes`` timed ones, each timed
until every receiver has *applied* it. With ``--dtype`` the same pushes also run without the
cast (to a second receiver set, alternating with the cast pushes when memory allows), so the
cast's gain is measured in the same run. The machine's bounds are measured on the same byte
count by separate worker processes (one memcpy, shared memory with N parallel readers, plain
loopback TCP; see ``_bounds``): one round after each timed push, so a shared machine's changing
load reaches pushes and bounds alike, or, when memory is too short to hold both sets of buffers,
half the rounds before the pushes and half after. Every process runs one torch thread. Exit
status: 0 when every push was applied bit-exact by every receiver, 1 otherwise, 2 on bad arguments.

With ``--interval-ms`` the run is different (see ``_interval``): pushes at a fixed pace whether
or not receivers keep up, reporting per receiver the fraction of versions applied and the age held.

Longer than 300 lines: every flag of the bench and its dispatch to each measurement, in one place.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable

import torch

from lightning_wsync.bench import _gpu, _hostbench, _storeload
from lightning_wsync.bench._bounds import BoundBench, BoundSamples
from lightning_wsync.bench._interval import format_interval, run_interval_phase
from lightning_wsync.bench._memory import fits
from lightning_wsync.bench._push import WARMUP_PUSHES, PushPhase, PushRun, run_push_phase
from lightning_wsync.bench._report import format_table, summarize
from lightning_wsync.config import APPLY_MODES, DELTA_MODES, SenderConfig
from lightning_wsync.errors import WeightSyncError
from lightning_wsync.testing.models import ModelSpec, build_model, spec_for_size
from lightning_wsync.testing.probes import pushed_bytes
from lightning_wsync.testing.procs import BenchError, Children, exit_on_sigterm

__all__ = ["add_arguments", "run"]

log = logging.getLogger(__name__)

_COMPARE = ("torchrl",)
_DEFAULT_SIZE_MB = 256.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the ``bench`` subcommand's flags on ``parser``."""
    parser.add_argument("--size-mb", type=float, default=None,
                        help="float32 model size in MiB (default 256; with --delta: GPT-2's 124M parameters)")
    parser.add_argument("--receivers", type=int, default=4, help="receiver processes on this host (default 4)")
    parser.add_argument("--transport", choices=("auto", "shm", "gloo", "nixl"), action="append", default=None,
                        help="sender transport (default auto); with --hosts, give several (gloo, nixl) to measure "
                             "each side by side with its raw hop bound")  # hook: nixl, and several with --hosts
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default=None,
                        help="cast on the wire; receivers hold their module in this dtype")
    parser.add_argument("--bucket-mb", type=float, default=SenderConfig.bucket_mb,
                        help=f"network send and checksum unit in MiB (default {SenderConfig.bucket_mb:g})")
    parser.add_argument("--apply", choices=APPLY_MODES, default="copy",
                        help="receivers' apply mode (WeightReceiver apply=; 'swap' matters on the network path)")
    parser.add_argument("--pushes", type=int, default=5, help="timed pushes after two warm-ups (default 5)")
    parser.add_argument("--compare", choices=_COMPARE, action="append", default=[], help="also run another library")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="bound on every wait (default 120)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model's weights")
    parser.add_argument("--interval-ms", type=float, default=None,
                        help="push every INTERVAL ms for --duration-s instead of one push at a time")
    parser.add_argument("--duration-s", type=float, default=10.0, help="length of an --interval-ms run (default 10)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    _hostbench.add_arguments(parser)
    _storeload.add_arguments(parser)
    parser.add_argument("--trainer-ranks", type=int, default=None,
                        help="a Lightning trainer of this many CPU ranks pushing every step, with sharded=False and "
                             "with the callback's default (sharded), against one rank (see --strategy)")
    parser.add_argument("--strategy", choices=("both", "ddp", "fsdp"), default="both",
                        help="the --trainer-ranks trainer's strategy (fsdp: FSDP2 over every rank; both: DDP, then "
                             "FSDP2, each against a one-rank run of its own; default)")
    parser.add_argument("--profile-threads", action="store_true",
                        help="with --trainer-ranks: each rank samples every thread of the bench's processes at its "
                             "hook's entry and exit (/proc schedstat); reported per configuration: CPU per thread "
                             "while each rank is in its hook, and where the other ranks are meanwhile")
    parser.add_argument("--delta", action="store_true",
                        help="measure deltas between versions made by AdamW steps on a GPT-2-sized model "
                             "(changed share, delta bytes vs full push, encode/decode time); with --hosts: "
                             "full versions against deltas through the relay")
    parser.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate for --delta (default 1e-6)")
    _gpu.add_arguments(parser)
    parser.add_argument("--delta-mode", choices=DELTA_MODES, default="auto",
                        help="with --delta --transport gloo: the delta sender's delta= (the other sends full versions)")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args``; print the report; return the exit status."""
    args.transports = args.transport or ["auto"]  # hook (the NIXL plane): several only with --hosts
    if args.json:  # NIXL prints each agent's start on stdout, here and in every process started from here
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    args.transport = args.transports[-1]
    if len(args.transports) > 1 and args.hosts is None:
        print("lightning-wsync bench: --transport more than once needs --hosts", file=sys.stderr)
        return 2
    if args.size_mb is None and not args.delta:
        args.size_mb = 1.0 if args.store_load else _DEFAULT_SIZE_MB
    try:
        _validate(args)
        if args.hosts is not None:
            _hostbench.validate(args)
        if args.store_load:
            _storeload.validate(args)
    except ValueError as exc:
        print(f"lightning-wsync bench: {exc}", file=sys.stderr)
        return 2
    if args.store_load:
        return _run_store_load(args)
    if args.hosts is not None:
        return _hostbench.run(args)
    if args.gpu:
        return _gpu.run_gpu(args.size_mb, args.pushes, device=args.device, as_json=args.json)
    if args.trainer_ranks is not None:
        from lightning_wsync.bench._ranks import run_ranks

        return run_ranks(args)
    if args.delta:
        from lightning_wsync.bench._delta import run_delta

        return run_delta(args)
    threads = torch.get_num_threads()
    restore_signals = exit_on_sigterm()
    try:
        if args.interval_ms is not None:
            result = run_interval_phase(
                spec_for_size(args.size_mb), n_receivers=args.receivers, transport=args.transport, dtype=args.dtype,
                bucket_mb=args.bucket_mb, apply=args.apply, interval_ms=args.interval_ms,
                duration_s=args.duration_s, timeout_s=args.timeout_s, seed=args.seed,
            )  # fmt: skip
        else:
            result = measure(args)
    except (BenchError, WeightSyncError, OSError) as exc:
        print(f"lightning-wsync bench: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        restore_signals()
        torch.set_num_threads(threads)
    table = format_interval(result) if args.interval_ms is not None else format_table(result)
    print(json.dumps(result, indent=2) if args.json else table)
    return 0 if result["ok"] else 1


def _run_store_load(args: argparse.Namespace) -> int:
    restore_signals = exit_on_sigterm()
    try:
        result = _storeload.run_store_load(args)
    except (BenchError, WeightSyncError, OSError) as exc:
        print(f"lightning-wsync bench: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        restore_signals()
    print(json.dumps(result, indent=2) if args.json else _storeload.format_store_load(result))
    return 0 if result["ok"] else 1


def measure(args: argparse.Namespace) -> dict[str, object]:
    """Run every phase and return the JSON-able result (what ``--json`` prints)."""
    torch.set_num_threads(1)
    spec = spec_for_size(args.size_mb)
    model = build_model(spec, seed=args.seed)
    config = SenderConfig(dtype=args.dtype, bucket_mb=args.bucket_mb)
    tensors = list(model.state_dict().values())
    pushed = pushed_bytes(model, config.wire_dtype, config.bucket_bytes)
    fp32_bytes = pushed_bytes(model, None, config.bucket_bytes)
    # With a cast, the uncast pushes alternate with the cast ones (two receiver sets) when
    # memory allows, so the machine's drift reaches both alike; else they run afterwards.
    alongside = args.dtype is not None and fits(
        spec.nbytes, pushed, args.receivers, args.transport, reference_bytes=fp32_bytes, bounds=False
    )
    reference_bytes = fp32_bytes if alongside else 0
    interleave = fits(spec.nbytes, pushed, args.receivers, args.transport, reference_bytes=reference_bytes)
    schedule = {"bounds_schedule": "interleaved" if interleave else "before-and-after",
                "uncast_schedule": None if args.dtype is None
                else ("alternating" if alongside else "after")}  # fmt: skip
    reference: PushPhase | None = None
    with Children() as children:
        bounds = BoundBench(children, args.receivers, pushed, args.timeout_s)
        try:
            if interleave:
                bounds.allocate(tensors, config.wire_dtype)
                between: Callable[[], None] | None = bounds.round
            else:
                first_half = (args.pushes + 1) // 2
                log.info("not enough free memory to hold the bounds' buffers during the pushes: "
                         "measuring bounds before and after them instead")  # fmt: skip
                bounds.measure(first_half, tensors, config.wire_dtype)
                between = None
            phase, reference = _push_phases(model, spec, args, between=between, alongside=alongside)
            if interleave:
                bounds.release()
            else:
                bounds.measure(args.pushes - first_half, tensors, config.wire_dtype)
        except BaseException:
            bounds.close(graceful=False)
            raise
        bounds.close()
    if args.dtype is not None and reference is None:
        # "A cast halves the bytes and the latency with them": the same pushes uncast, same run.
        reference = run_push_phase(
            model, spec, n_receivers=args.receivers, pushes=args.pushes, transport=args.transport, dtype=None,
            bucket_mb=args.bucket_mb, apply=args.apply, timeout_s=args.timeout_s,
        )  # fmt: skip
    compare: dict[str, object] = {}
    if "torchrl" in args.compare:
        from lightning_wsync.bench._torchrl import compare_torchrl

        compare["torchrl"] = compare_torchrl(model, spec, n_receivers=args.receivers, pushes=args.pushes,
                                             timeout_s=args.timeout_s)  # fmt: skip
    return _result(args, spec, schedule, phase, reference, bounds.samples, compare)


def _result(
    args: argparse.Namespace, spec: ModelSpec, schedule: dict[str, str | None], phase: PushPhase,
    reference: PushPhase | None, bounds: BoundSamples, compare: dict[str, object],
) -> dict[str, object]:
    """The JSON-able result of a run: configuration, samples, medians, ratios against the bounds."""
    summary = summarize(phase, bounds, transport=args.transport, n_receivers=args.receivers,
                        model_bytes=spec.nbytes, reference=reference)  # fmt: skip
    wsync_latency = summary.medians["latency_s"]
    for entry in compare.values():
        if isinstance(entry, dict) and isinstance(entry.get("latency_s"), float) and wsync_latency is not None:
            entry["wsync_latency_ratio"] = wsync_latency / entry["latency_s"]
    assert phase.sender_memory is not None
    return {
        "config": {
            "size_mb": args.size_mb, "receivers": args.receivers, "transport": args.transport,
            "dtype": args.dtype, "bucket_mb": args.bucket_mb, "apply": args.apply, "pushes": args.pushes,
            "torch": torch.__version__, "cpus": os.cpu_count(),
            "threads_per_process": 1, **schedule,
        },
        "model": {"tensors": phase.n_tensors, "fp32_bytes": spec.nbytes, "pushed_bytes": phase.pushed_bytes,
                  "fp32_pushed_bytes": phase.pushed_bytes if reference is None else reference.pushed_bytes,
                  "d_model": spec.d_model, "vocab": spec.vocab, "layers": spec.n_layers},
        "pushes": [s.to_json() for s in phase.samples],
        "fp32_pushes": [] if reference is None else [s.to_json() for s in reference.samples],
        "bounds": bounds.to_json(),
        "medians": summary.medians,
        "ratios": summary.ratios,
        "targets": summary.targets,
        "memory": {
            "sender": phase.sender_memory.to_json(),
            "receivers": {n: m.to_json() for n, m in phase.receiver_memory.items()},
        },
        "compare": compare,
        "ok": summary.ok,
        "problems": summary.problems,
    }  # fmt: skip


def _push_phases(
    model: torch.nn.Module, spec: ModelSpec, args: argparse.Namespace, *, between: Callable[[], None] | None,
    alongside: bool,
) -> tuple[PushPhase, PushPhase | None]:
    """The pushes as asked; with ``alongside``, uncast pushes alternate with the cast ones."""
    common = {"n_receivers": args.receivers, "transport": args.transport, "bucket_mb": args.bucket_mb,
              "apply": args.apply, "timeout_s": args.timeout_s}  # fmt: skip
    if not alongside:
        return run_push_phase(model, spec, pushes=args.pushes, dtype=args.dtype, between=between, **common), None
    cast, uncast = PushRun(model, spec, dtype=args.dtype, **common), PushRun(model, spec, dtype=None, **common)
    with cast:
        for version in range(1, WARMUP_PUSHES + 1):
            cast.push(version, warmup=True)
        cast.freeze_sender_memory()  # before the second sender in this process allocates
        with uncast:
            for version in range(1, WARMUP_PUSHES + 1):
                uncast.push(version, warmup=True)
            for version in range(WARMUP_PUSHES + 1, args.pushes + WARMUP_PUSHES + 1):
                for run in (cast, uncast) if version % 2 else (uncast, cast):
                    run.push(version)
                if between is not None:
                    between()
    assert cast.phase is not None and uncast.phase is not None
    return cast.phase, uncast.phase


def _validate(args: argparse.Namespace) -> None:
    if args.size_mb is not None and not args.size_mb >= 1:
        raise ValueError(f"--size-mb={args.size_mb!r} must be >= 1 (MiB of float32 weights), e.g. --size-mb 256")
    if args.receivers < 1:
        raise ValueError(f"--receivers={args.receivers!r} must be >= 1, e.g. --receivers 4")
    if not args.bucket_mb > 0:
        raise ValueError(f"--bucket-mb={args.bucket_mb!r} must be > 0, e.g. --bucket-mb 32")
    if args.pushes < 1:
        raise ValueError(f"--pushes={args.pushes!r} must be >= 1 (5 or more for stable medians)")
    if not args.lr > 0:
        raise ValueError(f"--lr={args.lr!r} must be > 0, e.g. --lr 1e-6")
    if args.interval_ms is not None and not args.interval_ms >= 0:
        raise ValueError(f"--interval-ms={args.interval_ms!r} must be >= 0 (0: back to back), e.g. --interval-ms 20")
    if not args.duration_s > 0:
        raise ValueError(f"--duration-s={args.duration_s!r} must be > 0, e.g. --duration-s 10")
    if args.trainer_ranks is not None and args.trainer_ranks < 2:
        raise ValueError(f"--trainer-ranks={args.trainer_ranks!r} must be >= 2 (one rank is the baseline it runs)")
    if not args.timeout_s > 0:
        raise ValueError(f"--timeout-s={args.timeout_s!r} must be > 0, e.g. --timeout-s 120")
