"""Tools for testing and benchmarking weight sync.

``procs``: child processes cleaned up by PID; ``hosts``: simulated hosts (network
namespaces on shaped links); ``models``: synthetic transformer-shaped models;
``steps``: versions made by real AdamW steps; ``pushmodel``: the relay's push-time
model; ``probes``: the library's layout, snapshot copy and delta codec, for the figures
that must measure them; ``trainers``: a recording logger and the arguments of a quiet
CPU Lightning run; ``storeproxy``: a TCPStore proxy that counts every request by command and
key; ``hostproc``: a simulated host's receivers in one child process.

Used by the project's own tests and by ``lightning-wsync bench``; this package may read
the library's internals, the bench may not.
"""
