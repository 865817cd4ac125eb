"""house6: bench --hosts 4 relay on 12db804 (/tmp/h6base) / d126d59 (/tmp/h6h5) / house6, alternating, with the probe.

Usage: python side_by_side.py OUT.jsonl ROUNDS [base,house5,house6]. The probe is
probe_sitecustomize.py here, copied as /tmp/h6/probe/sitecustomize.py: with H6_DUMP set it logs
every store request the bench's proxy sees (time, client address, command, key) and dumps them
with the idle window's bounds, and the times of each push, each leader's publish and each apply.
keys.py breaks the idle window down by host, command and key; lat.py the latency per side."""
import json, os, resource, subprocess, sys, time
PY = "/work/wt/house/.venv/bin/python"
SIDES = {"base": "/tmp/h6base", "house5": "/tmp/h6h5", "house6": "/work/wt/house"}
ARGS = ["--hosts", "4", "--receivers-per-host", "1", "--size-mb", "16", "--pushes", "3", "--topology", "relay", "--no-reference"]
out, rounds = sys.argv[1], int(sys.argv[2])
sides = sys.argv[3].split(",") if len(sys.argv) > 3 else list(SIDES)
for rep in range(rounds):
    order = sides[rep % len(sides):] + sides[:rep % len(sides)]
    if rep % 2: order = order[::-1]
    for side in order:
        dump = f"/tmp/h6/out/{os.path.basename(out)}-{rep}-{side}"
        os.makedirs(dump, exist_ok=True)
        env = dict(os.environ, PYTHONPATH=f"/tmp/h6/probe:{SIDES[side]}", H6_DUMP=dump)
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN); t0 = time.monotonic()
        p = subprocess.run(["nice", "-n", "5", PY, "-m", "lightning_wsync.cli", "bench", *ARGS, "--json"], env=env,
                           cwd="/tmp", capture_output=True, text=True, timeout=600)
        wall = time.monotonic() - t0; r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        try:
            result = json.loads(p.stdout)
        except ValueError:
            result = {"stdout_tail": p.stdout[-2000:], "stderr_tail": p.stderr[-2000:]}
        with open(out, "a") as f:
            f.write(json.dumps({"rep": rep, "bench": "hosts", "side": side, "rc": p.returncode, "wall_s": wall,
                                "cpu_s_all_processes": cpu, "dump": dump, "result": result}) + "\n")
        print(rep, side, p.returncode, round(wall, 1), round(cpu, 1), flush=True)
