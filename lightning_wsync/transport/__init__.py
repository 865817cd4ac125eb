"""Data planes. ``shm``: one shared snapshot per host, read straight into each receiver's
module. ``net``: one standalone gloo/NCCL process group per receiver, with staging and
per-bucket verification."""
