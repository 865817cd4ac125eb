"""Rollout app of the CartPole actor-learner demo (run under torchrun, role=rollout).

Keeps a ``Policy`` at the newest weights the trainer published (``WeightReceiver``),
plays CartPole-v1 episodes with it between updates, and sends each episode back on the
experience channel tagged with the version that played it. Exits 0 once the trainer
has closed and the final version is applied.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from algo import Policy, make_env, run_episode  # noqa: E402

from lightning_wsync import (  # noqa: E402
    ExperienceWriter,
    WeightReceiver,
    WeightSyncClosedError,
    WeightSyncStoreError,
    WeightSyncTimeoutError,
    register_configs,
)

CONF = Path(__file__).resolve().parents[2] / "conf"


@hydra.main(config_path=str(CONF), config_name="rollout", version_base="1.3")
def main(cfg: DictConfig) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    seed = int(cfg.rollout.seed) + 1000 * rank + 100_000 * restart
    out = Path(cfg.rollout.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    policy = Policy(hidden=int(cfg.rollout.hidden))
    env = make_env(seed=seed)
    generator = torch.Generator().manual_seed(seed)
    writer = ExperienceWriter(capacity=int(cfg.rollout.channel_capacity))
    log = (out / f"rollout-{rank}-{os.getpid()}.jsonl").open("w")
    started = time.time()
    with WeightReceiver(policy, store=cfg.store, config=OmegaConf.to_object(cfg.wsync)) as receiver:
        receiver.wait_for_version(0, timeout_s=float(cfg.rollout.first_version_timeout_s))
        episodes = 0
        try:
            while True:
                receiver.update()
                if receiver.sender_closed and receiver.update() is None:
                    break
                version = receiver.version
                assert version is not None
                episode = run_episode(env, policy, generator, version=version)
                episode.pop("version")  # the channel tags the whole episode with it
                ret = float(episode["ep_returns"].sum())
                log.write(json.dumps({"t": round(time.time() - started, 3), "version": version, "return": ret}) + "\n")
                episodes += 1
                if not writer.put(episode, version=version, block=False):
                    try:  # the learner is saturated: wait for fresher weights instead of piling up
                        receiver.wait_for_version(version + 1, timeout_s=1.0)
                    except (WeightSyncTimeoutError, WeightSyncClosedError):
                        pass
        except WeightSyncStoreError as exc:
            print(f"[rollout {rank}] store gone, stopping: {exc}", flush=True)
        print(f"[rollout {rank}] done: {episodes} episodes, final version {receiver.version}", flush=True)
    log.close()


if __name__ == "__main__":
    register_configs()
    main()
