"""Network plane: one standalone gloo/NCCL process group per receiver, staged and verified."""
