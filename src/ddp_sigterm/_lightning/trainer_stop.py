"""The Trainer callback's behaviour: every rank stops at the same step on a stop signal.

Shared by both Lightning distributions (``lightning_integration`` for ``lightning.pytorch``,
``pytorch_lightning_integration`` for the standalone ``pytorch_lightning``); Lightning itself is
not imported here. What it changes in the Trainer it is attached to, for the duration of a run:

* Lightning's SIGTERM notifier (which broadcasts from inside the signal handler in 2.5.2+) is
  replaced by :meth:`SignalRecorder.record`; Lightning still composes, chains and restores the
  handlers. ``trainer.received_sigterm`` stays False until the stop is agreed, so Lightning's three
  raises on the local flag never fire before the agreement.
* The per-batch broadcast from rank 0 in the training epoch loop (2.5.2+) is switched off.
* Under SLURM with auto-requeue, Lightning's requeue handler (which saves and runs ``scontrol
  requeue`` inside the handler) is replaced by the same recorder: the requeue signal stops the job
  like SIGTERM, and after the stop checkpoint global rank 0 requeues the job, once. It requeues a
  job that SLURM is preempting too (see :func:`slurm.preempted`): SLURM itself requeues only a
  preempted job that outlives a non-zero grace time (with ``GraceTime=0`` it requeues at once).
* At every optimizer-step boundary and every evaluation batch end the coordinator is asked
  ``should_stop``; at the agreed stop each rank saves ``hpc_ckpt_<N>.ckpt`` (during ``fit``) and
  raises ``SIGTERMException(128 + signal)``, which Lightning routes through ``on_exception``. A save
  or requeue that fails on any rank makes every rank raise :class:`StopError` instead.
* A fit resumed from a stop checkpoint gives its stateful training loaders (``state_dict`` and
  ``load_state_dict``, as torchdata's StatefulDataLoader) their saved positions again at the start of
  training, after setting the samplers' epoch, and makes the data fetcher's iterator again: Lightning gives
  them back before the epoch is set, and drops them when the data was set up before the restore (#20550).
  A plain DataLoader has no position: the stop says so, once, on rank 0.
* The stop checkpoint records the loggers' runs (TensorBoard's and CSV's version, W&B's and MLflow's run); a fit
  resumed from it gives them back before the Trainer makes them (before any callback hook: the instance the entry
  point adds follows the Trainer's choice of checkpoint), so the resumed run appends to them (:mod:`logger_runs`).
* Evaluation and prediction loops may run a different number of batches per rank (prediction
  shards without padding): at the first hook after such a loop (``on_*_epoch_end``) each rank
  waits, still agreeing, until every rank has left it.

Every private name of Lightning it reaches is in :mod:`ddp_sigterm._lightning.internals`: if one is
missing from the running release, the callback warns naming it and leaves the Trainer to stock Lightning.
"""

from __future__ import annotations

import dataclasses
import signal
import warnings
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.multiprocessing.spawn import ProcessExitedException

from ddp_sigterm import slurm
from ddp_sigterm._core import epoch_order, exit_codes
from ddp_sigterm._core.coordinator import StopCoordinator
from ddp_sigterm._core.decision import StopDecision
from ddp_sigterm._core.log import logger
from ddp_sigterm._core.settings import Settings, resolve
from ddp_sigterm._core.signals import stop_signals
from ddp_sigterm._core.stop_save import in_unison, save_in_unison
from ddp_sigterm._lightning import internals, loader_positions, logger_runs, resume_internals, stop_checkpoints
from ddp_sigterm._lightning.registration import Integration, acting
from ddp_sigterm._lightning.settings import TrainerSettings

_TRAINER_FIELDS = {field.name for field in dataclasses.fields(TrainerSettings)}


@dataclasses.dataclass(frozen=True)
class Lightning:
    """What the callback takes from the Lightning it runs in: ``lightning`` (``lightning.pytorch``
    with ``lightning.fabric``) or the standalone ``pytorch_lightning`` (with ``lightning_fabric``),
    whose classes are distinct."""

    distribution: str  # "lightning" or "pytorch_lightning": its version gates the internals
    trainer: type[Any]  # its Trainer: the callback refuses the other package's
    sigterm_exception: type[BaseException]
    slurm_environment: type[Any]
    rank_zero_info: Callable[[str], Any]
    fabric: str  # its Fabric's package: "lightning.fabric" or "lightning_fabric" (its launcher's watch)
    version: str  # the distribution's, as installed


