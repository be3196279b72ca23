"""The Trainer callback of both Lightning distributions: every rank stops at the same step, saves
``hpc_ckpt_<N>.ckpt``, requeues under SLURM and raises ``SIGTERMException(128 + signal)``; a resumed fit gets its
loaders' positions and loggers' runs back (docs/trainer.md)."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.multiprocessing.spawn import ProcessExitedException

from ddp_sigterm._core import exit_codes
from ddp_sigterm._core.coordinator import StopCoordinator
from ddp_sigterm._core.log import logger
from ddp_sigterm._core.settings import Settings, resolve
from ddp_sigterm._core.signals import stop_signals
from ddp_sigterm._core.stop_save import save_in_unison
from ddp_sigterm._lightning import at_stop, internals, loader_positions, logger_runs, resume_internals, stop_checkpoints
from ddp_sigterm._lightning.registration import Integration, acting
from ddp_sigterm._lightning.settings import TrainerSettings

_TRAINER_FIELDS = {field.name for field in dataclasses.fields(TrainerSettings)}


@dataclasses.dataclass(frozen=True)
class Lightning:
    """What the callback takes from ``lightning`` or the standalone ``pytorch_lightning``, whose classes differ."""

    distribution: str  # "lightning" or "pytorch_lightning": its version gates the internals
    trainer: type[Any]  # its Trainer: the callback refuses the other package's
    sigterm_exception: type[BaseException]
    slurm_environment: type[Any]
    rank_zero_info: Callable[[str], Any]
    fabric: str  # its Fabric's package: "lightning.fabric" or "lightning_fabric" (its launcher's watch)
    version: str  # the distribution's, as installed


class TrainerStop(Integration):
    """The Trainer callback: a subclass adds a distribution's ``Callback`` base and sets :attr:`lightning`."""

    lightning: Lightning

    def __init__(self, settings: Settings | None = None, **overrides: Any) -> None:
        own = {name: overrides.pop(name) for name in list(overrides) if name in _TRAINER_FIELDS}
        super().__init__(settings, **overrides)
        self.trainer_settings = resolve(TrainerSettings, **own)
        self._coordinator: StopCoordinator | None = None
        # from the checkpoint a fit resumes from: the loaders' positions Lightning saved, the data's place we recorded
        self._loaded: tuple[list[dict[str, Any]], dict[str, Any] | None] = ([], None)
        self._epoch_lengths: tuple[Any, Any] | None = None  # the fit's own, while the package deals an epoch

    def _steps_aside(self, trainer: Any) -> bool:
        return not self.settings.enabled or acting(trainer.callbacks, TrainerStop) is not self

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if not isinstance(trainer, self.lightning.trainer):
            mine = self.lightning.trainer
            raise TypeError(f"{type(self).__module__}.{type(self).__name__} is for {mine.__module__.split('.')[0]}'s "
                            f"Trainer, not {type(trainer).__module__.split('.')[0]}'s: use the UnisonStop of "
                            "ddp_sigterm.lightning_integration (lightning.pytorch) or "
                            "ddp_sigterm.pytorch_lightning_integration (pytorch_lightning)")
        if self._steps_aside(trainer) or not _same_world(trainer.world_size) or not self._supported(trainer):
            return
        requeue = internals.requeue_signal(trainer, self.lightning.slurm_environment)
        # the agreement's ranks are the Trainer's: a one-process Trainer agrees with no one, whatever the default group
        coordinator = StopCoordinator(self.settings, requeue_signal=requeue, distributed=trainer.world_size > 1,
                                      on_decided=[internals.retire_child_watch],
                                      routed_signals=internals.routed_signals(requeue),
                                      notice=self.notice_settings)
        # SIGTERM and the requeue signal go through Lightning's connector; the others are installed at the stage start
        coordinator.start(install_handlers=False)
        if not coordinator.integration.acting:  # no groups (it warned): the Trainer is left to stock Lightning
            return
        self._coordinator = coordinator
        internals.take_signal_handlers(trainer, coordinator.integration.record, self.lightning.distribution)
        if stage == "fit" and self._resumes_when_not_told():
            settings = self.trainer_settings
            internals.resume_when_not_told(trainer, lambda: stop_checkpoints.newest_on_every_rank(trainer, settings))

    def _resumes_when_not_told(self) -> bool:
        """``resume``, or a ``checkpoint_dir`` under SLURM (where Lightning looks in ``default_root_dir`` only)."""
        settings = self.trainer_settings
        return settings.resume or bool(settings.checkpoint_dir and self.lightning.slurm_environment.detect())

    @classmethod
    def entry_point(cls) -> list[Any]:
        """Also makes the Trainer being made call :func:`_before_run` at its choice of checkpoint."""
        instances = super().entry_point()
        trainer = internals.trainer_being_made(cls.lightning.trainer) if instances else None
        gone = [] if trainer is None else internals.missing(trainer, internals.BEFORE_RUN, cls.lightning.distribution)
        if gone:
            internals.warn_once(f"ddp_sigterm: the loggers' runs are not carried across a stop: "
                                f"{cls.lightning.distribution} {cls.lightning.version} has no {'; no '.join(gone)}")
        elif trainer is not None:
            internals.before_run(trainer, _before_run)
        return instances

    def _supported(self, trainer: Any) -> bool:
        """Whether the running Lightning has every internal needed; if not, a warning names what is missing."""
        name, version = self.lightning.distribution, self.lightning.version
        gone = internals.missing(trainer, internals.TRAINER, name) + \
            internals.missing(internals.launchers(self.lightning.fabric), internals.LAUNCHER, name)
        if gone:
            internals.warn_once(f"ddp_sigterm is switched off: {name} {version} has no {'; no '.join(gone)}. "
                                "A stop signal is handled as stock Lightning handles it")
            return False
        untested = internals.untested(name, version)
        if untested:
            internals.warn_once(untested)
        return True

    def _close(self, trainer: Any) -> None:
        coordinator, self._coordinator = self._coordinator, None
        if coordinator is not None:
            internals.restore_trainer(trainer)
            # a signal after the run's last agreement is kept, as stock Lightning's handler keeps it
            coordinator.close(redeliver=False)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._close(trainer)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._close(trainer)
        if not isinstance(exception, ProcessExitedException) or self._steps_aside(trainer):
            return
        # ddp_spawn's launching process: end with a stopped rank's exit code after Lightning's teardown, instead of
        # torch's traceback and 1
        code = exception.exit_code
        requeue = internals.requeue_signal(trainer, self.lightning.slurm_environment)
        signals = stop_signals(self.settings.signal_numbers, requeue, internals.routed_signals(requeue))
        stops = {exit_codes.stopped(signum) for signum in signals}
        if code in stops:
            ending: BaseException = self.lightning.sigterm_exception(code)
        elif code in (exit_codes.STOP_FAILED, exit_codes.GAVE_UP):
            ending = SystemExit(code)
        else:
            return
        self.lightning.rank_zero_info(f"ddp_sigterm: a spawned rank (process {exception.error_pid}) ended with exit "
                                      f"code {code}: the launching process exits with it")
        internals.raise_after_teardown(trainer, ending)

    def _stage_start(self, trainer: Any, pl_module: Any) -> None:
        if self._coordinator is not None:
            self._coordinator.integration.install_handlers()

    on_validation_start = on_test_start = on_predict_start = _stage_start

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._stage_start(trainer, pl_module)
        # only a resume from a stop checkpoint gets its loaders' positions, and where needed the rest of the epoch
        (positions, recorded), self._loaded = self._loaded, ([], None)
        self._epoch_lengths = None
        if self._coordinator is None or not stop_checkpoints.is_one(trainer.ckpt_path):
            return
        resumed = loader_positions.resume(trainer, recorded)
        given = resume_internals.restore_loader_positions(trainer, positions, resumed.start_over)
        if given or resumed.changed:
            resume_internals.remake_iterator(trainer)
        self._epoch_lengths = resumed.lengths
        for said in resumed.said:
            self.lightning.rank_zero_info(said)
        if given:
            self.lightning.rank_zero_info(f"ddp_sigterm: the training loaders resume where the stop left them, in "
                                          f"epoch {trainer.current_epoch}")

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        lengths, self._epoch_lengths = self._epoch_lengths, None
        if lengths is not None:  # the epoch the package dealt is over: Lightning's own length again
            resume_internals.set_epoch_length(trainer, *lengths)

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        recorded = checkpoint.get(stop_checkpoints.KEY, {}).get(loader_positions.KEY)
        self._loaded = (resume_internals.saved_loader_positions(checkpoint), recorded)

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        # Only where the optimizer stepped: stopping mid-accumulation would lose gradients.
        if self._coordinator is not None and internals.optimizer_stepped(trainer):
            self._stop_if(trainer, StopCoordinator.should_stop)

    def _at_boundary(self, trainer: Any, *args: Any) -> None:
        self._stop_if(trainer, StopCoordinator.should_stop)

    on_validation_batch_end = on_test_batch_end = on_predict_batch_end = _at_boundary

    def _on_leaving(self, trainer: Any, pl_module: Any) -> None:
        """Ranks may leave an evaluation or prediction loop after different numbers of batches."""
        self._stop_if(trainer, StopCoordinator.should_stop_on_leaving)

    on_validation_epoch_end = on_test_epoch_end = on_predict_epoch_end = _on_leaving

    def _at_end(self, trainer: Any, pl_module: Any) -> None:
        """A signal after the last check point must not be lost: one final agreement per run."""
        self._stop_if(trainer, StopCoordinator.decide_now)

    on_train_end = on_test_end = on_predict_end = _at_end

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.state.fn != "fit":
            self._at_end(trainer, pl_module)

    def _stop_if(self, trainer: Any, stops: Callable[[StopCoordinator, int], bool]) -> None:
        """If ``stops`` (asked on every rank at the same point): save, requeue, raise ``SIGTERMException``."""
        coordinator = self._coordinator
        step = trainer.global_step
        if coordinator is None or not stops(coordinator, step) or (decision := coordinator.decision) is None:
            return
        integration = coordinator.integration
        try:
            internals.mark_stopped(trainer, integration.ignored_after_stop)
            agreed = f"ddp_sigterm: {integration.stop_cause} received, every rank stops at step {step}"
            if trainer.state.fn == "fit" and not trainer.sanity_checking and self.trainer_settings.save_checkpoint:
                agreed += f"; checkpoint saved to {self._save_checkpoint(trainer, coordinator, step)}"
            if integration.requeue_signal is not None:  # SLURM, auto-requeue on
                requeued = at_stop.requeue(trainer, coordinator, decision, integration.requeue_signal, step)
                agreed += f"; SLURM job {requeued}" if requeued else ""
            self.lightning.rank_zero_info(agreed)  # the paths and the job id are rank 0's
        finally:
            # closed here on every rank, whatever the save did: a ddp_spawn rank gets no on_exception, and a heartbeat
            # still beating while the interpreter finalizes aborts it (docs/reliability.md)
            self._close(trainer)
        exception = self.lightning.sigterm_exception(decision.exit_code)
        exception.stop = decision  # type: ignore[attr-defined]  # what every rank agreed, for the curious
        raise exception

    def _save_checkpoint(self, trainer: Any, coordinator: StopCoordinator, step: int) -> str | None:
        """Every rank saves ``hpc_ckpt_<N>.ckpt`` in unison; rank 0 keeps the newest ones and returns the path."""
        directory = stop_checkpoints.directory(trainer, self.trainer_settings)
        path, dump = internals.hpc_checkpoint(trainer, directory)  # only rank 0's path is used: it renames

        def write(partial: str) -> None:
            checkpoint = dump()
            runs = logger_runs.record(trainer.loggers, self.lightning.distribution)
            checkpoint[stop_checkpoints.KEY] = {"logger_runs": runs}
            if trainer.is_global_zero:  # the rank that writes what is not tensors (sharded checkpoints too)
                checkpoint[stop_checkpoints.KEY][loader_positions.KEY] = loader_positions.record(trainer)
            trainer.strategy.save_checkpoint(checkpoint, partial)

        saved = save_in_unison(coordinator, write, path, writer=trainer.is_global_zero, step=step)
        if trainer.is_global_zero:
            stop_checkpoints.keep_newest(directory, self.trainer_settings.keep_checkpoints)
            positionless = at_stop.positionless(trainer.train_dataloader)
            if positionless:
                logger.warning("ddp_sigterm: the training DataLoader's position in its epoch is not saved (%s has no "
                               "state_dict): the resumed run starts this epoch over and trains again on its batches "
                               "so far. torchdata's StatefulDataLoader, a drop-in replacement, is saved and restored "
                               "(docs/trainer.md)", ", ".join(positionless))
        return saved


