"""Shared-memory plane: a ring of snapshot slots with reader pins, and the wake-up socket."""
