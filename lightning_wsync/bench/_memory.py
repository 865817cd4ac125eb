"""Resident memory of this process from ``/proc/self/status`` (Linux), without psutil.

``VmHWM`` is the peak resident set; writing ``5`` to ``/proc/self/clear_refs`` resets
it to the current size, so a peak can be measured over a window. ``RssAnon`` is private
memory; ``RssShmem`` is shared memory mapped and touched (a ``/dev/shm`` snapshot):
counted in every process that maps it, but present in RAM once.
"""

from __future__ import annotations

from dataclasses import dataclass

_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssShmem")


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
