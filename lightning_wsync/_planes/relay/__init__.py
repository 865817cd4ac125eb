"""Relay plane: one copy into each host, forwarded host to host by elected host leaders."""
