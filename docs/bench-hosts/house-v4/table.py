import json, statistics, sys
runs = [json.loads(l) for f in sys.argv[1:] for l in open(f)]
def metrics(r):
    res, b = r["result"], r["bench"]
    m = {}
    if b == "hosts":
        ph = res["phases"]["relay"]
        m["hosts: latency per push (s)"] = ph["latency_s"]
        m["hosts: per-hop overhead (ms)"] = ph["per_hop_overhead_s"] * 1e3
        m["hosts: egress models per push"] = ph["egress_models_per_push"]
        m["hosts: store requests per push"] = ph["store_requests_per_push"]
        m["hosts: store idle requests/s per host"] = ph["store_idle_requests_per_s_per_host"]
    elif b == "ranks":
        same = {"2 ranks, ddp": "2 ranks, ddp, unsharded", "2 ranks, ddp, sharded=False": "2 ranks, ddp, unsharded",
                "2 ranks, ddp, sharded": "2 ranks, ddp, sharded", "2 ranks, ddp, default": "2 ranks, ddp, sharded"}
        for row in res["rows"]:
            row = dict(row, config=same.get(row["config"], row["config"]))
            m[f"ranks, {row['config']}: stall (ms)"] = row["stall_s"] * 1e3
            m[f"ranks, {row['config']}: delivery (s)"] = row["delivery_s"]
    else:
        md, ra = res["medians"], res["ratios"]
        m["same-host: stall (ms)"] = md["stall_s"] * 1e3
        m["same-host: latency (ms)"] = md["latency_s"] * 1e3
        m["same-host: stall / memcpy bound"] = ra["stall_to_memcpy"]
        m["same-host: latency / shm bound"] = ra["latency_to_shm_bound"]
    m[f"{b}: CPU-s, all processes of the run"] = r["cpu_s_all_processes"]
    m[f"{b}: wall of the run (s)"] = r["wall_s"]
    return m
def flat(d, p=""):
    out = []
    if isinstance(d, dict):
        for k, v in d.items():
            if k in ("samples", "config", "pushes_s", "latencies_s"): continue
            out += flat(v, f"{p}.{k}" if p else k)
    elif isinstance(d, (int, float)) and not isinstance(d, bool):
        out.append((p, d))
    return out
table = {}
for r in runs:
    if r["rc"] != 0:
        print("FAILED", r["rep"], r["bench"], r["side"], str(r["result"])[:300]); continue
    for k, v in metrics(r).items():
        table.setdefault(k, {}).setdefault(r["side"], []).append(v)
def cell(vs):
    if not vs: return "—"
    f = (lambda x: f"{x:.3g}")
    return f"{f(statistics.median(vs))} ({f(min(vs))}–{f(max(vs))}, n={len(vs)})"
print("| figure | 12db804: median (min–max) | house5: median (min–max) |")
print("|---|---|---|")
for k, by in table.items():
    print(f"| {k} | {cell(by.get('base', []))} | {cell(by.get('house5', []))} |")
