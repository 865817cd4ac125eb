"""The apply seam: hand each complete, verified version to something other than a module.

A :class:`WeightReceiver` built on an :class:`ApplyTarget` keeps a private copy of the
published tensors (CPU, wire dtype, allocated from the sender's layout). Every data path
writes a version into that copy exactly as it would into a module (torn shared-memory
copies redone, network versions staged and verified first); only then is the target
called with the named tensors and the version number, and only once it returns is that
version reported as held.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Protocol

import torch

from lightning_wsync._control.manifest import Manifest


class ApplyTarget(Protocol):
    """Takes one complete, verified version: its named tensors and its number.

    The tensors are the receiver's own (CPU, in the sender's wire dtype) and are
    overwritten by the next version: copy what must outlive the call. An exception
    leaves the receiver's ``version`` at None (the target may hold part of a version);
    the next ``update()`` hands over the newest version again.

    Example::

        def load(tensors, version):
            engine.load_weights(tensors.items())

        receiver = WeightReceiver(load)
    """

    def __call__(self, tensors: Mapping[str, torch.Tensor], version: int, /) -> None: ...


class TargetTensors:
    """The receiver-side copy a version is applied into before the target gets it."""

    def __init__(self, target: ApplyTarget, include: Sequence[str], exclude: Sequence[str]) -> None:
        self.target = target
        self._include = tuple(include)
        self._exclude = tuple(exclude)
        self._layout: Manifest | None = None
        self._tensors: dict[str, torch.Tensor] = {}

    def tensors_for(self, layout: Manifest) -> dict[str, torch.Tensor]:
        """Tensors shaped like ``layout``'s selected entries (reused while the layout is the same)."""
        if layout != self._layout:
            self._tensors = {
                e.name: torch.empty(e.shape, dtype=e.wire_dtype)
                for e in layout.entries
                if self.selects(e.name)
            }
            self._layout = layout
        return self._tensors

    def hand_over(self, version: int) -> None:
        self.target(MappingProxyType(self._tensors), version)

    def selects(self, name: str) -> bool:
        """``name`` passes this receiver's include/exclude patterns."""
        if self._include and not any(fnmatch.fnmatchcase(name, p) for p in self._include):
            return False
        return not any(fnmatch.fnmatchcase(name, p) for p in self._exclude)


class CopyInto:
    """An apply target that copies each version into a module's tensors (a fleet member's
    module: versions are staged privately and copied in once the fleet switched)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._tensors = tensors

    def __call__(self, tensors: Mapping[str, torch.Tensor], version: int, /) -> None:
        with torch.no_grad():
            for name, t in tensors.items():
                self._tensors[name].copy_(t)
