"""The Trainer callback for the standalone ``pytorch_lightning``, added by its ``callbacks_factory`` entry point."""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

from lightning_fabric.plugins.environments.slurm import SLURMEnvironment
from pytorch_lightning import Trainer
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.utilities import rank_zero_info
from pytorch_lightning.utilities.exceptions import SIGTERMException

from ddp_sigterm._core.stop_save import StopError
from ddp_sigterm._lightning.trainer_stop import Lightning, TrainerStop

__all__ = ["StopError", "UnisonStop", "callbacks_factory"]


class UnisonStop(TrainerStop, Callback):
    """:class:`ddp_sigterm.UnisonStop` for ``pytorch_lightning.Trainer``: same arguments, same behaviour."""

    lightning = Lightning("pytorch_lightning", Trainer, SIGTERMException, SLURMEnvironment, rank_zero_info,
                          "lightning_fabric", version("pytorch_lightning"))


def callbacks_factory() -> list[Any]:
    """Entry point for ``pytorch_lightning.callbacks_factory``."""
    return UnisonStop.entry_point()