class TrainerStop(Integration):
    """The Trainer callback's behaviour, for either Lightning distribution: a subclass adds that
    distribution's ``Callback`` base and sets :attr:`lightning` (see ``lightning_integration``)."""

    lightning: Lightning

    def __init__(self, settings: Settings | None = None, **overrides: Any) -> None:
        own = {name: overrides.pop(name) for name in list(overrides) if name in _TRAINER_FIELDS}
        super().__init__(settings, **overrides)
        self.trainer_settings = resolve(TrainerSettings, **own)
        self._coordinator: StopCoordinator | None = None
        self._trainer: Any | None = None
        self._loader_positions: list[dict[str, Any]] = []  # from the checkpoint a fit resumes from
        self._data_position: dict[str, Any] | None = None  # what the stop checkpoint it resumes from recorded
        self._epoch_lengths: tuple[Any, Any] | None = None  # the fit's own, while the package deals an epoch

    # -- set-up and tear-down ------------------------------------------------------------------
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
        # The agreement's ranks are the Trainer's: a one-process Trainer (a one-device test after a
        # multi-device fit, in the same process) agrees with no one, whatever the default group holds.
        coordinator = StopCoordinator(self.settings, requeue_signal=requeue, distributed=trainer.world_size > 1,
                                      on_decided=[internals.retire_child_watch],
                                      routed_signals=internals.routed_signals(requeue),
                                      notice=self.notice_settings)
        # SIGTERM and SLURM's requeue signal go through Lightning's connector (it chains and
        # restores); other signals are installed by the recorder once the connector has
        # registered, in _on_stage_start.
        coordinator.start(install_handlers=False)
        if not coordinator.integration.acting:  # no groups (it warned): the Trainer is left to stock Lightning
            return
        self._coordinator, self._trainer = coordinator, trainer
        internals.take_signal_handlers(trainer, coordinator.integration.record, self.lightning.distribution)
        if stage == "fit" and self._resumes_when_not_told():
            internals.resume_when_not_told(trainer, lambda: _newest_stop_checkpoint(trainer, self.trainer_settings))

    def _resumes_when_not_told(self) -> bool:
        """Whether a fit started without ``ckpt_path`` resumes from the newest stop checkpoint: ``resume``, or a
        ``checkpoint_dir`` under SLURM (where Lightning would look in ``default_root_dir`` only)."""
        settings = self.trainer_settings
        return settings.resume or bool(settings.checkpoint_dir and self.lightning.slurm_environment.detect())

    @classmethod
    def entry_point(cls) -> list[Any]:
        """The instance the entry point adds to the Trainer being made; that Trainer's choice of the checkpoint a
        fit resumes from is followed by :func:`_before_run` (see :func:`internals.before_run`)."""
        instances = super().entry_point()
        trainer = internals.trainer_being_made(cls.lightning.trainer) if instances else None
        gone = [] if trainer is None else internals.missing(trainer, internals.BEFORE_RUN, cls.lightning.distribution)
        if gone:
            internals.warn_once(f"ddp_sigterm: the loggers' runs are not carried across a stop: "
                                f"{cls.lightning.distribution} {cls.lightning.version} has no {'; no '.join(gone)}")
        elif trainer is not None:
            internals.before_run(trainer, _before_run)
        return instances

    def _give_logger_runs_back(self, trainer: Any, path: Any) -> None:
        """Before a fit that resumes from a stop checkpoint makes its loggers' runs (``path``: Lightning's choice, or
        the package's when it resumes without ``ckpt_path``), give every logger the run the checkpoint recorded. On
        global rank 0 only, the one whose loggers make runs, known here from the environment (node 0, local rank 0:
        ``ddp_spawn``'s processes learn their global rank only in ``_run``). A failure is a warning: the loggers then
        make new runs, as stock Lightning's do."""
        if trainer.node_rank != 0 or trainer.local_rank != 0:
            return
        if path is None and self._resumes_when_not_told() and self._supported(trainer):  # what setup's resume chooses
            path = stop_checkpoints.newest(_stop_checkpoint_dir(trainer, self.trainer_settings))
        if not stop_checkpoints.is_one(path):
            return
        try:
            given, kept = logger_runs.give_back(trainer.loggers, logger_runs.recorded(str(path)),
                                                self.lightning.distribution)
        except Exception as error:  # Lightning's own load of the same file then says what is wrong, if anything
            warnings.warn(f"ddp_sigterm: the loggers start new runs: their runs could not be given back from {path} "
                          f"({type(error).__name__}: {error})", stacklevel=2)
            return
        for message in kept:
            warnings.warn(message, stacklevel=2)
        if given:
            self.lightning.rank_zero_info(f"ddp_sigterm: the loggers continue the stop's runs: {', '.join(given)}")

    def _supported(self, trainer: Any) -> bool:
        """Whether the running Lightning has every internal the callback needs; if not, a warning
        names what is missing and the Trainer runs as stock Lightning runs it. A release outside the
        tested range gets a warning too."""
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

    def _on_stage_start(self) -> None:
        if self._coordinator is not None:
            self._coordinator.integration.install_handlers()

    def _close(self) -> None:
        coordinator, trainer = self._coordinator, self._trainer
        self._coordinator = self._trainer = None
        if trainer is not None:
            internals.restore_trainer(trainer)
        if coordinator is not None:
            # a signal after the run's last agreement is kept, as stock Lightning's handler keeps it
            coordinator.close(redeliver=False)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._close()
        if isinstance(exception, ProcessExitedException) and not self._steps_aside(trainer):
            self._exit_as_the_ranks(trainer, exception)

    def _exit_as_the_ranks(self, trainer: Any, exception: ProcessExitedException) -> None:
        """The launching process of ``ddp_spawn`` (not a rank: its ``fit`` waits for the spawned ranks)
        learns that a rank ended with a stop's exit code: after Lightning's own exception handling and
        teardown, it ends with the same code, as the ranks did, instead of torch's traceback and 1."""
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

    # -- check points --------------------------------------------------------------------------
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._on_stage_start()
        # a resume from a stop checkpoint (hpc_ckpt_<N>.ckpt) gets its loaders' positions back in the epoch it
        # resumes in, and the rest of that epoch where their own positions would not give it; any other resume is
        # left as stock Lightning runs it
        positions, self._loader_positions = self._loader_positions, []
        recorded, self._data_position = self._data_position, None
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
        if lengths is not None:  # the epoch the package dealt is over
            resume_internals.set_epoch_length(trainer, *lengths)

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self._loader_positions = resume_internals.saved_loader_positions(checkpoint)
        self._data_position = checkpoint.get(stop_checkpoints.KEY, {}).get(loader_positions.KEY)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._on_stage_start()

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        self._on_stage_start()

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        self._on_stage_start()

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        # Only where the optimizer stepped: stopping mid-accumulation would lose gradients.
        if self._coordinator is not None and internals.optimizer_stepped(trainer):
            self._stop_if(trainer, self._coordinator.should_stop)

    def on_validation_batch_end(self, trainer: Any, *args: Any) -> None:
        self._at_boundary(trainer)

    def on_test_batch_end(self, trainer: Any, *args: Any) -> None:
        self._at_boundary(trainer)

    def on_predict_batch_end(self, trainer: Any, *args: Any) -> None:
        self._at_boundary(trainer)

    # Ranks may leave an evaluation or prediction loop after different numbers of batches.
    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._on_leaving(trainer)

    def on_test_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._on_leaving(trainer)

    def on_predict_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._on_leaving(trainer)

    # A signal after the last check point must not be lost: one final agreement per run.
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._at_end(trainer)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.state.fn != "fit":
            self._at_end(trainer)

    def on_test_end(self, trainer: Any, pl_module: Any) -> None:
        self._at_end(trainer)

    def on_predict_end(self, trainer: Any, pl_module: Any) -> None:
        self._at_end(trainer)

    def _at_boundary(self, trainer: Any) -> None:
        if self._coordinator is not None:
            self._stop_if(trainer, self._coordinator.should_stop)

    def _on_leaving(self, trainer: Any) -> None:
        if self._coordinator is not None:
            self._stop_if(trainer, self._coordinator.should_stop_on_leaving)

    def _at_end(self, trainer: Any) -> None:
        if self._coordinator is not None:
            self._stop_if(trainer, self._coordinator.decide_now)

    def _stop_if(self, trainer: Any, stops: Callable[[int], bool]) -> None:
        """If ``stops(step)`` (one of the coordinator's questions, asked on every rank at the same point)
        says stop: save the stop checkpoint, requeue under SLURM, raise ``SIGTERMException(128 + signal)``."""
        coordinator = self._coordinator
        step = trainer.global_step
        if coordinator is None or not stops(step) or (decision := coordinator.decision) is None:
            return
        try:
            exception = self._stop(trainer, coordinator, decision, step)
        finally:
            # Closed here, on every rank at the same point, whatever the stop's save did: a rank that ddp_spawn
            # started runs fit without Lightning's exception handling (only the launching process calls
            # on_exception), so no other hook would close it there, and its heartbeat still beating while the
            # interpreter finalizes aborts the rank (issue 36, finding 8). on_exception's close is then a no-op.
            self._close()
        raise exception

    def _stop(self, trainer: Any, coordinator: StopCoordinator, decision: StopDecision, step: int) -> BaseException:
        """The agreed stop's work on this rank: the stop checkpoint, the requeue; returns the exception to raise."""
        # Lightning puts its saved handlers back at teardown, after this callback has closed: make that
        # SIG_IGN for the signals the runtime ignores after a stop, so a late signal cannot change the exit code.
        internals.mark_stopped(trainer, coordinator.integration.ignored_after_stop)
        agreed = f"ddp_sigterm: {coordinator.integration.stop_cause} received, every rank stops at step {step}"
        if trainer.state.fn == "fit" and not trainer.sanity_checking and self.trainer_settings.save_checkpoint:
            saved = _save_stop_checkpoint(trainer, coordinator, self.trainer_settings, step,
                                          self.lightning.distribution)
            agreed += f"; checkpoint saved to {saved}"
            positionless = _positionless(trainer.train_dataloader) if trainer.is_global_zero else []
            if positionless:
                logger.warning("ddp_sigterm: the training DataLoader's position in its epoch is not saved (%s has no "
                               "state_dict): the resumed run starts this epoch over and trains again on its batches "
                               "so far. torchdata's StatefulDataLoader, a drop-in replacement, is saved and restored "
                               "(docs/trainer.md)", ", ".join(positionless))
        if coordinator.integration.requeue_signal is not None:  # SLURM, auto-requeue on
            requeued = _requeue(trainer, coordinator, decision, coordinator.integration.requeue_signal, step)
            agreed += f"; SLURM job {requeued}" if requeued else ""
        self.lightning.rank_zero_info(agreed)  # the paths and the job id are rank 0's
        exception = self.lightning.sigterm_exception(decision.exit_code)
        exception.stop = decision  # type: ignore[attr-defined]  # what every rank agreed, for the curious
        return exception


