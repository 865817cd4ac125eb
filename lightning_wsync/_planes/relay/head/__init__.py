"""The relay's head, on the sender: it feeds each version to the first leader of the chain
(:mod:`.feed`) or to the two trees' roots (:mod:`.treefeed`); :mod:`.plane` is the send plane
that re-forms the chain at each membership refresh, :mod:`.streams` a sharded push's streams."""
