"""Break each run's idle window (and the whole run) down by client host, command and key pattern."""
import glob, json, re, sys
from collections import Counter
num = re.compile(r"[0-9]+"); hexs = re.compile(r"[0-9a-f]{8,}")
def pat(k):
    k = re.sub(r"^/?wsync/[^/]+/", "", k)  # the job prefix
    return num.sub("#", hexs.sub("*", k))
for line in open(sys.argv[1]):
    r = json.loads(line)
    files = glob.glob(r["dump"] + "/idle-*.json")
    if not files: print(r["rep"], r["side"], "no dump"); continue
    d = json.load(open(files[0]))
    rate = d["rate"] if isinstance(d["rate"], float) else d["rate"][0]  # house6's bench returns (rate, by key)
    ev = d["events"]; t0, t1 = d["t0"], d["t1"]
    win = [e for e in ev if t0 <= e[0] <= t1]
    c = Counter((e[1].split(":")[0], e[2], pat(e[3])) for e in win)
    print(f"== rep {r['rep']} {r['side']}: {len(win)} requests in {t1-t0:.2f} s; rate {rate:.2f}/s")
    for (h, cmd, k), n in sorted(c.items()):
        print(f"   {h:>12} {cmd:>12} {k:<50} {n}")
    if len(sys.argv) > 2:  # every request after the last push's end, with times
        for e in ev:
            if e[0] >= t0 - float(sys.argv[2]):
                print(f"   {e[0]-t0:+8.3f} {e[1]:>20} {e[2]:>12} {e[3]}")


def group(cmd, k):
    """The idle window's requests by what asks (see docs/control-plane.md's table)."""
    if k.startswith("relay/#/leader") and cmd == "compare_set":
        return "leader record (its look every hosted_beat_s, and the bell's read after a ring)"
    if k.startswith("relay/#/bell") or k == "relay/#/chain":
        return "bell ring cycle (set, wait, delete, chain)"
    if k.startswith("member/#/hb"):
        return "heartbeat multi_set"
    if k in ("news", "sender/current", "closed/#", "latest"):
        return "watcher: news and records"
    return k


print("\nBy what asks, per run:")
for line in open(sys.argv[1]):
    r = json.loads(line)
    files = glob.glob(r["dump"] + "/idle-*.json")
    if not files: continue
    d = json.load(open(files[0]))
    c = Counter(group(e[2], pat(e[3])) for e in d["events"] if d["t0"] <= e[0] <= d["t1"])
    print(r["rep"], r["side"], sum(c.values()), dict(sorted(c.items())))
