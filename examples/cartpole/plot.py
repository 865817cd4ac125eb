"""Plot rollout return against weights version and wall-clock time.

    python examples/cartpole/plot.py wsync_demo_out    # writes wsync_demo_out/returns.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(out: Path) -> dict[str, list[tuple[float, int, float]]]:
    runs = {}
    for path in sorted(out.glob("rollout-*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if rows:
            runs[path.stem] = [(r["t"], r["version"], r["return"]) for r in rows]
    return runs


def rolling(values: list[float], n: int = 20) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v - (values[i - n] if i >= n else 0.0)
        out.append(acc / min(i + 1, n))
    return out


def main(out: Path) -> Path:
    runs = load(out)
    if not runs:
        raise SystemExit(f"no rollout-*.jsonl in {out}: did the rollout job run?")
    fig, (by_version, by_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, rows in runs.items():
        t, version, ret = zip(*rows)
        by_version.scatter(version, ret, s=6, alpha=0.35, label=f"{name} episodes")
        by_time.plot(t, rolling(list(ret)), label=f"{name} (mean of 20)")
    merged = sorted((row for rows in runs.values() for row in rows), key=lambda r: (r[1], r[0]))
    _, versions, returns = zip(*merged)
    by_version.plot(versions, rolling(list(returns)), color="black", label="all workers, mean of 20")
    for ax in (by_version, by_time):
        ax.axhline(195, color="red", linestyle="--", linewidth=1, label="target 195")
        ax.set_ylabel("episode return")
        ax.legend(fontsize=7, loc="lower right")
    by_version.set_xlabel("weights version the episode was played with (trainer global step)")
    by_time.set_xlabel("wall-clock seconds since the worker started")
    fig.suptitle("CartPole-v1 rollout return as weight versions arrive (lightning_wsync demo)")
    fig.tight_layout()
    path = out / "returns.png"
    fig.savefig(path, dpi=110)
    return path


if __name__ == "__main__":
    print(main(Path(sys.argv[1] if len(sys.argv) > 1 else "wsync_demo_out")))
