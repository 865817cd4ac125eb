"""Plot the engine's rollout reward against the weights version that generated it.

    python examples/llm_vllm/plot.py OUT_DIR    # writes OUT_DIR/reward.png, prints its path
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main(out: Path) -> Path:
    rows = [json.loads(line) for line in (out / "rollout.jsonl").read_text().splitlines() if line]
    by_version: dict[int, list[float]] = defaultdict(list)
    for r in rows:
        by_version[r["version"]].append(r["reward"])
    versions = sorted(by_version)
    means = [sum(by_version[v]) / len(by_version[v]) for v in versions]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.scatter([r["version"] for r in rows], [r["reward"] for r in rows], s=8, alpha=0.4, label="one batch (64 samples)")
    a.plot(versions, means, color="C1", label="mean per version")
    a.set_xlabel("weights version in the vLLM engine (trainer step)")
    a.set_ylabel("reward: fraction of digit tokens")
    a.set_ylim(0, 1.02)
    a.legend(loc="lower right")
    b.plot([r["t"] for r in rows], [r["reward"] for r in rows], ".", ms=3)
    b.set_xlabel("seconds since the engine got version 0")
    b.set_ylabel("batch reward")
    b.set_ylim(0, 1.02)
    fig.suptitle("lightning_wsync: Lightning trainer -> vLLM engine, policy gradient on 'answer in digits'")
    fig.tight_layout()
    path = out / "reward.png"
    fig.savefig(path, dpi=110)
    return path


if __name__ == "__main__":
    print(main(Path(sys.argv[1])))
