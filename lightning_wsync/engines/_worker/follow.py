"""vLLM servers that follow the trainer on their own: ``WSYNC_FOLLOW`` in the server's environment.

A server started with ``--weight-transfer-config '{"backend": "wsync"}'`` and, in its
environment, ``WSYNC_FOLLOW=1`` (plus ``WSYNC_STORE``/``WSYNC_JOB``, and receiver options
as JSON in ``WSYNC_FOLLOW_OPTIONS``) needs no client to call its weight routes::

    VLLM_SERVER_DEV_MODE=1 WSYNC_FOLLOW=1 WSYNC_STORE=trainer:29500 WSYNC_JOB=run1 \
    WSYNC_FOLLOW_OPTIONS='{"fleet": "rollout"}' \
        python -m vllm.entrypoints.openai.api_server --model MODEL --port 8000 \
        --weight-transfer-config '{"backend": "wsync"}'

Every worker's ``wsync`` engine joins the job at start (retrying until the store answers).
The first worker (rank 0) then waits for a version newer than the one loaded (with
``fleet``: the next one the fleet switched to) and runs the same update a trainer would
(:func:`~lightning_wsync.engines.vllm_servers.apply_version`) against its own server:
every worker stages it while requests run, then ``/pause?mode=keep`` (requests freeze at
a step boundary), every worker loads exactly it, the label becomes the version, the
prefix cache is reset, ``/resume``. The routes are vLLM's own, so the engine core's
pause, its per-token labels and ``/weight_info`` stay true, and TP workers load one
version or none as when a trainer drives them.

The server's own URL: ``WSYNC_FOLLOW=http://host:port``, or with ``WSYNC_FOLLOW=1`` from
vLLM's ``--host``/``--port`` on the server's command line (``127.0.0.1`` for an
all-interfaces or empty host; port 8000 by default).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from lightning_wsync.config import ReceiverConfig, config_values
from lightning_wsync.engines.vllm_servers import VllmServers, apply_version
from lightning_wsync.errors import WeightSyncClosedError, WeightSyncError, WeightSyncTimeoutError

if TYPE_CHECKING:
    from lightning_wsync._pull.receiver import WeightReceiver

log = logging.getLogger(__name__)

FOLLOW_ENV = "WSYNC_FOLLOW"
OPTIONS_ENV = "WSYNC_FOLLOW_OPTIONS"
_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")
RETRY_S = 1.0
"""Wait before trying again after the store, the server or an update failed."""
WAIT_S = 10.0
"""One wait for a newer version (then the loop looks at its stop flag again)."""


@dataclass(frozen=True)
class FollowSettings:
    """Where the server answers, and the receivers' options (``ReceiverConfig`` fields)."""

    url: str
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def timeout_s(self) -> float:
        return float(self.options.get("timeout_s", 60.0))


def follow_settings(
    environ: Mapping[str, str] | None = None, argv: Sequence[str] | None = None
) -> FollowSettings | None:
    """The follow settings from the environment, or None when ``WSYNC_FOLLOW`` is off or unset.

    Raises:
        ValueError: ``WSYNC_FOLLOW`` or ``WSYNC_FOLLOW_OPTIONS`` cannot be read (names the value).
    """
    env = os.environ if environ is None else environ
    value = env.get(FOLLOW_ENV, "").strip()
    if value.lower() in _OFF:
        return None
    if value.startswith(("http://", "https://")):
        url = value
    elif value.lower() in _ON:
        url = _url_from_argv(sys.argv if argv is None else argv)
    else:
        raise ValueError(
            f"{FOLLOW_ENV}={value!r}: set it to 1 (the server's URL from its --host/--port) or to the "
            f"server's own URL, http://host:port"
        )
    raw = env.get(OPTIONS_ENV, "").strip()
    try:
        options = json.loads(raw) if raw else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f'{OPTIONS_ENV}={raw!r} is not JSON ({exc}); e.g. \'{{"fleet": "rollout"}}\'') from exc
    if not isinstance(options, dict):
        raise ValueError(f"{OPTIONS_ENV}={raw!r} must be a JSON object of ReceiverConfig fields")
    try:  # refused at the server's start, not later in a thread
        ReceiverConfig(**config_values(ReceiverConfig, None, options, owner=OPTIONS_ENV))
    except TypeError as exc:
        raise ValueError(str(exc)) from exc
    return FollowSettings(url.rstrip("/"), options)


