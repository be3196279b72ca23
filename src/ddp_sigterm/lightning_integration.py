"""The Trainer callback for ``lightning.pytorch``, added by its ``callbacks_factory`` entry point."""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

from lightning.fabric.plugins.environments.slurm import SLURMEnvironment
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException

from ddp_sigterm._core.stop_save import StopError
from ddp_sigterm._lightning.trainer_stop import Lightning, TrainerStop

__all__ = ["StopError", "UnisonStop", "callbacks_factory"]


class UnisonStop(TrainerStop, Callback):
    """Stop every rank at the same step when any process of the job receives a stop signal.

    ``Trainer(callbacks=[UnisonStop(max_delay=0.5)])`` chooses settings (the entry point's instance then steps
    aside); ``DDP_SIGTERM_*`` variables override the arguments (see :class:`ddp_sigterm.Settings`).
    """

    lightning = Lightning("lightning", Trainer, SIGTERMException, SLURMEnvironment, rank_zero_info,
                          "lightning.fabric", version("lightning"))


def callbacks_factory() -> list[Any]:
    """Entry point for ``lightning.pytorch.callbacks_factory``."""
    return UnisonStop.entry_point()
