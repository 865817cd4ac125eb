"""What runs inside an engine's worker processes, under the public adapters of
:mod:`lightning_wsync.engines`: :mod:`.commit` (one version in every TP worker, or none),
:mod:`.names` (the trainer's names checked against the model), :mod:`.lora` (a LoRA
adapter's versions as in-memory adapters), :mod:`.served` (the adapter versions vLLM's own
adapter routes load) and :mod:`.follow` (a server that follows the trainer by itself).

The public modules (``vllm``, ``vllm_async``, ``vllm_transfer``, ``vllm_servers``, ...) and
the ``vllm.general_plugins`` entry point (``_vllm_plugin``) stay at ``lightning_wsync.engines``.
"""