def _before_run(trainer: Any, stage: str, path: Any) -> None:
    """After the Trainer chose the checkpoint a run restores (``path``), before the run makes the loggers' runs: a
    fit gives the loggers the runs of the stop checkpoint it resumes from (see :meth:`TrainerStop.entry_point`)."""
    stop = acting(trainer.callbacks, TrainerStop)
    if stage == "fit" and stop is not None and not stop._steps_aside(trainer) \
            and stop.trainer_settings.resume_logger_runs:
        stop._give_logger_runs_back(trainer, path)


def _positionless(iterables: Any) -> list[str]:
    """The class names of the training loaders in ``trainer.train_dataloader`` (a loader, or lists, tuples and
    dicts of them) whose position a checkpoint cannot hold (see :func:`epoch_order.has_state`)."""
    if isinstance(iterables, dict):
        return [name for value in iterables.values() for name in _positionless(value)]
    if isinstance(iterables, (list, tuple)):
        return [name for value in iterables for name in _positionless(value)]
    return [] if iterables is None or epoch_order.has_state(iterables) else [type(iterables).__name__]


def _same_world(world_size: int) -> bool:
    """A multi-process Trainer runs on the whole default group (Lightning's collectives use it); if the
    two disagree, stock Lightning's own collectives cannot work either: the callback steps aside."""
    if world_size == 1 or (dist.is_initialized() and dist.get_world_size() == world_size):
        return True
    found = dist.get_world_size() if dist.is_initialized() else "no process group"
    warnings.warn(f"ddp_sigterm: the Trainer runs on {world_size} processes but the default process group has "
                  f"{found}: the stop agreement is switched off for this Trainer", stacklevel=2)
    return False


