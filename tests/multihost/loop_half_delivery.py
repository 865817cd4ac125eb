"""Loop the 16-host shape of issue 32 item 5 and record what each run delivered (a script, not a CI test).

::

    nice -n 5 .venv/bin/python tests/multihost/loop_half_delivery.py --runs 4 --out /tmp/trust4/half

Each run is ``lightning-wsync bench --hosts 16 --receivers-per-host 1 --link 700mbit --size-mb 64
--pushes 3 --topology tree --no-reference --json`` (root: simulated hosts), every receiver
waiting for each version. The library's INFO lines of every process (the trainer and each
receiver, through a ``sitecustomize`` put on ``PYTHONPATH``) go to the run's ``stderr.log``.
Per run it prints and appends to ``runs.jsonl``: the load average, the wall time, per push the
receivers in the push report (``delivered``), the ones that applied it, the trainer's egress in
models, and the log lines that say the trees re-formed, a hop failed, a leader was dropped or a
version was resent.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

_SITE = """\
import logging, os, sys
_h = logging.StreamHandler(sys.stderr)
_h.setFormatter(logging.Formatter(f"%(asctime)s pid={os.getpid()} %(processName)s %(name)s %(levelname)s %(message)s"))
_l = logging.getLogger("lightning_wsync")
_l.setLevel(logging.INFO)
_l.addHandler(_h)
"""

# What re-forms the trees, breaks a hop or sends a version again, as the library logs it.
_EVENTS = re.compile(
    r"relay (trees|chain) \d+:|hop to .* failed|dropped from the chain|resent|leads host|"
    r"hops? from (the trees|upstream) ended|step failed|counted gone|not published"
)


def one_run(index: int, out: Path, timeout_s: float) -> dict[str, object]:
    run_dir = out / str(index)
    run_dir.mkdir(parents=True, exist_ok=True)
    site = run_dir / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(_SITE)
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    argv = [sys.executable, "-m", "lightning_wsync.cli", "bench", "--hosts", "16", "--receivers-per-host", "1",
            "--link", "700mbit", "--size-mb", "64", "--pushes", "3", "--topology", "tree", "--no-reference",
            "--json"]  # fmt: skip
    load0 = os.getloadavg()[0]
    started = time.monotonic()
    with open(run_dir / "stdout.json", "w") as stdout, open(run_dir / "stderr.log", "w") as stderr:
        try:
            rc: int | str = subprocess.run(argv, stdout=stdout, stderr=stderr, env=env, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    record: dict[str, object] = {"run": index, "rc": rc, "wall_s": round(time.monotonic() - started, 1),
                                 "load": [round(load0, 1), round(os.getloadavg()[0], 1)]}  # fmt: skip
    try:
        result = json.loads((run_dir / "stdout.json").read_text())
        phase = result["phases"]["tree"]
        record["pushes"] = [
            {"version": s["version"], "warmup": s["warmup"], "reported": len(s.get("delivered", ())),
             "applied": sum(1 for v in s.get("applied", {}).values() if v == s["version"]),
             "failed": s["failed"], "egress_models": round(s["egress_models"], 3),
             "latency_s": round(s["latency_s"], 2)}
            for s in phase["samples"]
        ]  # fmt: skip
        record["egress_models_per_push"] = phase["egress_models_per_push"]
    except (ValueError, KeyError) as exc:
        record["no_result"] = f"{type(exc).__name__}: {exc}"
    lines = (run_dir / "stderr.log").read_text(errors="replace").splitlines()
    record["events"] = [line[:300] for line in lines if _EVENTS.search(line)]
    record["warnings"] = sum(" WARNING " in line for line in lines)
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--out", type=Path, default=Path("/tmp/half-delivery"))
    parser.add_argument("--timeout-s", type=float, default=900.0, help="bound on one run")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for i in range(1, args.runs + 1):
        record = one_run(i, args.out, args.timeout_s)
        with open(args.out / "runs.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        pushes = record.get("pushes", [])
        summary = ", ".join(f"v{p['version']} {p['reported']}/{p['applied']} {p['egress_models']}" for p in pushes)
        print(f"run {i}: rc={record['rc']} wall={record['wall_s']} s load={record['load']} "
              f"[version reported/applied egress] {summary}; {len(record['events'])} events", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
