"""Per push: from sender.push() to each host's staged and applied, per side; and the bench's figures."""
import glob, json, statistics, sys
from collections import defaultdict
rows = defaultdict(list)
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["rc"] != 0: print("FAILED", r["rep"], r["side"]); continue
    ph = r["result"]["phases"]["relay"]
    ev = defaultdict(dict)
    for f in glob.glob(r["dump"] + "/times-*.txt"):
        for l in open(f):
            kind, t, who, v = l.split()
            ev[int(v)].setdefault(kind, {})[who] = float(t)
    per = []
    for v in sorted(ev):
        if v == 1: continue
        e = ev[v]; p = e["push"]["trainer"]
        st = sorted(x - p for x in e.get("staged", {}).values()); ap = sorted(x - p for x in e.get("applied", {}).values())
        per.append((st[0], st[-1], ap[-1], max(a - e["staged"][w] for w, a in e["applied"].items())))
    first_staged = statistics.median(x[0] for x in per); last_staged = statistics.median(x[1] for x in per)
    last_applied = statistics.median(x[2] for x in per); apply_gap = statistics.median(x[3] for x in per)
    rows[r["side"]].append(dict(lat=ph["latency_s"], hop=ph["per_hop_overhead_s"], idle=ph["store_idle_requests_per_s_per_host"],
                                first_staged=first_staged, last_staged=last_staged, last_applied=last_applied, apply_gap=apply_gap,
                                cpu=r["cpu_s_all_processes"], wall=r["wall_s"]))
    print(r["rep"], r["side"], "lat %.3f hop %.1f ms idle/host %.2f | staged first %.3f last %.3f, applied last %.3f, staged->applied max %.3f" % (
        ph["latency_s"], ph["per_hop_overhead_s"] * 1e3, ph["store_idle_requests_per_s_per_host"], first_staged, last_staged, last_applied, apply_gap),
        [round(s["latency_s"], 3) for s in ph["samples"]])
def cell(vs, k=1):
    vs = [v * k for v in vs]; return f"{statistics.median(vs):.3g} ({min(vs):.3g}-{max(vs):.3g}, n={len(vs)})"
for side, rs in rows.items():
    print(side, "latency s", cell([r["lat"] for r in rs]), "| per-hop ms", cell([r["hop"] for r in rs], 1e3),
          "| idle/s/host", cell([r["idle"] for r in rs]), "| last staged s", cell([r["last_staged"] for r in rs]),
          "| staged->applied s", cell([r["apply_gap"] for r in rs]), "| CPU-s", cell([r["cpu"] for r in rs]))
