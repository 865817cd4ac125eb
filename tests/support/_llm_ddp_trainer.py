"""A real Lightning trainer of 2 CPU ranks (DDP, gloo) fitting the tiny Llama in MODEL_DIR, with
``WeightSyncCallback`` at its defaults (sharded on: each rank writes its own share) pushing every
step and waiting for the engine to hold each version (``max_version_lag=0``). Rank 0 saves the
pushed weights of every version to ``OUT/v<N>.pt``; each rank writes ``OUT/rank<R>.json`` (the
path the callback took, the versions it pushed).

    python _llm_ddp_trainer.py MODEL_DIR OUT --store HOST:PORT --job JOB [--max-steps 4]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_wsync.callback import WeightSyncCallback
from lightning_wsync.testing.trainers import RecordingLogger, trainer_kwargs

warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)


class TinyLlama(pl.LightningModule):
    def __init__(self, model_dir: str) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.02)  # large steps: greedy tokens change per version


class _SaveVersions(pl.Callback):
    """After WeightSyncCallback: rank 0 saves the weights of each version pushed (DDP: every rank holds them)."""

    def __init__(self, sync: WeightSyncCallback, out: Path) -> None:
        self.sync = sync
        self.out = out
        self._seen: int | None = None

    def _save(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        version = self.sync.last_pushed_version
        if version is None or version == self._seen or not trainer.is_global_zero:
            return
        self._seen = version
        state = {k: v.detach().clone() for k, v in pl_module.model.state_dict().items()}
        torch.save(state, self.out / f"v{version}.pt.tmp")
        os.replace(self.out / f"v{version}.pt.tmp", self.out / f"v{version}.pt")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._save(trainer, pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._save(trainer, pl_module)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("out")
    parser.add_argument("--store", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--max-steps", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    sync = WeightSyncCallback(every_n_steps=1, module="model", store=args.store, job=args.job, max_version_lag=0,
                              timeout_s=120)  # fmt: skip  (no sharded=, no sender options: the defaults)
    logger = RecordingLogger()
    trainer = pl.Trainer(**trainer_kwargs(out, devices=2, strategy="ddp", max_steps=args.max_steps, logger=logger,
                                          callbacks=[sync, _SaveVersions(sync, out)]))  # fmt: skip
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randint(3, 512, (64, 16), generator=g))
    trainer.fit(TinyLlama(args.model_dir), train_dataloaders=torch.utils.data.DataLoader(data, batch_size=4))
    record = {
        "sharded_push": sync.sharded_push,
        "unsharded_reason": sync.unsharded_reason,
        "versions": [int(v) for v in logger.values("wsync/version")],
        "delivered": logger.values("wsync/delivered"),
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as _lightning_workers.py: no interpreter teardown under gloo's worker threads


if __name__ == "__main__":
    main()
