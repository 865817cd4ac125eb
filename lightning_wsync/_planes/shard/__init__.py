"""The sharded plane: every trainer rank snapshots its own share of a version into a ring of
its own in shared memory; same-host receivers assemble whole tensors from all the rings and
apply a version only when every rank's share of it is complete (see docs/sharded.md)."""
