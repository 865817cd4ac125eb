"""Relay plane: one copy into each host, forwarded host to host by elected host leaders.

By role: :mod:`.head` (the sender's side), :mod:`.leader` (a host leader's thread and hops),
:mod:`.mate` (a host-mate's reader, board and notes). Shared here: the hop's wire
(:mod:`.hops`, :mod:`.down`, :mod:`.treedelta`), the shapes (:mod:`.plan`), what is deleted
(:mod:`.tidy`), and opening a relay host's receive side (:mod:`.receive`, :mod:`.sharded`; a receiver
that cannot map its host's ring of a sharded stream gets it as a host of its own: :mod:`.alone`).
"""