def _save_stop_checkpoint(trainer: Any, coordinator: StopCoordinator, settings: TrainerSettings, step: int,
                          distribution: str) -> str | None:
    """Every rank takes part in saving ``hpc_ckpt_<N>.ckpt``, which also records the loggers' runs
    (:mod:`logger_runs`), in the stop-checkpoint directory (see
    :func:`save_in_unison`: a save cut short never leaves a checkpoint that resuming would pick; a
    failure on any rank raises :class:`StopError` on every rank); then rank 0 deletes all but the newest
    ``keep_checkpoints``. Returns the path on rank 0."""
    directory = _stop_checkpoint_dir(trainer, settings)
    path, dump = internals.hpc_checkpoint(trainer, directory)  # only rank 0's path is used: it renames

    def write(partial: str) -> None:
        checkpoint = dump()
        checkpoint[stop_checkpoints.KEY] = {"logger_runs": logger_runs.record(trainer.loggers, distribution)}
        if trainer.is_global_zero:  # the rank that writes what is not tensors (sharded checkpoints too)
            checkpoint[stop_checkpoints.KEY][loader_positions.KEY] = loader_positions.record(trainer)
        trainer.strategy.save_checkpoint(checkpoint, partial)

    saved = save_in_unison(coordinator, write, path, writer=trainer.is_global_zero, step=step)
    if trainer.is_global_zero:
        stop_checkpoints.keep_newest(directory, settings.keep_checkpoints)
    return saved


