"""What the Lightning trainers of the tests and of ``lightning-wsync bench --trainer-ranks``
share: a logger that keeps every metric in memory, and the arguments of a quiet CPU run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override


class RecordingLogger(Logger):
    """Keeps every ``log_metrics`` call in memory (on rank 0, as Lightning logs)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int | None, dict[str, float]]] = []

    @property
    @override
    def name(self) -> str:
        return "recording"

    @property
    @override
    def version(self) -> int:
        return 0

    @override
    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    @override
    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((step, dict(metrics)))

    def values(self, key: str) -> list[float]:
        """Every value logged under ``key``, in order."""
        return [m[key] for _, m in self.rows if key in m]


def trainer_kwargs(root_dir: Path | str, **overrides: Any) -> dict[str, Any]:
    """``pl.Trainer`` arguments for a run on CPU with no checkpoints, progress bar, model
    summary or sanity check, writing under ``root_dir``; ``overrides`` win."""
    kwargs: dict[str, Any] = {
        "accelerator": "cpu", "devices": 1, "default_root_dir": str(root_dir), "enable_checkpointing": False,
        "enable_progress_bar": False, "enable_model_summary": False, "num_sanity_val_steps": 0,
    }  # fmt: skip
    kwargs.update(overrides)
    return kwargs
