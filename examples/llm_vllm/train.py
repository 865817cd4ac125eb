"""Trainer side of the LLM demo: policy gradient on the engine's samples, pushed every N steps.

A real ``lightning.Trainer`` fits ``DigitsLearner`` (the tiny Llama) on batches read from
the experience channel: REINFORCE with the group mean as baseline (GRPO-style). The
``WeightSyncCallback`` pushes the policy every ``--every-n-steps`` optimizer steps; it
hosts the store at ``WSYNC_STORE``. Stops once the mean reward of the last
``--window`` batches reaches ``--target`` (or after ``--budget-s``).

    python examples/llm_vllm/train.py MODEL_DIR OUT_DIR [--every-n-steps 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from typing_extensions import override

sys.path.insert(0, str(Path(__file__).resolve().parent))
from task import GROUP, PROMPTS

from lightning_wsync import ExperienceReader, WeightSyncCallback


class DigitsLearner(L.LightningModule):
    def __init__(self, model_dir: str, lr: float) -> None:
        super().__init__()
        self.policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(model_dir)
        self.prompt_ids = [tok(p).input_ids for p in PROMPTS]
        self.pad = int(tok.pad_token_id)
        self.lr = lr

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        completion, reward = batch["completion"], batch["reward"]
        groups = reward.view(-1, GROUP)
        advantage = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).view(-1)
        # prompt + completion, right-padded; only completion tokens carry the loss.
        rows = [self.prompt_ids[int(p)] + c.tolist() for p, c in zip(batch["prompt"], completion)]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad)
        mask = torch.zeros(len(rows), width, dtype=torch.bool)
        for i, (row, p) in enumerate(zip(rows, batch["prompt"])):
            ids[i, : len(row)] = torch.tensor(row)
            mask[i, len(self.prompt_ids[int(p)]) : len(row)] = True
        logits = self.policy(input_ids=ids, attention_mask=(ids != self.pad) | mask).logits[:, :-1]
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
        target_mask = mask[:, 1:]
        token_logp = (logp * target_mask).sum(1) / target_mask.sum(1)
        loss = -(advantage * token_logp).mean()
        self.log("reward", reward.mean(), prog_bar=False)
        return loss

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.policy.parameters(), lr=self.lr)


class Batches(IterableDataset[dict[str, torch.Tensor]]):
    """Batches off the channel; ends once the reward target is met or the budget is spent."""

    def __init__(self, target: float, window: int, budget_s: float, out: Path) -> None:
        self.reader = ExperienceReader(idle_timeout_s=300)
        self.target, self.budget_s = target, budget_s
        self.recent: deque[float] = deque(maxlen=window)
        self.started = time.monotonic()
        self.solved_at: float | None = None
        self.log = open(out / "trainer.jsonl", "w")  # noqa: SIM115 - closed by main()
        self.count = 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for item in self.reader:
            wall = time.monotonic() - self.started
            version = int(item.pop("version"))
            reward = float(item["reward"].mean())
            self.recent.append(reward)
            self.count += 1
            self.log.write(json.dumps({"t": round(wall, 3), "version": version, "reward": round(reward, 4)}) + "\n")
            if self.count % 5 == 0:
                mean = sum(self.recent) / len(self.recent)
                print(f"[trainer {wall:6.1f}s] batch {self.count:4d} from version {version:4d} | "
                      f"reward(last {len(self.recent)}) {mean:.3f}", flush=True)  # fmt: skip
            yield item
            if len(self.recent) == self.recent.maxlen and sum(self.recent) / len(self.recent) >= self.target:
                self.solved_at = wall
                return
            if wall > self.budget_s:
                return


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--every-n-steps", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("--window", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=600)
    args = ap.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    out = Path(args.out_dir)
    batches = Batches(args.target, args.window, args.budget_s, out)
    learner = DigitsLearner(args.model_dir, args.lr)
    trainer = L.Trainer(
        callbacks=[WeightSyncCallback(every_n_steps=args.every_n_steps, module="policy", timeout_s=120)],
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )
    trainer.fit(learner, DataLoader(batches, batch_size=None))
    batches.log.close()
    summary: dict[str, Any] = {
        "solved": batches.solved_at is not None,
        "seconds": batches.solved_at,
        "final_mean_reward": sum(batches.recent) / max(1, len(batches.recent)),
        "target_reward": args.target,
        "versions": trainer.global_step,
        "batches": batches.count,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"[trainer] done: {json.dumps(summary)}", flush=True)


if __name__ == "__main__":
    main()
