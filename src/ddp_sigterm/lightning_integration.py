"""Lightning integration: a callback that makes every rank stop at the same step on SIGTERM.

Installed through the ``lightning.pytorch.callbacks_factory`` entry point, so an unchanged script
gets it. What it changes in the Trainer it is attached to, for the duration of a run:

* Lightning's SIGTERM notifier (which broadcasts from inside the signal handler in 2.5.2+) is
  replaced by :meth:`SignalRecorder.record`; Lightning still composes, chains and restores the
  handlers. ``trainer.received_sigterm`` stays False until the stop is agreed, so Lightning's three
  raises on the local flag never fire before the agreement.
* The per-batch broadcast from rank 0 in the training epoch loop (2.5.2+) is switched off.
* At every optimizer-step boundary and every evaluation batch end the coordinator is asked
  ``should_stop``; at the agreed stop each rank saves ``hpc_ckpt_<N>.ckpt`` (during ``fit``) and
  raises ``SIGTERMException(128 + signal)``, which Lightning routes through ``on_exception``.
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
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from ddp_sigterm.coordinator import StopCoordinator
from ddp_sigterm.settings import Settings


class StopError(RuntimeError):
    """Saving the agreed stop checkpoint failed; the message names the rank and step."""


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
        coordinator = StopCoordinator(self.settings)
        # SIGTERM goes through Lightning's connector (it chains and restores); other signals are
        # installed by the recorder once the connector has registered, in _on_stage_start.
        coordinator.start(install_handlers=False)
        self._coordinator, self._trainer = coordinator, trainer
        trainer._signal_connector._sigterm_notifier_fn = coordinator.recorder.record
        if hasattr(trainer.fit_loop.epoch_loop, "_broadcast_sigterm_tensor"):
            trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = _no_broadcast

    def _on_stage_start(self, evaluation: bool = False) -> None:
        if self._coordinator is not None:
            extra = tuple(s for s in self._coordinator.settings.signal_numbers if s != signal.SIGTERM)
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
            trainer._signal_connector.__dict__.pop("_sigterm_notifier_fn", None)
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
            path = _save_stop_checkpoint(trainer, coordinator.rank, step)
            rank_zero_info(f"{agreed}; checkpoint saved to {path}")
        else:
            rank_zero_info(agreed)
        exception = SIGTERMException(decision.exit_code)
        exception.stop = decision  # type: ignore[attr-defined]
        raise exception


def _no_broadcast() -> None:
    """Replaces Lightning's per-batch broadcast of rank 0's flag; the agreement decides instead."""


def _save_stop_checkpoint(trainer: pl.Trainer, rank: int, step: int) -> str:
    """Every rank takes part; rank 0 writes to a temporary name and renames, so that a save cut
    short never leaves a truncated ``hpc_ckpt_<N>.ckpt`` that resuming would pick."""
    final = trainer.strategy.broadcast(trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir))
    partial = os.path.join(os.path.dirname(final), ".ddp_sigterm-partial.ckpt")
    try:
        trainer.save_checkpoint(partial)
        if trainer.is_global_zero:
            os.replace(partial, final)
        trainer.strategy.barrier("ddp_sigterm.stop_checkpoint")
    except Exception as error:
        raise StopError(f"ddp_sigterm: rank {rank}: saving the stop checkpoint of step {step} to {final} failed: {error}") from error
    return final


def callbacks_factory() -> list[Callback]:
    """Entry point for ``lightning.pytorch.callbacks_factory``: one auto-registered callback,
    or none when ``DDP_SIGTERM=0``."""
    callback = UnisonStop()
    if not callback.settings.enabled:
        return []
    callback.auto_registered = True
    return [callback]