def _before_run(trainer: Any, stage: str, path: Any) -> None:
    """After the Trainer chose ``path``, before it makes the loggers' runs: a fit resumed from a stop gives each
    logger its run back (a failure warns). Global rank 0 only: ``ddp_spawn`` sets ``global_rank`` later."""
    stop = acting(trainer.callbacks, TrainerStop)
    if stage != "fit" or stop is None or not stop.settings.enabled or not stop.trainer_settings.resume_logger_runs \
            or trainer.node_rank != 0 or trainer.local_rank != 0:
        return
    if path is None and stop._resumes_when_not_told() and stop._supported(trainer):  # what setup's resume chooses
        path = stop_checkpoints.newest(stop_checkpoints.directory(trainer, stop.trainer_settings))
    if not stop_checkpoints.is_one(path):
        return
    try:
        runs = logger_runs.recorded(str(path))
        given, kept = logger_runs.give_back(trainer.loggers, runs, stop.lightning.distribution)
    except Exception as error:  # Lightning's own load of the same file then says what is wrong, if anything
        warnings.warn(f"ddp_sigterm: the loggers start new runs: their runs could not be given back from {path} "
                      f"({type(error).__name__}: {error})", stacklevel=2)
        return
    for message in kept:
        warnings.warn(message, stacklevel=2)
    if given:
        stop.lightning.rank_zero_info(f"ddp_sigterm: the loggers continue the stop's runs: {', '.join(given)}")


def _same_world(world_size: int) -> bool:
    """Whether the Trainer runs on the whole default group, as Lightning's own collectives need; else a warning."""
    if world_size == 1 or (dist.is_initialized() and dist.get_world_size() == world_size):
        return True
    found = dist.get_world_size() if dist.is_initialized() else "no process group"
    warnings.warn(f"ddp_sigterm: the Trainer runs on {world_size} processes but the default process group has "
                  f"{found}: the stop agreement is switched off for this Trainer", stacklevel=2)
    return False