def _url_from_argv(argv: Sequence[str]) -> str:
    """``http://host:port`` from vLLM's ``--host``/``--port`` flags (as vLLM's parser reads them)."""
    flags: dict[str, str] = {}
    args = list(argv)
    for i, arg in enumerate(args):
        for flag in ("--host", "--port"):
            if arg == flag and i + 1 < len(args):
                flags[flag] = args[i + 1]
            elif arg.startswith(flag + "="):
                flags[flag] = arg.split("=", 1)[1]
    host = flags.get("--host", "")
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"
    elif ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{flags.get('--port', '8000')}"


class Followed(Protocol):
    """What the follower uses of the worker's ``wsync`` engine."""

    receiver: WeightReceiver | None
    version: int | None  # loaded into the model

    def join_job(self, name: str | None, options: dict[str, Any]) -> None: ...


class Follower:
    """On a thread of the worker: join the job; in the first worker, apply each new version.

    Args:
        engine: the worker's ``wsync`` engine.
        settings: the server's URL and the receivers' options.
        drive: run the updates (one worker per server: rank 0); others only join the job.
    """

    def __init__(self, engine: Followed, settings: FollowSettings, *, drive: bool) -> None:
        self.engine = engine
        self.settings = settings
        self.drive = drive
        self.applied: list[int] = []  # versions this follower brought the server to, in order
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="wsync-follow", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self._stop.set()
        if self.thread is not threading.current_thread():
            self.thread.join(WAIT_S + 5)

    def _run(self) -> None:
        try:
            if self._join() and self.drive:
                self._follow()
        except Exception:  # a thread's error would vanish: say it in the server's log
            log.exception("wsync follow %s: stopped", self.settings.url)

    def _join(self) -> bool:
        options = dict(self.settings.options)
        name = options.pop("name", None)
        while not self._stop.is_set():
            try:
                self.engine.join_job(name, options)
                return True
            except WeightSyncError as exc:
                log.warning("wsync follow %s: could not join the job yet (%s); trying again", self.settings.url, exc)
                self._stop.wait(RETRY_S)
        return False

    def _follow(self) -> None:
        servers = VllmServers([self.settings.url], timeout_s=self.settings.timeout_s + 60)
        while not self._stop.is_set() and not _up(self.settings.url):  # vLLM serves once the engine is up
            self._stop.wait(RETRY_S)
        while not self._stop.is_set():
            receiver, loaded = self.engine.receiver, self.engine.version
            if receiver is None:
                return
            try:  # stages it here; with fleet, the version the fleet switched to
                version = receiver.wait_for_version(0 if loaded is None else loaded + 1, WAIT_S)
            except WeightSyncTimeoutError:
                continue
            except WeightSyncClosedError:
                self._stop.wait(RETRY_S)  # training finished; a relaunched sender's versions are followed
                continue
            except WeightSyncError as exc:
                log.warning("wsync follow %s: %s", self.settings.url, exc)
                self._stop.wait(RETRY_S)
                continue
            try:
                apply_version(servers, servers, version, timeout_s=self.settings.timeout_s, pause_mode="keep")
            except WeightSyncError as exc:
                log.warning("wsync follow %s: version %d not applied: %s", self.settings.url, version, exc)
                self._stop.wait(RETRY_S)
                continue
            self.applied.append(version)
            log.info("wsync follow %s: serving version %d", self.settings.url, version)


def _up(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            return bool(response.status == 200)
    except OSError:
        return False
