"""WeightSyncCallback: push a LightningModule's weights to rollout workers while it trains.

Longer than 300 lines: the public callback, its user-facing docstring (when, where, what
blocks) and each of Lightning's hooks it takes part in; the push decision is one pure
function (:func:`_should_push`) and the sending is :class:`~lightning_wsync._push.sender.WeightSender`'s.

::

    trainer = L.Trainer(max_steps=1000, callbacks=[WeightSyncCallback(every_n_steps=10, module="policy")])
    trainer.fit(model)  # store and job from $WSYNC_STORE / $WSYNC_JOB, or pass store= and job=

**When.** The version is ``trainer.global_step`` (optimizer steps, so gradient
accumulation counts once per step). One push when training starts (the initial
weights), one every ``every_n_steps``, one when it ends; never two for the same step.
Versions strictly increase: a step at or below the last version published for the job,
or recorded in the checkpoint being resumed, is skipped (logged at INFO).

**Where.** Single device and DDP (``"ddp"``, ``"ddp_spawn"``, ...): global rank 0 sends
the module's own tensors; the other ranks never talk to rollout workers. FSDP
(``FSDPStrategy``) and FSDP2 (``ModelParallelStrategy`` with ``fully_shard``): at each
push every rank takes part in gathering the full weights
(``get_model_state_dict(..., full_state_dict=True, cpu_offload=True)``), and rank 0 copies
them into a CPU mirror that it sends. Other strategies (DeepSpeed, XLA) are refused.
By default (``sharded="auto"``) a trainer of several ranks under DDP or FSDP2, on one
host or several, pushes *sharded*: no gather and no funnel; every rank snapshots its own
share (FSDP2: its local shards; replicated tensors: ~1/world of their bytes) into a
shared-memory ring of its own, and receivers apply a version only once every rank's share
of it is complete (docs/sharded.md). ``wsync/stall_s`` is then rank 0's own share. Where it
cannot (one rank, ``FSDPStrategy``, a tensor placement it cannot split, ``transport`` other
than ``"auto"``/``"shm"``, ``cross_host="star"``) the push is unsharded as
above and rank 0 says why once in the log (:attr:`WeightSyncCallback.unsharded_reason`).
``sharded=False`` always pushes unsharded; ``sharded=True`` fails where it cannot shard.

**Blocking.** A push blocks for the snapshot only (plus the gather under FSDP); delivery
reports are awaited by a daemon thread (``wsync-callback-reports``). With
``max_version_lag=K`` rank 0 also waits after each push, at most ``timeout_s``, until
the push K pushes back is confirmed: every receiver live at that push holds it (or a
newer version), or was reported failed. A receiver that stages versions (its relay
host's leader, a network link) holds one once it is staged and verified
(:attr:`PushReport.delivered`), not once its ``update()`` applied it; ``update()`` takes
the newest staged, so even with ``max_version_lag=0`` such a receiver skips a version when
its ``update()`` comes after the next one was staged. Under DDP the other ranks then wait
for rank 0 at their next collective. When training ends, rank 0 waits at most ``2 * timeout_s``
for the report of the last push, then closes the sender for good (receivers see
``sender_closed``). A ``fit()`` that raises (SIGTERM included) closes it without
waiting and not for good: receivers see ``sender_left`` and follow the next ``fit()``
or relaunched trainer of the job, whose versions continue above the last one.

**Metrics**, logged to the Trainer's loggers by rank 0 at the push step:

- ``wsync/version``, ``wsync/stall_s`` (snapshot, plus gather under FSDP), ``wsync/bytes``;
  ``wsync/lag_wait_s`` when ``max_version_lag`` is set;
- ``wsync/dropped``: pushes so far not published because receivers were still reading
  both snapshot slots (pushes faster than their copies; the next push carries newer
  weights; the final push waits up to ``timeout_s`` for a slot instead), and
  ``wsync/superseded``: network sends overwritten after a receiver stalled past the pin
  lease (both cumulative);
- from the newest push report completed since the previous push: ``wsync/report_version``,
  ``wsync/delivery_s`` (push to last delivery), ``wsync/delivered`` and ``wsync/failed``
  (receiver counts), and ``wsync/version_lag``: how many pushes, up to the one just before
  this push, the slowest receiver of that report is not known to hold (0: all of them
  confirmed). It counts pushes, not steps. When network receivers got that version as a
  delta: ``wsync/delta_bytes`` (on the wire, per receiver; compare ``wsync/bytes``),
  ``wsync/delta_receivers``, ``wsync/delta_changed_share``, ``wsync/delta_encode_s`` and,
  when reported in time, ``wsync/delta_decode_s`` (slowest receiver).

Longer than 300 lines: one Lightning callback per file (hooks, state, FSDP gather and
metrics), as Lightning's own callbacks are.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import FSDPStrategy
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from typing_extensions import override

from lightning_wsync._control.shards import Shares
from lightning_wsync._model import as_tensor, is_sharded, mirror_of, submodule
from lightning_wsync._planes.open import ShareWriter
from lightning_wsync._push.report import PushReport
from lightning_wsync._push.sender import WeightSender
from lightning_wsync._push.shard_choice import start_shares, why_unsharded
from lightning_wsync._push.waiter import ReportWaiter
from lightning_wsync.config import CallbackConfig, SenderConfig, config_values
from lightning_wsync.errors import WeightSyncError

log = logging.getLogger(__name__)

class WeightSyncCallback(Callback):
    """Pushes the weights of a LightningModule (or one submodule) to rollout workers.

    Args:
        every_n_steps: push every this many optimizer steps.
        module: attribute path of the submodule to send (``"policy"``, ``"model.policy"``);
            None sends the whole LightningModule.
        store: ``"host:port"`` or a ``torch.distributed.Store`` (default ``$WSYNC_STORE``).
        job: the job (run) name shared with the receivers (default ``$WSYNC_JOB``).
        max_version_lag: None (default) never waits for receivers; K >= 0 bounds how
            far the slowest receiver may fall behind (see the module docs).
        sharded: ``"auto"`` (default): with several ranks under DDP or FSDP2, every rank
            snapshots its own share into shared memory instead of rank 0 sending everything
            (after a gather under FSDP2); other hosts get each rank's share relayed (a chain
            per rank). Where it cannot, rank 0 sends everything and says why once
            (:attr:`unsharded_reason`). ``True``: sharded or an error; ``False``: never. See
            docs/sharded.md.
        sender: a whole :class:`~lightning_wsync.SenderConfig` instead of the flat options
            (``job``, when given, overrides its ``job``).
        options: the :class:`~lightning_wsync.SenderConfig` fields (``dtype``, ``include``,
            ``exclude``, ``bucket_mb``, ``timeout_s``, ``transport``, ``delta``, ...), when
            ``sender`` is not given. The shared secret defaults to ``$WSYNC_SECRET``.
    """

    def __init__(
        self,
        every_n_steps: int,
        module: str | None = None,
        store: str | dist.Store | None = None,
        job: str | None = None,
        *,
        max_version_lag: int | None = None,
        sharded: bool | str = "auto",
        sender: SenderConfig | None = None,
        **options: object,
    ) -> None:
        if store is not None and not isinstance(store, (str, dist.Store)):
            raise TypeError(
                f"WeightSyncCallback: store={store!r} must be 'host:port', a torch.distributed.Store, or None"
            )
        values = config_values(SenderConfig, sender, options, owner="WeightSyncCallback", param="sender", job=job)
        self.config = CallbackConfig(
            every_n_steps=every_n_steps, module=module, store=store if isinstance(store, str) else None,
            max_version_lag=max_version_lag, sharded=sharded, **values,
        )  # fmt: skip
        #: What the WeightSender is built with.
        self.sender_config = self.config.sender_config()
        self._store = store
        self._last_pushed: int | None = None  # identical on every rank; saved in checkpoints
        self._floor: int | None = None  # pushes must be above this (checkpoint and store)
        self._restored: int | None = None  # last_pushed_version of the checkpoint resumed from
        self._published: int | None = None  # the store's newest version when this fit started
        self._sharded = False  # the strategy shards weights: gather them for rank 0, unless pushing sharded
        self._shares: Shares | None = None  # sharded push: this rank's share
        self._writer: ShareWriter | None = None  # sharded push, ranks other than 0
        self._sender: WeightSender | None = None
        self._target: nn.Module | None = None
        self._mirror: dict[str, torch.Tensor] = {}
        self._skipped: int | None = None
        self._reports: ReportWaiter | None = None
        self._pushes = 0
        self._held: dict[str, int] = {}  # receiver name -> index of the newest push it is known to hold
        self._failing: set[str] = set()  # receivers that failed the newest report (warned once)
        self._sharded_push = False  # this fit pushes sharded (kept after it ends, unlike _shares)
        self._unsharded_reason: str | None = None  # this fit's, when it pushes unsharded
        self._said: set[str] = set()  # reasons already logged (once per callback)

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(job=self.config.job, module=self.config.module)

    @property
    def sender(self) -> WeightSender | None:
        """The :class:`~lightning_wsync.WeightSender` on this rank (global rank 0 while training), else None."""
        return self._sender

    @property
    def sharded_push(self) -> bool:
        """Whether this fit pushes sharded (every rank its share); False before it starts."""
        return self._sharded_push

    @property
    def unsharded_reason(self) -> str | None:
        """Why this fit pushes unsharded (rank 0 sends everything), or None when it pushes sharded."""
        return self._unsharded_reason

    @property
    def last_pushed_version(self) -> int | None:
        """The newest version pushed, here or in the run this one resumed (same on every rank)."""
        return self._last_pushed

    # -- hooks --------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._sharded = is_sharded(trainer.strategy)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Start before Lightning fetches the first batch: in an actor-learner loop that
        # batch comes from rollout workers waiting for these initial weights. A resumed
        # run pushes in on_train_start instead, once global_step is restored. FSDP and
        # ModelParallel restore a checkpoint only after this hook (trainer.ckpt_path is
        # still None here, the weights not yet loaded): their first push waits for
        # on_train_start too, so a resumed run never publishes its initial weights.
        late_restore = trainer.strategy.restore_checkpoint_after_setup
        self._start(trainer, pl_module, push=trainer.ckpt_path is None and not late_restore)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._target is None:
            self._start(trainer, pl_module, push=False)
        self._maybe_push(trainer, None)

    def _start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *, push: bool) -> None:
        self._target = submodule(pl_module, self.config.module)
        self._pushes, self._held, self._failing = 0, {}, set()
        why = why_unsharded(self.config.sharded, self.sender_config, trainer.strategy, trainer.world_size)
        self._shares, self._unsharded_reason = None, why
        if why is None:  # None under sharded="auto" when a share cannot be cut (then the reason is kept)
            self._shares, self._writer, self._unsharded_reason = start_shares(
                self._target, self.sender_config, trainer.global_rank, trainer.world_size,
                auto=self.config.sharded == "auto")  # fmt: skip
        self._sharded_push = self._shares is not None
        self._say_path(trainer)
        full = self._gather(trainer) if self._gathers else None
        latest: int | None = None
        error: str | None = None
        epoch, store = 0, None  # a sharded push's other ranks relay their shares under rank 0's epoch and store
        if trainer.is_global_zero:
            try:
                source = self._target if full is None else mirror_of(self._target, full, self._mirror)
                self._sender = WeightSender(source, store=self._store, config=self.sender_config, shares=self._shares)
                latest, epoch, store = self._sender.latest_version, self._sender.epoch, self._sender.store_address
                self._reports = ReportWaiter(self._sender.config.timeout_s)
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
                if trainer.world_size > 1:  # let the other ranks leave the broadcast below
                    trainer.strategy.broadcast((None, error, 0, None), src=0)
                raise
        # Every rank must agree on the floor: under FSDP each push is a collective.
        latest, error, epoch, store = trainer.strategy.broadcast((latest, error, epoch, store), src=0)
        if error is not None:
            raise WeightSyncError(f"WeightSyncCallback: global rank 0 could not start its WeightSender: {error}")
        if self._writer is not None:  # a Store object is this rank's own; an address is rank 0's (port 0 resolved)
            try:
                self._writer.relay(self._store if isinstance(self._store, dist.Store) else store, epoch,
                                   self.sender_config)  # fmt: skip
            except (WeightSyncError, ValueError, OSError) as exc:  # raising here alone would hang the other ranks
                log.error("WeightSyncCallback: trainer rank %d cannot relay its share to other hosts (%s): "
                          "receivers there apply no version of this run", trainer.global_rank, exc)  # fmt: skip
        self._published = latest
        floors = [v for v in (self._last_pushed, latest) if v is not None]
        self._floor = max(floors) if floors else None
        if push:
            self._maybe_push(trainer, full)

    def _say_path(self, trainer: pl.Trainer) -> None:
        """Rank 0 says once which path a fit pushes by, and why when unsharded with several ranks."""
        why = self._unsharded_reason
        said = "sharded" if why is None else why
        if not trainer.is_global_zero or said in self._said:
            return
        self._said.add(said)
        if why is None:
            log.info("WeightSyncCallback: sharded push: each of the %d trainer ranks writes its own share "
                     "(sharded=%r; docs/sharded.md)", trainer.world_size, self.config.sharded)  # fmt: skip
            return
        level = logging.WARNING if trainer.world_size > 1 and self.config.sharded == "auto" else logging.INFO
        gathers = " after gathering the full weights" if self._sharded else ""
        log.log(level, "WeightSyncCallback: unsharded push (rank 0 sends every version%s): %s", gathers, why)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step % self.config.every_n_steps == 0:
            self._maybe_push(trainer, None)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._maybe_push(trainer, None, final=True)
        self._close(trainer, flush=True, final=True)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Any exception, SIGTERM (Lightning raises SIGTERMException) included: the trainer
        # may be relaunched, so receivers must keep following the job, not end.
        self._close(trainer, flush=False, final=False)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close(trainer, flush=True, final=False)  # a finished fit() closed in on_train_end

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"last_pushed_version": self._last_pushed}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        version = state_dict.get("last_pushed_version")
        self._last_pushed = self._restored = None if version is None else int(version)
        if self._target is not None and self._last_pushed is not None:
            # FSDP and ModelParallel restore callbacks after on_fit_start, where the floor
            # was set: raise it now (every rank loads the same checkpoint).
            self._floor = max(self._last_pushed, -1 if self._floor is None else self._floor)

    # -- pushing --------------------------------------------------------------------
    def _maybe_push(
        self, trainer: pl.Trainer, gathered: dict[str, torch.Tensor] | None, *, final: bool = False
    ) -> None:
        """Push ``global_step`` if it is above every version seen; the same decision on every rank."""
        step = trainer.global_step
        if not _should_push(step=step, floor=self._floor, restored=self._restored, published=self._published,
                             pushes=self._pushes):  # fmt: skip
            if step != self._last_pushed and step != self._skipped:
                self._skipped = step
                log.info("WeightSyncCallback: step %d not pushed: version %d is already published or recorded "
                         "in the resumed checkpoint, and versions must increase", step, self._floor)  # fmt: skip
            return
        started = time.perf_counter()
        wait_s = self.config.timeout_s if final else 0.0
        full = gathered if gathered is not None or not self._gathers else self._gather(trainer)
        self._floor = self._last_pushed = step
        if self._writer is not None:
            self._writer.write(step, wait_for_slot_s=wait_s)
            return
        if self._sender is None:
            return
        if full is not None:
            for name, tensor in self._mirror.items():
                tensor.copy_(full[name])
        # The final weights must not be dropped for want of a free slot; the run is over,
        # so a bounded wait for a reader to finish its copy costs training nothing.
        handle = self._sender.push(step, wait_for_slot_s=wait_s)
        metrics = {
            "wsync/version": float(step),
            "wsync/stall_s": time.perf_counter() - started,
            "wsync/bytes": float(self._sender.layout.total_bytes),
            "wsync/dropped": float(self._sender.dropped_pushes),
            "wsync/superseded": float(self._sender.superseded_sends),
        }
        assert self._reports is not None
        metrics.update(self._report_metrics(self._reports.take()))
        if handle.dropped:
            log.debug("WeightSyncCallback: version %d dropped (receivers still copying both slots)", step)
            _log_metrics(trainer, metrics)
            return
        self._pushes += 1
        self._reports.add(self._pushes, handle)
        lag = self.config.max_version_lag
        if lag is not None:
            waited = time.perf_counter()
            if not self._reports.wait_confirmed(self._pushes - lag, self.config.timeout_s):
                log.warning("WeightSyncCallback: receivers are still more than max_version_lag=%d versions "
                            "behind after timeout_s=%s; training goes on", lag, self.config.timeout_s)  # fmt: skip
            metrics["wsync/lag_wait_s"] = time.perf_counter() - waited
        log.debug("pushed version %d: %s", step, metrics)
        _log_metrics(trainer, metrics)

    @property
    def _gathers(self) -> bool:
        """Each push gathers the full weights first (a collective): sharded training, pushed unsharded."""
        return self._sharded and self._shares is None

    def _gather(self, trainer: pl.Trainer) -> dict[str, torch.Tensor]:
        """The target's full weights on global rank 0 (empty elsewhere). A collective."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        if isinstance(trainer.strategy, FSDPStrategy):
            # FSDP1 gathers through the root wrapper only; keep the target's part.
            assert trainer.strategy.model is not None
            full = get_model_state_dict(trainer.strategy.model, options=options)
            prefix = "" if self.config.module is None else self.config.module + "."
            return {k[len(prefix) :]: as_tensor(k, v) for k, v in full.items() if k.startswith(prefix)}
        assert self._target is not None
        return {k: as_tensor(k, v) for k, v in get_model_state_dict(self._target, options=options).items()}

    def _report_metrics(self, reports: list[tuple[int, PushReport]]) -> dict[str, float]:
        """Metrics of the newest of ``reports`` (empty if none); see the module docs."""
        for index, report in reports:
            for name in report.delivered:
                self._held[name] = index
            for name, reason in report.failed.items():
                level = logging.DEBUG if name in self._failing else logging.WARNING
                log.log(level, "WeightSyncCallback: receiver %r did not get version %d: %s",
                        name, report.version, reason)  # fmt: skip
            self._failing = set(report.failed)
        if not reports:
            return {}
        _, report = reports[-1]
        metrics = {
            "wsync/report_version": float(report.version),
            "wsync/delivered": float(len(report.delivered)),
            "wsync/failed": float(len(report.failed)),
        }
        if report.latency_s is not None:
            metrics["wsync/delivery_s"] = report.latency_s
        if report.delta_bytes is not None:
            metrics["wsync/delta_bytes"] = float(report.delta_bytes)
            metrics["wsync/delta_receivers"] = float(len(report.delta_receivers))
        for key in ("delta_changed_share", "delta_encode_s", "delta_decode_s"):
            value = getattr(report, key)
            if value is not None:
                metrics[f"wsync/{key}"] = float(value)
        names = [*report.delivered, *report.failed]
        if names:
            metrics["wsync/version_lag"] = float(self._pushes - min(self._held.get(n, 0) for n in names))
        return metrics

    def _close(self, trainer: pl.Trainer, *, flush: bool, final: bool) -> None:
        sender, reports, writer = self._sender, self._reports, self._writer
        self._sender, self._reports, self._mirror, self._writer, self._shares = None, None, {}, None, None
        if writer is not None:  # flushing waits (bounded) for rank 0's close: the last push may need this share
            writer.close(flush_timeout_s=2 * self.config.timeout_s if flush else 0.0)
        if reports is not None:
            reports.close(flush=flush)  # flushing waits (bounded) for the last push's report
            metrics = self._report_metrics(reports.take())
            if flush and metrics:
                _log_metrics(trainer, metrics)
        if sender is not None:
            sender.close(flush_timeout_s=0, final=final)  # already awaited above


def _should_push(*, step: int, floor: int | None, restored: int | None, published: int | None, pushes: int) -> bool:
    """Whether the callback pushes ``step``: a pure function (logging, gathering and pushing stay in
    ``_maybe_push``), so the decision can be read and tested apart.

    A step is pushed when it is above every version seen (``floor``: the newest on the store
    at start, the resumed checkpoint's, or the last pushed). One more case: resuming at the step
    the checkpoint last pushed (``restored``), before any push of this run, on a store that does
    not hold it (``published`` below it: a relaunched trainer with a fresh store): those are that
    version's weights, published again so late receivers get them at once.
    """
    republish = pushes == 0 and step == restored and (-1 if published is None else published) < step
    return floor is None or step > floor or republish


def _log_metrics(trainer: pl.Trainer, metrics: dict[str, float]) -> None:
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)
