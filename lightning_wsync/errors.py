"""Runtime failures of weight sync.

Bad arguments raise ``ValueError``/``TypeError`` at construction. Failures that
happen while the system runs raise a subclass of :class:`WeightSyncError`::

    WeightSyncError
    ├── WeightSyncTimeoutError     a bounded wait ran out (names what was awaited)
    ├── WeightSyncSchemaError      a receiver's module does not match the published one
    ├── WeightSyncClosedError      the sender (or the receiver itself) has closed
    ├── WeightSyncStoreError       the control-plane store cannot be reached
    ├── WeightSyncConfigError      the setup cannot work as configured (names the fix)
    ├── WeightSyncIntegrityError   received bytes failed verification (torn or corrupt)
    ├── WeightSyncAuthError        a peer's signature does not match the shared secret
    └── WeightSyncRecordError      a record on the store is malformed (names the key)

Every message names the peer, parameter or key involved, the value seen, and the
setting that changes the outcome.
"""

from __future__ import annotations

__all__ = [
    "WeightSyncError",
    "WeightSyncTimeoutError",
    "WeightSyncSchemaError",
    "WeightSyncClosedError",
    "WeightSyncStoreError",
    "WeightSyncConfigError",
    "WeightSyncIntegrityError",
    "WeightSyncAuthError",
    "WeightSyncRecordError",
]


class WeightSyncError(RuntimeError):
    """Base class of every runtime failure raised by lightning_wsync."""


class WeightSyncTimeoutError(WeightSyncError, TimeoutError):
    """A bounded wait on a peer or on the store ran out."""


class WeightSyncSchemaError(WeightSyncError):
    """The receiver's module does not match the names, shapes or dtypes published."""


class WeightSyncClosedError(WeightSyncError):
    """The sender closed the job, or the object was used after ``close()``."""


class WeightSyncStoreError(WeightSyncError):
    """The control-plane store is unreachable or answered with an error."""


class WeightSyncConfigError(WeightSyncError):
    """The setup cannot work as configured: ``transport='shm'`` across hosts, a shared
    segment that is not a wsync snapshot of this user, a segment name that is not one
    lightning_wsync creates. Never reported as a store failure; the message names the fix."""


class WeightSyncIntegrityError(WeightSyncError):
    """Received bytes failed verification; the version was not applied."""


class WeightSyncAuthError(WeightSyncError):
    """A record was not signed with the job's shared secret."""


class WeightSyncRecordError(WeightSyncError):
    """A record on the store is not what lightning_wsync writes there (not JSON, wrong
    fields or types, a counter that is not an integer); the message names the key, shows
    the value and says what was expected. The record is ignored, never trusted."""
