"""The Trainer's own settings (its stop checkpoint and resuming), set in code by ``UnisonStop(checkpoint_dir=...)``
and overridden by ``DDP_SIGTERM_<FIELD>`` as the core's :class:`ddp_sigterm.Settings` are; the core never reads them."""

from __future__ import annotations

import dataclasses

from ddp_sigterm._core.settings import SettingsError, check_bools, read_from_environment


@read_from_environment
@dataclasses.dataclass(frozen=True)
class TrainerSettings:
    """What the Trainer callback does around the stop. Every field can be overridden by ``DDP_SIGTERM_<FIELD>``."""

    save_checkpoint: bool = True
    """Save ``hpc_ckpt_<N>.ckpt`` at an agreed stop during ``fit`` (Lightning integration)."""

    checkpoint_dir: str = ""
    """Where the Trainer's stop checkpoints go: a local directory or an fsspec URL (``s3://bucket/run``).
    Empty (the default): the Trainer's ``default_root_dir``, where Lightning looks for ``ckpt_path="hpc"``."""

    keep_checkpoints: int = 0
    """How many stop checkpoints (``hpc_ckpt_<N>.ckpt``) to keep in that directory: after a stop
    checkpoint is saved, all but the newest ``keep_checkpoints`` are deleted. 0 (the default) keeps all."""

    resume: bool = False
    """Resume ``fit`` started without ``ckpt_path`` from the newest stop checkpoint, on every platform (Lightning
    does it only under SLURM, from ``default_root_dir``). Off by default, so that a script run again starts from
    scratch; set ``DDP_SIGTERM_RESUME=1`` where a relaunch must resume (a Kubernetes Job, torchrun's restarts)."""

    resume_logger_runs: bool = True
    """A fit resumed from a stop checkpoint gives the Trainer's loggers the runs they wrote to before the stop
    (TensorBoard's and CSV's version, W&B's and MLflow's run), so that the resumed run appends to them."""

    def __post_init__(self) -> None:
        if not isinstance(self.checkpoint_dir, str):
            raise SettingsError(f"checkpoint_dir must be a directory or URL, got {self.checkpoint_dir!r}")
        keep = self.keep_checkpoints
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 0:
            raise SettingsError(f"keep_checkpoints must be a whole number, 0 to keep all, got {keep!r}")
        check_bools(self, "save_checkpoint", "resume", "resume_logger_runs")
