"""The control plane: the shared store and everything kept on it.

``store`` connects to the TCPStore and is the one error boundary (:class:`Control`, signed
records); ``keys`` builds every key; ``manifest`` describes a version's tensors and
buckets; ``host`` says which host and process namespace this is; ``inflight`` counts the
store calls in flight, so that the process's exit closes the store to threads and waits for them.
"""
