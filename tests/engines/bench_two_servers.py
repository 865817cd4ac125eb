"""Two CPU vLLM servers on one host, one kept busy: how long the other takes per request.

    PYTHONPATH=. .venv-vllm/bin/python tests/engines/bench_two_servers.py --bind auto
    PYTHONPATH=. .venv-vllm/bin/python tests/engines/bench_two_servers.py --bind split

No wsync in the servers' path: two plain ``python -m vllm.entrypoints.openai.api_server``
(a random Llama of ``tiny_llama`` sizes), a client generating on server 0 without pause, and
every ``--gap`` seconds a greedy 16-token ``/v1/completions`` on server 1, timed. ``auto``
leaves vLLM's CPU binding as it is (every server's worker on the same cores); ``split`` gives
each server a core of its own (``VLLM_CPU_OMP_THREADS_BIND``). Prints each worker's affinity
and the request times. Why it matters: docs/engines.md, "Several CPU servers on one host".
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parents[1] / "examples" / "llm_vllm")]

PROMPT = [391, 289, 28, 288, 321]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bind", choices=("auto", "split"), default="auto")
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--gap", type=float, default=2.0, help="seconds between requests (> 1 s: vLLM readers park)")
    args = parser.parse_args()

    from _vllm_server import Server
    from conftest import free_port
    from tiny_llama import write_tiny_llama

    root = Path(tempfile.mkdtemp(prefix="two-servers-"))
    model = write_tiny_llama(root / "model", init_std=0.5)
    cpus = [None, None] if args.bind == "auto" else ["0", "1"]
    servers = [Server(model, free_port(), root / f"server{i}.log", cpus=cpus[i]) for i in range(2)]
    busy = threading.Event()
    try:
        for server in servers:
            server.wait_ready(600)
        workers = subprocess.run(["pgrep", "-f", "VLLM::Worker"], capture_output=True, text=True).stdout.split()
        for pid in workers:
            print(subprocess.run(["taskset", "-cp", pid], capture_output=True, text=True).stdout.strip())

        def keep_busy() -> None:
            while not busy.is_set():
                try:
                    servers[0].generate(PROMPT, 24)
                except OSError:  # requests' errors are OSErrors: the server stopping under a request
                    if not busy.is_set():
                        raise

        threading.Thread(target=keep_busy, name="busy-client", daemon=True).start()
        took = []
        for _ in range(args.requests):
            time.sleep(args.gap)  # the gap is the point: a quiet server 1 between requests
            start = time.monotonic()
            servers[1].complete(PROMPT, 16)
            took.append(time.monotonic() - start)
        print(
            f"bind={args.bind} server 1, 16 greedy tokens every {args.gap} s while server 0 is busy: "
            f"{[round(t, 2) for t in took]} s; median {statistics.median(took):.2f} s, max {max(took):.2f} s"
        )
    finally:
        busy.set()
        for server in servers:
            server.stop()


if __name__ == "__main__":
    main()
