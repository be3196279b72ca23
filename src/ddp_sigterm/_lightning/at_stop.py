"""The agreed stop's work on a Trainer, in unison: the stop checkpoint with the package's record (the loggers' runs,
the data's place) and the SLURM requeue by global rank 0. A failure on any rank raises ``StopError`` on every rank."""

from __future__ import annotations

import signal
import warnings
from typing import Any

from ddp_sigterm import slurm
from ddp_sigterm._core import epoch_order
from ddp_sigterm._core.coordinator import StopCoordinator
from ddp_sigterm._core.decision import StopDecision
from ddp_sigterm._core.log import logger
from ddp_sigterm._core.stop_save import in_unison, save_in_unison
from ddp_sigterm._lightning import internals, loader_positions, logger_runs, stop_checkpoints
from ddp_sigterm._lightning.settings import TrainerSettings


def save_checkpoint(trainer: Any, coordinator: StopCoordinator, settings: TrainerSettings, step: int,
                    distribution: str) -> str | None:
    """Every rank saves ``hpc_ckpt_<N>.ckpt``; rank 0 then keeps the newest ``keep_checkpoints``, warns for a
    loader whose position it cannot hold, and returns the path."""
    directory = stop_checkpoints.directory(trainer, settings)
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
        positionless = _positionless(trainer.train_dataloader)
        if positionless:
            logger.warning("ddp_sigterm: the training DataLoader's position in its epoch is not saved (%s has no "
                           "state_dict): the resumed run starts this epoch over and trains again on its batches "
                           "so far. torchdata's StatefulDataLoader, a drop-in replacement, is saved and restored "
                           "(docs/trainer.md)", ", ".join(positionless))
    return saved


def _positionless(iterables: Any) -> list[str]:
    """The class names of the loaders in ``iterables`` (nested in lists, tuples, dicts) with no position to save."""
    if isinstance(iterables, dict):
        iterables = list(iterables.values())
    if isinstance(iterables, (list, tuple)):
        return [name for value in iterables for name in _positionless(value)]
    return [] if iterables is None or epoch_order.has_state(iterables) else [type(iterables).__name__]


def requeue(trainer: Any, coordinator: StopCoordinator, decision: StopDecision, requeue_signal: int,
            step: int) -> str | None:
    """Global rank 0 runs ``scontrol requeue`` if the stop is the requeue signal's or SLURM is preempting the job
    (if ``scontrol`` cannot tell, it warns and does not); returns ``"<job id> requeued: <why>"`` there if it did."""

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
