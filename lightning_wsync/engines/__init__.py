"""Apply targets other than an in-place module copy.

``ApplyTarget`` is the seam (any callable taking the named tensors of one complete
version and its number); ``lightning_wsync.engines.vllm`` runs a receiver inside each
vLLM engine worker (``pip install 'lightning-wsync[vllm]'``). Importing this package
never imports an engine.
"""

from lightning_wsync._pull.target import ApplyTarget

__all__ = ["ApplyTarget"]
