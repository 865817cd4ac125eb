"""house v4 before/after: the benches on 12db804 (/tmp/base) and on this branch, alternating, in one run."""
import json, os, resource, subprocess, sys, time
PY = "/work/wt/house/.venv/bin/python"
SIDES = {"base": "/tmp/base", "house5": "/work/wt/house"}
BENCHES = {
    "hosts_": ["--hosts", "4", "--receivers-per-host", "1", "--size-mb", "16", "--pushes", "3", "--topology", "relay", "--no-reference"],
    "ranks": ["--trainer-ranks", "2", "--strategy", "ddp", "--size-mb", "32", "--pushes", "5", "--receivers", "1"],
    "same": ["--size-mb", "64", "--receivers", "2", "--pushes", "5"],
}
out = sys.argv[1]
BENCHES = {"same": BENCHES["same"], "ranks": BENCHES["ranks"], "hosts": BENCHES["hosts_"]}
for rep in range(3):
    order = ["base", "house5"] if rep % 2 == 0 else ["house5", "base"]
    for bench, args in BENCHES.items():
        for side in order:
            env = dict(os.environ, PYTHONPATH=SIDES[side])
            r0 = resource.getrusage(resource.RUSAGE_CHILDREN); t0 = time.monotonic()
            p = subprocess.run(["nice", "-n", "5", PY, "-m", "lightning_wsync.cli", "bench", *args, "--json"], env=env,
                               cwd="/tmp", capture_output=True, text=True, timeout=600)
            wall = time.monotonic() - t0; r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
            try:
                result = json.loads(p.stdout)
            except ValueError:
                result = {"stdout_tail": p.stdout[-2000:], "stderr_tail": p.stderr[-2000:]}
            with open(out, "a") as f:
                f.write(json.dumps({"rep": rep, "bench": bench, "side": side, "rc": p.returncode, "wall_s": wall,
                                    "cpu_s_all_processes": cpu, "result": result}) + "\n")
            print(rep, bench, side, p.returncode, round(wall, 1), round(cpu, 1), flush=True)
