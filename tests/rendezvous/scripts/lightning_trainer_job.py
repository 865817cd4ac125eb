"""A Lightning trainer under torchrun that checkpoints and resumes (for the restart test).

Pushes every 2 optimizer steps through WeightSyncCallback, checkpoints every 4, and on
start resumes from ``<out>/ckpt/last.ckpt`` when it exists. Each step takes ``--step-s``
of simulated compute so the test can kill it mid-run. At the end it reports the
digest of the trained weights.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from _report import emit
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, IterableDataset

from lightning_wsync import WeightSyncCallback
from lightning_wsync.testing.models import digest


class Noise(IterableDataset[torch.Tensor]):
    def __iter__(self):  # type: ignore[no-untyped-def]
        g = torch.Generator().manual_seed(0)
        while True:
            yield torch.randn(8, 4, generator=g)


class Learner(pl.LightningModule):
    def __init__(self, step_s: float) -> None:
        super().__init__()
        self.policy = torch.nn.Linear(4, 2)
        self.step_s = step_s

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        time.sleep(self.step_s)  # simulated compute, so the test can kill mid-run
        return self.policy(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--step-s", type=float, default=0.05)
    args = parser.parse_args()
    torch.manual_seed(0)
    ckpt_dir = args.out / "ckpt"
    last = ckpt_dir / "last.ckpt"
    resume = str(last) if last.exists() else None
    emit(args.out, "start", resume=resume)
    learner = Learner(args.step_s)
    trainer = pl.Trainer(
        max_steps=args.max_steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[WeightSyncCallback(every_n_steps=2, module="policy", timeout_s=10),
                   ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=4, save_last=True)],
    )  # fmt: skip
    trainer.fit(learner, DataLoader(Noise(), batch_size=None), ckpt_path=resume)
    emit(args.out, "done", step=trainer.global_step, digest=digest(learner.policy))


if __name__ == "__main__":
    main()
