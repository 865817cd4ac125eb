"""Single-machine prototype of the lagged actor/learner loop, WITHOUT lightning_wsync.

* ``--actors`` rollout processes (spawned), each acting with the last weights it
  received; new weights arrive through a per-actor queue (latest wins) every
  ``--push-every`` learner optimizer steps and are picked up between episodes, so
  actors keep acting with stale weights in between (realistic version lag).
* Experience goes back through ONE bounded queue (``--queue-episodes``) as plain
  numpy arrays, each sample tagged with the version that produced it.
* The learner is a real ``lightning.Trainer`` (CPU, no logger, no progress bar)
  fitting ``CartPoleLearner`` on an ``EpisodeStream`` IterableDataset fed by that queue.
* Stops when the mean return of the last ``--window`` episodes reaches ``--target``.

Usage::

    .venv/bin/python examples/cartpole/prototype.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import queue
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@dataclass
class _Tracker:
    window: int
    returns: deque[float] = field(default_factory=deque)
    episodes: int = 0
    steps: int = 0
    solved_s: float | None = None
    first_ep_s: float | None = None
    lags: list[int] = field(default_factory=list)
    # (seconds, learner version when consumed, behaviour version, return)
    curve: list[tuple[float, int, int, float]] = field(default_factory=list)
    last_print: float = 0.0

    def __post_init__(self) -> None:
        self.returns = deque(maxlen=self.window)


def actor_main(
    rank: int, seed: int, weights_q: Any, exp_q: Any, stop_ev: Any, hidden: int
) -> None:
    import torch

    torch.set_num_threads(1)
    from algo import Policy, make_env, run_episode

    exp_q.cancel_join_thread()  # do not hang at exit on unread experience
    policy = Policy(hidden)
    version = -1
    env = make_env(seed * 1000 + rank)
    gen = torch.Generator().manual_seed(seed * 1000 + rank + 7)
    # Wait for the initial weights (version 0), then go.
    while version < 0 and not stop_ev.is_set():
        try:
            msg = weights_q.get(timeout=0.5)
        except queue.Empty:
            continue
        version = msg["version"]
        policy.load_state_dict(
            {k: torch.from_numpy(v) for k, v in msg["state"].items()}
        )
    while not stop_ev.is_set():
        latest = None
        while True:  # drain: keep only the newest weights
            try:
                latest = weights_q.get_nowait()
            except queue.Empty:
                break
        if latest is not None:
            version = latest["version"]
            policy.load_state_dict(
                {k: torch.from_numpy(v) for k, v in latest["state"].items()}
            )
        ep = {k: v.numpy() for k, v in run_episode(env, policy, gen, version).items()}
        while not stop_ev.is_set():
            try:
                exp_q.put(ep, timeout=0.5)  # bounded: blocks when the learner lags
                break
            except queue.Full:
                continue


def run(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    import lightning as L
    import torch

    torch.set_num_threads(1)
    from algo import CartPoleLearner, EpisodeStream

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)

    ctx = mp.get_context("spawn")
    L.seed_everything(seed, verbose=False)
    model = CartPoleLearner(
        hidden=args.hidden,
        lr=args.lr,
        ent_coef=args.ent_coef,
        clip=args.clip,
        lam=args.lam,
        log_metrics=False,
    )
    stop_ev = ctx.Event()
    exp_q = ctx.Queue(maxsize=args.queue_episodes)
    wqs = [ctx.Queue(maxsize=4) for _ in range(args.actors)]

    def push(version: int) -> None:
        state = {
            k: v.detach().numpy().copy() for k, v in model.policy.state_dict().items()
        }
        for q in wqs:
            while True:  # drop anything the actor has not picked up yet
                try:
                    q.get_nowait()
                except queue.Empty:
                    break
            try:
                q.put_nowait({"version": version, "state": state})
            except queue.Full:
                pass

    t0 = time.perf_counter()
    procs = [
        ctx.Process(
            target=actor_main,
            args=(r, seed, wqs[r], exp_q, stop_ev, args.hidden),
            daemon=True,
        )
        for r in range(args.actors)
    ]
    for p in procs:
        p.start()
    push(0)

    log = _Tracker(args.window, last_print=t0)

    def get_episode() -> dict[str, torch.Tensor] | None:
        while True:
            now = time.perf_counter()
            if now - t0 > args.time_limit:
                return None
            try:
                ep = exp_q.get(timeout=1.0)
                break
            except queue.Empty:
                if not all(p.is_alive() for p in procs):
                    raise RuntimeError("an actor died")
        now = time.perf_counter()
        if log.first_ep_s is None:
            log.first_ep_s = now - t0
        ret, behaviour_version = float(ep["ep_returns"][0]), int(ep["version"][0])
        log.returns.append(ret)
        log.episodes += 1
        log.steps += len(ep["actions"])
        log.lags.append(model.global_step - behaviour_version)
        mean = float(np.mean(log.returns))
        log.curve.append(
            (round(now - t0, 2), model.global_step, behaviour_version, ret)
        )
        if now - log.last_print > args.print_every:
            log.last_print = now
            print(
                f"  t={now - t0:6.1f}s  version={model.global_step:5d}  "
                f"episodes={log.episodes:5d}  env_steps={log.steps:7d}  "
                f"mean{args.window}={mean:6.1f}  lag(last 50)={np.mean(log.lags[-50:]):.1f}",
                flush=True,
            )
        if len(log.returns) >= args.window and mean >= args.target:
            log.solved_s = now - t0
            return None  # ends the IterableDataset -> the epoch -> fit()
        return {k: torch.from_numpy(v) for k, v in ep.items()}

    class Push(L.Callback):
        def on_train_batch_end(
            self,
            trainer: L.Trainer,
            pl_module: L.LightningModule,
            outputs: Any,
            batch: Any,
            batch_idx: int,
        ) -> None:
            if trainer.global_step % args.push_every == 0:
                push(trainer.global_step)

    ds = EpisodeStream(
        get_episode, min_transitions=args.min_transitions, reuse=args.reuse
    )
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[Push()],
    )
    try:
        trainer.fit(model, dl)
    finally:
        stop_ev.set()
        for p in procs:
            p.join(timeout=3)
            if p.is_alive():
                p.terminate()
    total = time.perf_counter() - t0
    res = {
        "seed": seed,
        "solved_s": log.solved_s,
        "startup_s": log.first_ep_s,
        "versions": model.global_step,
        "episodes": log.episodes,
        "env_steps": log.steps,
        "lag_mean": float(np.mean(log.lags)) if log.lags else None,
        "lag_p90": float(np.percentile(log.lags, 90)) if log.lags else None,
        "total_s": total,
    }
    if args.curve_dir:
        os.makedirs(args.curve_dir, exist_ok=True)
        with open(os.path.join(args.curve_dir, f"curve_seed{seed}.json"), "w") as f:
            json.dump(log.curve, f)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--push-every", type=int, default=2)
    ap.add_argument("--min-transitions", type=int, default=1024)
    ap.add_argument("--reuse", type=int, default=4)
    ap.add_argument("--queue-episodes", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2.5e-3)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--lam", type=float, default=0.95)
    ap.add_argument("--ent-coef", type=float, default=0.0)
    ap.add_argument("--target", type=float, default=195.0)
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--time-limit", type=float, default=240.0)
    ap.add_argument("--print-every", type=float, default=5.0)
    ap.add_argument("--curve-dir", default=None)
    args = ap.parse_args()

    import warnings

    warnings.filterwarnings("ignore")

    results = []
    for seed in args.seeds:
        print(f"seed {seed}:", flush=True)
        r = run(args, seed)
        results.append(r)
        print("  result:", json.dumps(r), flush=True)
    solved = [r["solved_s"] for r in results if r["solved_s"] is not None]
    print(
        f"solved {len(solved)}/{len(results)}; seconds to {args.target}: "
        f"{[round(s, 1) for s in solved]}  mean={np.mean(solved) if solved else float('nan'):.1f}"
    )


if __name__ == "__main__":
    main()
