"""The two tables of architecture.md's 'The two relay figures' from the runs (python table.py runs.jsonl)."""
import glob, json, re, statistics, sys
from collections import Counter, defaultdict
sys.argv = sys.argv[:2]
num, hexs = re.compile(r"[0-9]+"), re.compile(r"[0-9a-f]{8,}")
def pat(k): return num.sub("#", hexs.sub("*", re.sub(r"^/?wsync/[^/]+/", "", k)))
GROUPS = {"leader record look (and the bell's read after a ring)": lambda c, k: k.startswith("relay/#/leader"),
          "bell ring cycle (set, wait, delete, chain)": lambda c, k: k.startswith("relay/#/bell") or k == "relay/#/chain",
          "heartbeat `multi_set`": lambda c, k: k.startswith("member/#/hb"),
          "watcher: news and records": lambda c, k: k in ("news", "sender/current", "closed/#", "latest")}
NAMES = {"base": "12db804", "house5": "d126d59 (house5)", "house6": "main + this bench (house6)"}
def cell(vs, f="{:.3g}"):
    return "—" if not vs else f"{f.format(statistics.median(vs))} ({f.format(min(vs))}–{f.format(max(vs))}, n={len(vs)})"
idle, lat = defaultdict(lambda: defaultdict(list)), defaultdict(lambda: defaultdict(list))
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["rc"] != 0: continue
    ph, side = r["result"]["phases"]["relay"], r["side"]
    p = r.get("probe")  # runs.jsonl here embeds the probe's window and times; a fresh run has its dump folder
    d = p or json.load(open(glob.glob(r["dump"] + "/idle-*.json")[0]))
    c = Counter()
    for e in d["events"]:
        if d["t0"] <= e[0] <= d["t1"]:
            c[next((g for g, f in GROUPS.items() if f(e[2], pat(e[3]))), "other")] += 1
    for g in [*GROUPS, "other"]: idle[side][g].append(c[g])
    idle[side]["all, in 3 s"].append(sum(c.values()))
    idle[side]["the bench's figure: per host per s"].append(ph["store_idle_requests_per_s_per_host"])
    ev = defaultdict(lambda: defaultdict(dict))
    lines = p["times"] if p else [l for f in glob.glob(r["dump"] + "/times-*.txt") for l in open(f)]
    for l in lines:
        kind, t, who, v = l.split(); ev[int(v)][kind][who] = float(t)
    timed = [ev[v] for v in sorted(ev) if v > 1]
    def med(fn): return statistics.median(fn(e) for e in timed)
    L = lat[side]
    L["latency per push (s)"].append(ph["latency_s"])
    L["per-hop overhead (ms)"].append(ph["per_hop_overhead_s"] * 1e3)
    L["last leader published (s after push)"].append(med(lambda e: max(e["staged"].values()) - e["push"]["trainer"]))
    L["last receiver applied (s after push)"].append(med(lambda e: max(e["applied"].values()) - e["push"]["trainer"]))
    L["a host's publish to its apply, the slowest (s)"].append(med(lambda e: max(a - e["staged"][w] for w, a in e["applied"].items())))
    L["store requests per push"].append(ph["store_requests_per_push"])
    L["CPU-s, all processes of the run"].append(r["cpu_s_all_processes"])
sides = [s for s in NAMES if s in lat]
for table in (idle, lat):
    rows = list(dict.fromkeys(k for s in sides for k in table[s]))
    print("| figure | " + " | ".join(NAMES[s] for s in sides) + " |")
    print("|---" * (len(sides) + 1) + "|")
    for k in rows:
        print(f"| {k} | " + " | ".join(cell(table[s][k]) for s in sides) + " |")
    print()
