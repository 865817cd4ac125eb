"""Trainer side: the sender, its view of the receivers, and push reports."""
