"""Tools for testing and benchmarking weight sync: child processes cleaned up by PID,
simulated hosts (network namespaces on shaped links), and synthetic models.

Used by the project's own tests and by ``lightning-wsync bench``.
"""
