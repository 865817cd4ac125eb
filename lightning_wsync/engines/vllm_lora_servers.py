"""LoRA adapters by version on vLLM servers: each version a served model named ``wsync-v{N}``.

The servers run with LoRA on and vLLM's adapter routes (``--enable-lora --max-lora-rank R
--max-loras K``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``) besides the ``wsync`` backend; the
trainer publishes only the adapter (``include=ADAPTER_TENSORS``) and passes its config::

    sync = WeightSyncCallback(every_n_steps=10, include=ADAPTER_TENSORS)
    servers = VllmServersCallback(sync, urls, server_options={"lora": adapter_config(peft_model),
                                                              "keep_adapters": 2})

For each version :class:`ServedAdapterNames` drives the usual update (every worker stages
and takes exactly that version: :func:`~lightning_wsync.engines.vllm_servers.apply_version`;
a worker keeps the tensors of the newest ``keep_adapters``, ``_worker/served.py``), then
``POST /v1/load_lora_adapter {"lora_name": "wsync-v7", "lora_path": "wsync:v7"}`` on every
server: vLLM gives the name an id and its workers build the adapter from memory (no file).
Before a version lands, the names of the versions it pushes out are unloaded
(``/v1/unload_lora_adapter``): from then on a request naming one is refused by vLLM at
admission (404, "The model `wsync-v3` does not exist"), never half-served. Clients name
the version they want (``model="wsync-v7"``); ``/weight_info`` reports the newest.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lightning_wsync.engines._worker.served import adapter_path
from lightning_wsync.engines.lora import adapter_name
from lightning_wsync.engines.vllm_servers import SyncClient, VllmServers, apply_version
from lightning_wsync.errors import WeightSyncError

log = logging.getLogger(__name__)


class ServedAdapterNames:
    """The names ``wsync-v{N}`` the servers serve: those of the newest ``keep`` versions.

    Args:
        servers: the vLLM servers (their URLs and HTTP timeout).
        keep: the servers' ``keep_adapters`` (each worker holds that many versions).
    """

    def __init__(self, servers: VllmServers, keep: int) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"ServedAdapterNames: keep={keep!r} must be an int >= 1 (the servers' keep_adapters)")
        self.servers = servers
        self.keep = keep
        self.versions: list[int] = []  # served by name, oldest first

    @classmethod
    def from_options(cls, servers: VllmServers, server_options: Mapping[str, Any]) -> ServedAdapterNames | None:
        """The names for ``server_options`` with ``lora`` (None without: whole models travel)."""
        if server_options.get("lora") is None:
            return None
        keep = server_options.get("keep_adapters")
        if keep is None:
            raise ValueError(
                "server_options: 'lora' on servers needs 'keep_adapters' too (how many versions each server "
                "keeps loadable; at least the oldest a request may still run on, plus one)"
            )
        return cls(servers, keep)

    def apply(
        self,
        client: SyncClient,
        version: int,
        *,
        timeout_s: float,
        pause_mode: str | None = "keep",
        reset_prefix_cache: bool = True,
    ) -> None:
        """Bring every server to ``version``'s adapter and serve it as ``wsync-v{version}``.

        Raises:
            WeightSyncError: a server refused a step (names it); the names unloaded before
                stay unloaded, the new name is not served.
        """
        kept = [v for v in self.versions if v != version]
        leaving = kept[: max(0, len(kept) - (self.keep - 1))]
        for old in leaving:  # first: no request may be admitted on a version a worker is about to drop
            self._each("v1/unload_lora_adapter", {"lora_name": adapter_name(old)}, missing_ok=True)
        self.versions = [v for v in kept if v not in leaving]
        apply_version(client, self.servers, version, timeout_s=timeout_s, pause_mode=pause_mode,
                      reset_prefix_cache=reset_prefix_cache)  # fmt: skip
        if version in self.versions:
            return
        self._each("v1/load_lora_adapter", {"lora_name": adapter_name(version), "lora_path": adapter_path(version)})
        self.versions.append(version)
        log.debug("vLLM servers %s serve adapters %s", self.servers.urls, [adapter_name(v) for v in self.versions])

    def _each(self, route: str, body: dict[str, Any], missing_ok: bool = False) -> None:
        urls = self.servers.urls
        with ThreadPoolExecutor(len(urls), thread_name_prefix="wsync-adapters") as pool:
            futures = [pool.submit(self._call, url, route, body, missing_ok) for url in urls]
        for future in futures:
            future.result()  # the first server's error, raised again

    def _call(self, url: str, route: str, body: dict[str, Any], missing_ok: bool) -> None:
        request = urllib.request.Request(f"{url}/{route}", data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=self.servers.timeout_s):
                return
        except urllib.error.HTTPError as exc:
            if missing_ok and exc.code == 404:
                return
            detail = exc.read()[:2000].decode(errors="replace")
            hint = " (start it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 and --enable-lora)" if exc.code == 404 else ""
            raise WeightSyncError(f"vLLM server {url!r}: POST /{route} answered {exc.code}: {detail}{hint}") from exc
        except OSError as exc:
            raise WeightSyncError(f"vLLM server {url!r}: POST /{route} failed ({exc}); is it up?") from exc