def _stop_checkpoint_dir(trainer: Any, settings: TrainerSettings) -> str:
    return settings.checkpoint_dir or str(trainer.default_root_dir)


def _newest_stop_checkpoint(trainer: Any, settings: TrainerSettings) -> str | None:
    """Global rank 0's newest stop checkpoint, on every rank (a collective: every rank resumes from the
    same file, or every rank starts afresh)."""
    found = stop_checkpoints.newest(_stop_checkpoint_dir(trainer, settings)) if trainer.is_global_zero else None
    newest: str | None = trainer.strategy.broadcast(found, src=0)
    if newest is not None:
        logger.info("rank %d of %d: fit started without ckpt_path resumes from the newest stop checkpoint, %s "
                    "(DDP_SIGTERM_RESUME)", trainer.global_rank, trainer.world_size, newest)
    return newest


def _requeue(trainer: Any, coordinator: StopCoordinator, decision: StopDecision, requeue_signal: int,
             step: int) -> str | None:
    """After the stop checkpoint, global rank 0 runs ``scontrol requeue`` once if the stop is the
    requeue signal's or SLURM is preempting the job; every rank learns the outcome (a failed requeue
    raises :class:`StopError` everywhere). When ``scontrol show job`` cannot tell whether SLURM is
    preempting the job, rank 0 warns with its error and does not requeue: the stop itself succeeded,
    and a SIGTERM is most often not a preemption. Returns, on rank 0 if it requeued the job,
    ``"<job id> requeued: <why>"``."""

    def requeue_on_rank_0() -> str | None:
        if not trainer.is_global_zero:
            return None
        if decision.requeue:
            why = f"{coordinator.integration.stop_cause} came" if decision.notice else \
                f"{signal.Signals(requeue_signal).name} is its requeue signal"
        else:
            try:
                preempt_time = slurm.preempted()
            except slurm.RequeueError as error:
                warnings.warn(f"{error}; cannot tell whether SLURM is preempting the job: it is not requeued",
                              stacklevel=2)
                return None
            if preempt_time is None:
                return None
            why = f"SLURM is preempting it (PreemptTime={preempt_time})"
        requeued = f"{slurm.requeue()} requeued: {why}"
        logger.info("rank %d of %d: SLURM job %s", trainer.global_rank, trainer.world_size, requeued)
        return requeued

    with coordinator.integration.waiting_for("`scontrol show job` / `scontrol requeue` (global rank 0)"):
        return in_unison(coordinator, requeue_on_rank_0, "requeueing the SLURM job", step)
