"""Push time on RDMA NICs with one-sided READ hops: a paper model, not a measurement.

``python -m lightning_wsync.bench._rdmamodel`` prints the table in docs/rdma-model.md.

The relay's design carried over to NIXL on a GPU cluster: the trainer publishes each
engine-GPU's share of the model (sharded push), and the hosts holding the same share
(one per engine instance, the same position in each) form the relay's two complementary
binary trees, one pair per GPU "rail", each rail on its own NIC. A host READs every chunk
from its parent's registered ring slot as soon as the parent holds it, so the rails run in
parallel and a chunk pays, at each tree level, its wire time to the two children plus a
fixed per-hop cost ``h``::

    b          = model bytes / GPUs per engine           (one GPU's share)
    R          = NIC line rate x READ efficiency
    levels     = floor(log2(engines))                    (the trees below their roots)
    h          = READ post + completion + ready notice + our software per chunk
    T_full     = t0 + b / R + levels (2 c / R + h) + b / copy      (apply: one device copy)

With deltas the wire carries ``w b`` (``w``: delta bytes over full bytes) but every share
must be encoded once at the trainer and decoded at every host; the stages are pipelined
chunk by chunk, so the slowest of them sets the pace::

    T_delta    = t0 + max(b / encode, w b / R, b / decode) + levels (2 w c / R + h) + b / copy

The inputs are assumptions, each named in :class:`Rdma` with its source: UCX's RDMA READ
costs a few microseconds per message on ConnectX-class NICs and streams large READs at
~90-95% of line rate; ``encode``/``decode`` default to this package's CPU codec as
measured in docs/benchmarks.md (2.0 / 5.3 GB/s per core), times the cores a host gives it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

__all__ = ["PEERS", "Model", "Rdma", "delta_push_s", "full_push_s", "gpu_codec", "levels", "share_bytes"]

GB = 1e9


@dataclass(frozen=True)
class Model:
    """A policy as the engines hold it."""

    name: str
    params: float
    gpus_per_engine: int  # TP (x EP) size of one rollout engine instance
    bytes_per_param: int = 2  # bf16

    @property
    def bytes(self) -> float:
        return self.params * self.bytes_per_param


@dataclass(frozen=True)
class Rdma:
    """The cluster's NICs and the per-chunk costs (assumptions; see the module docstring)."""

    nic_gbit_s: float  # one NIC per GPU, as on 8-GPU H100/H200 hosts
    read_efficiency: float = 0.92  # large RDMA READ goodput over line rate
    read_s: float = 5e-6  # post one READ, poll its completion (UCX: a few microseconds)
    notice_s: float = 10e-6  # the parent's "chunk ready" notification (a NIXL notif / UCX active message)
    software_s: float = 50e-6  # our per-chunk work in Python: a thread wakes, checks the slot's sequence words
    chunk_bytes: float = 64 * 2**20
    fixed_s: float = 0.1  # announce on the store, snapshot into the ring, the last chunk's checks
    copy_gb_s: float = 1300.0  # device-to-device copy of the share into the engine's weights (H100 HBM3)
    encode_gb_s: float = 2.0 * 8  # delta encode: the CPU codec (2.0 GB/s a core) on 8 cores per GPU's share
    decode_gb_s: float = 5.3 * 8  # delta decode, the same

    @property
    def rate(self) -> float:
        """Bytes per second one READ stream moves."""
        return self.nic_gbit_s * 1e9 / 8 * self.read_efficiency

    @property
    def hop_s(self) -> float:
        return self.read_s + self.notice_s + self.software_s


def share_bytes(model: Model) -> float:
    """One engine GPU's share of the model: what each rail carries."""
    return model.bytes / model.gpus_per_engine


def levels(gpus: int, model: Model, gpus_per_host: int = 8) -> int:
    """Tree levels below the roots for the engines that hold one share each."""
    engines = max(1, gpus // max(model.gpus_per_engine, gpus_per_host))
    return int(math.floor(math.log2(engines)))


def full_push_s(model: Model, gpus: int, rdma: Rdma) -> float:
    """Seconds from the push until every engine GPU holds its share, full versions."""
    b = share_bytes(model)
    wire = b / rdma.rate
    per_level = 2 * rdma.chunk_bytes / rdma.rate + rdma.hop_s
    return rdma.fixed_s + wire + levels(gpus, model) * per_level + b / (rdma.copy_gb_s * GB)


def delta_push_s(model: Model, gpus: int, rdma: Rdma, *, wire_fraction: float) -> float:
    """The same with deltas whose bytes are ``wire_fraction`` of the full share."""
    b = share_bytes(model)
    pace = max(b / (rdma.encode_gb_s * GB), wire_fraction * b / rdma.rate, b / (rdma.decode_gb_s * GB))
    per_level = 2 * wire_fraction * rdma.chunk_bytes / rdma.rate + rdma.hop_s
    return rdma.fixed_s + pace + levels(gpus, model) * per_level + b / (rdma.copy_gb_s * GB)


def gpu_codec(rdma: Rdma, gb_s: float = 300.0) -> Rdma:
    """``rdma`` with a delta codec on the GPU (XOR and a GPU compressor; not built here)."""
    return replace(rdma, encode_gb_s=gb_s, decode_gb_s=gb_s)


# Published figures the model is set against (as quoted in issue 30 and docs/benchmarks.md).
PEERS = (
    ("vLLM sharded RDT over NIXL", "Qwen3-235B, 472 GB, 8xH100 -> 8xH100", "3.2-3.3 s"),
    ("Miles P2P on Mooncake", "Kimi K2 1T FP8, end to end", "~7 s"),
    ("Miles P2P on Mooncake", "GLM5 744B", "8.5 s"),
    ("Perplexity", "1T", "1.3 s"),
    ("checkpoint-engine", "1T across thousands of GPUs", "~20 s"),
)
