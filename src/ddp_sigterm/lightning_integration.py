"""Lightning integration: a callback that makes every rank stop at the same step on SIGTERM.

Installed through the ``lightning.pytorch.callbacks_factory`` entry point, so an unchanged script
gets it. What it changes in the Trainer it is attached to, for the duration of a run:

* Lightning's SIGTERM notifier (which broadcasts from inside the signal handler in 2.5.2+) is
  replaced by :meth:`SignalRecorder.record`; Lightning still composes, chains and restores the
  handlers. ``trainer.received_sigterm`` stays False until the stop is agreed, so Lightning's three
  raises on the local flag never fire before the agreement.
* The per-batch broadcast from rank 0 in the training epoch loop (2.5.2+) is switched off.
* Under SLURM with auto-requeue, Lightning's requeue handler (which saves and runs ``scontrol
  requeue`` inside the handler) is replaced by the same recorder: the requeue signal stops the job
  like SIGTERM, and after the stop checkpoint global rank 0 requeues the job, once.
* At every optimizer-step boundary and every evaluation batch end the coordinator is asked
  ``should_stop``; at the agreed stop each rank saves ``hpc_ckpt_<N>.ckpt`` (during ``fit``) and
  raises ``SIGTERMException(128 + signal)``, which Lightning routes through ``on_exception``. A save
  or requeue that fails on any rank makes every rank raise :class:`StopError` instead.
* Evaluation and prediction loops may run a different number of batches per rank (prediction
  shards without padding): at the first hook after such a loop (``on_*_epoch_end``) each rank
  waits, still agreeing, until every rank has left it.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from ddp_sigterm import slurm
from ddp_sigterm.coordinator import StopCoordinator
from ddp_sigterm.settings import Settings


class StopError(RuntimeError):
    """Saving the agreed stop checkpoint (or requeueing the job) failed on some rank; every rank
    raises it, and the message names the rank, the step and the reason."""


class UnisonStop(Callback):
    """Stop every rank at the same step when any process of the job receives a stop signal.

    Pass it explicitly to choose settings (``Trainer(callbacks=[UnisonStop(max_delay=0.5)])``); the
    instance added by the entry point then steps aside. ``DDP_SIGTERM_*`` variables override the
    arguments (see :class:`ddp_sigterm.Settings`).
    """

    def __init__(self, settings: Settings | None = None, **overrides: Any) -> None:
        if settings is not None and overrides:
            raise TypeError("UnisonStop takes either settings or keyword overrides, not both")
        base = dataclasses.asdict(settings) if settings is not None else overrides
        self.settings = Settings.resolve(**base)
        self.auto_registered = False
        self._coordinator: StopCoordinator | None = None
        self._trainer: pl.Trainer | None = None

    # -- set-up and tear-down ------------------------------------------------------------------
    def _steps_aside(self, trainer: pl.Trainer) -> bool:
        if not self.settings.enabled:
            return True
        return self.auto_registered and any(
            isinstance(cb, UnisonStop) and not cb.auto_registered for cb in trainer.callbacks
        )

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._steps_aside(trainer):
            return
        environment = trainer._accelerator_connector.cluster_environment
        requeue = environment.requeue_signal if isinstance(environment, SLURMEnvironment) and \
            environment.auto_requeue else None
        coordinator = StopCoordinator(self.settings, requeue_signal=requeue)
        # SIGTERM and SLURM's requeue signal go through Lightning's connector (it chains and
        # restores); other signals are installed by the recorder once the connector has
        # registered, in _on_stage_start.
        coordinator.start(install_handlers=False)
        self._coordinator, self._trainer = coordinator, trainer
        connector = trainer._signal_connector
        connector._sigterm_notifier_fn = coordinator.recorder.record
        connector._slurm_sigusr_handler_fn = coordinator.recorder.record
        connector._sigterm_handler_fn = _bypass_log_in_handler
        if hasattr(trainer.fit_loop.epoch_loop, "_broadcast_sigterm_tensor"):
            trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = _no_broadcast

    def _on_stage_start(self, evaluation: bool = False) -> None:
        if self._coordinator is not None:
            by_lightning = {signal.SIGTERM, self._coordinator.requeue_signal}
            extra = tuple(s for s in self._coordinator.settings.signal_numbers if s not in by_lightning)
            if extra:
                self._coordinator.recorder.install(extra)
            if evaluation:  # its batches take their own time (on every rank, at the same point)
                self._coordinator.restart_cadence()

    def _close(self) -> None:
        coordinator, trainer = self._coordinator, self._trainer
        self._coordinator = self._trainer = None
        if coordinator is not None:
            coordinator.close()
        if trainer is not None:
            for name in ("_sigterm_notifier_fn", "_slurm_sigusr_handler_fn", "_sigterm_handler_fn"):
                trainer._signal_connector.__dict__.pop(name, None)
            trainer.fit_loop.epoch_loop.__dict__.pop("_broadcast_sigterm_tensor", None)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close()

    # -- check points --------------------------------------------------------------------------
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._on_stage_start()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._on_stage_start(evaluation=True)

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._on_stage_start(evaluation=True)

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._on_stage_start(evaluation=True)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        # Only where the optimizer stepped: stopping mid-accumulation would lose gradients.
        if self._coordinator is not None and not trainer.fit_loop.epoch_loop._should_accumulate():
            self._check(trainer)

    def on_validation_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._check(trainer)

    def on_test_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._check(trainer)

    def on_predict_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._check(trainer)

    # Ranks may leave an evaluation or prediction loop after different numbers of batches.
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check(trainer, leaving=True)

    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check(trainer, leaving=True)

    def on_predict_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check(trainer, leaving=True)

    # A signal after the last check point must not be lost: one final agreement per run.
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check(trainer, final=True)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn != "fit":
            self._check(trainer, final=True)

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check(trainer, final=True)

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check(trainer, final=True)

    def _check(self, trainer: pl.Trainer, final: bool = False, leaving: bool = False) -> None:
        coordinator = self._coordinator
        if coordinator is None:
            return
        step = trainer.global_step
        if leaving:
            stop = coordinator.should_stop_on_leaving(step)
        elif final:
            stop = coordinator.decide_now(step)
        else:
            stop = coordinator.should_stop(step)
        if not stop:
            return
        decision = coordinator.decision
        assert decision is not None
        trainer._signal_connector.received_sigterm = True
        agreed = f"ddp_sigterm: {signal.Signals(decision.signum).name} received, every rank stops at step {step}"
        if trainer.state.fn == "fit" and not trainer.sanity_checking and self.settings.save_checkpoint:
            agreed += f"; checkpoint saved to {_save_stop_checkpoint(trainer, coordinator, step)}"
        if decision.requeue:
            agreed += f"; SLURM job {_requeue(trainer, coordinator, step)} requeued"
        rank_zero_info(agreed)  # the paths and the job id are rank 0's
        exception = SIGTERMException(decision.exit_code)
        exception.stop = decision  # type: ignore[attr-defined]
        raise exception


def _no_broadcast() -> None:
    """Replaces Lightning's per-batch broadcast of rank 0's flag; the agreement decides instead."""


def _bypass_log_in_handler(signum: int, frame: Any) -> None:
    """Replaces Lightning's SLURM SIGTERM handler, which only logs, from inside the signal handler."""


