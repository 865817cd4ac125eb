"""Data planes: how a version's bytes travel from a sender to receivers.

``base`` is the interface, ``open`` the one place that picks a plane; each plane is a
subpackage (``shm``: a snapshot ring in shared memory on one host; ``net``: a process group
per receiver; ``relay``: one copy into each host, host to host) and ``delta`` is the codec
that the network planes use. ``wire`` holds what every network hop shares: the group, the
header and the signed trailer.
"""
