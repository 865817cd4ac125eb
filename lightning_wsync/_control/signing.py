"""Record signing: the key derived from the job's secret, and the MACs that bind a record
to its job, its key and the run (the store's run id).

The HMAC key is never the raw secret: :func:`derive_key` stretches it with
PBKDF2-HMAC-SHA256 (``KDF_ITERATIONS``, salt bound to the job), once per process and
job, so guessing a weak secret from a signed record on the store costs that much work
per guess. The run id (a random token the first signing peer stores under ``run``, see
:meth:`Control.run_id <lightning_wsync._control.store.Control.run_id>`) is in every MAC,
so a record recorded in another run (another store) fails verification in this one.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import os
from collections.abc import Callable

from lightning_wsync._control.keys import ENV_SECRET
from lightning_wsync.errors import WeightSyncAuthError, WeightSyncRecordError

SIGNED = "wsync_signed"
KDF_ITERATIONS = 200_000  # ~0.1 s once per process on one core (measured 0.07-0.09 s)


def resolve_secret(secret: str | None, owner: str = "lightning_wsync") -> bytes | None:
    """The secret as given, else ``$WSYNC_SECRET``; an empty one is a configuration error."""
    source = "secret="
    if secret is None:
        secret, source = os.environ.get(ENV_SECRET), ENV_SECRET
    if secret is None:
        return None
    if not secret:
        raise ValueError(
            f"{owner}: {source} is set but empty, which would turn signing off without a word; set a "
            f"non-empty shared secret, or unset {ENV_SECRET} (and leave secret=None) to run unsigned"
        )
    return secret.encode()


@functools.lru_cache(maxsize=8)
def derive_key(secret: bytes, label: str) -> bytes:
    """The HMAC key for ``secret`` within ``label`` (the job): PBKDF2-HMAC-SHA256, computed once per process."""
    salt = f"lightning_wsync/v1/{label}".encode()
    return hashlib.pbkdf2_hmac("sha256", secret, salt, KDF_ITERATIONS)


def short(raw: bytes | str, limit: int = 60) -> str:
    """A bounded ``!r`` of a stored value, for error messages."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    return repr(text[:limit]) + (f" (+{len(text) - limit} chars)" if len(text) > limit else "")


class Signer:
    """Seals and opens the JSON records of one job (see the module docstring)."""

    def __init__(self, job_prefix: str, key: bytes | None, run_id: Callable[[], str]) -> None:
        self.prefix = job_prefix
        self.key = key
        self._run_id = run_id

    def mac(self, key: str, body: str) -> str:
        assert self.key is not None
        message = f"{self.prefix}/{key}\0{self._run_id()}\0{body}".encode()
        return hmac.new(self.key, message, hashlib.sha256).hexdigest()

    def mac_bytes(self, message: bytes) -> bytes:
        """HMAC-SHA256 of ``message`` within this job and run (32 zero bytes without a secret)."""
        if self.key is None:
            return bytes(32)
        head = f"{self.prefix}/\0{self._run_id()}\0".encode()
        return hmac.new(self.key, head + message, hashlib.sha256).digest()

    def seal(self, key: str, value: object) -> str:
        body = json.dumps(value, separators=(",", ":"))
        if self.key is None:
            return body
        return json.dumps({SIGNED: body, "mac": self.mac(key, body)}, separators=(",", ":"))

    def open(self, key: str, raw: bytes | str, job: str) -> object:
        """The JSON value sealed in ``raw``; raises only WeightSyncRecordError (not JSON)
        or WeightSyncAuthError (signature missing, unexpected or wrong)."""
        value = _parse(key, raw, job)
        signed = isinstance(value, dict) and SIGNED in value
        if self.key is None:
            if signed:
                raise WeightSyncAuthError(
                    f"record {key!r} of job {job!r} is signed but this process has no secret; "
                    f"set the job's secret with secret= or WSYNC_SECRET"
                )
            return value
        if not isinstance(value, dict) or not signed:
            raise WeightSyncAuthError(
                f"record {key!r} of job {job!r} is not signed, but this process requires the shared secret "
                f"({short(raw)}); set the same secret= / WSYNC_SECRET on every peer"
            )
        body, mac = value[SIGNED], value.get("mac")
        if not isinstance(body, str) or not isinstance(mac, str) or not mac.isascii() or not hmac.compare_digest(
            mac, self.mac(key, body)
        ):
            raise WeightSyncAuthError(
                f"record {key!r} of job {job!r} is signed with a different secret or in another run "
                f"({short(raw)}); set the same secret= / WSYNC_SECRET on every peer"
            )
        return _parse(key, body, job)


def _parse(key: str, raw: bytes | str, job: str) -> object:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise WeightSyncRecordError(
            f"record {key!r} of job {job!r} holds {short(raw)}, which is not JSON ({type(exc).__name__}); "
            f"something other than lightning_wsync wrote it: it is ignored until its writer replaces it"
        ) from None
