"""The Trainer callback's own settings (its stop checkpoint, resuming), which the core never reads."""

from __future__ import annotations

import dataclasses

from ddp_sigterm._core.settings import SettingsError, check_bools, read_from_environment


@read_from_environment
@dataclasses.dataclass(frozen=True)
class TrainerSettings:
    """What the Trainer callback does around the stop; ``DDP_SIGTERM_<FIELD>`` overrides each field."""

    save_checkpoint: bool = True
    """Save ``hpc_ckpt_<N>.ckpt`` at an agreed stop during ``fit``."""
    checkpoint_dir: str = ""
    """The stop checkpoints' directory or fsspec URL; empty: ``default_root_dir``, where ``ckpt_path="hpc"`` looks."""
    keep_checkpoints: int = 0
    """After a stop checkpoint is saved, keep the newest this many there (0: all)."""
    resume: bool = False
    """A ``fit`` started without ``ckpt_path`` resumes from the newest stop checkpoint, on every platform."""
    resume_logger_runs: bool = True
    """A fit resumed from a stop checkpoint gives the loggers the runs they wrote to before the stop."""

    def __post_init__(self) -> None:
        if not isinstance(self.checkpoint_dir, str):
            raise SettingsError(f"checkpoint_dir must be a directory or URL, got {self.checkpoint_dir!r}")
        keep = self.keep_checkpoints
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 0:
            raise SettingsError(f"keep_checkpoints must be a whole number, 0 to keep all, got {keep!r}")
        check_bools(self, "save_checkpoint", "resume", "resume_logger_runs")
