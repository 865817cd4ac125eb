"""Rollout side: the receiver, its watcher thread, and apply targets."""
