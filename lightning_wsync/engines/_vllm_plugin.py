"""The ``vllm.general_plugins`` entry point: the ``wsync`` backend in every vLLM process.

vLLM calls :func:`register` in its API server, engine core and worker processes (see
``vllm.plugins.load_general_plugins``), so ``vllm serve MODEL --weight-transfer-config
'{"backend": "wsync"}'`` finds the worker engine, and ``WeightTransferTrainerFactory``
the trainer engine. Both are registered by module path: nothing of lightning_wsync's
receive or send side is imported until vLLM creates an engine.
"""

from __future__ import annotations

import logging
import os

BACKEND = "wsync"
WORKER_ENGINE = ("lightning_wsync.engines.vllm_transfer", "WsyncTransferEngine")
TRAINER_ENGINE = ("lightning_wsync.engines.vllm_trainer", "WsyncTrainerEngine")
LOG_ENV = "WSYNC_LOG_LEVEL"
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def register() -> None:
    """Register the worker and trainer ``wsync`` engines with vLLM's factories (idempotent:
    vLLM may load plugins more than once, and importing our modules registers them too)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    log_from_env()

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, *WORKER_ENGINE)
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, *TRAINER_ENGINE)


def log_from_env() -> None:
    """``WSYNC_LOG_LEVEL=INFO`` (or DEBUG, WARNING, ERROR) in a server's environment: this
    package's log, at that level, on the process's stderr (the server's log), each line with
    its process id. vLLM configures only its own logger, so without it a server shows
    lightning_wsync's warnings alone. Idempotent: the handler is added once per process."""
    text = os.environ.get(LOG_ENV, "").strip()
    if not text:
        return
    level = text.upper()
    if level not in _LEVELS:
        raise ValueError(f"{LOG_ENV}={text!r} is not a log level: set it to one of {', '.join(_LEVELS)}, or unset it")
    logger = logging.getLogger("lightning_wsync")
    logger.setLevel(level)
    if not any(getattr(h, "_wsync_env", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s wsync[%(process)d] %(levelname)s %(name)s: %(message)s"))
        handler._wsync_env = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
