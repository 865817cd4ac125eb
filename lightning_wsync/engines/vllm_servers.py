"""vLLM servers running the ``wsync`` backend, driven over HTTP (no vLLM needed on this side).

:class:`VllmServers` speaks vLLM's RL routes to several servers at once (it is also a
``VLLMWeightSyncClient``), and :func:`apply_version` is one update of all of them to a
version the trainer has pushed::

    servers = VllmServers(["http://a:8000", "http://b:8000"])
    servers.init_weight_transfer_engine({"store": "trainer:29500", "job": "run1", "options": {}})
    sender.push(7)
    apply_version(servers, servers, 7, timeout_s=60)    # staged everywhere, then paused, loaded, labelled
    servers.weight_versions()                            # ["7", "7"]

The servers need ``VLLM_SERVER_DEV_MODE=1`` (vLLM registers its RL routes only then).
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from lightning_wsync.errors import WeightSyncError

UNKNOWN_LABEL = "wsync-unknown"
"""A server's or engine's weight-version label after a failed load (with the version tried)."""

log = logging.getLogger(__name__)

PAUSE_MODES = ("keep", "abort")


class SyncClient(Protocol):
    """vLLM's ``VLLMWeightSyncClient``: the four calls of one update."""

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: dict[str, Any]) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


class VllmServers:
    """Several vLLM servers; each call runs on all of them at once and returns once all answered.

    Raises:
        WeightSyncError: a server answered an error or not within ``timeout_s`` (names it).
    """

    def __init__(self, urls: Sequence[str], *, timeout_s: float = 300.0) -> None:
        if isinstance(urls, str) or not urls:
            raise ValueError(f"VllmServers: urls={urls!r} must be a non-empty list of 'http://host:port'")
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout_s = timeout_s

    def _call(self, url: str, route: str, body: dict[str, Any] | None, method: str) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{url}/{route}", data=data, method=method,
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:2000].decode(errors="replace")
            raise WeightSyncError(f"vLLM server {url!r}: {method} /{route} answered {exc.code}: {detail}") from exc
        except OSError as exc:
            raise WeightSyncError(
                f"vLLM server {url!r}: {method} /{route} failed ({exc}); is it up, with VLLM_SERVER_DEV_MODE=1?"
            ) from exc

    def _each(self, route: str, body: dict[str, Any] | None = None, method: str = "POST") -> list[Any]:
        with ThreadPoolExecutor(len(self.urls), thread_name_prefix="wsync-servers") as pool:
            futures = [pool.submit(self._call, url, route, body, method) for url in self.urls]
        return [f.result() for f in futures]  # the first server's error, raised again

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._each("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._each("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._each("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._each("finish_weight_update", None if weight_version is None else {"weight_version": weight_version})

    def pause(self, mode: str) -> None:
        """Freeze (``"keep"``) or end (``"abort"``) requests in flight at a step boundary."""
        self._each(f"pause?mode={mode}&clear_cache=false")

    def resume(self) -> None:
        self._each("resume")

    def reset_prefix_cache(self) -> list[bool]:
        """Per server: whether the reset went through (False while requests in flight hold blocks)."""
        return [bool(r.get("success", False)) for r in self._each("reset_prefix_cache")]

    def set_label(self, label: str) -> None:
        """Set the servers' weight-version label (``/update_weight_version``) without loading."""
        self._each("update_weight_version", {"new_version": label})

    def weight_versions(self) -> list[str]:
        """Per server: ``/weight_info``'s version (``"default"`` before the first)."""
        return [str(r["weight_version"]) for r in self._each("weight_info", method="GET")]


def apply_version(
    client: SyncClient,
    servers: VllmServers | None,
    version: int,
    *,
    timeout_s: float,
    pause_mode: str | None = "keep",
    reset_prefix_cache: bool = True,
) -> None:
    """Bring every server to the pushed ``version``: all its workers load exactly it, or none.

    Two rounds through ``client``: first every worker stages ``version`` while requests keep
    running (``stage_only``); then, with ``servers`` paused (``pause_mode``; None: no pause),
    every worker loads it and ``finish_weight_update`` sets the server's weight-version
    label, so every token's label names the weights that made it. The prefix cache is reset
    before the servers resume. When the load round fails, the label becomes
    ``wsync-unknown-<version>`` (some workers or servers may hold it, others not) until a
    later update succeeds; a failed stage round loads nothing and leaves the label.
    """
    if pause_mode not in (*PAUSE_MODES, None):
        raise ValueError(f"apply_version: pause_mode={pause_mode!r} is not one of 'keep', 'abort', None")
    update = {"version": version, "timeout_s": timeout_s}
    _round(client, {**update, "stage_only": True})
    paused = servers is not None and pause_mode is not None
    if paused:
        assert servers is not None and pause_mode is not None
        servers.pause(pause_mode)
    try:
        try:
            _round(client, update, str(version))
        except BaseException:
            if servers is not None:  # some workers may hold v, others not: no label may name either
                servers.set_label(f"{UNKNOWN_LABEL}-{version}")
            raise
        if reset_prefix_cache and servers is not None and not all(servers.reset_prefix_cache()):
            log.debug("vLLM servers kept prefix-cache blocks of requests in flight (version %d)", version)
    finally:
        if paused:
            assert servers is not None
            servers.resume()


def _round(client: SyncClient, update_info: dict[str, Any], weight_version: str | None = None) -> None:
    client.start_weight_update()
    client.update_weights(update_info)
    client.finish_weight_update(weight_version)
