"""Resident memory of this process from ``/proc/self/status`` (Linux), without psutil.

``VmHWM`` is the peak resident set; writing ``5`` to ``/proc/self/clear_refs`` resets
it to the current size, so a peak can be measured over a window. ``RssAnon`` is private
memory; ``RssShmem`` is shared memory mapped and touched (a ``/dev/shm`` snapshot):
counted in every process that maps it, but present in RAM once.
"""

from __future__ import annotations

from dataclasses import dataclass

_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssShmem")
_PROCESS_BYTES = 300 * 2**20  # a spawned process with torch imported
_HEADROOM_BYTES = 4 * 2**30  # left to the rest of a shared machine


@dataclass(frozen=True)
class MemSample:
    """Bytes resident now (``rss``, ``anon``, ``shmem``) and at the peak (``hwm``)."""

    rss: int
    hwm: int
    anon: int
    shmem: int


@dataclass(frozen=True)
class MemGrowth:
    """Growth over a baseline, in bytes: peak resident, and private/shared at the end."""

    peak_rss: int
    anon: int
    shmem: int

    def to_json(self) -> dict[str, int]:
        return {"peak_rss_bytes": self.peak_rss, "anon_bytes": self.anon, "shmem_bytes": self.shmem}


def sample() -> MemSample:
    """Read this process's memory figures; zeros where ``/proc`` does not have them."""
    values = dict.fromkeys(_FIELDS, 0)
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in values:
                    values[key] = int(rest.split()[0]) * 1024  # reported in kB
    except OSError:
        pass
    return MemSample(rss=values["VmRSS"], hwm=values["VmHWM"], anon=values["RssAnon"], shmem=values["RssShmem"])


def reset_peak() -> MemSample:
    """Reset the peak to the current resident size; returns the sample taken after it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # not Linux, or not permitted: the peak then covers the whole process life
    return sample()


def growth(base: MemSample, now: MemSample | None = None) -> MemGrowth:
    """What grew since ``base`` (taken by :func:`reset_peak`)."""
    now = sample() if now is None else now
    return MemGrowth(
        peak_rss=max(0, now.hwm - base.rss),
        anon=max(0, now.anon - base.anon),
        shmem=max(0, now.shmem - base.shmem),
    )


def fits(
    model_bytes: int, pushed_bytes: int, n: int, transport: str, *, reference_bytes: int = 0, bounds: bool = True
) -> bool:
    """Whether the receivers (and, with ``bounds``, the bounds' buffers) fit in memory at once.

    Interleaving a round of bounds after each push is the fairer schedule on a shared
    machine; it needs, beyond the trainer's model: source, destination and shared
    segment of the bounds, the sender's snapshot, and per receiver its module, the
    bound worker's buffer and (gloo) a staging buffer, plus ~300 MiB per process.
    ``reference_bytes``: a second, uncast sender and receiver set alongside.
    """
    gloo = transport == "gloo"
    per_receiver = model_bytes + (pushed_bytes if gloo else 0) + _PROCESS_BYTES
    need = 2 * pushed_bytes + n * per_receiver + _HEADROOM_BYTES
    if bounds:
        need += 3 * pushed_bytes + n * (pushed_bytes + _PROCESS_BYTES)
    if reference_bytes:
        need += 2 * reference_bytes + n * (model_bytes + (reference_bytes if gloo else 0) + _PROCESS_BYTES)
    return need <= available_bytes()


def available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0  # unknown: take the schedule that needs less
