"""The ``vllm.general_plugins`` entry point: the ``wsync`` backend in every vLLM process.

vLLM calls :func:`register` in its API server, engine core and worker processes (see
``vllm.plugins.load_general_plugins``), so ``vllm serve MODEL --weight-transfer-config
'{"backend": "wsync"}'`` finds the worker engine, and ``WeightTransferTrainerFactory``
the trainer engine. Both are registered by module path: nothing of lightning_wsync's
receive or send side is imported until vLLM creates an engine.
"""

from __future__ import annotations

BACKEND = "wsync"
WORKER_ENGINE = ("lightning_wsync.engines.vllm_transfer", "WsyncTransferEngine")
TRAINER_ENGINE = ("lightning_wsync.engines.vllm_trainer", "WsyncTrainerEngine")


def register() -> None:
    """Register the worker and trainer ``wsync`` engines with vLLM's factories (idempotent:
    vLLM may load plugins more than once, and importing our modules registers them too)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, *WORKER_ENGINE)
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, *TRAINER_ENGINE)