def _save_stop_checkpoint(trainer: pl.Trainer, coordinator: StopCoordinator, step: int) -> str | None:
    """Every rank takes part in writing a temporary file; once every rank reports success, rank 0
    renames it to ``hpc_ckpt_<N>.ckpt``, so that a save cut short never leaves a checkpoint that
    resuming would pick. A failure on any rank raises :class:`StopError` on every rank. Returns the
    path on rank 0."""
    root = trainer.default_root_dir
    partial = os.path.join(root, ".ddp_sigterm-partial.ckpt")
    error = None
    coordinator.activity = f"saving the stop checkpoint of step {step} in {root}"
    try:
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        trainer.strategy.save_checkpoint(checkpoint, partial)
        if trainer.is_global_zero and not os.path.exists(partial):
            _raise_why_not_written(root, partial)
    except Exception as caught:  # noqa: BLE001 - every rank must learn of it; re-raised as StopError
        error = caught
    _every_rank_succeeded(coordinator, error, f"saving the stop checkpoint of step {step} in {root}", step)
    final = None
    try:
        if trainer.is_global_zero:
            final = trainer._checkpoint_connector.hpc_save_path(root)
            os.replace(partial, final)
    except Exception as caught:  # noqa: BLE001 - every rank must learn of it; re-raised as StopError
        error = caught
    _every_rank_succeeded(coordinator, error, f"naming the stop checkpoint of step {step} in {root}", step)
    return final


def _raise_why_not_written(root: str, partial: str) -> None:
    """Lightning (2.6.6) returns from a save that a PermissionError stopped as if it had succeeded;
    find the reason by trying to create a file where the checkpoint should be."""
    probe = os.path.join(root, ".ddp_sigterm-probe")
    with open(probe, "wb"):  # raises the file system's reason, e.g. PermissionError
        pass
    os.remove(probe)
    raise OSError(f"{partial} is missing after a save that reported no error")


def _requeue(trainer: pl.Trainer, coordinator: StopCoordinator, step: int) -> str | None:
    """Global rank 0 runs ``scontrol requeue`` once, after the stop checkpoint; every rank learns the
    outcome. Returns the job id on rank 0."""
    error, job = None, None
    coordinator.activity = "`scontrol requeue` (global rank 0)"
    try:
        if trainer.is_global_zero:
            job = slurm.requeue()
    except Exception as caught:  # noqa: BLE001 - every rank must learn of it; re-raised as StopError
        error = caught
    _every_rank_succeeded(coordinator, error, "requeueing the SLURM job", step)
    return job


def _every_rank_succeeded(coordinator: StopCoordinator, error: Exception | None, what: str, step: int) -> None:
    failed = coordinator.all_succeeded(error is None, what, step)
    if failed is None:
        return
    rank = coordinator.rank
    if error is not None:
        raise StopError(f"ddp_sigterm: rank {rank}: every rank stopped at step {step}, but {what} failed: "
                        f"{type(error).__name__}: {error}") from error
    raise StopError(f"ddp_sigterm: rank {rank}: every rank stopped at step {step}, but {what} failed on rank "
                    f"{failed} (its log has the reason)")


def callbacks_factory() -> list[Callback]:
    """Entry point for ``lightning.pytorch.callbacks_factory``: one auto-registered callback,
    or none when ``DDP_SIGTERM=0``."""
    callback = UnisonStop()
    if not callback.settings.enabled:
        return []
    callback.auto_registered = True
    return [callback]
