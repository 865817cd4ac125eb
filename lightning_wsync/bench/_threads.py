"""``lightning-wsync bench --trainer-ranks W --profile-threads``: which threads of the bench's
processes run while a rank is in its push hook (Linux ``/proc``).

Each rank samples every thread of every bench process (the ranks, the receivers, and the bench
itself, which serves the store) at its hook's entry and exit, outside the timed window: each
thread's CPU time and its time runnable but waiting for a CPU (``/proc/<pid>/task/<tid>/schedstat``),
and the machine's busy time (``/proc/stat``, whoever spent it). The bench sums them per thread over
each rank's hooks (:func:`profile`): who took the cores while a rank copied its share, and where
the other ranks were meanwhile (in their own hook, training, or waiting).
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from typing import Any

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_TOP = 12  # threads listed per rank, the busiest first


class ThreadSampler:
    """Samples the threads of ``pids`` (role -> pid); a thread's schedstat file stays open once seen."""

    def __init__(self, pids: dict[str, int]) -> None:
        self._pids = pids
        self._fds: dict[str, int] = {}  # "role/tid" -> open schedstat
        self.comms: dict[str, str] = {}  # "role/tid" -> the kernel's thread name, when first seen

    def sample(self) -> dict[str, Any]:
        """``{"t_ns": monotonic, "busy_ticks": machine-wide, "threads": {"role/tid": [cpu_ns, wait_ns]}}``."""
        threads: dict[str, list[int]] = {}
        for role, pid in self._pids.items():
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue  # exited
            for tid in tids:
                key = f"{role}/{tid}"
                fd = self._fds.get(key)
                if fd is None:
                    try:
                        fd = self._fds[key] = os.open(f"/proc/{pid}/task/{tid}/schedstat", os.O_RDONLY)
                        with open(f"/proc/{pid}/task/{tid}/comm") as f:
                            self.comms[key] = f.read().strip()
                    except OSError:
                        continue
                try:
                    cpu, wait = os.pread(fd, 128, 0).split()[:2]
                except (OSError, ValueError):
                    os.close(self._fds.pop(key))
                    continue
                threads[key] = [int(cpu), int(wait)]
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        busy = sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)  # all but idle and iowait
        return {"t_ns": time.monotonic_ns(), "busy_ticks": busy, "threads": threads}

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}


def window(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What ran between two samples: each thread's CPU and runqueue wait (ns), the machine's busy ns."""
    threads = {key: [c - before["threads"][key][0], w - before["threads"][key][1]]
               for key, (c, w) in after["threads"].items() if key in before["threads"]}  # fmt: skip
    busy_ns = (after["busy_ticks"] - before["busy_ticks"]) * 1_000_000_000 // _CLK_TCK
    return {"t0_ns": before["t_ns"], "t1_ns": after["t_ns"], "busy_ns": busy_ns,
            "threads": {k: v for k, v in threads.items() if v[0] or v[1]}}  # fmt: skip


def python_names() -> dict[int, str]:
    """This process's Python threads by native id (the kernel's name is the process's for them)."""
    return {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}


def profile(per_rank: list[dict[str, Any]], names: dict[str, str], warmup: int) -> list[dict[str, Any]]:
    """Per rank: over its hooks after ``warmup``, per push: CPU by thread (``role:name``, ms, the busiest
    first), its training thread's runqueue wait, the bench's and the machine's CPU, and for each other rank:
    how long it was in its own hook meanwhile, how much later it entered it, and its training thread's CPU and
    runqueue wait in this window (in its hook, training, or neither: waiting at a collective).

    ``names``: ``"role/tid"`` -> a thread's name (Python's, else the kernel's).
    """
    out = []
    for r, rec in enumerate(per_rank):
        windows = rec["threads"][warmup:]
        n = len(windows) or 1
        by_name: dict[str, float] = {}
        bench_ns = 0
        for w in windows:
            for key, (cpu, _) in w["threads"].items():
                label = f"{key.split('/')[0]}:{names.get(key, key)}"
                by_name[label] = by_name.get(label, 0.0) + cpu / 1e6 / n
                bench_ns += cpu
        me = f"rank{r}/{rec['pid']}"
        others = []
        for o, other in enumerate(per_rank):
            if o == r:
                continue
            overlap, entry_skew, cpu, wait = [], [], [], []
            main = f"rank{o}/{other['pid']}"
            for w, ow in zip(windows, other["threads"][warmup:]):
                overlap.append(max(0, min(w["t1_ns"], ow["t1_ns"]) - max(w["t0_ns"], ow["t0_ns"])) / 1e6)
                entry_skew.append((ow["t0_ns"] - w["t0_ns"]) / 1e6)
                cpu.append(w["threads"].get(main, [0, 0])[0] / 1e6)
                wait.append(w["threads"].get(main, [0, 0])[1] / 1e6)
            # its training thread in this window: CPU beyond its hook's share of the overlap is training
            others.append({"rank": o, "in_its_hook_ms": _med(overlap), "entry_after_ms": _med(entry_skew),
                           "training_thread_cpu_ms": _med(cpu), "training_thread_wait_ms": _med(wait)})  # fmt: skip
        out.append({
            "rank": r,
            "window_ms": _med([(w["t1_ns"] - w["t0_ns"]) / 1e6 for w in windows]),
            "own_cpu_ms": _med([w["threads"].get(me, [0, 0])[0] / 1e6 for w in windows]),
            "own_wait_ms": _med([w["threads"].get(me, [0, 0])[1] / 1e6 for w in windows]),
            "bench_cpu_ms": bench_ns / 1e6 / n,
            "machine_cpu_ms": sum(w["busy_ns"] for w in windows) / 1e6 / n,
            "threads_ms": dict(sorted(by_name.items(), key=lambda kv: -kv[1])[:_TOP]),
            "other_ranks": others,
        })  # fmt: skip
    return out


def _med(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0
