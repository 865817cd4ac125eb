"""Trainer app of the CartPole actor-learner demo (run under torchrun, role=trainer).

Consumes episodes from the experience channel, trains ``CartPoleLearner`` with a real
``lightning.Trainer`` and pushes the policy to the rollout workers every few optimizer
steps through ``WeightSyncCallback``. Stops once the rollout return (mean of the last
``demo.window`` episodes) reaches ``demo.target_return``, or at ``demo.time_budget_s``.

    torchrun ... --rdzv-backend=wsync --rdzv-conf role=trainer examples/cartpole/train.py wsync.every_n_steps=2
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from lightning.pytorch.loggers.logger import Logger
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader
from typing_extensions import override

sys.path.insert(0, str(Path(__file__).resolve().parent))
from algo import CartPoleLearner, EpisodeStream  # noqa: E402

from lightning_wsync import ExperienceReader, register_configs  # noqa: E402

CONF = Path(__file__).resolve().parents[2] / "conf"


class _Latest(Logger):
    """Keeps the newest value of each metric (the push reports) for the progress line."""

    def __init__(self) -> None:
        super().__init__()
        self.values: dict[str, float] = {}

    @property
    @override
    def name(self) -> str:
        return "latest"

    @property
    @override
    def version(self) -> int:
        return 0

    @override
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    @override
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.values.update(metrics)


class Episodes:
    """Pulls episodes off the channel, tracks returns by version, decides when to stop."""

    def __init__(self, cfg: DictConfig, out: Path) -> None:
        self.reader = iter(ExperienceReader(idle_timeout_s=cfg.demo.idle_timeout_s))
        self.target, self.window = float(cfg.demo.target_return), int(cfg.demo.window)
        self.budget_s = float(cfg.demo.time_budget_s)
        self.recent: deque[float] = deque(maxlen=self.window)
        self.started = time.monotonic()
        self.solved_at: float | None = None
        self.log = open(out / "episodes.jsonl", "w")  # noqa: SIM115 - closed in finish()
        self.count = 0
        self.last_version = -1

    def __call__(self) -> dict[str, torch.Tensor] | None:
        if self.solved_at is not None or time.monotonic() - self.started > self.budget_s:
            return None
        item = next(self.reader)
        version = int(item.pop("version"))
        item["version"] = torch.full_like(item["actions"], version)  # per step, as the loss expects
        ret = float(item["ep_returns"].sum())
        self.recent.append(ret)
        self.count += 1
        self.last_version = version
        wall = time.monotonic() - self.started
        self.log.write(json.dumps({"t": round(wall, 3), "version": version, "return": ret}) + "\n")
        if len(self.recent) == self.window and self.mean >= self.target:
            self.solved_at = wall
        return item

    @property
    def mean(self) -> float:
        return sum(self.recent) / max(1, len(self.recent))

    def finish(self) -> None:
        self.log.close()


class Progress(L.Callback):
    """One readable line every ``every_s`` seconds."""

    def __init__(self, episodes: Episodes, latest: _Latest, every_s: float) -> None:
        self.episodes, self.latest, self.every_s = episodes, latest, every_s
        self.next_print = 0.0

    @override
    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        now = time.monotonic()
        if now < self.next_print:
            return
        self.next_print = now + self.every_s
        m = self.latest.values
        ep = self.episodes
        sample_lag = getattr(trainer.lightning_module, "last_metrics", {}).get("lag_mean", 0.0)
        print(
            f"[trainer {now - ep.started:6.1f}s] version {trainer.global_step:4d} | "
            f"return(last {len(ep.recent)}) {ep.mean:6.1f} from versions <= {ep.last_version}, "
            f"sample lag {sample_lag:4.1f} versions | "
            f"push stall {1e3 * m.get('wsync/stall_s', 0):.2f} ms, delivery {1e3 * m.get('wsync/delivery_s', 0):.1f} ms | "
            f"receivers {int(m.get('wsync/delivered', 0))} ok {int(m.get('wsync/failed', 0))} failed, "
            f"slowest {int(m.get('wsync/version_lag', 0))} pushes behind",
            flush=True,
        )


@hydra.main(config_path=str(CONF), config_name="trainer", version_base="1.3")
def main(cfg: DictConfig) -> None:
    torch.set_num_threads(1)
    L.seed_everything(int(cfg.demo.seed), verbose=False)
    out = Path(cfg.demo.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    episodes = Episodes(cfg, out)
    latest = _Latest()
    learner = CartPoleLearner(**OmegaConf.to_container(cfg.learner))  # type: ignore[arg-type]
    stream = EpisodeStream(episodes, min_transitions=int(cfg.demo.min_transitions), reuse=int(cfg.demo.reuse))
    trainer = L.Trainer(
        callbacks=[hydra.utils.instantiate(cfg.wsync), Progress(episodes, latest, float(cfg.demo.print_every_s))],
        logger=latest,
        max_epochs=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **OmegaConf.to_container(cfg.trainer),  # type: ignore[arg-type]
    )
    trainer.fit(learner, DataLoader(stream, batch_size=None))
    episodes.finish()
    summary = {
        "solved": episodes.solved_at is not None,
        "seconds": episodes.solved_at,
        "versions": trainer.global_step,
        "episodes": episodes.count,
        "final_mean_return": episodes.mean,
        "target_return": episodes.target,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    verdict = f"reached {episodes.mean:.1f} >= {episodes.target:g}" if summary["solved"] else "did NOT reach the target"
    print(f"[trainer] done: {verdict} after {trainer.global_step} versions, {episodes.count} episodes", flush=True)


if __name__ == "__main__":
    register_configs()
    if os.environ.get("RANK", "0") != "0":
        raise SystemExit("the demo trainer runs one process: use --nproc-per-node=1")
    main()
