"""A snapshot ring's slots on the trainer's GPU, shared with same-host GPU receivers by CUDA IPC.

With ``SenderConfig(cuda_ipc=True)`` and the module on a GPU, the ring keeps a *device
mirror*: one allocation of ``slots`` slots on the module's GPU. A push copies the
weights into the claimed slot's mirror (device to device) and from there into the host
slot, both on the ring's copy stream, before the slot is published; the mirror and the
host slot hold the same version under the same sequence word and the same pins. The
mirror's IPC handle is written once, beside the segment's pins (``cuda-ipc``, JSON).

A receiver whose module is on a GPU opens the handle and copies each pinned slot from
the mirror, device to device (or over NVLink/PCIe peer access from another GPU), instead
of from host memory. It falls back to the host slot, saying why once, when the handle
cannot be used: the trainer's GPU is not visible in this process (matched by UUID, so
``CUDA_VISIBLE_DEVICES`` orderings may differ), the two devices have no peer access, or
CUDA refuses the handle. ``verify=True`` checks the host slot's bytes, which were copied
from the mirror under the same claim.
"""

from __future__ import annotations

import base64
import json
import logging
import os

import torch

from lightning_wsync._control.untrusted import Untrusted, load_json, read_file
from lightning_wsync._planes.shm.cuda_host import clear_last_error

log = logging.getLogger(__name__)

_FILE = "cuda-ipc"


def mirror_device(tensors: list[torch.Tensor], owner: str) -> torch.device:
    """The one GPU ``tensors`` live on, where ``cuda_ipc=True`` keeps the mirror.

    Raises:
        ValueError: they are not all on one GPU.
    """
    devices = {t.device for t in tensors}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise ValueError(
            f"{owner}: cuda_ipc=True shares snapshot slots on the module's GPU, but its tensors are on "
            f"{sorted(map(str, devices))}; move the module to one GPU, or cuda_ipc=False"
        )
    return next(iter(devices))


def mirror(nbytes: int, slots: int, device: torch.device) -> list[torch.Tensor]:
    """``slots`` flat device buffers of ``nbytes`` in one allocation (one IPC handle)."""
    whole = torch.empty(slots * nbytes, dtype=torch.uint8, device=device)
    return [whole[i * nbytes : (i + 1) * nbytes] for i in range(slots)]


def export(slots: list[torch.Tensor], pin_dir: str) -> None:
    """Write the mirror's IPC handle into ``pin_dir`` (atomically: a reader sees all or nothing)."""
    storage = slots[0].untyped_storage()
    _dev, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync = storage._share_cuda_()  # type: ignore[no-untyped-call]
    record = {
        "uuid": str(torch.cuda.get_device_properties(slots[0].device).uuid),
        "handle": base64.b64encode(handle).decode(), "size": size, "offset": offset,
        "rc_handle": base64.b64encode(rc_handle).decode(), "rc_offset": rc_offset,
        "event": base64.b64encode(ev_handle or b"").decode(), "event_sync": bool(ev_sync),
        "slots": [[s.storage_offset(), s.numel()] for s in slots], "pid": os.getpid(),
    }  # fmt: skip
    tmp = os.path.join(pin_dir, f".{_FILE}.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, os.path.join(pin_dir, _FILE))


def withdraw(pin_dir: str) -> None:
    """Remove the handle: no new reader opens the mirror once the ring closes."""
    try:
        os.unlink(os.path.join(pin_dir, _FILE))
    except FileNotFoundError:
        pass


def _local_index(uuid: str) -> int | None:
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    return None


def open_mirror(pin_dir: str, into: torch.device, what: str) -> list[torch.Tensor] | None:
    """The writer's mirror slots, opened in this process; None when there is no mirror or
    this process cannot copy from it to ``into`` (said once in the log, with why)."""
    try:
        path = os.path.join(pin_dir, _FILE)
        record = load_json(read_file(path)[0], path)  # no symlink, FIFO or unbounded read
        if not isinstance(record, dict):
            raise Untrusted(f"{path} holds no JSON object")
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("%s: cannot read the trainer's CUDA IPC handle (%s); copying from host memory", what, exc)
        return None
    if record.get("pid") == os.getpid():
        return None  # CUDA opens no handle in the process that made it; same-process readers use host memory
    index = _local_index(record["uuid"])
    if index is None:
        log.warning("%s: the trainer's GPU %s is not visible in this process (CUDA_VISIBLE_DEVICES); copying "
                    "from host memory", what, record["uuid"])  # fmt: skip
        return None
    target = into.index if into.index is not None else torch.cuda.current_device()
    if index != target and not torch.cuda.can_device_access_peer(target, index):
        log.warning("%s: no peer access from cuda:%d to the trainer's cuda:%d; copying from host memory",
                    what, target, index)  # fmt: skip
        return None
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            index, base64.b64decode(record["handle"]), record["size"], record["offset"],
            base64.b64decode(record["rc_handle"]), record["rc_offset"],
            base64.b64decode(record["event"]), record["event_sync"],
        )  # fmt: skip
    except RuntimeError as exc:
        clear_last_error()  # else torch raises it at this process's next kernel launch
        log.warning("%s: CUDA refused the trainer's IPC handle (%s); copying from host memory", what, exc)
        return None
    whole = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index))
    whole.set_(storage, 0, (storage.nbytes(),), (1,))
    return [whole[start : start + n] for start, n in record["slots"]]
