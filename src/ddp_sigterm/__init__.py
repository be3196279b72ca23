"""ddp_sigterm: every DDP rank stops at the same step on SIGTERM, saves one checkpoint, exits 128+signal.

The core needs torch only, and importing it starts nothing. :class:`UnisonStop`, the ``lightning.pytorch`` Trainer
callback, is imported on first use (``pytorch_lightning_integration`` has the standalone ``pytorch_lightning``'s);
:mod:`ddp_sigterm.fabric` serves Fabric, :mod:`ddp_sigterm.slurm` requeues a SLURM job (docs/how-it-works.md: layout).
"""

from __future__ import annotations

from typing import Any

from ddp_sigterm._core.coordinator import StopCoordinator
from ddp_sigterm._core.data_position import DataPosition
from ddp_sigterm._core.decision import StopDecision
from ddp_sigterm._core.notices import NoticeSettings
from ddp_sigterm._core.port import AgreementError
from ddp_sigterm._core.settings import Settings, SettingsError
from ddp_sigterm._core.stop_save import StopError, save_in_unison
from ddp_sigterm._lightning import settings as _trainer_settings  # noqa: F401  # its DDP_SIGTERM_* are known

__version__ = "0.1.0"
__all__ = ["AgreementError", "DataPosition", "NoticeSettings", "Settings", "SettingsError", "StopCoordinator",
           "StopDecision", "StopError", "UnisonStop", "__version__", "save_in_unison"]


def __getattr__(name: str) -> Any:
    if name == "UnisonStop":
        try:
            from ddp_sigterm import lightning_integration
        except ModuleNotFoundError as error:
            raise ModuleNotFoundError(f"ddp_sigterm.UnisonStop is the Lightning integration, which needs lightning "
                                      f"(pip install 'ddp_sigterm[lightning]'): {error}") from error
        return lightning_integration.UnisonStop
    raise AttributeError(f"module 'ddp_sigterm' has no attribute {name!r}")
