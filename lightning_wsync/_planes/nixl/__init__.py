"""The NIXL data plane: receivers on other hosts READ the sender's ring one-sided (docs/nixl.md).

:mod:`.open` is its row of the picker (:func:`~.open.offered`, :func:`~.open.open_send`, :func:`~.open.open_receive`),
each from one parameter object; :mod:`.agent` is the only module that imports NIXL.
"""
