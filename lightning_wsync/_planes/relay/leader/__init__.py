"""A relay host's leader: each receiver's member thread (:mod:`.member`), which elects
(:mod:`.elect`), waits on its bell (:mod:`.bell`) and, while it leads, receives each version
from upstream into the host's ring (:mod:`.hop` on a chain, :mod:`.treehop` in a tree) and
forwards it (:mod:`lightning_wsync._planes.relay.down`)."""
